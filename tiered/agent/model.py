"""One served model version: its engine, batcher, statistics and drain.

Validates a request's tensors against the model's config before they queue,
so a bad request never reaches the engine, and counts every outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import math
import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
from opentelemetry import trace

from tiered.agent.batching import (
    Batcher,
    BatchPolicy,
    BatchResult,
    least_loaded,
)
from tiered.agent.config import ModelConfig
from tiered.agent.devices import DeviceEngine, EngineLost, in_thread
from tiered.agent.sequences import SequenceFlags, Sequences
from tiered.engines.base import Engine
from tiered.errors import (
    EngineError,
    InvalidArgument,
    TieredError,
    Unavailable,
    caused_by_client,
)
from tiered.protocol import codec, error_text
from tiered.telemetry.inference_stats import BatchTiming, InferenceStats
from tiered.telemetry.recorder import VersionRecorder

log = logging.getLogger(__name__)

RESTART_DELAYS_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # then every 30 s
BATCHES_AHEAD = 2  # an engine process's batches in flight, per instance of its engine
BATCH_THREAD = "tiered-batch"  # the kernel's name of the threads that run batches


def name_native_thread(name: str) -> None:
    """Name the calling thread for the kernel too (top -H, /proc/PID/task),
    where Python's thread names are not seen: at most 15 bytes."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15])  # PR_SET_NAME


def batch_policy(config: ModelConfig) -> BatchPolicy:
    batching = config.dynamic_batching
    if config.sequence_batching is not None and config.max_batch_size > 0:
        # Requests of different sequences batch together, each row with its controls.
        return BatchPolicy(config.max_batch_size, 0.0, (), config.max_queue_size,
                           config.instance_count)
    if batching is None:
        return BatchPolicy(0, 0.0, (), config.max_queue_size, config.instance_count)
    return BatchPolicy(
        max_batch_size=config.max_batch_size,
        max_queue_delay_s=batching.max_queue_delay_us / 1e6,
        preferred_batch_sizes=batching.preferred_batch_sizes,
        max_queue_size=batching.max_queue_size,
        instances=config.instance_count,
        wait_when_idle=batching.wait_when_idle,
    )


def check_inputs(config: ModelConfig, inputs: Mapping[str, np.ndarray]) -> int:
    """Check names, datatypes and shapes against the config; return the batch size."""
    expected = {t.name: t for t in config.inputs}
    for name in inputs:
        if name not in expected:
            raise InvalidArgument(error_text.unexpected_input(name, config.name, expected))
    missing = [name for name in expected if name not in inputs]
    if missing:
        raise InvalidArgument(error_text.missing_inputs(config.name, len(expected),
                                                        len(inputs), missing))
    batch_sizes = set()
    for name, tensor in expected.items():
        array = inputs[name]
        datatype = codec.datatype_of(array.dtype)
        if datatype != tensor.datatype:
            raise InvalidArgument(error_text.wrong_datatype(name, datatype, config.name,
                                                            tensor.datatype))
        shape, want = array.shape, config.batch_shape(tensor)
        if len(shape) != len(want) or any(w != -1 and s != w for s, w in zip(shape, want)):
            raise InvalidArgument(error_text.wrong_shape(name, config.name, want, shape))
        if config.max_batch_size > 0:
            if shape[0] > config.max_batch_size:
                raise InvalidArgument(error_text.batch_too_large(
                    config.name, config.max_batch_size, name, shape[0]))
            if shape[0] < 1:
                raise InvalidArgument(f"input {name!r}: batch size 0; at least 1")
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


def response_rows(outputs: Mapping[str, np.ndarray], model: str
                  ) -> list[dict[str, np.ndarray]]:
    """A decoupled model's responses: row i of every output is response i."""
    counts = {name: len(array) for name, array in outputs.items()}
    if len(set(counts.values())) > 1:
        raise EngineError(f"model {model!r} is decoupled: its outputs must lead with one "
                          f"count of responses, got {counts}")
    rows = next(iter(counts.values()), 0)
    return [{name: array[row] for name, array in outputs.items()} for row in range(rows)]


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
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self) -> None:
        """A request begins (`request`, or a stream answered as its tokens
        come, which calls `leave` once it ends)."""
        if self.closing:
            raise Unavailable(f"model {self.name!r} version {self.version} is unloading")
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
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


