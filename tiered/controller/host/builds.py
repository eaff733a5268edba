"""The host backend's tier builds, in the background.

Each `tiered build` runs in a process of its own, as the Kubernetes init
container does, at most `max_builds` at a time (builds are CPU heavy): a
reconcile pass starts what it may, queues the rest and returns at once, and
a later pass finds the build finished. Meanwhile the version is Pending on
its tier with what it waits for ("building, 12 s", "queued to build"), which
the plan's waiting message shows (`tiered get`, the status).

What a restarted controller needs lives on disk, under
STATE/builds/MODEL/VERSION/TIER/:

    lock        held (flock) by the build process for as long as it runs
    build.json  its pid, when it started, the artifact file's stamp then
    build.log   its stderr, whose last line is its verdict
    refused.json  why it was refused, and the artifact stamp it was refused on

so the next controller finds a build still running (and waits for it, its
clock going on), one that was refused (a verdict on the same bytes stands),
one that installed its version (in the repository: nothing kept here), or
one that was interrupted (started again). A build writes its version into a
temporary directory and renames it into place (`tiered.engines.build`), so
an interrupted build never leaves a version that an agent could load.

A build no longer wanted (the spec moved on, the model was deleted) is
stopped and forgotten; one that runs past BUILD_TIMEOUT_S, exits without a
verdict or is killed is refused with why, and not tried again until its
artifact file changes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from tiered.controller import plan
from tiered.errors import ConfigError
from tiered.files import lock_held, write_atomically
from tiered.protocol.verdict import read_verdict

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 600.0  # one tier build of one version
STOP_WAIT_S = 5.0  # a stopped build's time to clean up (SIGINT) before SIGKILL
LOG_TAIL_BYTES = 64 * 1024  # of build.log, read for the verdict
LOADING = "built, loading"  # a built version the agent is not serving yet

Stamp = tuple[int, int] | None  # the artifact file's size and mtime; None for a URI


class BuildKey(NamedTuple):
    model: str
    version: int
    tier: str


@dataclass(frozen=True)
class BuildRequest:
    key: BuildKey
    command: tuple[str, ...]  # `tiered build ...`, as a process's argv
    stamp: Stamp


def default_max_builds(cpus: int | None = None) -> int:
    """One build at a time on a machine of two cores or fewer, else two."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    return 1 if cpus <= 2 else 2


# -- pure: what to start, what to say -----------------------------------------

def startable(queue: Sequence[BuildKey], running: int, limit: int) -> tuple[BuildKey, ...]:
    """The queued builds to start now: the oldest, as many as slots are free."""
    return tuple(queue[:max(0, limit - running)])


def building(elapsed_s: float) -> str:
    return f"building, {max(0.0, elapsed_s):.0f} s"


def queued(ahead: int) -> str:
    return "queued to build" + (f", {ahead} ahead" if ahead else "")


