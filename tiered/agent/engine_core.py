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

    agent -> core   WORK    ([Entry, ...] new requests, with a vision-language
                            decoder's visual tokens; [key, ...] cancelled)
    core -> agent   HELLO   CoreFacts, once its engine is loaded
                    TURN    Turn: the turn's admissions, token ids and errors
                    FAILED  (error class name, message): the engine did not load

The agent closes its end to stop the core. A core that dies fails its
running requests; the next request starts a new one. `main` is the core
(`python -m tiered.agent.engine_core`, its spec pickled on stdin).
"""

from __future__ import annotations

import asyncio
import collections
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

from tiered.agent.devices import (
    FAILED,
    HELLO,
    Device,
    device_environment,
    read_frame,
    send_frame,
    spawn,
)
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
WAIT_FOR_A_CORE_S = 0.1  # how often a worker with no core up looks again


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
    """The agent's handle on one engine core process: the facts its engine
    said, and the frames to and from it. `start` blocks: call it off the
    event loop."""

    def __init__(self, spec: CoreSpec, device: Device | None = None) -> None:
        self.spec = spec
        self._device = device  # None: the devices the agent sees
        self.facts = CoreFacts("cpu", 1, 1, {})
        self._process: subprocess.Popen | None = None
        self.socket: socket.socket | None = None
        self._send_lock = threading.Lock()

    @property
    def label(self) -> str | None:
        """The device as telemetry names it, where the core has one of its own."""
        return self._device.name if self._device is not None else None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def up(self) -> bool:
        return self.socket is not None

    def start(self) -> None:
        """Start the core and wait until its engine is loaded."""
        env = {**os.environ, "TIERED_ENGINE": self.spec.name}
        if self._device is not None:
            env.update(device_environment(self._device))
        process, ours, facts = spawn(
            "tiered.agent.engine_core", lambda fd: replace(self.spec, socket_fd=fd), env,
            f"{self.spec.name}: the engine core" + (f" on {self.label}" if self.label else ""))
        self.close()  # an earlier process, if any
        self.facts, self._process, self.socket = facts, process, ours
        log.info("%s: engine core on %s (pid %d)", self.spec.name,
                 self.label or facts.device, process.pid)

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


class EngineCores:
    """The engine cores of one version, one per device (or one), and its
    tokenizer: what the text side asks of an engine (encode, decode, the
    limits, the facts) and what the version closes."""

    def __init__(self, cores: Sequence[EngineCore], tokenizer: Tokenizer) -> None:
        self.cores = tuple(cores)
        self._tokenizer = tokenizer

    @property
    def device(self) -> str:
        return self.cores[0].facts.device

    @property
    def max_sequences(self) -> int:
        """Sequences the version runs at once, on all its cores."""
        return sum(core.facts.max_sequences for core in self.cores)

    @property
    def max_context(self) -> int:
        return self.cores[0].facts.max_context

    @property
    def labels(self) -> tuple[str, ...]:
        """The cores' devices as telemetry names them; () with one core of the agent's."""
        return tuple(core.label for core in self.cores if core.label is not None)

    def describe(self) -> dict[str, str]:
        return {**self.cores[0].facts.facts, "engine_core": "process " + ", ".join(
            str(core.pid) for core in self.cores)}

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids)

    def start(self) -> None:
        """Start every core at once; the first failure, once all have tried."""
        failures: list[Exception] = []

        def start(core: EngineCore) -> None:
            try:
                core.start()
            except Exception as error:  # noqa: BLE001 -- raised below, after the others
                failures.append(error)

        threads = [threading.Thread(target=start, args=(core,)) for core in self.cores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            self.close()
            raise failures[0]

    def close(self) -> None:
        for core in self.cores:
            core.close()


class CoreScheduler(Scheduler):
    """The text side on a thread of the agent; the sequence loop in engine
    cores, one per device of the agent (or one).

    The worker waits on the cores' sockets and on a wake-up socket the event
    loop's calls write to. Each round places the new requests, each on the
    core holding the fewest, sends each core its new and cancelled requests
    in one frame, and reads the turns that came. A core that is lost fails
    the requests it held; the others go on, and it is started again."""

    def __init__(self, cores: EngineCores, limits: SchedulerLimits,
                 loop: asyncio.AbstractEventLoop, on_step: StepObserver | None = None,
                 name: str = "generation", clock: Callable[[], float] = time.monotonic) -> None:
        self.cores = cores.cores
        self._running_on = [0] * len(self.cores)  # sequences of each core's last turn
        self._restarting: set[int] = set()  # lanes whose core a thread starts again
        self._why_down = ""  # the last start's error
        self._wake_in, self._wake_out = socket.socketpair()
        self._woken = False  # a wake-up byte is sent that the worker has not read
        self._wake_out.setblocking(False)
        self._wake_in.setblocking(False)
        super().__init__(cores, limits, loop, on_step, name, clock)  # type: ignore[arg-type]

    def _wake(self) -> None:
        """One byte until the worker reads it, not one a request: a burst of
        arrivals costs one system call and one wake-up."""
        if self._woken:
            return
        self._woken = True
        with contextlib.suppress(OSError):  # closed: the worker is gone
            self._wake_in.send(b"\0")

    def _work(self) -> None:
        try:
            while not self._round():
                pass
        finally:
            self._wake_in.close()
            self._wake_out.close()

    def _round(self) -> bool:
        """Send what came, read the turns that are there; True once closed."""
        for lane, core in enumerate(self.cores):
            if not core.up and lane not in self._restarting:
                self._restarting.add(lane)
                threading.Thread(target=self._restart, args=(lane,), daemon=True,
                                 name=f"{core.spec.name}-restart").start()
        up = [lane for lane, core in enumerate(self.cores)
              if core.up and lane not in self._restarting]
        if not up:
            return self._wait_for_a_core()
        readable, _, _ = select.select([self.cores[lane].socket for lane in up]
                                       + [self._wake_out], [], [])
        if self._wake_out in readable:
            with contextlib.suppress(BlockingIOError):
                self._wake_out.recv(4096)
            # After the bytes are read (one sent meanwhile is not lost with
            # them) and before what came is taken: a later arrival wakes it.
            self._woken = False
        arrived, cancelled, closed = self._take()
        if closed:
            self._shut(arrived)
            return True
        entries, events = self._entries(arrived)
        work: dict[int, tuple[list[Entry], list[int]]] = {lane: ([], []) for lane in up}
        new = {entry.key for entry in entries}
        held = collections.Counter(job.lane for job in self._jobs.values() if job.key not in new)
        for entry in entries:
            job = self._jobs[entry.key]
            job.lane = min(up, key=lambda lane: held[lane])
            held[job.lane] += 1
            work[job.lane][0].append(entry)
        for job in self._forget(cancelled):
            if job.lane in work:
                work[job.lane][1].append(job.key)
        steps = []
        for lane in up:
            core = self.cores[lane]
            try:
                if any(work[lane]):
                    core.send(*work[lane])
                if core.socket in readable:
                    turn = core.receive()
                    if turn is None:
                        raise OSError("it exited")
                    stopped = self._read(turn, events)
                    if stopped:
                        core.send((), stopped)
                    self._running_on[lane] = turn.running
                    if turn.stepped:
                        steps.append((turn.step_s, turn.stepped, core.label))
            except OSError as error:
                self._lost(lane, events, f"the engine core exited ({error})")
        self.running = sum(self._running_on)
        self._send(events, steps)
        return False

    def _lost(self, lane: int, events: list, why: str) -> None:
        """Fail what the core held; a later round starts another."""
        core = self.cores[lane]
        lost = [job for job in self._jobs.values() if job.lane == lane]
        log.error("%s: %s; failing its %d requests and starting another",
                  core.label or core.spec.name, why, len(lost))
        for job in lost:
            del self._jobs[job.key]
            if job.admitted is None:
                self._dequeued(1)
            events.append((job, EngineError(why)))
        self._running_on[lane] = 0
        core.close()

    def _restart(self, lane: int) -> None:
        """Start a lost core again, off the worker (the others go on), until it
        runs or the scheduler closes."""
        while not self._closed:
            try:
                self.cores[lane].start()
                self._why_down = ""
                if self._closed:  # the version unloaded meanwhile
                    self.cores[lane].close()
                break
            except Exception as error:  # noqa: BLE001 -- said, and tried again
                log.error("%s", error)
                self._why_down = str(error)
                time.sleep(RESTART_DELAY_S)
        self._restarting.discard(lane)
        self._wake()

    def _wait_for_a_core(self) -> bool:
        """No core runs: requests wait while one starts (up to their admission
        deadline), and fail at once while starting fails; True once closed."""
        with self._lock:
            self._lock.wait(WAIT_FOR_A_CORE_S)
            now, closed = self._clock(), self._closed
            if closed or self._why_down:
                failing, self._arrived = self._arrived, []
            else:
                failing = [job for job in self._arrived if now >= job.admit_by]
                self._arrived = [job for job in self._arrived if now < job.admit_by]
        if closed:
            self._shut(failing)
            return True
        self._dequeued(len(failing))
        why = (f"no engine core runs: {self._why_down}" if self._why_down
               else "no engine core came up in time")
        self._send([(job, Unavailable(why)) for job in failing], [])
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