@dataclass(eq=False)
class Lane:
    """One device of a version: its engine, the batcher that feeds it, and
    whether it is up (an engine in a process of its own can die)."""

    device: str  # the ledger's name of the device: "cpu", "cuda", "cuda:1"
    engine: Engine
    batcher: Batcher
    executor: ThreadPoolExecutor
    restarts: int = 0
    down: str = ""  # why the lane takes no requests; "" while up

    @property
    def own_process(self) -> bool:
        """Its engine runs in an engine process (`devices.py`), not the agent's."""
        return isinstance(self.engine, DeviceEngine)

    @property
    def load(self) -> int | None:
        """Batch elements queued or running; None while down."""
        return None if self.down else self.batcher.load


@dataclass(frozen=True)
class Answer:
    """A request's outputs, its time queued and the compute of the batch it ran in."""

    outputs: dict[str, np.ndarray]
    queue_ns: int
    timing: BatchTiming


def record_failure(stats: InferenceStats, recorder: VersionRecorder | None, elapsed_ns: int,
                   error: TieredError) -> None:
    """A version's failed request. Triton's statistics count every failure;
    the telemetry the rollout judge reads counts what the client caused apart."""
    stats.request_failed(elapsed_ns, _now_ms())
    if recorder is not None:
        recorder.request_failed(elapsed_ns / 1e9, by_client=caused_by_client(error))


