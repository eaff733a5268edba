"""Real tier builds in the background on the local backend.

The local controller (`HostController`, in a thread, as `tiered controller`
runs it) over a state directory whose agents are small gRPC servers that
answer RepositoryModelLoad; the builds are real `tiered build` processes.
The slow artifact is a ResNet-18 at 48x48 built INT8 for the edge tier
(calibration and evaluation take it about 10 s on an idle core); the tests
that wait for a build to end build it at 32x32 (under half of that: at 48x48
such a test took 193 s of its 300 beside the suite's other work); the fast
one a small MLP built FP16 for the regional tier (about a second).

- While a build runs, the model's status says so ("edge (building, N s)"),
  and another model is built and served meanwhile; a spec that no longer
  wants the version stops its build.
- A build refused at once (bytes that are no ONNX model) and a build that is
  killed both end Refused with why, and are not tried again.
- A controller that dies while a build runs: the next one waits for that
  build when it runs on, and builds again when it was killed with it,
  never serving what a killed build left half-written.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import onnx
import pytest
import yaml

from tiered.controller.host.controller import HostController
from tiered.controller.host.state import RunningSystem, StateLayout
from tiered.controller.reconciler import decode_status
from tiered.controller.store import StateStore
from tiered.files import sha256_file
from tiered.models import zoo
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
from tiered.rollout.spec import as_resource

TIERS = ("edge", "regional")
TIMEOUT_S = 300.0  # a slow build on a loaded two-core machine, with room to spare


class LoadingAgent(pb_grpc.GRPCInferenceServiceServicer):
    def RepositoryModelLoad(self, request, context):
        return pb.RepositoryModelLoadResponse()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("artifacts")
    garbage = root / "garbage.onnx"
    garbage.write_bytes(b"these bytes are no ONNX model\n" * 100)
    return {"slow": zoo.resnet18(root / "slow.onnx", image_size=48, num_classes=10),
            "medium": zoo.resnet18(root / "medium.onnx", image_size=32, num_classes=10),
            "fast": zoo.mlp(root / "fast.onnx", seed=1),
            "fast2": zoo.mlp(root / "fast2.onnx", seed=2), "garbage": garbage}


@pytest.fixture(scope="module")
def agents():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(LoadingAgent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield {tier: (f"127.0.0.1:{port}",) for tier in TIERS}
    server.stop(0)


class Controller:
    """A local controller reconciling in a thread of its own (the store's
    connection stays in that thread). `crash()` ends it as a kill would:
    nothing is stopped, its builds run on."""

    def __init__(self, state: Path, max_builds: int = 2) -> None:
        self.state, self.max_builds = state, max_builds
        self.lines: list[str] = []
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._crashed = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            controller = HostController(self.state, interval_s=0.3, progress=self.lines.append,
                                         max_builds=self.max_builds)
        except BaseException as error:
            self.failure = error
            raise
        try:
            controller.run(self._stop)
        except BaseException as error:
            self.failure = error
            raise
        finally:
            if self._crashed:
                controller.store.close()
            else:
                controller.close()

    def crash(self) -> None:
        self._crashed = True
        self._stop.set()
        self._thread.join(60)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


class System:
    def __init__(self, root: Path, agents) -> None:
        self.layout = StateLayout(root).create()
        self.layout.ensure_admin_token()
        RunningSystem(agents, "").write(self.layout.system)
        self.store = StateStore(self.layout.store)
        self.controllers: list[Controller] = []

    def controller(self, max_builds: int = 2) -> Controller:
        self.controllers.append(Controller(self.layout.root, max_builds))
        return self.controllers[-1]

    def apply(self, name: str, artifact: Path, tier: str) -> None:
        self.store.apply(name, as_resource({
            "name": name, "artifact": {"uri": str(artifact), "sha256": sha256_file(artifact)},
            "tiers": {tier: {}},
            "rollout": {"stages": [{"name": "one", "weights": {tier: 10}}]}}))

    def status(self, name: str):
        return decode_status(name, self.store.get(name).status)

    def wait(self, what: str, done, timeout_s: float = TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for controller in self.controllers:
                assert controller.failure is None, f"the controller failed: {controller.failure}"
            result = done()
            if result:
                return result
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; controller said:\n"
                             + "\n".join(self.controllers[-1].lines[-30:]))

    def serving(self, name: str, version: int) -> bool:
        status = self.store.get(name).status
        rollout = decode_status(name, status).rollout if status else None
        return rollout is not None and rollout.stable_version == version

    def message(self, name: str) -> str:
        status = self.store.get(name).status
        return decode_status(name, status).message if status else ""

    def record(self, name: str, version: int, tier: str) -> Path:
        return self.layout.builds / name / str(version) / tier

    def build_pid(self, name: str, version: int, tier: str) -> int | None:
        try:
            return json.loads((self.record(name, version, tier) / "build.json").read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return None

    def version_dir(self, tier: str, name: str, version: int) -> Path:
        return self.layout.repository(tier) / name / str(version)

    def loaded(self, tier: str, name: str) -> list[int]:
        path = self.layout.repository(tier) / name / "config.yaml"
        config = yaml.safe_load(path.read_text()) if path.is_file() else None
        return list(((config or {}).get("version_policy") or {}).get("specific") or ())

    def close(self) -> None:
        for controller in self.controllers:
            controller.stop()
        self.store.close()


@pytest.fixture
def system(tmp_path, agents):
    opened = System(tmp_path / "state", agents)
    yield opened
    opened.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def building(message: str, tier: str) -> bool:
    return f"{tier} (building, " in message


def _seconds(message: str) -> str | None:
    """How long the message says a build has run."""
    found = re.search(r"\(building, (\d+) s\)", message)
    return found.group(1) if found else None


def test_a_build_shows_in_the_status_and_holds_up_no_other_model(system, artifacts):
    controller = system.controller(max_builds=2)
    system.apply("a-slow", artifacts["slow"], "edge")
    system.apply("b-fast", artifacts["fast"], "regional")
    said = system.wait("a-slow's status to say it builds",
                       lambda: building(system.message("a-slow"), "edge")
                       and system.message("a-slow"))
    assert said.startswith("version 1: waiting for its agents on edge (building, "), said
    pid = system.build_pid("a-slow", 1, "edge")
    assert pid is not None and alive(pid)

    # The other model is built, loaded and served while the slow build runs.
    system.wait("b-fast serving", lambda: system.serving("b-fast", 1))
    assert system.status("a-slow").rollout is None
    assert building(system.message("a-slow"), "edge"), system.message("a-slow")
    assert alive(pid) and not system.version_dir("edge", "a-slow", 1).exists()
    assert system.loaded("regional", "b-fast") == [1]
    system.wait("its clock to run in the message",
                lambda: int(_seconds(system.message("a-slow")) or 0) >= 2)
    assert alive(pid)

    # A spec that no longer wants version 1 stops its build.
    system.apply("a-slow", artifacts["fast2"], "regional")
    system.wait("a-slow's v1 build stopped", lambda: not alive(pid))
    system.wait("a-slow serving version 2", lambda: system.serving("a-slow", 2))
    assert not system.record("a-slow", 1, "edge").exists()
    assert not system.version_dir("edge", "a-slow", 1).exists()
    assert any("stopped the build of version 1 for edge (no longer wanted)" in line
               for line in controller.lines), controller.lines


def test_failed_builds_end_refused_with_why_and_are_not_tried_again(system, artifacts):
    controller = system.controller(max_builds=2)
    system.apply("garbage", artifacts["garbage"], "regional")
    system.apply("killed", artifacts["slow"], "edge")
    refused = system.wait("the garbage refused",
                          lambda: "refused" in system.message("garbage")
                          and system.status("garbage"))
    assert refused.message.startswith("version 1 refused: regional: "), refused.message
    degraded = {c.type: c for c in refused.conditions}["Degraded"]
    assert (degraded.status, degraded.reason) == ("True", "BuildRefused")

    system.wait("the slow build running", lambda: building(system.message("killed"), "edge"))
    pid = system.build_pid("killed", 1, "edge")
    os.kill(pid, signal.SIGKILL)  # as the OOM killer would
    said = system.wait("the killed build refused",
                       lambda: "refused" in system.message("killed")
                       and system.message("killed"))
    assert said == ("version 1 refused: edge: tiered build was killed by SIGKILL and left "
                    "no verdict"), said

    time.sleep(3.0)  # ten passes and more
    for name, tier in (("garbage", "regional"), ("killed", "edge")):
        starts = [line for line in controller.lines
                  if line == f"{name}: building version 1 for {tier}"]
        assert len(starts) == 1, controller.lines
        assert system.message(name) == system.status(name).message
        assert "refused" in system.message(name)


def test_a_restarted_controller_waits_for_a_build_that_runs_on(system, artifacts):
    first = system.controller()
    system.apply("digits", artifacts["medium"], "edge")
    system.wait("the build running", lambda: building(system.message("digits"), "edge"))
    pid = system.build_pid("digits", 1, "edge")
    first.crash()
    assert alive(pid)

    second = system.controller()
    system.wait("the second controller to say it builds",
                lambda: any("is still building" in line for line in second.lines))
    system.wait("digits serving", lambda: system.serving("digits", 1))
    assert not any(line == "digits: building version 1 for edge" for line in second.lines)
    system.wait("its end seen (a built version keeps no record)",
                lambda: not system.record("digits", 1, "edge").exists())
    assert any(line.startswith("digits: built version 1 for edge in ") for line in second.lines)
    _check_complete(system.version_dir("edge", "digits", 1))


def test_a_restarted_controller_builds_again_what_was_killed_with_its_predecessor(
        system, artifacts):
    first = system.controller()
    system.apply("digits", artifacts["medium"], "edge")
    system.wait("the build running", lambda: building(system.message("digits"), "edge"))
    pid = system.build_pid("digits", 1, "edge")
    first.crash()
    os.killpg(pid, signal.SIGKILL)  # the build dies with its controller
    # ... having copied part of its version beside its place, as a build killed
    # while installing leaves it.
    model_dir = system.layout.repository("edge") / "digits"
    half = model_dir / f".1.partial-{pid}"
    half.mkdir(parents=True)
    (half / "model.onnx").write_bytes(artifacts["medium"].read_bytes()[:1000])
    system.wait("the killed build to let its lock go", lambda: not alive(pid) or _reap(pid))

    second = system.controller()
    system.wait("the second controller building again",
                lambda: "digits: building version 1 for edge" in second.lines)
    assert any("was interrupted; building it again" in line for line in second.lines)
    assert system.build_pid("digits", 1, "edge") != pid

    def served_whole():
        # Never a version served that is not whole: named by the config only once built.
        if 1 in system.loaded("edge", "digits"):
            _check_complete(system.version_dir("edge", "digits", 1))
        return system.serving("digits", 1)

    system.wait("digits serving", served_whole)
    _check_complete(system.version_dir("edge", "digits", 1))
    assert not half.exists()  # the next build of the version cleared it


def _reap(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # the test process started it: a zombie until reaped
    except ChildProcessError:
        return True
    return not alive(pid)


def _check_complete(version: Path) -> None:
    report = json.loads((version / "build.json").read_text())
    assert report["verdict"]["built"] is True
    assert sha256_file(version / "model.onnx") == report["artifact"]["sha256"]
    onnx.checker.check_model(onnx.load(str(version / "model.onnx")))
