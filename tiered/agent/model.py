"""One served model version: its engine, batcher, statistics and drain.

Validates a request's tensors against the model's config before they queue,
so a bad request never reaches the engine, and counts every outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from opentelemetry import trace

from tiered.agent.batching import Batcher, BatchPolicy, BatchResult
from tiered.agent.config import ModelConfig
from tiered.engines.base import Engine
from tiered.errors import InvalidArgument, TieredError, Unavailable
from tiered.protocol import codec
from tiered.telemetry.inference_stats import BatchTiming, InferenceStats
from tiered.telemetry.recorder import VersionRecorder

log = logging.getLogger(__name__)


def batch_policy(config: ModelConfig) -> BatchPolicy:
    batching = config.dynamic_batching
    if batching is None:
        return BatchPolicy(0, 0.0, (), config.max_queue_size, config.instance_count)
    return BatchPolicy(
        max_batch_size=config.max_batch_size,
        max_queue_delay_s=batching.max_queue_delay_us / 1e6,
        preferred_batch_sizes=batching.preferred_batch_sizes,
        max_queue_size=batching.max_queue_size,
        instances=config.instance_count,
    )


def check_inputs(config: ModelConfig, inputs: Mapping[str, np.ndarray]) -> int:
    """Check names, datatypes and shapes against the config; return the batch size."""
    expected = {t.name: t for t in config.inputs}
    for name in inputs:
        if name not in expected:
            raise InvalidArgument(
                f"inputs: unknown input {name!r}; model {config.name!r} takes "
                f"{', '.join(expected)}"
            )
    batch_sizes = set()
    for name, tensor in expected.items():
        if name not in inputs:
            raise InvalidArgument(f"inputs: missing input {name!r} of model {config.name!r}")
        array = inputs[name]
        datatype = codec.datatype_of(array.dtype)
        if datatype != tensor.datatype:
            raise InvalidArgument(
                f"input {name!r}: datatype {datatype}, model expects {tensor.datatype}"
            )
        shape, want = array.shape, config.batch_shape(tensor)
        if len(shape) != len(want) or any(w != -1 and s != w for s, w in zip(shape, want)):
            raise InvalidArgument(
                f"input {name!r}: shape {list(shape)} does not match {list(want)} "
                "(-1 = any size)"
            )
        if config.max_batch_size > 0:
            if not 1 <= shape[0] <= config.max_batch_size:
                raise InvalidArgument(
                    f"input {name!r}: batch size {shape[0]} is outside 1..{config.max_batch_size}"
                    " (max_batch_size)"
                )
            batch_sizes.add(shape[0])
    if len(batch_sizes) > 1:
        raise InvalidArgument(f"inputs: batch sizes differ between inputs: {sorted(batch_sizes)}")
    return batch_sizes.pop() if batch_sizes else 1


def check_outputs(config: ModelConfig, requested: Sequence[str]) -> tuple[str, ...]:
    names = [t.name for t in config.outputs]
    for name in requested:
        if name not in names:
            raise InvalidArgument(
                f"outputs: unknown output {name!r}; model {config.name!r} has {', '.join(names)}"
            )
    return tuple(requested) or tuple(names)


class Admissions:
    """The requests one version is answering, so that unloading it refuses new
    ones and waits for those running (`ModelVersion` and `GenerativeVersion`)."""

    def __init__(self, name: str, version: int) -> None:
        self.name, self.version = name, version
        self.count = 0
        self.closing = False
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """One request, from admission to its answer; Unavailable once unloading."""
        if self.closing:
            raise Unavailable(f"model {self.name!r} version {self.version} is unloading")
        self.count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.count -= 1
            if not self.count:
                self._idle.set()

    async def close(self, timeout_s: float) -> None:
        """Refuse new requests and wait up to `timeout_s` for those running."""
        self.closing = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("%s v%d: %d requests still running after %.0f s; closing anyway",
                        self.name, self.version, self.count, timeout_s)


class ModelVersion:
    """Created and used on the agent's event loop."""

    def __init__(
        self,
        config: ModelConfig,
        version: int,
        engine: Engine,
        built_from: Hashable = None,
        recorder: VersionRecorder | None = None,
        build: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.version = version
        self.engine = engine
        self.built_from = built_from  # a reload rebuilds only when this changes
        self.stats = InferenceStats()  # cumulative, Triton's shape
        self.recorder = recorder  # windowed, for routing and rollouts; None: off
        self.build = dict(build or {})  # key figures of its tier build (build.json)
        self._executor = ThreadPoolExecutor(
            config.instance_count, thread_name_prefix=f"{config.name}-v{version}"
        )
        self._batcher = Batcher(
            batch_policy(config), self._run, self._executor, on_batch=self._batch_ran,
            stage=engine.stage,
        )
        self.admissions = Admissions(config.name, version)

    @property
    def queue_depth(self) -> int:
        return self._batcher.queue_depth

    @property
    def in_flight(self) -> int:
        return self.admissions.count

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.engine.run(inputs)

    def _batch_ran(self, size: int, timing: BatchTiming) -> None:
        self.stats.batch_executed(size, timing)
        if self.recorder is not None:
            self.recorder.batch_ran(timing.infer_ns / 1e9)

    def _failed(self, elapsed_ns: int) -> None:
        self.stats.request_failed(elapsed_ns, _now_ms())
        if self.recorder is not None:
            self.recorder.request_failed(elapsed_ns / 1e9)

    def count_rejected(self) -> None:
        """A request for this version that could not even be decoded."""
        self._failed(0)

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        requested: Sequence[str] = (),
        deadline: float = math.inf,
        tracer: trace.Tracer | None = None,
    ) -> dict[str, np.ndarray]:
        """Answer one request; `deadline` is on the monotonic clock. With a tracer,
        the queue and engine phases become child spans of the current span."""
        started = time.perf_counter_ns()
        with self.admissions.request():
            try:
                outputs = check_outputs(self.config, requested)
                batch_size = check_inputs(self.config, inputs)
                inputs = self.engine.accept(inputs)
                signature = tuple((n, a.dtype.str, a.shape[1:])
                                  for n, a in sorted(inputs.items()))
                result = await self._batcher.submit(inputs, batch_size, signature, deadline)
            except TieredError:
                self._failed(time.perf_counter_ns() - started)
                raise
        elapsed_ns = time.perf_counter_ns() - started
        self.stats.request_succeeded(
            elapsed_ns, int(result.queue_s * 1e9), result.timing, _now_ms()
        )
        if self.recorder is not None:
            self.recorder.request_succeeded(
                elapsed_ns / 1e9, result.queue_s, result.timing.infer_ns / 1e9, batch_size
            )
        if tracer is not None:
            _trace_phases(tracer, result)
        return {name: result.outputs[name] for name in outputs}

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, let in-flight ones finish, then release the engine."""
        await self.admissions.close(timeout_s)
        await self._batcher.close()
        self._executor.shutdown(wait=True)
        self.engine.close()


def _trace_phases(tracer: trace.Tracer, result: BatchResult) -> None:
    """Child spans for the queue and the engine, placed back in time from now."""
    timing = result.timing
    finished = time.time_ns() - timing.output_ns
    engine_start = finished - timing.infer_ns
    batch_start = engine_start - timing.input_ns
    queue = tracer.start_span("queue", start_time=batch_start - int(result.queue_s * 1e9))
    queue.end(end_time=batch_start)
    engine = tracer.start_span("engine", start_time=engine_start,
                               attributes={"tiered.batch_size": result.batch_size})
    engine.end(end_time=finished)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
