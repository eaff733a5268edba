"""A generative engine in a process of its own: the engine core.

In one process, a generative model's per-token work (detokenizing, stop
strings, responses written) shares one interpreter and one GIL with its
engine's step. With `generation.engine_core: process` (and by default where
the engine runs on a GPU) the engine runs in an engine core process whose
one thread turns the sequence loop (`scheduler.SequenceLoop`: admit, step,
sample) as fast as the engine goes, while the agent's side
(`CoreScheduler`, the scheduler's text side on a thread of the agent)
tokenizes, detokenizes, applies stop strings and answers. They exchange one
frame a turn each way over a socket pair (`devices.send_frame`: a pickled
header):

    agent -> core   WORK    ([Entry, ...] new requests, [key, ...] cancelled)
    core -> agent   HELLO   CoreFacts, once its engine is loaded
                    TURN    Turn: the turn's admissions, token ids and errors
                    FAILED  (error class name, message): the engine did not load

The agent closes its end to stop the core. A core that dies fails its
running requests; the next request starts a new one. `main` is the core
(`python -m tiered.agent.engine_core`, its spec pickled on stdin).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tiered.agent.devices import FAILED, HELLO, read_frame, send_frame, spawn
from tiered.agent.scheduler import (
    Entry,
    Scheduler,
    SchedulerLimits,
    SequenceLoop,
    StepObserver,
    Turn,
)
from tiered.engines.generative.text import Tokenizer
from tiered.errors import EngineError, Unavailable

log = logging.getLogger(__name__)

WORK, TURN = 4, 5  # frame kinds beside devices' HELLO and FAILED
START_TIMEOUT_S = 600.0  # loading the weights and capturing CUDA graphs takes a while
STOP_TIMEOUT_S = 30.0
RESTART_DELAY_S = 1.0


def runs_in_a_process(layout: str, backend: str, settings: Mapping[str, Any],
                      gpu_count: Callable[[], int]) -> bool:
    """Whether a generative version gets an engine core process: asked for,
    or (`auto`) where its engine runs on a GPU, whose steps are short enough
    that the agent's per-token work would hold them back. A CPU engine on a
    small machine gains nothing from a process beside the agent's."""
    if layout != "auto":
        return layout == "process"
    device = settings.get("device", "auto")
    return backend == "torch-generative" and (
        device == "cuda" or (device == "auto" and gpu_count() > 0))


@dataclass(frozen=True)
class CoreSpec:
    """What an engine core loads."""

    name: str  # the model version, for logs: "llama v3"
    backend: str
    path: Path
    settings: Mapping[str, Any] = field(default_factory=dict)
    where: str = "engine"
    socket_fd: int = -1


@dataclass(frozen=True)
class CoreFacts:
    """What a started core tells the agent of its engine."""

    device: str
    max_sequences: int
    max_context: int
    facts: Mapping[str, str]


class EngineCore:
    """The agent's handle on an engine core process: the engine's facts and
    its version's tokenizer (what the text side asks of an engine), and the
    frames to and from the process. `start` blocks: call it off the event loop."""

    def __init__(self, spec: CoreSpec, tokenizer: Tokenizer) -> None:
        self.spec = spec
        self._tokenizer = tokenizer
        self._facts = CoreFacts("cpu", 1, 1, {})
        self._process: subprocess.Popen | None = None
        self.socket: socket.socket | None = None
        self._send_lock = threading.Lock()

    @property
    def device(self) -> str:
        return self._facts.device

    @property
    def max_sequences(self) -> int:
        return self._facts.max_sequences

    @property
    def max_context(self) -> int:
        return self._facts.max_context

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def describe(self) -> dict[str, str]:
        return {**self._facts.facts, "engine_core": f"process {self.pid}"}

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids)

    def start(self) -> None:
        """Start the core and wait until its engine is loaded."""
        process, ours, facts = spawn(
            "tiered.agent.engine_core", lambda fd: replace(self.spec, socket_fd=fd),
            {**os.environ, "TIERED_ENGINE": self.spec.name},
            f"{self.spec.name}: the engine core")
        self.close()  # an earlier process, if any
        self._facts, self._process, self.socket = facts, process, ours
        log.info("%s: engine core on %s (pid %d)", self.spec.name, self.device, process.pid)

    def send(self, entries: Sequence[Entry], cancelled: Sequence[int]) -> None:
        assert self.socket is not None
        send_frame(self.socket, self._send_lock, 0, WORK, (list(entries), list(cancelled)))

    def receive(self) -> Turn | None:
        """The next turn; None when the core is gone."""
        assert self.socket is not None
        try:
            frame = read_frame(self.socket)
        except (OSError, pickle.UnpicklingError):
            return None
        return frame[2] if frame is not None and frame[1] == TURN else None

    def close(self) -> None:
        """Ask the core to finish (the end of its stream) and wait for it."""
        process, sock = self._process, self.socket
        self._process = self.socket = None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
        if process is not None:
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if sock is not None:
            sock.close()