def no_verdict(code: int, stderr: str) -> str:
    """Why a build that left no verdict failed: its exit code or signal, and
    the last line it wrote."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        said = f"tiered build was killed by {name} and left no verdict"
    else:
        said = f"tiered build exited with code {code} and no verdict"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    return f"{said}: {last}" if last else said


# -- the processes --------------------------------------------------------------

@dataclass
class _Running:
    pid: int | None  # None: an earlier controller died before it wrote build.json
    started: float  # wall clock, so that a restarted controller's clock goes on
    stamp: Stamp
    process: subprocess.Popen | None  # None: started by an earlier controller


class Builds:
    """The background builds of one local controller; see the module docstring.

    `poll()` once per pass observes the processes; `state()` then answers per
    (model, version, tier) from what was observed, queuing and starting builds.
    """

    def __init__(self, root: Path, progress: Callable[[str], None], *,
                 max_builds: int | None = None, timeout_s: float = BUILD_TIMEOUT_S,
                 clock: Callable[[], float] = time.time) -> None:
        max_builds = default_max_builds() if max_builds is None else max_builds
        if max_builds < 1:
            raise ConfigError(f"max_builds: at least 1, got {max_builds}")
        self.root = root
        self.progress = progress
        self.max_builds = max_builds
        self.timeout_s = timeout_s
        self.clock = clock
        self._running: dict[BuildKey, _Running] = {}
        self._queue: dict[BuildKey, BuildRequest] = {}  # oldest first
        for key in self._recorded():  # what an earlier controller left
            self._adopt(key)

    # -- per pass

    def poll(self) -> None:
        """Reap the builds that ended (keeping a refusal's verdict) and stop
        those past their time."""
        now = self.clock()
        for key, run in list(self._running.items()):
            if self._alive(key, run):
                if now - run.started > self.timeout_s:
                    self._stop(key, run)
                    del self._running[key]
                    self._refuse(key, run.stamp,
                                 f"tiered build did not finish in {self.timeout_s:g} s")
                continue
            del self._running[key]
            self._ended(key, run, run.process.returncode if run.process is not None else None)

    def state(self, request: BuildRequest) -> plan.VersionState:
        """A version not in its tier's repository: Pending while its build is
        queued or runs, Refused with the verdict once refused."""
        key = request.key
        run = self._running.get(key)
        if run is not None:
            return plan.VersionState(plan.PENDING, building(self.clock() - run.started))
        refusal = self._refusal(key)
        if refusal is not None:
            reason, stamp = refusal
            if stamp == request.stamp:
                return plan.VersionState(plan.REFUSED, reason)
            self._drop(key)  # other bytes: again
        if key not in self._queue:
            self._queue[key] = request
            if len(self._running) >= self.max_builds:
                self.progress(f"{key.model}: version {key.version} for {key.tier} waits to "
                              f"build ({self.max_builds} at a time)")
        self._start_due()
        run = self._running.get(key)
        if run is not None:
            return plan.VersionState(plan.PENDING, building(self.clock() - run.started))
        if key in self._queue:
            return plan.VersionState(plan.PENDING, queued(list(self._queue).index(key)))
        refusal = self._refusal(key)  # it could not be started
        return plan.VersionState(plan.REFUSED, refusal[0] if refusal else "not started")

    def running(self, key: BuildKey) -> bool:
        """Whether the build was running when last polled."""
        return key in self._running

    def keep(self, model: str, wanted: Iterable[BuildKey]) -> None:
        """Stop and forget the model's builds that are no longer wanted."""
        wanted = set(wanted)
        keys = {k for k in (*self._running, *self._queue, *self._recorded(model))
                if k.model == model and k not in wanted}
        for key in sorted(keys):
            self._forget(key, "no longer wanted")

    def keep_models(self, models: Iterable[str]) -> None:
        """Stop and forget the builds of models that are gone."""
        models = set(models)
        keys = {k for k in (*self._running, *self._queue, *self._recorded())
                if k.model not in models}
        for key in sorted(keys):
            self._forget(key, "its model was deleted")
        for path in self.root.iterdir() if self.root.is_dir() else ():
            if path.name not in models:
                shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Stop every build still running (the controller is stopping); a
        build that has ended is judged first, so its verdict is kept."""
        self.poll()
        for key, run in list(self._running.items()):
            self._signal(run, signal.SIGINT)
        deadline = time.monotonic() + STOP_WAIT_S
        for key, run in list(self._running.items()):
            self._stop(key, run, deadline)
            self._drop(key)  # interrupted: built again
        self._running.clear()
        self._queue.clear()

    # -- starting and ending

    def _start_due(self) -> None:
        for key in startable(list(self._queue), len(self._running), self.max_builds):
            self._start(self._queue.pop(key))

    def _start(self, request: BuildRequest) -> None:
        key, record = request.key, self._record(request.key)
        shutil.rmtree(record, ignore_errors=True)
        record.mkdir(parents=True)
        lock = os.open(record / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with open(record / "build.log", "wb") as stderr:
                # The build holds the lock (the same open file) until it ends;
                # its own session keeps a terminal's Ctrl-C for the controller.
                process = subprocess.Popen(request.command, stdin=subprocess.DEVNULL,
                                           stdout=subprocess.DEVNULL, stderr=stderr,
                                           pass_fds=(lock,), start_new_session=True)
        except OSError as error:
            self._refuse(key, request.stamp, f"cannot start tiered build: {error}")
            return
        finally:
            os.close(lock)
        started = self.clock()
        write_atomically(record / "build.json", json.dumps(
            {"pid": process.pid, "started": started, "stamp": request.stamp,
             "command": list(request.command)}))
        self._running[key] = _Running(process.pid, started, request.stamp, process)
        self.progress(f"{key.model}: building version {key.version} for {key.tier}")

    def _ended(self, key: BuildKey, run: _Running, code: int | None) -> None:
        """A build ended (`code` None: an earlier controller's, whose exit code
        is unknown): built, refused with its verdict, or interrupted."""
        stderr = self._log_tail(key)
        verdict = read_verdict(stderr)
        took = f" in {self.clock() - run.started:.1f} s"
        if verdict is not None and verdict.built:
            self._drop(key)  # the repository holds it
            self.progress(f"{key.model}: built version {key.version} for {key.tier}{took}: "
                          f"{verdict.reason}")
        elif verdict is not None:
            log.warning("%s: tiered build: %s", "/".join(map(str, key)), stderr.strip())
            self._refuse(key, run.stamp, verdict.reason)
        elif code is None:  # no verdict and no exit code: interrupted, build again
            self._drop(key)
            self.progress(f"{key.model}: the build of version {key.version} for {key.tier} "
                          "was interrupted; building it again")
        else:
            log.warning("%s: tiered build: %s", "/".join(map(str, key)), stderr.strip())
            self._refuse(key, run.stamp, no_verdict(code, stderr))

    def _refuse(self, key: BuildKey, stamp: Stamp, reason: str) -> None:
        record = self._record(key)
        record.mkdir(parents=True, exist_ok=True)
        write_atomically(record / "refused.json",
                         json.dumps({"reason": reason, "stamp": stamp}))
        self.progress(f"{key.model}: version {key.version} refused on {key.tier}: {reason}")

    def _refusal(self, key: BuildKey) -> tuple[str, Stamp] | None:
        try:
            data = json.loads((self._record(key) / "refused.json").read_text())
            stamp = data["stamp"]
            return str(data["reason"]), tuple(stamp) if stamp is not None else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _forget(self, key: BuildKey, why: str) -> None:
        self._queue.pop(key, None)
        run = self._running.pop(key, None)
        if run is not None:
            self._stop(key, run)
            self.progress(f"{key.model}: stopped the build of version {key.version} for "
                          f"{key.tier} ({why})")
        self._drop(key)

    # -- processes, this controller's or an earlier one's

    def _adopt(self, key: BuildKey) -> None:
        """A record an earlier controller left: a build still running is
        waited for, one that ended is judged by its verdict."""
        record = self._record(key)
        try:
            info = json.loads((record / "build.json").read_text())
            pid, started = int(info["pid"]), float(info["started"])
            stamp = tuple(info["stamp"]) if info.get("stamp") is not None else None
        except (OSError, ValueError, KeyError, TypeError):
            pid, stamp = None, None
            started = _mtime(record / "lock") or self.clock()
        run = _Running(pid, started, stamp, None)
        if lock_held(record / "lock"):
            self._running[key] = run
            self.progress(f"{key.model}: version {key.version} for {key.tier} is still "
                          f"building (pid {pid})")
        elif self._refusal(key) is None:
            self._ended(key, run, None)

    def _stop(self, key: BuildKey, run: _Running, deadline: float | None = None) -> None:
        """SIGINT (its temporary files go), then SIGKILL once the deadline has passed."""
        self._signal(run, signal.SIGINT)
        deadline = deadline if deadline is not None else time.monotonic() + STOP_WAIT_S
        while self._alive(key, run) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._alive(key, run):
            self._signal(run, signal.SIGKILL)
            if run.process is not None:
                run.process.wait()

    def _alive(self, key: BuildKey, run: _Running) -> bool:
        if run.process is not None:
            return run.process.poll() is None
        return lock_held(self._record(key) / "lock")

    @staticmethod
    def _signal(run: _Running, signum: int) -> None:
        if run.pid is None:
            return  # cannot be told apart from another process: it ends by itself
        if run.process is not None and run.process.poll() is not None:
            return
        try:
            os.killpg(run.pid, signum)  # its own session: the build and anything it started
        except ProcessLookupError:
            pass

    # -- the records

    def _record(self, key: BuildKey) -> Path:
        return self.root / key.model / str(key.version) / key.tier

    def _drop(self, key: BuildKey) -> None:
        """Remove a build's record, and the folders it leaves empty."""
        record = self._record(key)
        shutil.rmtree(record, ignore_errors=True)
        for folder in (record.parent, record.parent.parent):
            try:
                folder.rmdir()
            except OSError:
                break  # not empty (or gone)

    def _recorded(self, model: str | None = None) -> list[BuildKey]:
        models = [self.root / model] if model is not None else (
            sorted(self.root.iterdir()) if self.root.is_dir() else [])
        keys = []
        for model_dir in models:
            for record in sorted(model_dir.glob("*/*")):
                if record.is_dir() and record.parent.name.isdigit():
                    keys.append(BuildKey(model_dir.name, int(record.parent.name), record.name))
        return keys

    def _log_tail(self, key: BuildKey) -> str:
        try:
            with open(self._record(key) / "build.log", "rb") as stream:
                stream.seek(0, os.SEEK_END)
                stream.seek(max(0, stream.tell() - LOG_TAIL_BYTES))
                return stream.read().decode(errors="replace")
        except OSError:
            return ""


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
