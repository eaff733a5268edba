"""Dynamic batching: merge queued requests of one model version into batches.

Batch formation, merge and split are pure functions; `Batcher` is the asyncio
loop around them. Each request owns a future; a failed batch fails only its
own requests, each with the engine's message. The queue is bounded and a full
queue refuses at once. A batch is formed when an engine instance is free: an
idle engine runs what is queued at once, and requests that arrive while it is
busy are merged into the next batch; the queue delay bounds how long a free
instance waits for more while another runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from tiered.engines.base import merge
from tiered.errors import (
    DeadlineExceeded,
    EngineError,
    ResourceExhausted,
    TieredError,
    Unavailable,
)
from tiered.telemetry.inference_stats import BatchTiming

log = logging.getLogger(__name__)

Arrays = Mapping[str, np.ndarray]

COARSE_TIMER_S = 0.002  # shorter waits than this yield instead of sleeping on a timer
# Handing a batch to a worker thread and back costs ~100-200 µs of loop
# wake-ups; a batch whose engine time is typically below this runs on the loop.
INLINE_BELOW_S = 100e-6


@dataclass(frozen=True)
class BatchPolicy:
    """max_batch_size 0 runs every request alone (no dynamic batching)."""

    max_batch_size: int
    max_queue_delay_s: float
    preferred_batch_sizes: tuple[int, ...]
    max_queue_size: int
    instances: int = 1
    # True: a batch waits max_queue_delay_s for more even when no batch runs
    # (Triton's dynamic batcher); a lone request then waits for company.
    wait_when_idle: bool = False

    @property
    def target_size(self) -> int:
        """A batch this large goes at once: the largest preferred size, else the max."""
        preferred = [s for s in self.preferred_batch_sizes if s <= self.max_batch_size]
        return max(preferred) if preferred else self.max_batch_size


@dataclass(frozen=True)
class BatchDecision:
    take: int  # run the first `take` queued requests now; 0 means wait
    wait_s: float  # when waiting: at most this long before deciding again


@dataclass(eq=False)
class Pending:
    """A request waiting in (or taken from) the queue."""

    inputs: Arrays
    batch_size: int
    signature: Hashable  # requests merge only when equal (dtypes, non-batch dims)
    enqueued_at: float  # clock seconds
    deadline: float  # clock seconds; math.inf when none
    future: asyncio.Future = field(repr=False)


@dataclass(frozen=True)
class BatchResult:
    outputs: dict[str, np.ndarray]
    queue_s: float
    timing: BatchTiming
    batch_size: int  # of the whole batch this request ran in


def form_batch(queued: Sequence[Pending], now: float, policy: BatchPolicy,
               running: int) -> BatchDecision:
    """Decide whether the head of the queue runs now, and with how many others,
    while `running` batches of this version run."""
    if not queued:
        return BatchDecision(0, math.inf)
    if policy.max_batch_size == 0:
        return BatchDecision(1, 0.0)
    head = queued[0]
    total = take = 0
    blocked = False
    for item in queued:
        if item.signature != head.signature or total + item.batch_size > policy.max_batch_size:
            blocked = True  # waiting cannot make this batch larger
            break
        total += item.batch_size
        take += 1
    if take == 0:  # the head alone exceeds max_batch_size: it runs alone
        return BatchDecision(1, 0.0)
    waited = now - head.enqueued_at
    idle = running == 0 and not policy.wait_when_idle
    if idle or blocked or total >= policy.target_size or waited >= policy.max_queue_delay_s:
        return BatchDecision(take, 0.0)
    return BatchDecision(0, policy.max_queue_delay_s - waited)


def split(outputs: Arrays, sizes: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Cut a batch's outputs back into one mapping per request (views, no copies)."""
    if len(sizes) == 1:
        return [dict(outputs)]
    total = sum(sizes)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise EngineError(
                f"output {name!r} has shape {list(array.shape)}; a batch of {total} "
                "needs it to lead with the batch dimension"
            )
    parts, start = [], 0
    for size in sizes:
        parts.append({name: array[start:start + size] for name, array in outputs.items()})
        start += size
    return parts


def least_loaded(loads: Sequence[int | None]) -> int | None:
    """The lane with the least queued and running work (None: a lane that is
    down); ties go to the first, so light traffic keeps batching on one."""
    up = [(load, index) for index, load in enumerate(loads) if load is not None]
    return min(up)[1] if up else None


RunFn = Callable[[Arrays], dict[str, np.ndarray]]
StageFn = Callable[[Sequence[Arrays]], Arrays]  # requests -> one batch (`Engine.stage`)


