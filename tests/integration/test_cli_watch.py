"""`tiered get --watch` and `tiered rollout status --watch` as processes: they
print again when the store changes, say what a long hold waits for, end when
the rollout ends or pauses (on either backend), and end quietly (no
traceback) when the reader closes the pipe, even with nothing new to print,
or Ctrl-C comes. Then what the local system's verbs say when it is not
running: no controller (apply, get, rollout status), no router (load), and
`tiered top` finding the agents in the state directory."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tiered.controller.host.state import RunningSystem, StateLayout, controller_running
from tiered.controller.plan import make_snapshot
from tiered.controller.store import StateStore
from tiered.files import hold_shared_lock
from tiered.local.processes import AgentProcess, interruptible
from tiered.rollout import engine
from tiered.rollout.snapshot import to_record
from tiered.rollout.spec import load_tiered_model
from tiered.rollout.status import ArtifactVersion, HistoryEntry, TieredModelStatus
from tiered.rollout.wire import API_GROUP, API_VERSION, to_plain

SHA = "ab" * 32
DOCUMENT = {"name": "digits", "artifact": {"uri": "/models/digits.onnx", "sha256": SHA},
            "tiers": {"edge": {}, "regional": {}},
            "rollout": {"stages": [{"name": "edge", "weights": {"edge": 10}}]}}
SPEC = load_tiered_model(DOCUMENT)
NEXT = {**DOCUMENT, "artifact": {"uri": "/models/digits.onnx", "sha256": "cd" * 32}}
DEADLINE_S = 60.0  # generous: the machine may be loaded


@pytest.fixture
def state(tmp_path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def as_controller(state):
    """This test writes statuses as a controller does, and holds the lock a
    running controller holds, so the verbs do not say that none runs."""
    layout = StateLayout(state)
    StateStore(layout.store).close()  # the state directory and its store
    lock = hold_shared_lock(layout.controller_lock)
    yield
    os.close(lock)


def write(store: StateStore, message: str, rollout=None, **status) -> None:
    record = store.get("digits")
    written = TieredModelStatus(rollout=rollout, message=message,
                                observed_generation=record.generation, **status)
    store.write_status("digits", record.revision, status=to_plain(written))


def tiered(state: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tiered", *args, "--state", str(state)],
                            env=interruptible(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until(process: subprocess.Popen, text: str) -> list[str]:
    lines = []
    while True:
        line = process.stdout.readline()
        assert line, f"ended before {text!r}: {lines} {process.stderr.read()}"
        lines.append(line)
        if text in line:
            return lines


def test_get_watch_prints_the_table_again_when_it_changes_and_ends_on_ctrl_c(state,
                                                                            as_controller):
    with StateStore(state / "state.db") as store:
        store.apply("digits", DOCUMENT)
        write(store, "first message")
        process = tiered(state, "get", "--watch", "--interval", "0.2")
        try:
            read_until(process, "first message")
            write(store, "second message")
            read_until(process, "second message")
            process.send_signal(signal.SIGINT)
            assert process.wait(DEADLINE_S) == 130
            assert "Traceback" not in process.stderr.read()
        finally:
            process.kill()


@pytest.mark.parametrize("verb", [("get", "--watch", "--interval", "0.2"),
                                  ("rollout", "status", "digits", "--watch")])
def test_a_watch_whose_reader_goes_away_ends_quietly(state, as_controller, verb):
    with StateStore(state / "state.db") as store:
        store.apply("digits", DOCUMENT)
        write(store, "v1", engine.start(SPEC, 1, 2, 0.0))
        process = tiered(state, *verb)
        try:
            process.stdout.readline()
            process.stdout.close()  # as `| head -1` does
            deadline = time.monotonic() + DEADLINE_S
            count = 0
            while process.poll() is None and time.monotonic() < deadline:
                count += 1
                write(store, f"message {count}", engine.start(SPEC, 1, 2, 0.0))
                store.record("digits", to_record(make_snapshot(
                    SPEC, engine.start(SPEC, 1, 2, 0.0), "hold", f"step {count}")))
                time.sleep(0.3)
            assert process.wait(DEADLINE_S) == 0
            assert process.stderr.read() == ""
        finally:
            process.kill()


def test_rollout_status_watch_waits_for_the_new_version_and_exits_when_it_ends(state):
    """Right after `apply`, the previous rollout's Promoted is not this one's end."""
    with StateStore(state / "state.db") as store:
        store.apply("digits", DOCUMENT)
        promoted = engine.promote(SPEC, engine.start(SPEC, 1, 2, 0.0), 0.0, full=True).status
        write(store, "v2 serving", promoted,
              artifacts=({"version": 1, "uri": "/m", "sha256": "ef" * 32},
                         {"version": 2, "uri": "/m", "sha256": SHA}))
        store.apply("digits", NEXT)  # a new version, not yet seen by a controller
        process = tiered(state, "rollout", "status", "digits", "--watch")
        try:
            time.sleep(3.0)
            assert process.poll() is None, process.stdout.read()
            record = store.get("digits")
            status = TieredModelStatus(
                rollout=engine.abort(SPEC, engine.start(SPEC, 2, 3, 0.0), 0.0).status,
                artifacts=({"version": 1, "uri": "/m", "sha256": "ef" * 32},
                           {"version": 2, "uri": "/m", "sha256": SHA},
                           {"version": 3, "uri": "/m", "sha256": "cd" * 32}),
                observed_generation=record.generation)
            store.write_status("digits", record.revision, status=to_plain(status))
            assert process.wait(DEADLINE_S) == 3  # aborted
        finally:
            process.kill()


@pytest.mark.parametrize("verb", [("get", "--watch", "--interval", "0.2"),
                                  ("rollout", "status", "digits", "--watch")])
def test_a_watch_with_nothing_new_to_print_still_ends_when_its_reader_goes(
        state, as_controller, verb):
    """`tiered get --watch | head -1` on a system where nothing changes."""
    with StateStore(state / "state.db") as store:
        store.apply("digits", DOCUMENT)
        write(store, "v1", engine.start(SPEC, 1, 2, time.time()))
        process = tiered(state, *verb)
        try:
            process.stdout.readline()
            time.sleep(1.0)  # it has printed all it will and waits
            process.stdout.close()
            closed = time.monotonic()
            assert process.wait(DEADLINE_S) == 0
            assert time.monotonic() - closed < 5.0  # at its next look, not at a next write
            assert process.stderr.read() == ""
        finally:
            process.kill()


# --- rollout status --watch on both backends: a long hold, and any pause ----------

HELD = "stage 1/1 'edge': too little data: 3 of 1000 canary requests"
PAUSING = {**DOCUMENT, "rollout": {**DOCUMENT["rollout"], "on_failure": "pause"}}
ARTIFACTS = (ArtifactVersion(1, "/models/v1.onnx", "ef" * 32),
             ArtifactVersion(2, "/models/digits.onnx", SHA))


class LocalBackend:
    """A local state directory, written as the controller writes it."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.store = StateStore(state / "state.db")
        self.store.apply("digits", PAUSING)

    def flags(self) -> list[str]:
        return ["--state", str(self.state)]

    def write(self, rollout, action: str) -> None:
        record = self.store.get("digits")
        status = TieredModelStatus(rollout=rollout, message=rollout.message,
                                   artifacts=ARTIFACTS, observed_generation=record.generation)
        self.store.write_status("digits", record.revision, status=to_plain(status))
        self.store.record("digits", to_record(make_snapshot(SPEC, rollout, action,
                                                            rollout.message)))


