"""In-flight batching for one generative model version: a worker thread
that owns the engine.

Requests arrive from the event loop (`submit`), wait in a bounded queue for a
sequence slot, and join the running batch between two steps; each `step`
gives every running sequence one token, which goes back to its request's
asyncio queue (one `call_soon_threadsafe` per step, with at most
`MAX_UNDELIVERED_STEPS` of them not yet taken by the event loop: an engine
that keeps the GIL through its step, as onnxruntime-genai does, would
otherwise starve the loop and every other call the agent answers until its
sequences end). A sequence leaves on its
last token, its stop string, its deadline or its client's cancellation, and
its slot is free for the next step. A request that finds no slot before its
admission deadline fails RESOURCE_EXHAUSTED; one that cannot fit the context
fails INVALID_ARGUMENT at once. An engine error fails the sequences of that
call, never the worker. The engine is called from this thread only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tiered.agent.generation import Detokenizer, GenerationRequest, StopText
from tiered.engines.generative.base import GenerativeEngine
from tiered.errors import (
    DeadlineExceeded,
    EngineError,
    InvalidArgument,
    ResourceExhausted,
    TieredError,
    Unavailable,
)

log = logging.getLogger(__name__)


# Steps whose tokens the event loop has not yet taken, at most: the worker
# waits for the loop beyond that. 1 made the loop run every step (agent TPOT
# P50 0.43 ms at one stream against 0.06 in-process, `bench/generate.py`, edge
# INT4, this 2-core VM); 16 let tokens go out in bursts (P95 52 ms at 64
# streams); 4: 0.14 ms and 38 ms, with the loop late by 3 ms on average.
MAX_UNDELIVERED_STEPS = 4
LOOP_WAIT_S = 0.1  # the longest the worker waits for the loop before going on


@dataclass(frozen=True)
class SchedulerLimits:
    max_queue_size: int = 64  # requests waiting for a sequence slot
    max_queue_wait_s: float = 30.0  # the longest a request waits for a slot


@dataclass(frozen=True)
class Piece:
    """One token of a sequence, and the text it lets out (maybe none yet)."""

    text: str
    token_id: int
    last: bool
    at: float  # monotonic time its step ended
    logprob: float = 0.0  # natural log of the token's probability under the model


@dataclass(eq=False)
class Job:
    """One request inside the scheduler. `queue` is read on the event loop;
    the rest belongs to the worker thread once submitted."""

    request: GenerationRequest
    arrived: float
    deadline: float  # the request's own (monotonic; inf: none)
    admit_by: float  # when waiting for a slot ends
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # Piece | TieredError
    prompt: list[int] = field(default_factory=list)
    sequence: int | None = None
    admitted: float | None = None
    tokens: int = 0
    detokenizer: Detokenizer | None = None
    stop_text: StopText | None = None


# Called on the event loop after each step: (seconds the step took, sequences in it).
StepObserver = Callable[[float, int], None]


class Scheduler:
    def __init__(self, engine: GenerativeEngine, limits: SchedulerLimits,
                 loop: asyncio.AbstractEventLoop, on_step: StepObserver | None = None,
                 name: str = "generation", clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.limits = limits
        self._loop = loop
        self._on_step = on_step
        self._clock = clock
        self._lock = threading.Condition()
        self._arrived: list[Job] = []  # submitted, not yet seen by the worker
        self._cancelled: list[Job] = []
        self._waiting: deque[Job] = deque()  # worker-owned
        self._running: dict[int, Job] = {}  # worker-owned: sequence id -> job
        self._queued = 0  # arrived + waiting, under the lock
        self.running = 0  # sequences in the batch, as of the last step (for readers)
        self._closed = False
        self._undelivered = threading.BoundedSemaphore(MAX_UNDELIVERED_STEPS)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queued

    # -- the event loop's side ------------------------------------------------------

    def submit(self, request: GenerationRequest, deadline: float) -> Job:
        now = self._clock()
        job = Job(request, now, deadline, min(deadline, now + self.limits.max_queue_wait_s))
        with self._lock:
            if self._closed:
                raise Unavailable("the model is unloading")
            if self._queued >= self.limits.max_queue_size:
                raise ResourceExhausted(
                    f"{self._queued} requests already wait for a sequence slot "
                    f"(max_queue_size {self.limits.max_queue_size}); retry later")
            self._queued += 1
            self._arrived.append(job)
            self._lock.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: free its sequence at the next step boundary."""
        with self._lock:
            self._cancelled.append(job)
            self._lock.notify()

    def close(self) -> None:
        """Fail what waits or runs (Unavailable) and stop the worker."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()

    # -- the worker thread ----------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._lock:
                while not (self._closed or self._arrived or self._cancelled or self._waiting
                           or self._running):
                    self._lock.wait()
                arrived, self._arrived = self._arrived, []
                cancelled, self._cancelled = self._cancelled, []
                closed = self._closed
            events: list[tuple[Job, Piece | TieredError]] = []
            if closed:
                self._shut(arrived, events)
                self._send(events, 0.0, 0)
                return
            for job in arrived:
                self._take(job, events)
            self._drop(cancelled)  # after: a request may arrive and go in one round
            now = self._clock()
            self._expire(now, events)
            self._admit(events)
            step_s, stepped = self._step(events) if self._running else (0.0, 0)
            self._send(events, step_s, stepped)

    def _take(self, job: Job, events: list) -> None:
        """Tokenize a new request and check it fits, before it waits."""
        try:
            job.prompt = self.engine.encode(job.request.prompt)
            if not job.prompt:
                raise InvalidArgument("text_input: the prompt has no tokens")
            limit = self.engine.max_context
            if len(job.prompt) + job.request.sampling.max_tokens > limit:
                raise InvalidArgument(
                    f"text_input: {len(job.prompt)} prompt tokens + max_tokens "
                    f"{job.request.sampling.max_tokens} exceed the model's context of {limit}")
        except Exception as error:  # noqa: BLE001 -- reported to its request
            self._fail(job, _domain(error, "tokenizing the prompt"), events, queued=True)
            return
        self._waiting.append(job)

    def _drop(self, cancelled: list[Job]) -> None:
        for job in cancelled:
            if job.sequence is not None and self._running.pop(job.sequence, None) is job:
                self.engine.stop(job.sequence)
            elif job in self._waiting:
                self._waiting.remove(job)
                self._dequeued(1)

    def _expire(self, now: float, events: list) -> None:
        for sequence, job in list(self._running.items()):
            if now >= job.deadline:
                del self._running[sequence]
                self.engine.stop(sequence)
                events.append((job, DeadlineExceeded(
                    f"the request's deadline passed after {job.tokens} tokens")))
        for job in [j for j in self._waiting if now >= j.admit_by]:
            self._waiting.remove(job)
            self._fail(job, ResourceExhausted(
                f"no sequence slot came free in {now - job.arrived:.2f} s "
                f"({len(self._running)} of {self.engine.max_sequences} sequences running, "
                f"{len(self._waiting) + 1} requests waiting)"), events, queued=True)

    def _admit(self, events: list) -> None:
        while self._waiting and len(self._running) < self.engine.max_sequences:
            job = self._waiting.popleft()
            try:
                sequence = self.engine.start(job.prompt, job.request.sampling)
            except ResourceExhausted:
                self._waiting.appendleft(job)  # the engine is fuller than it said
                return
            except Exception as error:  # noqa: BLE001 -- reported to its request
                self._fail(job, _domain(error, "starting the sequence"), events, queued=True)
                continue
            self._dequeued(1)
            job.sequence, job.admitted = sequence, self._clock()
            job.detokenizer = Detokenizer(self.engine.decode)
            job.stop_text = StopText(job.request.stop)
            self._running[sequence] = job

    def _step(self, events: list) -> tuple[float, int]:
        started = time.perf_counter()
        stepped = len(self._running)
        try:
            tokens = self.engine.step()
        except Exception as error:  # noqa: BLE001 -- fails this batch, not the worker
            log.exception("generative engine step failed")
            for sequence, job in list(self._running.items()):
                self.engine.stop(sequence)
                events.append((job, EngineError(f"the engine failed: {error}")))
            self._running.clear()
            return time.perf_counter() - started, stepped
        step_s, at = time.perf_counter() - started, self._clock()
        for token in tokens:
            job = self._running.get(token.sequence)
            if job is None:
                continue
            try:
                piece: Piece | TieredError = self._piece(job, token.id, token.last, at,
                                                         token.logprob)
                ended = piece.last
            except Exception as error:  # noqa: BLE001 -- a tokenizer error fails its request
                piece, ended = _domain(error, "decoding a token"), True
            if ended:
                del self._running[token.sequence]
                if not token.last:  # its stop string (or an error) ended it early
                    self.engine.stop(token.sequence)
            events.append((job, piece))
        return step_s, stepped

    def _piece(self, job: Job, token: int, last: bool, at: float,
               logprob: float = 0.0) -> Piece:
        assert job.detokenizer is not None and job.stop_text is not None
        job.tokens += 1
        last = last or job.tokens >= job.request.sampling.max_tokens
        text = job.detokenizer.add(token)
        if last:
            text += job.detokenizer.flush()
        text = job.stop_text.add(text)
        if job.stop_text.stopped:
            last = True
        elif last:
            text += job.stop_text.flush()
        return Piece(text, token, last, at, logprob)

    def _fail(self, job: Job, error: TieredError, events: list, queued: bool) -> None:
        if queued:
            self._dequeued(1)
        events.append((job, error))

    def _dequeued(self, count: int) -> None:
        with self._lock:
            self._queued -= count

    def _shut(self, arrived: list[Job], events: list) -> None:
        for sequence, job in self._running.items():
            self.engine.stop(sequence)
            events.append((job, Unavailable("the model is unloading")))
        for job in [*self._waiting, *arrived]:
            events.append((job, Unavailable("the model is unloading")))
        self._running.clear()
        self._waiting.clear()

    def _send(self, events: list, step_s: float, stepped: int) -> None:
        self.running = len(self._running)
        if not events and not stepped:
            return
        taken = self._undelivered.acquire(timeout=LOOP_WAIT_S)
        try:
            self._loop.call_soon_threadsafe(self._deliver, events, step_s, stepped, taken)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            if taken:
                self._undelivered.release()

    def _deliver(self, events: list, step_s: float, stepped: int, taken: bool) -> None:
        if taken:
            self._undelivered.release()
        if stepped and self._on_step is not None:
            self._on_step(step_s, stepped)
        for job, event in events:
            job.queue.put_nowait(event)


def _domain(error: Exception, doing: str) -> TieredError:
    if isinstance(error, TieredError):
        return error
    return EngineError(f"the engine failed {doing}: {type(error).__name__}: {error}")
