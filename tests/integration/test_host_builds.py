"""The local backend's background builds (`tiered.controller.host.builds`) with
real processes standing in for `tiered build`: each sleeps, writes a verdict
line (or none) on stderr and exits as told, so what is checked is how builds
are queued, reaped, refused, stopped and found again by a restarted
controller, in a second or two each. tests/integration/test_background_builds.py
runs real builds through the local controller."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tiered.controller import plan
from tiered.controller.host.builds import BuildKey, BuildRequest, Builds
from tiered.protocol.verdict import BuildVerdict

# argv: starts file, seconds, verdict line ('' for none), exit code
FAKE_BUILD = """
import sys, time
with open(sys.argv[1], 'a') as starts:
    starts.write('started\\n')
time.sleep(float(sys.argv[2]))
if sys.argv[3]:
    print('some library chatter', file=sys.stderr)
    print(sys.argv[3], file=sys.stderr)
sys.exit(int(sys.argv[4]))
"""
STAMP = (100, 1)


def verdict(key: BuildKey, built: bool, reason: str) -> str:
    return BuildVerdict(built=built, model=key.model, version=key.version, tier=key.tier,
                        reason=reason, installed=None, exit_code=0 if built else 1).to_json()


class Fakes:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.lines: list[str] = []

    def builds(self, **kwargs) -> Builds:
        return Builds(self.root / "builds", self.lines.append, **kwargs)

    def request(self, version: int, seconds: float = 0.0, *, built: bool | None = True,
                code: int = 0, stamp=STAMP, tier: str = "edge") -> BuildRequest:
        key = BuildKey("m", version, tier)
        line = "" if built is None else verdict(key, built, "pass" if built else "fail: 0.9")
        return BuildRequest(key, (sys.executable, "-c", FAKE_BUILD, str(self.starts(key)),
                                  str(seconds), line, str(code)), stamp)

    def starts(self, key: BuildKey) -> Path:
        return self.root / f"starts-{key.version}-{key.tier}"

    def started(self, key: BuildKey) -> int:
        path = self.starts(key)
        return len(path.read_text().splitlines()) if path.exists() else 0

    def record(self, key: BuildKey) -> Path:
        return self.root / "builds" / key.model / str(key.version) / key.tier


@pytest.fixture
def fakes(tmp_path) -> Fakes:
    return Fakes(tmp_path)


def until(builds: Builds, request: BuildRequest, done, timeout_s: float = 60.0):
    """Poll and ask for the state until `done(state)`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        builds.poll()
        state = builds.state(request)
        if done(state):
            return state
        time.sleep(0.05)
    raise AssertionError(f"timed out; last state {state}")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_started(fakes: Fakes, key: BuildKey) -> None:
    deadline = time.monotonic() + 30
    while not fakes.started(key) and time.monotonic() < deadline:
        time.sleep(0.02)


def pid_of(fakes: Fakes, key: BuildKey) -> int:
    return json.loads((fakes.record(key) / "build.json").read_text())["pid"]


def test_builds_run_a_few_at_a_time_the_oldest_first(fakes):
    builds = fakes.builds(max_builds=1)
    first, second = fakes.request(1, 1.0), fakes.request(2, 0.0)
    builds.poll()
    assert builds.state(first).why.startswith("building, ")
    assert builds.state(second) == plan.VersionState(plan.PENDING, "queued to build")
    assert any("waits to build (1 at a time)" in line for line in fakes.lines)
    until(builds, second, lambda s: s.why.startswith("building"))
    assert fakes.started(first.key) == 1 and not fakes.record(first.key).exists()  # built
    assert any(line.startswith("m: built version 1 for edge in ") for line in fakes.lines)
    builds.close()


def test_a_refused_build_keeps_its_verdict_across_a_restart_until_the_file_changes(fakes):
    request = fakes.request(1, built=False, code=1)
    refused = until(fakes.builds(), request, lambda s: s.state != plan.PENDING)
    assert refused == plan.VersionState(plan.REFUSED, "fail: 0.9")
    again = fakes.builds()  # a restarted controller
    again.poll()
    for _ in range(3):
        assert again.state(request) == refused
    assert fakes.started(request.key) == 1  # not tried again
    changed = fakes.request(1, built=False, code=1, stamp=(100, 2))
    assert again.state(changed).why.startswith("building")  # other bytes: built again
    until(again, changed, lambda s: s.state == plan.REFUSED)
    assert fakes.started(request.key) == 2