class KubeBackend:
    """A TieredModel on the Kubernetes API double, its status written as the
    controller writes it (each step in the status's history)."""

    def __init__(self, api, tmp_path: Path) -> None:
        from kubernetes import client

        self.kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
        self.custom = client.CustomObjectsApi(client.ApiClient(api.client_configuration()))
        spec = {"artifact": DOCUMENT["artifact"], "tiers": {"edge": {}, "regional": {}},
                "rollout": {"onFailure": "pause",
                            "stages": [{"name": "edge", "weights": {"edge": 10}}]}}
        self.custom.create_namespaced_custom_object(
            API_GROUP, API_VERSION, "default", "tieredmodels",
            {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "TieredModel",
             "metadata": {"name": "digits"}, "spec": spec})

    def flags(self) -> list[str]:
        return ["--kubernetes", "--namespace", "default", "--kubeconfig", str(self.kubeconfig)]

    def write(self, rollout, action: str) -> None:
        from tiered.controller.kube.render import status_body
        from tiered.controller.reconciler import decode_status

        obj = self.custom.get_namespaced_custom_object(API_GROUP, API_VERSION, "default",
                                                       "tieredmodels", "digits")
        before = decode_status("digits", obj.get("status"))
        step = HistoryEntry(t=time.time(), action=action, reason=rollout.message,
                            phase=rollout.phase, stable_version=rollout.stable_version,
                            canary_version=rollout.canary_version, stage="1/1 edge")
        status = TieredModelStatus(rollout=rollout, message=rollout.message,
                                   artifacts=ARTIFACTS,
                                   observed_generation=obj["metadata"]["generation"],
                                   history=(*before.history, step))
        self.custom.replace_namespaced_custom_object_status(
            API_GROUP, API_VERSION, "default", "tieredmodels", "digits",
            status_body(obj, status))