class CoreScheduler(Scheduler):
    """The text side on a thread of the agent; the sequence loop in the core.

    The worker waits on the core's socket and on a wake-up socket the event
    loop's calls write to; each round sends the new and cancelled requests
    in one frame and reads one turn."""

    def __init__(self, core: EngineCore, limits: SchedulerLimits,
                 loop: asyncio.AbstractEventLoop, on_step: StepObserver | None = None,
                 name: str = "generation", clock: Callable[[], float] = time.monotonic) -> None:
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_out.setblocking(False)
        self._wake_in.setblocking(False)
        super().__init__(core, limits, loop, on_step, name, clock)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: it wakes anyway
            self._wake_in.send(b"\0")

    def _work(self) -> None:
        try:
            while not self._round(self.engine):  # type: ignore[arg-type]
                pass
        finally:
            self._wake_in.close()
            self._wake_out.close()

    def _round(self, core: EngineCore) -> bool:
        """Send what came, read a turn if one is there; True once closed."""
        if core.socket is None:
            return self._restart(core)
        readable, _, _ = select.select([core.socket, self._wake_out], [], [])
        if self._wake_out in readable:
            with contextlib.suppress(BlockingIOError):
                self._wake_out.recv(4096)
        arrived, cancelled, closed = self._take()
        if closed:
            self._shut(arrived)
            return True
        entries, events = self._entries(arrived)
        cancelled_keys = self._forget(cancelled)
        turn = None
        try:
            if entries or cancelled_keys:
                core.send(entries, cancelled_keys)
            if core.socket in readable:
                turn = core.receive()
                if turn is None:
                    raise OSError("it exited")
                stopped = self._read(turn, events)
                if stopped:
                    core.send((), stopped)
        except OSError as error:
            self._lost(core, events, f"the engine core exited ({error})")
        self._send(events, turn)
        return False

    def _lost(self, core: EngineCore, events: list, why: str) -> None:
        """Fail what the core held; the next round starts another."""
        log.error("%s: %s; failing its %d requests and starting another", core.spec.name, why,
                  len(self._jobs))
        for job in self._jobs.values():
            if job.admitted is None:
                self._dequeued(1)
            events.append((job, EngineError(why)))
        self._jobs.clear()
        core.close()

    def _restart(self, core: EngineCore) -> bool:
        """Start the core again; while it cannot, what comes fails. True once closed."""
        try:
            core.start()
            return False
        except Exception as error:  # noqa: BLE001 -- told to the requests that came
            arrived, _, closed = self._take()
            if closed:
                self._shut(arrived)
                return True
            self._dequeued(len(arrived))
            self._send([(job, Unavailable(str(error))) for job in arrived], None)
            time.sleep(RESTART_DELAY_S)
            return False


# -- the engine core process -------------------------------------------------------------

def main() -> int:
    """An engine core: load the engine, say hello, then turn the sequence loop
    until the agent closes its end."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s engine core %(levelname)s %(message)s")
    spec: CoreSpec = pickle.load(sys.stdin.buffer)
    sock = socket.socket(fileno=spec.socket_fd)
    send_lock = threading.Lock()
    from tiered.engines.generative import open_generative

    try:
        engine = open_generative(spec.backend, spec.path, spec.settings, spec.where)
    except Exception as error:  # told to the agent, which reports it
        log.exception("engine did not load")
        send_frame(sock, send_lock, 0, FAILED, (type(error).__name__, str(error)))
        return 1
    send_frame(sock, send_lock, 0, HELLO, CoreFacts(
        engine.device, engine.max_sequences, engine.max_context, engine.describe()))
    log.info("%s ready (pid %d)", spec.name, os.getpid())
    inbox = _Inbox()
    threading.Thread(target=inbox.fill, args=(sock,), daemon=True, name="core-inbox").start()
    sequences = SequenceLoop(engine)
    try:
        while True:
            entries, cancelled, closed = inbox.take(wait=not sequences.busy)
            if closed:
                break
            for entry in entries:
                sequences.add(entry)
            for key in cancelled:
                sequences.cancel(key)
            turn = sequences.turn()
            if not turn.empty:
                send_frame(sock, send_lock, 0, TURN, turn)
    except OSError:
        pass  # the agent is gone
    finally:
        sequences.close()
        engine.close()
    return 0


class _Inbox:
    """What the agent sent since the loop last looked, filled by a thread of
    its own so that the loop never waits on the socket while it has work."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._entries: list[Entry] = []
        self._cancelled: list[int] = []
        self._closed = False

    def fill(self, sock: socket.socket) -> None:
        try:
            while (frame := read_frame(sock)) is not None:
                entries, cancelled = frame[2]
                with self._lock:
                    self._entries += entries
                    self._cancelled += cancelled
                    self._lock.notify()
        except (OSError, pickle.UnpicklingError):
            pass
        with self._lock:
            self._closed = True
            self._lock.notify()

    def take(self, wait: bool) -> tuple[list[Entry], list[int], bool]:
        with self._lock:
            while wait and not (self._entries or self._cancelled or self._closed):
                self._lock.wait()
            entries, self._entries = self._entries, []
            cancelled, self._cancelled = self._cancelled, []
            return entries, cancelled, self._closed


if __name__ == "__main__":
    from tiered.agent import engine_core  # what it pickles must name this module

    sys.exit(engine_core.main())