@pytest.mark.parametrize("code, why", [
    (3, "tiered build exited with code 3 and no verdict"),
    (-signal.SIGKILL, "tiered build was killed by SIGKILL and left no verdict")])
def test_a_build_that_leaves_no_verdict_is_refused_with_how_it_ended(fakes, code, why):
    builds = fakes.builds()
    request = fakes.request(1, 30.0 if code < 0 else 0.0, built=None, code=max(code, 0))
    builds.poll()
    builds.state(request)
    if code < 0:  # killed by someone else (the OOM killer, say), once it runs
        wait_started(fakes, request.key)
        os.kill(pid_of(fakes, request.key), -code)
    refused = until(builds, request, lambda s: s.state != plan.PENDING)
    assert refused.state == plan.REFUSED and refused.why.startswith(why), refused
    for _ in range(3):
        builds.poll()
        assert builds.state(request) == refused
    assert fakes.started(request.key) == 1


def test_a_build_past_its_time_is_stopped_and_refused(fakes):
    builds = fakes.builds(timeout_s=0.5)
    request = fakes.request(1, 60.0)
    builds.poll()
    builds.state(request)
    pid = pid_of(fakes, request.key)
    refused = until(builds, request, lambda s: s.state != plan.PENDING)
    assert refused == plan.VersionState(plan.REFUSED, "tiered build did not finish in 0.5 s")
    assert gone(pid)


def test_a_restarted_controller_waits_for_a_build_still_running(fakes):
    first = fakes.builds()
    request = fakes.request(1, 2.0)
    first.poll()
    first.state(request)
    pid = pid_of(fakes, request.key)
    time.sleep(0.5)
    second = fakes.builds()  # the first died without a word: its build runs on
    assert any(f"is still building (pid {pid})" in line for line in fakes.lines)
    second.poll()
    state = second.state(request)
    assert state.state == plan.PENDING and state.why != "building, 0 s"  # its clock goes on
    deadline = time.monotonic() + 60
    while fakes.record(request.key).exists() and time.monotonic() < deadline:
        second.poll()  # (the repository, not this test, would hold what it built)
        time.sleep(0.05)
    assert not fakes.record(request.key).exists(), "the build was not seen to end"
    assert any(line.startswith("m: built version 1 for edge in ") for line in fakes.lines)
    assert fakes.started(request.key) == 1


def test_a_build_interrupted_with_its_controller_is_built_again(fakes):
    first = fakes.builds()
    request = fakes.request(1, 30.0)
    first.poll()
    first.state(request)
    pid = pid_of(fakes, request.key)
    wait_started(fakes, request.key)
    os.killpg(pid, signal.SIGKILL)  # the controller and its build die together
    os.waitpid(pid, 0)
    second = fakes.builds()
    assert any("was interrupted; building it again" in line for line in fakes.lines)
    second.poll()
    assert second.state(fakes.request(1, 0.0)).why.startswith("building")
    deadline = time.monotonic() + 30
    while fakes.started(request.key) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fakes.started(request.key) == 2
    second.close()


def test_a_build_no_longer_wanted_is_stopped_and_forgotten(fakes):
    builds = fakes.builds(max_builds=2)
    old, new = fakes.request(1, 60.0), fakes.request(2, 60.0)
    builds.poll()
    builds.state(old)
    builds.state(new)
    pid = pid_of(fakes, old.key)
    builds.keep("m", [new.key])
    assert gone(pid) and not fakes.record(old.key).exists()
    assert any("stopped the build of version 1 for edge (no longer wanted)" in line
               for line in fakes.lines)
    other = pid_of(fakes, new.key)
    builds.keep_models(["another"])  # the model was deleted
    assert gone(other) and not (fakes.root / "builds" / "m").exists()


def test_a_stopping_controller_stops_its_builds(fakes):
    builds = fakes.builds(max_builds=2)
    requests = [fakes.request(v, 60.0) for v in (1, 2)]
    builds.poll()
    for request in requests:
        builds.state(request)
    pids = [pid_of(fakes, r.key) for r in requests]
    builds.close()
    assert all(gone(pid) for pid in pids)
    again = fakes.builds()  # the next controller builds them again
    again.poll()
    assert again.state(requests[0]).why.startswith("building")
    again.close()