class Batcher:
    """The queue and loop of one model version. Lives on one event loop."""

    def __init__(
        self,
        policy: BatchPolicy,
        run: RunFn,
        executor: Executor,
        on_batch: Callable[[int, BatchTiming], None] = lambda size, timing: None,
        clock: Callable[[], float] = time.monotonic,
        stage: StageFn = merge,
    ) -> None:
        self.policy = policy
        self._run = run
        self._stage = stage
        self._executor = executor
        self._on_batch = on_batch
        self._clock = clock
        self._queue: deque[Pending] = deque()
        self._changed = asyncio.Event()  # a request arrived or a batch ended
        self._slots = asyncio.Semaphore(policy.instances)
        self._running: set[asyncio.Task] = set()
        self._closing = False
        self._typical_infer_s = math.inf  # moving average of engine time per batch
        self.inline_below_s = INLINE_BELOW_S  # 0: never run a batch on the loop
        self._queued_items = self._running_items = 0  # batch elements
        self._loop_task = asyncio.get_running_loop().create_task(self._serve())

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def load(self) -> int:
        """Batch elements queued or running."""
        return self._queued_items + self._running_items

    async def submit(
        self, inputs: Arrays, batch_size: int, signature: Hashable, deadline: float = math.inf
    ) -> BatchResult:
        if self._closing:
            raise Unavailable("the model version is unloading")
        if len(self._queue) >= self.policy.max_queue_size:
            raise ResourceExhausted(
                f"queue full: {len(self._queue)} requests waiting (max_queue_size "
                f"{self.policy.max_queue_size})"
            )
        future = asyncio.get_running_loop().create_future()
        self._queue.append(Pending(inputs, batch_size, signature, self._clock(), deadline, future))
        self._queued_items += batch_size
        self._changed.set()
        return await future

    async def close(self) -> None:
        """Stop taking requests; finish every queued and running one."""
        self._closing = True
        self._changed.set()
        await self._loop_task
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    async def _serve(self) -> None:
        while True:
            await self._slots.acquire()
            batch = await self._next_batch()
            if batch is None:
                self._slots.release()
                return
            task = asyncio.get_running_loop().create_task(self._execute(batch))
            self._running.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._slots.release()
        self._changed.set()  # a free instance waiting for more may go now

    async def _next_batch(self) -> list[Pending] | None:
        while True:
            now = self._clock()
            self._drop_dead(now)
            decision = form_batch(self._queue, now, self.policy, len(self._running))
            if decision.take:
                batch = [self._queue.popleft() for _ in range(decision.take)]
                self._queued_items -= sum(p.batch_size for p in batch)
                return batch
            if self._closing and not self._queue:
                return None
            self._changed.clear()
            if math.isinf(decision.wait_s):
                await self._changed.wait()
            elif decision.wait_s < COARSE_TIMER_S:
                # asyncio's timers wake a millisecond late or more (epoll counts
                # in ms), which would multiply sub-ms delays: yield to the loop,
                # letting requests arrive, and decide again.
                await asyncio.sleep(0)
            else:
                timer = asyncio.get_running_loop().call_later(decision.wait_s, self._changed.set)
                await self._changed.wait()
                timer.cancel()

    def _drop_dead(self, now: float) -> None:
        """Remove cancelled requests and fail those whose deadline passed in the queue."""
        if not any(p.future.done() or p.deadline <= now for p in self._queue):
            return
        alive = deque()
        for pending in self._queue:
            if pending.future.done():
                continue
            if pending.deadline <= now:
                waited_ms = (now - pending.enqueued_at) * 1e3
                pending.future.set_exception(
                    DeadlineExceeded(f"timeout expired after {waited_ms:.1f} ms in the queue")
                )
                continue
            alive.append(pending)
        self._queue = alive
        self._queued_items = sum(p.batch_size for p in alive)

    async def _execute(self, batch: list[Pending]) -> None:
        started = self._clock()
        sizes = [p.batch_size for p in batch]
        self._running_items += sum(sizes)
        try:
            await self._run_and_answer(batch, sizes, started)
        finally:
            self._running_items -= sum(sizes)

    async def _run_and_answer(self, batch: list[Pending], sizes: list[int],
                              started: float) -> None:
        inputs = [p.inputs for p in batch]
        try:
            if self._typical_infer_s < self.inline_below_s:
                parts, timing = self._run_batch(inputs, sizes)
            else:
                parts, timing = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._run_batch, inputs, sizes
                )
        except TieredError as error:
            self._fail(batch, error)
            return
        except Exception as error:  # an engine bug must not take the server down
            log.exception("batch of %d failed", sum(sizes))
            self._fail(batch, EngineError(f"engine failed: {error}"))
            return
        infer_s = timing.infer_ns / 1e9
        self._typical_infer_s = (
            infer_s if math.isinf(self._typical_infer_s)
            else 0.8 * self._typical_infer_s + 0.2 * infer_s
        )
        self._on_batch(sum(sizes), timing)
        for pending, outputs in zip(batch, parts):
            if not pending.future.done():
                pending.future.set_result(
                    BatchResult(outputs, started - pending.enqueued_at, timing, sum(sizes))
                )

    def _run_batch(
        self, requests: list[Arrays], sizes: list[int]
    ) -> tuple[list[dict[str, np.ndarray]], BatchTiming]:
        """In an executor thread: merge (into the engine's staging), run, split."""
        t0 = time.perf_counter_ns()
        merged = self._stage(requests)
        t1 = time.perf_counter_ns()
        outputs = self._run(merged)
        t2 = time.perf_counter_ns()
        parts = split(outputs, sizes)
        t3 = time.perf_counter_ns()
        return parts, BatchTiming(t1 - t0, t2 - t1, t3 - t2)

    @staticmethod
    def _fail(batch: list[Pending], error: Exception) -> None:
        for pending in batch:
            if not pending.future.done():
                pending.future.set_exception(error)
