"""In-flight batching for one generative model version, in two halves.

- The sequence loop (`SequenceLoop`) lives beside the engine and alone calls
  it. Requests wait in order for a sequence slot and join the running batch
  between two steps; each turn ends what is past its deadline, admits what
  fits, steps every running sequence once, and says what happened in one
  `Turn`: admissions, each sequence's new token id, and the sequences that
  ended with an error. A request that finds no slot before its admission
  deadline fails RESOURCE_EXHAUSTED; an engine error fails the sequences of
  that step, never the loop.
- The text side (`Scheduler`) lives beside the wire. It takes requests from
  the event loop (`submit`, into a bounded queue), tokenizes each and checks
  that it fits the context before it waits (INVALID_ARGUMENT at once if not),
  turns each turn's tokens into text pieces (a character split across tokens
  waits, a stop string ends its sequence early; a request whose text a front
  end makes gets its token ids alone) and hands them to their requests'
  asyncio queues: one `call_soon_threadsafe` a turn, with at most
  `MAX_UNDELIVERED_STEPS` of them not yet taken by the event loop (an engine
  that keeps the GIL through its step, as onnxruntime-genai does, would
  otherwise starve the loop and every other call the agent answers).

`Scheduler` runs both halves on one worker thread of the agent's process;
`engine_core.CoreScheduler` runs the sequence loop in a process of its own
and the text side on a thread of the agent, one message a turn each way.
A sequence leaves on its last token, its stop string, its deadline or its
client's cancellation, and its slot is free for the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from tiered.agent.generation import GenerationRequest, TextSide
from tiered.engines.generative.base import GenerativeEngine, Sampling
from tiered.errors import (
    DeadlineExceeded,
    EngineError,
    InvalidArgument,
    ResourceExhausted,
    TieredError,
    Unavailable,
)

log = logging.getLogger(__name__)


# Turns whose tokens the event loop has not yet taken, at most: the worker
# waits for the loop beyond that. 1 made the loop run every step (agent TPOT
# P50 0.43 ms at one stream against 0.06 in-process, `bench/generate.py`, edge
# INT4, this 2-core VM); 16 let tokens go out in bursts (P95 52 ms at 64
# streams); 4: 0.14 ms and 38 ms, with the loop late by 3 ms on average.
MAX_UNDELIVERED_STEPS = 4
LOOP_WAIT_S = 0.1  # the longest the worker waits for the loop before going on
UNLOADING = "the model is unloading"


@dataclass(frozen=True)
class SchedulerLimits:
    max_queue_size: int = 64  # requests waiting for a sequence slot
    max_queue_wait_s: float = 30.0  # the longest a request waits for a slot


# -- the sequence loop -------------------------------------------------------------------

@dataclass(eq=False)
class Entry:
    """A request as the sequence loop knows it: token ids, no text."""

    key: int  # the text side's name for it
    prompt: list[int]
    sampling: Sampling
    arrived: float
    deadline: float  # monotonic; inf: none
    admit_by: float  # when waiting for a slot ends
    generated: int = 0
    # The visual tokens of the prompt's image tokens (a vision-language
    # decoder), FP32 [tokens, hidden], until the engine admits it.
    visual: np.ndarray | None = None


@dataclass(frozen=True)
class Turn:
    """What one turn of the sequence loop did."""

    at: float  # monotonic time it ended (clocks agree across processes)
    step_s: float = 0.0  # how long the engine's step took; 0: no step
    stepped: int = 0  # sequences in the step
    admitted: tuple[tuple[int, float], ...] = ()  # (key, when)
    tokens: tuple[tuple[int, int, float, bool], ...] = ()  # (key, token id, logprob, last)
    failed: tuple[tuple[int, TieredError], ...] = ()
    running: int = 0  # sequences in the batch after it

    @property
    def empty(self) -> bool:
        return not (self.stepped or self.admitted or self.failed)


class SequenceLoop:
    """The engine's half; one thread at a time calls it (and the engine)."""

    def __init__(self, engine: GenerativeEngine,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self._clock = clock
        self._waiting: deque[Entry] = deque()
        self._running: dict[int, Entry] = {}  # engine sequence id -> entry
        self._sequence_of: dict[int, int] = {}  # key -> engine sequence id

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._running)

    def add(self, entry: Entry) -> None:
        self._waiting.append(entry)

    def cancel(self, key: int) -> None:
        """Drop the request now, running or waiting; unknown keys are ignored."""
        sequence = self._sequence_of.pop(key, None)
        if sequence is not None:
            del self._running[sequence]
            self.engine.stop(sequence)
            return
        for entry in self._waiting:
            if entry.key == key:
                self._waiting.remove(entry)
                return

    def turn(self) -> Turn:
        failed: list[tuple[int, TieredError]] = []
        self._expire(self._clock(), failed)
        admitted = self._admit(failed)
        step_s, stepped, tokens = self._step(failed) if self._running else (0.0, 0, [])
        return Turn(self._clock(), step_s, stepped, tuple(admitted), tuple(tokens),
                    tuple(failed), len(self._running))

    def close(self) -> None:
        """Stop every sequence and forget what waits (the text side fails them)."""
        for sequence in self._running:
            self.engine.stop(sequence)
        self._running.clear()
        self._sequence_of.clear()
        self._waiting.clear()

    def _expire(self, now: float, failed: list) -> None:
        for sequence, entry in list(self._running.items()):
            if now >= entry.deadline:
                self._end(sequence)
                self.engine.stop(sequence)
                failed.append((entry.key, DeadlineExceeded(
                    f"the request's deadline passed after {entry.generated} tokens")))
        for entry in [e for e in self._waiting if now >= e.admit_by]:
            self._waiting.remove(entry)
            failed.append((entry.key, ResourceExhausted(
                f"no sequence slot came free in {now - entry.arrived:.2f} s "
                f"({len(self._running)} of {self.engine.max_sequences} sequences running, "
                f"{len(self._waiting) + 1} requests waiting)")))

    def _admit(self, failed: list) -> list[tuple[int, float]]:
        admitted = []
        while self._waiting and len(self._running) < self.engine.max_sequences:
            entry = self._waiting.popleft()
            try:
                sequence = self.engine.start(entry.prompt, entry.sampling, entry.visual)
            except ResourceExhausted:
                self._waiting.appendleft(entry)  # the engine is fuller than it said
                break
            except Exception as error:  # noqa: BLE001 -- reported to its request
                failed.append((entry.key, domain_error(error, "starting the sequence")))
                continue
            entry.visual = None  # the engine holds them now
            self._running[sequence] = entry
            self._sequence_of[entry.key] = sequence
            admitted.append((entry.key, self._clock()))
        return admitted

    def _step(self, failed: list) -> tuple[float, int, list]:
        started = time.perf_counter()
        stepped = len(self._running)
        try:
            tokens = self.engine.step()
        except Exception as error:  # noqa: BLE001 -- fails this batch, not the loop
            log.exception("generative engine step failed")
            for sequence, entry in list(self._running.items()):
                self.engine.stop(sequence)
                failed.append((entry.key, EngineError(f"the engine failed: {error}")))
            self._running.clear()
            self._sequence_of.clear()
            return time.perf_counter() - started, stepped, []
        out = []
        for token in tokens:
            entry = self._running.get(token.sequence)
            if entry is None:
                continue
            entry.generated += 1
            if token.last:
                self._end(token.sequence)
            out.append((entry.key, token.id, token.logprob, token.last))
        return time.perf_counter() - started, stepped, out

    def _end(self, sequence: int) -> None:
        entry = self._running.pop(sequence)
        del self._sequence_of[entry.key]