@pytest.fixture(params=["local", "kubernetes"])
def backend(request, state, tmp_path):
    if request.param == "local":
        request.getfixturevalue("as_controller")  # the test plays the controller
        yield LocalBackend(state)
        return
    pytest.importorskip("kubernetes")
    from tests.kubeapi import FakeKubeAPI

    with FakeKubeAPI() as api:
        yield KubeBackend(api, tmp_path)


def cli(backend, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tiered", *args, *backend.flags()],
                            env=interruptible(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("how", ["by hand", "onFailure"])
def test_a_held_stage_is_reported_and_any_pause_ends_the_watch(backend, how):
    spec = load_tiered_model(PAUSING)
    started = engine.start(spec, 1, 2, time.time() - 5.0)
    backend.write(dataclasses.replace(started, message=HELD), "start")
    process = cli(backend, "rollout", "status", "digits", "--watch", "--still-every", "1")
    try:
        # Nothing new for a second: a line saying what the stage waits for, how long.
        still = read_until(process, "nothing new for")[-1]
        assert "v1->v2 Progressing stage 1/1 edge [edge 10%]" in still, still
        assert f"hold: {HELD} | nothing new for" in still, still
        assert "maxDurationSeconds 3600" in still and " s left)" in still, still
        if how == "by hand":
            paused = subprocess.run(
                [sys.executable, "-m", "tiered", "rollout", "pause", "digits",
                 *backend.flags()], capture_output=True, text=True, timeout=DEADLINE_S)
            assert "paused by hand" in paused.stdout, paused.stdout + paused.stderr
            said = "pause: paused by hand"
        else:  # the stage ran out of time with nothing to judge
            decision = engine.decide(spec, started, None, started.stage_started_at + 3600)
            assert decision.action == "pause"
            backend.write(decision.status, decision.action)
            said = f"pause: {decision.reason[:40]}"
        assert process.wait(DEADLINE_S) == 5
        out, err = process.stdout.read(), process.stderr.read()
        assert said in out, out
        assert "paused: `tiered rollout resume digits` goes on" in err, err
        assert "Traceback" not in err
    finally:
        process.kill()


def test_a_watch_ended_by_a_status_prints_the_step_recorded_just_after_it(state, as_controller):
    """The controller and the verbs write a status, then record its step, in two
    commits; a watch that reads between them still prints the step."""
    backend = LocalBackend(state)
    spec = load_tiered_model(PAUSING)
    started = engine.start(spec, 1, 2, time.time() - 5.0)
    backend.write(dataclasses.replace(started, message=HELD), "start")
    process = cli(backend, "rollout", "status", "digits", "--watch", "--still-every", "1")
    try:
        read_until(process, "nothing new for")
        decision = engine.decide(spec, started, None, started.stage_started_at + 3600)
        record = backend.store.get("digits")
        backend.store.write_status("digits", record.revision, status=to_plain(TieredModelStatus(
            rollout=decision.status, message=decision.reason, artifacts=ARTIFACTS,
            observed_generation=record.generation)))
        time.sleep(1.2)  # the watch looks every second: it sees the status alone
        backend.store.record("digits", to_record(make_snapshot(
            SPEC, decision.status, decision.action, decision.reason)))
        assert process.wait(DEADLINE_S) == 5
        out = process.stdout.read()
        assert f"pause: {decision.reason[:40]}" in out, out
    finally:
        process.kill()


def test_rollout_status_of_a_paused_rollout_says_so_with_its_exit_code(backend):
    paused = engine.pause(SPEC, engine.start(SPEC, 1, 2, time.time()), time.time()).status
    backend.write(paused, "pause")
    for flags in ((), ("--timeout", "30")):  # as it is; followed, as a pipeline waits
        process = cli(backend, "rollout", "status", "digits", *flags)
        try:
            assert process.wait(DEADLINE_S) == 5, process.stderr.read()
        finally:
            process.kill()


# --- the local system when it is not running ----------------------------------


def run(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiered", *args, "--state", str(state)],
                          capture_output=True, text=True, timeout=DEADLINE_S)


NO_CONTROLLER = "no controller is running on"


def test_the_verbs_say_when_no_controller_runs_on_the_state(state, tmp_path):
    spec = tmp_path / "digits.yaml"
    spec.write_text(yaml.safe_dump(DOCUMENT))
    StateStore(state / "state.db").close()  # a system that ran once and was stopped
    for args in (("apply", "-f", str(spec)), ("get",), ("rollout", "status", "digits")):
        result = run(state, *args)
        assert result.returncode == 0, result.stderr
        assert NO_CONTROLLER in result.stderr and "`tiered up -f FILE` starts" in result.stderr
    # A controller on the state directory (a real one; with no system to act on
    # it only says so every pass): the verbs are quiet about it.
    controller = subprocess.Popen(
        [sys.executable, "-m", "tiered", "controller", "--state", str(state), "--interval",
         "0.2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not controller_running(StateLayout(state)):
            assert time.monotonic() < deadline and controller.poll() is None
            time.sleep(0.1)
        result = run(state, "apply", "-f", str(spec))
        assert result.returncode == 0 and NO_CONTROLLER not in result.stderr, result.stderr
    finally:
        controller.send_signal(signal.SIGTERM)
        controller.wait(DEADLINE_S)
    assert not controller_running(StateLayout(state))  # let go when it ended
    assert NO_CONTROLLER in run(state, "get").stderr


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_load_against_a_stopped_system_names_the_router_and_how_to_start_it(state):
    port = free_port()  # nothing listens there any more
    StateLayout(state).create()
    RunningSystem({"edge": ("127.0.0.1:1",)}, f"127.0.0.1:{port}").write(
        StateLayout(state).system)
    result = run(state, "load", "digits", "--duration", "1")
    assert result.returncode == 1
    assert f"no router answered at 127.0.0.1:{port} (the local system's, from " in result.stderr
    assert "`tiered up -f FILE` starts the local system, or --router HOST:PORT names " \
        "another router" in result.stderr
    assert "Traceback" not in result.stderr
    # With no local system, the default address, and it says so.
    from tiered.cli import load

    assert load._router(load.argparse.Namespace(router=None, state=state / "none")) == (
        load.DEFAULT_ROUTER, f"the default: no local system in {state / 'none'}")


def test_top_finds_the_local_systems_agents_in_the_state_directory(state, tmp_path):
    assert "no agent address given and no local system in" in run(state, "top",
                                                                   "--once").stderr
    (tmp_path / "repository").mkdir()
    agent = AgentProcess("edge", tmp_path / "repository", log_dir=tmp_path,
                         extra_args=["--allow-failed-models"])
    agent.start()
    try:
        StateLayout(state).create()
        RunningSystem({"edge": (agent.address,)}, "127.0.0.1:1").write(
            StateLayout(state).system)
        result = run(state, "top", "--once")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("agent") and result.stderr == ""
    finally:
        agent.stop()
    stopped = run(state, "top", "--once")
    assert stopped.returncode == 1 and agent.address in stopped.stderr
    assert "no agent of the local system in" in stopped.stderr and "tiered up" in stopped.stderr