class ModelVersion:
    """Created and used on the agent's event loop.

    Runs on one engine per device (`engines`, by device name): one, in the
    agent's process, unless the tier has several devices; then each is an
    engine process (`devices.py`) fed by a batcher of its own. A request goes
    to the device with the least work queued and running; one whose engine
    process dies goes to another while that one restarts."""

    def __init__(
        self,
        config: ModelConfig,
        version: int,
        engines: Mapping[str, Engine],
        built_from: Hashable = None,
        recorder: VersionRecorder | None = None,
        build: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.version = version
        self.built_from = built_from  # a reload rebuilds only when this changes
        self.stats = InferenceStats()  # cumulative, Triton's shape
        self.recorder = recorder  # windowed, for routing and rollouts; None: off
        self.build = dict(build or {})  # key figures of its tier build (build.json)
        self.lanes = [self._lane(device, engine) for device, engine in engines.items()]
        self.engine = self.lanes[0].engine  # what ModelMetadata describes
        self.admissions = Admissions(config.name, version)
        self.sequences = None if config.sequence_batching is None else Sequences(
            config.name, config.sequence_batching, batched=config.max_batch_size > 0)
        self._supervisors = [asyncio.get_running_loop().create_task(self._supervise(lane))
                             for lane in self.lanes if lane.own_process]

    def _lane(self, device: str, engine: Engine) -> Lane:
        own_process = isinstance(engine, DeviceEngine)
        policy = batch_policy(self.config)
        if own_process:  # the next batches merge here while the engine process runs its own
            policy = replace(policy, instances=policy.instances * BATCHES_AHEAD)
        executor = ThreadPoolExecutor(policy.instances,
                                      thread_name_prefix=f"{self.config.name}-v{self.version}",
                                      initializer=name_native_thread, initargs=(BATCH_THREAD,))
        batcher = Batcher(
            policy, engine.run, executor,
            on_batch=lambda size, timing: self._batch_ran(device, size, timing),
            stage=engine.stage,
        )
        if own_process:  # its batches wait on another process: never on the loop
            batcher.inline_below_s = 0.0
        return Lane(device, engine, batcher, executor)

    def describe(self) -> dict[str, str]:
        """Facts of its engine for users, and the devices it runs on."""
        facts = self.engine.describe()
        if self.lanes[0].own_process:
            facts["devices"] = ",".join(self.devices)
        return facts

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(lane.device for lane in self.lanes)

    @property
    def ready(self) -> bool:
        """Some device of it takes requests."""
        return any(not lane.down for lane in self.lanes)

    @property
    def queue_depth(self) -> int:
        return sum(lane.batcher.queue_depth for lane in self.lanes)

    @property
    def in_flight(self) -> int:
        return self.admissions.count

    def _batch_ran(self, device: str, size: int, timing: BatchTiming) -> None:
        self.stats.batch_executed(size, timing)
        if self.recorder is not None:
            self.recorder.batch_ran(timing.infer_ns / 1e9, device, size)

    def _failed(self, elapsed_ns: int, error: TieredError) -> None:
        record_failure(self.stats, self.recorder, elapsed_ns, error)

    def count_rejected(self, error: TieredError) -> None:
        """A request for this version that could not even be decoded."""
        self._failed(0, error)

    @property
    def on_gpu(self) -> bool:
        return self.engine.device != "cpu"

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        requested: Sequence[str] = (),
        deadline: float = math.inf,
        tracer: trace.Tracer | None = None,
        requests: Sequence[int] = (),
        sequence: SequenceFlags | None = None,
    ) -> dict[str, np.ndarray]:
        """Answer one request; `deadline` is on the monotonic clock. With a tracer,
        the queue and engine phases become child spans of the current span.
        `requests`: the rows of each request when `inputs` are several merged
        (a front end's group), each counted as a request of its own.
        `sequence`: its place in a sequence, for a model with a sequence batcher."""
        answer = await self.infer_timed(inputs, requested, deadline, tracer, requests, sequence)
        return answer.outputs

    async def infer_timed(
        self,
        inputs: Mapping[str, np.ndarray],
        requested: Sequence[str] = (),
        deadline: float = math.inf,
        tracer: trace.Tracer | None = None,
        requests: Sequence[int] = (),
        sequence: SequenceFlags | None = None,
    ) -> Answer:
        """`infer`, with where the request spent its time (an ensemble sums
        its steps' times into its own statistics, as Triton does)."""
        started = time.perf_counter_ns()
        with self.admissions.request():
            try:
                outputs = check_outputs(self.config, requested)
                batch_size = check_inputs(self.config, inputs)
                if self.sequences is None:
                    result = await self._run(inputs, batch_size, deadline)
                else:
                    async with self.sequences.turn(sequence, batch_size) as (fed, keep):
                        result = await self._run({**inputs, **fed}, batch_size, deadline)
                        keep(result.outputs)
            except TieredError as error:
                for _ in requests or (None,):
                    self._failed(time.perf_counter_ns() - started, error)
                raise
        elapsed_ns = time.perf_counter_ns() - started
        queue_ns, now_ms = int(result.queue_s * 1e9), _now_ms()
        for rows in requests or (batch_size,):
            self.stats.request_succeeded(elapsed_ns, queue_ns, result.timing, now_ms)
            if self.recorder is not None:
                self.recorder.request_succeeded(
                    elapsed_ns / 1e9, result.queue_s, result.timing.infer_ns / 1e9, rows)
        if tracer is not None:
            _trace_phases(tracer, result)
        return Answer({name: result.outputs[name] for name in outputs}, queue_ns, result.timing)

    async def _run(self, inputs: Mapping[str, np.ndarray], batch_size: int,
                   deadline: float) -> BatchResult:
        inputs = self.engine.accept(inputs)
        signature = tuple((n, a.dtype.str, a.shape[1:]) for n, a in sorted(inputs.items()))
        return await self._submit(inputs, batch_size, signature, deadline)

    async def _submit(self, inputs, batch_size: int, signature: Hashable,
                      deadline: float) -> BatchResult:
        """Queue on the least loaded device; where its engine process is lost
        on the way, on the next (every device is tried once)."""
        tried: list[Lane] = []
        while True:
            index = least_loaded([None if lane in tried else lane.load for lane in self.lanes])
            if index is None:
                raise Unavailable(
                    f"model {self.config.name!r} version {self.version}: no device takes "
                    "requests (" + "; ".join(f"{lane.device}: {lane.down or 'lost the request'}"
                                             for lane in self.lanes) + ")")
            lane = self.lanes[index]
            try:
                return await lane.batcher.submit(inputs, batch_size, signature, deadline)
            except EngineLost as error:
                log.warning("%s v%d: %s; trying another device", self.config.name,
                            self.version, error)
                tried.append(lane)

    async def _supervise(self, lane: Lane) -> None:
        """Restart the lane's engine process whenever it dies, backing off while
        it fails to start (a device that is gone stays down, with the reason)."""
        engine = lane.engine
        assert isinstance(engine, DeviceEngine)
        while True:
            code = await in_thread(engine.wait)
            if self.admissions.closing:
                return
            lane.down = f"engine process exited with code {code}; restarting"
            log.error("%s v%d on %s: %s", self.config.name, self.version, lane.device, lane.down)
            for delay in itertools.chain(RESTART_DELAYS_S, itertools.repeat(RESTART_DELAYS_S[-1])):
                await asyncio.sleep(delay)
                if self.admissions.closing:
                    return
                try:
                    await in_thread(engine.start)
                except (TieredError, OSError) as error:
                    lane.down = f"restart failed: {error}"
                    log.error("%s v%d on %s: %s", self.config.name, self.version,
                              lane.device, lane.down)
                    continue
                lane.restarts += 1
                lane.down = ""
                log.info("%s v%d on %s: engine process restarted (pid %s)",
                         self.config.name, self.version, lane.device, engine.pid)
                break

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, let in-flight ones finish, then release the engines."""
        await self.admissions.close(timeout_s)
        for task in self._supervisors:
            task.cancel()
        for lane in self.lanes:
            await lane.batcher.close()
            lane.executor.shutdown(wait=True)
            await in_thread(lane.engine.close)


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