# -- the text side -----------------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """One token of a sequence, and the text it lets out (maybe none yet)."""

    text: str
    token_id: int
    last: bool
    at: float  # monotonic time its step ended
    logprob: float = 0.0  # natural log of the token's probability under the model
    prompt_tokens: int = 0  # the request's prompt, in tokens
    finish: str = ""  # on the last: "length" (max_tokens) or "stop" (its end, a stop string)


@dataclass(eq=False)
class Job:
    """One request on the text side. `deliver` is called on the event loop;
    the rest belongs to the worker thread once submitted."""

    request: GenerationRequest
    arrived: float
    deadline: float  # the request's own (monotonic; inf: none)
    admit_by: float  # when waiting for a slot ends
    deliver: Callable[[Piece | TieredError], None]  # each piece, then or else an error
    key: int = 0
    lane: int = 0  # which engine core runs it, where there are several
    admitted: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    text: TextSide | None = None  # None: its text is made elsewhere (`text_elsewhere`)


# Called on the event loop after each step: (seconds the step took, sequences in
# it, the device it ran on; None: the version's one device).
StepObserver = Callable[[float, int, "str | None"], None]
Step = tuple[float, int, "str | None"]  # what a StepObserver is told
Events = list[tuple[Job, Piece | TieredError]]


