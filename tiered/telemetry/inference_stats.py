"""Per model-version inference counters in the shape of Triton's statistics.

Counts and cumulative nanoseconds for success, failure, queueing and the
three compute phases, plus the same per executed batch size. Updated only
from the agent's event loop, so it needs no lock. Pure data; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered.telemetry.histogram import CumulativeHistogram


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass(frozen=True)
class BatchTiming:
    """Where one executed batch spent its time (merge, engine, split)."""

    input_ns: int
    infer_ns: int
    output_ns: int


@dataclass
class BatchDurations:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class InferenceStats:
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    # Counted together when a batch runs, as Triton does, so that no reading
    # ever sees a batch without its elements.
    inference_count: int = 0  # batch elements the engine ran
    execution_count: int = 0  # batches the engine ran
    last_inference_ms: int = 0  # wall-clock ms of the last answer
    by_batch_size: dict[int, BatchDurations] = field(default_factory=dict)
    # The same times as Prometheus histograms (seconds), which sum across replicas.
    request_seconds: CumulativeHistogram = field(default_factory=CumulativeHistogram)
    queue_seconds: CumulativeHistogram = field(default_factory=CumulativeHistogram)
    compute_seconds: CumulativeHistogram = field(default_factory=CumulativeHistogram)

    def request_succeeded(
        self, total_ns: int, queue_ns: int, timing: BatchTiming, now_ms: int
    ) -> None:
        # Each request of a batch lived through the whole batch's compute.
        self.success.add(total_ns)
        self.queue.add(queue_ns)
        self.compute_input.add(timing.input_ns)
        self.compute_infer.add(timing.infer_ns)
        self.compute_output.add(timing.output_ns)
        self.last_inference_ms = now_ms
        self.request_seconds.observe(total_ns / 1e9)
        self.queue_seconds.observe(queue_ns / 1e9)
        self.compute_seconds.observe(
            (timing.input_ns + timing.infer_ns + timing.output_ns) / 1e9)

    def request_failed(self, total_ns: int, now_ms: int) -> None:
        self.fail.add(total_ns)
        self.last_inference_ms = now_ms

    def batch_executed(self, size: int, timing: BatchTiming) -> None:
        self.execution_count += 1
        self.inference_count += size
        durations = self.by_batch_size.setdefault(size, BatchDurations())
        durations.compute_input.add(timing.input_ns)
        durations.compute_infer.add(timing.infer_ns)
        durations.compute_output.add(timing.output_ns)