class Scheduler:
    """The text side, with the sequence loop on the same worker thread.

    `engine` gives the tokenizer and the limits (encode, decode, max_context,
    max_sequences); subclasses may run its loop elsewhere (`_work`)."""

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
        self._closed = False
        self._queued = 0  # submitted and not yet admitted or ended, under the lock
        self._keys = itertools.count(1)
        self._jobs: dict[int, Job] = {}  # worker-owned: key -> job not yet ended
        self.running = 0  # sequences in the batch, as of the last step (for readers)
        self._undelivered = threading.BoundedSemaphore(MAX_UNDELIVERED_STEPS)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queued

    # -- the event loop's side ------------------------------------------------------

    def submit(self, request: GenerationRequest, deadline: float,
               deliver: Callable[[Piece | TieredError], None]) -> Job:
        """Queue a request; `deliver` gets its pieces on the event loop, each
        step's for all requests in one call of the loop's, until the last
        piece or an error."""
        now = self._clock()
        job = Job(request, now, deadline, min(deadline, now + self.limits.max_queue_wait_s),
                  deliver)
        with self._lock:
            if self._closed:
                raise Unavailable(UNLOADING)
            if self._queued >= self.limits.max_queue_size:
                raise ResourceExhausted(
                    f"{self._queued} requests already wait for a sequence slot "
                    f"(max_queue_size {self.limits.max_queue_size}); retry later")
            self._queued += 1
            self._arrived.append(job)
            self._lock.notify()
        self._wake()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: free its sequence at the next step boundary."""
        with self._lock:
            self._cancelled.append(job)
            self._lock.notify()
        self._wake()

    def close(self) -> None:
        """Fail what waits or runs (Unavailable) and stop the worker."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._wake()
        self._thread.join()

    def _wake(self) -> None:
        """Tell a worker that waits elsewhere than on the lock (a subclass's)."""

    # -- the worker thread ----------------------------------------------------------

    def _work(self) -> None:
        sequences = SequenceLoop(self.engine, self._clock)
        while True:
            with self._lock:
                while not (self._closed or self._arrived or self._cancelled
                           or sequences.busy):
                    self._lock.wait()
            arrived, cancelled, closed = self._take()
            if closed:
                sequences.close()
                self._shut(arrived)
                return
            entries, events = self._entries(arrived)
            for entry in entries:
                sequences.add(entry)
            for job in self._forget(cancelled):  # after: a request may come and go at once
                sequences.cancel(job.key)
            turn = sequences.turn()
            for key in self._read(turn, events):
                sequences.cancel(key)
            self.running = turn.running
            self._send(events, [(turn.step_s, turn.stepped, None)] if turn.stepped else [])

    def _take(self) -> tuple[list[Job], list[Job], bool]:
        with self._lock:
            arrived, self._arrived = self._arrived, []
            cancelled, self._cancelled = self._cancelled, []
            return arrived, cancelled, self._closed

    def _entries(self, arrived: Iterable[Job]) -> tuple[list[Entry], Events]:
        """The new requests, tokenized and checked to fit the context, as the
        sequence loop takes them; and the errors of those that cannot."""
        entries, events = [], []
        for job in arrived:
            try:
                prompt = self.engine.encode(job.request.prompt)
                if not prompt:
                    raise InvalidArgument("text_input: the prompt has no tokens")
                limit = self.engine.max_context
                if len(prompt) + job.request.sampling.max_tokens > limit:
                    raise InvalidArgument(
                        f"text_input: {len(prompt)} prompt tokens + max_tokens "
                        f"{job.request.sampling.max_tokens} exceed the model's context of "
                        f"{limit}")
            except Exception as error:  # noqa: BLE001 -- reported to its request
                self._dequeued(1)
                events.append((job, domain_error(error, "tokenizing the prompt")))
                continue
            job.key = next(self._keys)
            job.prompt_tokens = len(prompt)
            self._jobs[job.key] = job
            entries.append(Entry(job.key, prompt, job.request.sampling, job.arrived,
                                 job.deadline, job.admit_by, visual=job.request.visual))
        return entries, events

    def _forget(self, cancelled: Iterable[Job]) -> list[Job]:
        """The cancelled requests that had not ended."""
        gone = []
        for job in cancelled:
            if self._jobs.pop(job.key, None) is job:
                if job.admitted is None:
                    self._dequeued(1)
                gone.append(job)
        return gone

    def _read(self, turn: Turn, events: Events) -> list[int]:
        """A turn's admissions, errors and tokens, into `events` as text
        pieces; the keys whose sequences a stop string (or an error reading
        a token) ended before the engine did."""
        for key, at in turn.admitted:
            job = self._jobs.get(key)
            if job is not None:
                self._dequeued(1)
                job.admitted = at
                if not job.request.text_elsewhere:
                    job.text = TextSide(self.engine.decode, job.request.stop)
        for key, error in turn.failed:
            job = self._jobs.pop(key, None)
            if job is not None:
                if job.admitted is None:
                    self._dequeued(1)
                events.append((job, error))
        stopped = []
        for key, token, logprob, last in turn.tokens:
            job = self._jobs.get(key)
            if job is None:  # ended here already (a stop string, a cancellation)
                continue
            try:
                piece: Piece | TieredError = self._piece(job, token, last, turn.at, logprob)
                ended = piece.last
            except Exception as error:  # noqa: BLE001 -- a tokenizer error fails its request
                piece, ended = domain_error(error, "decoding a token"), True
            if ended:
                del self._jobs[key]
                if not last:
                    stopped.append(key)
            events.append((job, piece))
        return stopped

    def _piece(self, job: Job, token: int, last: bool, at: float, logprob: float) -> Piece:
        job.tokens += 1
        length = job.tokens >= job.request.sampling.max_tokens
        text, last = ("", last or length) if job.text is None \
            else job.text.add(token, last or length)
        stopped = job.text is not None and job.text.stopped
        finish = "" if not last else "length" if length and not stopped else "stop"
        return Piece(text, token, last, at, logprob, job.prompt_tokens, finish)

    def _dequeued(self, count: int) -> None:
        with self._lock:
            self._queued -= count

    def _shut(self, arrived: list[Job]) -> None:
        """Fail every request not yet ended: the model is unloading."""
        jobs = [*self._jobs.values(), *arrived]
        self._jobs.clear()
        self.running = 0
        self._send([(job, Unavailable(UNLOADING)) for job in jobs], [])

    def _send(self, events: Events, steps: list[Step]) -> None:
        """Hand a round's events and steps to the event loop."""
        if not events and not steps:
            return
        taken = self._undelivered.acquire(timeout=LOOP_WAIT_S)
        try:
            self._loop.call_soon_threadsafe(self._deliver, events, steps, taken)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            if taken:
                self._undelivered.release()

    def _deliver(self, events: Events, steps: list[Step], taken: bool) -> None:
        if taken:
            self._undelivered.release()
        if self._on_step is not None:
            for step in steps:
                self._on_step(*step)
        for job, event in events:
            try:
                job.deliver(event)
            except Exception:  # noqa: BLE001 -- one reader's fault stops no other's tokens
                log.exception("delivering a piece of a generation failed")


def domain_error(error: Exception, doing: str) -> TieredError:
    if isinstance(error, TieredError):
        return error
    return EngineError(f"the engine failed {doing}: {type(error).__name__}: {error}")
