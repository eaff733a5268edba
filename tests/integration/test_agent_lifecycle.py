"""Agent lifecycle with real processes: load/unload under traffic, bad configs,
size limits and draining on shutdown."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from tests.conftest import exited, wait_until_held
from tiered.agent.repository import model_file, write_config
from tiered.local.processes import AgentError, AgentProcess
from tiered.models import zoo

FEATURES = 16


def mlp_inputs(rows: int = 1) -> list[grpcclient.InferInput]:
    data = np.random.default_rng(rows).standard_normal((rows, FEATURES)).astype(np.float32)
    item = grpcclient.InferInput("input", [rows, FEATURES], "FP32")
    item.set_data_from_numpy(data)
    return [item]


def mlp_repository(root: Path) -> Path:
    zoo.mlp(model_file(root, "mlp", 1), seed=1)
    write_config(root, "mlp", {"max_batch_size": 8, "dynamic_batching": {}})
    return root


class Traffic:
    """Threads sending requests back to back, each logging its outcomes in order."""

    def __init__(self, address: str, model: str, threads: int = 4) -> None:
        self.address, self.model = address, model
        self.logs: list[list[tuple[bool, str]]] = [[] for _ in range(threads)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(log,)) for log in self.logs]

    def _send(self, log: list[tuple[bool, str]]) -> None:
        with grpcclient.InferenceServerClient(self.address) as client:
            while not self._stop.is_set():
                try:
                    result = client.infer(self.model, mlp_inputs())
                    log.append((True, result.get_response().model_version))
                except InferenceServerException as error:
                    log.append((False, f"{error.status()}: {error.message()}"))

    def outcomes(self, answered: bool) -> list[str]:
        return [what for log in self.logs for ok, what in log if ok == answered]

    @property
    def versions(self) -> list[str]:
        return self.outcomes(answered=True)

    @property
    def failures(self) -> list[str]:
        return self.outcomes(answered=False)

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


ADMIN_TOKEN = "lifecycle-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def admin_token(tmp_path) -> Path:
    path = tmp_path / "admin.token"
    path.write_text(f"{ADMIN_TOKEN}\n")
    return path


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_new_version_loads_during_traffic_without_a_failed_request(tmp_path):
    root = mlp_repository(tmp_path)
    with AgentProcess("edge", root, admin_token_file=admin_token(tmp_path)) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        with Traffic(agent.address, "mlp") as traffic:
            wait_for(lambda: len(traffic.versions) > 20)
            zoo.mlp(model_file(root, "mlp", 2), seed=2)
            client.load_model("mlp", headers=ADMIN)  # the default policy serves the newest version
            served_at_load = len(traffic.versions)
            wait_for(lambda: all(log[-1:] == [(True, "2")] for log in traffic.logs)
                     and len(traffic.versions) > served_at_load + 20)
        assert traffic.failures == []
        assert set(traffic.versions) == {"1", "2"}
        assert client.get_model_metadata("mlp").versions == ["2"]
        for log in traffic.logs:  # once a thread saw the new version, it never sees the old one
            first_two = log.index((True, "2"))
            assert (True, "1") not in log[first_two:], "old version served after the swap"


def test_unload_drains_then_refuses_and_load_brings_it_back(tmp_path):
    root = mlp_repository(tmp_path)
    with AgentProcess("edge", root, admin_token_file=admin_token(tmp_path)) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        with Traffic(agent.address, "mlp") as traffic:
            wait_for(lambda: len(traffic.versions) > 20)
            client.unload_model("mlp", headers=ADMIN)
            answered_at_unload = len(traffic.versions)
            wait_for(lambda: len(traffic.failures) > 5)
        # Unload answers only after in-flight requests finished: at most one answer
        # per thread was still on its way back, and no thread was answered after
        # its first refusal.
        assert len(traffic.versions) - answered_at_unload <= len(traffic.logs)
        for log in traffic.logs:
            first_refusal = next((i for i, (ok, _) in enumerate(log) if not ok), len(log))
            assert all(not ok for ok, _ in log[first_refusal:]), log[first_refusal:]
        assert {f.split(":")[0] for f in traffic.failures} <= {
            "StatusCode.NOT_FOUND", "StatusCode.UNAVAILABLE"}
        assert not client.is_model_ready("mlp")
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert index["mlp"].state == "UNAVAILABLE" and index["mlp"].reason == "unloaded"
        client.load_model("mlp", headers=ADMIN)
        assert client.infer("mlp", mlp_inputs()).as_numpy("probabilities").shape == (1, 4)


def test_bad_config_on_reload_is_refused_and_the_old_version_keeps_serving(tmp_path):
    root = mlp_repository(tmp_path)
    with AgentProcess("edge", root, admin_token_file=admin_token(tmp_path)) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        (root / "mlp" / "config.yaml").write_text("max_batch_size: 8\ndynamic_batchin: {}\n")
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("mlp", headers=ADMIN)
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "dynamic_batchin" in caught.value.message()
        assert client.infer("mlp", mlp_inputs()).get_response().model_version == "1"
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("../etc", headers=ADMIN)
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("absent", headers=ADMIN)
        assert caught.value.status() == "StatusCode.NOT_FOUND"


def test_malformed_config_stops_start_up_with_a_message_naming_the_field(tmp_path):
    root = mlp_repository(tmp_path)
    zoo.add_sub(model_file(root, "broken", 1))
    write_config(root, "broken", {"max_batch_size": 4,
                                  "inputs": [{"name": "INPUT0", "datatype": "FP33", "dims": [16]}]})
    with pytest.raises(AgentError) as caught:
        AgentProcess("edge", root).start()
    assert "broken/config.yaml.inputs[0].datatype" in str(caught.value)
    assert "FP33" in str(caught.value)

    model_file(root, "garbled", 1).write_bytes(b"not an ONNX model")
    write_config(root, "garbled", {"max_batch_size": 4})
    with AgentProcess("edge", root, extra_args=["--allow-failed-models"]) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert index["broken"].state == "UNAVAILABLE" and "FP33" in index["broken"].reason
        # An engine's own error names the file: where the models are kept is
        # the agent's business, and the index says the path in the repository.
        garbled = index["garbled"]
        assert garbled.state == "UNAVAILABLE" and "garbled/1/model.onnx" in garbled.reason
        assert str(root) not in garbled.reason, garbled.reason
        assert index["mlp"].state == "READY"


def test_oversize_message_is_refused_and_the_agent_keeps_serving(tmp_path):
    root = mlp_repository(tmp_path)
    profile = yaml.safe_load(resources.files("tiered.profiles").joinpath("edge.yaml").read_text())
    profile["limits"]["max_message_bytes"] = 1 << 20
    (tmp_path / "edge.yaml").write_text(yaml.safe_dump(profile))
    with AgentProcess("edge", root, extra_args=["--profile", str(tmp_path / "edge.yaml")]) \
            as agent, grpcclient.InferenceServerClient(agent.address) as client:
        huge = grpcclient.InferInput("input", [8, 40_000], "FP32")
        huge.set_data_from_numpy(np.zeros((8, 40_000), np.float32))  # 1.28 MB
        with pytest.raises(InferenceServerException) as caught:
            client.infer("mlp", [huge])
        assert caught.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert client.infer("mlp", mlp_inputs()).as_numpy("probabilities").shape == (1, 4)


def test_sigterm_drains_in_flight_requests(tmp_path):
    root = tmp_path
    zoo.resnet18(model_file(root, "slow", 1), image_size=224, num_classes=10)
    write_config(root, "slow", {"max_batch_size": 1})
    image = np.zeros((1, 3, 224, 224), np.float32)
    agent = AgentProcess("edge", root).start()
    results, errors = [], []
    done = threading.Event()

    def callback(result, error):
        (errors if error else results).append(error or result)
        if len(results) + len(errors) == 6:
            done.set()

    with grpcclient.InferenceServerClient(agent.address) as client:
        for _ in range(6):
            item = grpcclient.InferInput("input", [1, 3, 224, 224], "FP32")
            item.set_data_from_numpy(image)
            client.async_infer("slow", [item], callback)
        # The signal once the agent holds all six: one not yet received could
        # rightly be refused.
        answered, in_flight = wait_until_held(agent, "slow", 6)
        code = agent.stop()
        assert done.wait(30)
    assert answered + in_flight == 6 and in_flight > 0, (answered, in_flight)
    assert code == 0, agent.log_tail()
    assert errors == [] and len(results) == 6
    assert "shutting down" in agent.log()


def test_missing_repository_is_a_clear_start_up_error(tmp_path):
    with pytest.raises(AgentError) as caught:
        AgentProcess("edge", tmp_path / "nowhere").start()
    assert "is not a directory" in str(caught.value)


def test_reload_rebuilds_only_versions_whose_files_changed(tmp_path):
    """Reload rebuilds a version whose file changed and keeps one that did not."""
    root = mlp_repository(tmp_path)
    with AgentProcess("edge", root, admin_token_file=admin_token(tmp_path)) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        before = client.infer("mlp", mlp_inputs()).as_numpy("probabilities")
        client.load_model("mlp", headers=ADMIN)  # nothing changed: same answers
        np.testing.assert_array_equal(
            client.infer("mlp", mlp_inputs()).as_numpy("probabilities"), before)
        replacement = tmp_path / "other.onnx"
        zoo.mlp(replacement, seed=9)
        shutil.copy(replacement, root / "mlp" / "1" / "model.onnx")
        client.load_model("mlp", headers=ADMIN)
        after = client.infer("mlp", mlp_inputs()).as_numpy("probabilities")
        assert not np.allclose(after, before)


def test_load_and_unload_need_an_admin_token(tmp_path):
    root = mlp_repository(tmp_path)
    with AgentProcess("edge", root, admin_token_file=admin_token(tmp_path)) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        for headers, status in ((None, "StatusCode.UNAUTHENTICATED"),
                                ({"authorization": "Bearer guess"},
                                 "StatusCode.PERMISSION_DENIED")):
            with pytest.raises(InferenceServerException) as caught:
                client.unload_model("mlp", headers=headers)
            assert caught.value.status() == status
            assert "admin token" in caught.value.message()
        assert client.is_model_ready("mlp")  # refused calls changed nothing
        assert client.infer("mlp", mlp_inputs()).get_response().model_version == "1"
    with AgentProcess("edge", root) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:  # no admin at all
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("mlp", headers=ADMIN)
        assert caught.value.status() == "StatusCode.PERMISSION_DENIED"


def test_a_symlink_out_of_the_repository_is_refused(tmp_path):
    root = mlp_repository(tmp_path / "repository")
    outside = tmp_path / "outside"
    outside.mkdir()
    zoo.mlp(outside / "model.onnx", seed=3)
    with AgentProcess("edge", root, admin_token_file=admin_token(tmp_path)) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        (root / "mlp" / "2").symlink_to(outside, target_is_directory=True)
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("mlp", headers=ADMIN)
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "leads out of the repository" in caught.value.message()
        assert client.infer("mlp", mlp_inputs()).get_response().model_version == "1"


PARENT_SCRIPT = """
import sys
from pathlib import Path
from tiered.local.processes import AgentProcess, RouterProcess
agent = AgentProcess("edge", Path(sys.argv[1])).start()
table = Path(sys.argv[2])
table.write_text('{"version": 1, "models": {"mlp": {"tiers": {"edge": {"agents": ["%s"]}}}}}'
                 % agent.address)
router = RouterProcess(table).start()
print(agent.pid, router.pid, flush=True)
sys.stdin.read()  # until killed
"""


def test_servers_whose_parent_is_killed_outright_stop_and_leave_nothing_behind(tmp_path):
    """A process that started an agent and a router is SIGKILLed (as a test's
    timeout or an OOM kill does to `tiered up`): no handler of its runs, yet
    both servers notice they were orphaned, drain and exit."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_SCRIPT, str(mlp_repository(tmp_path / "repository")),
         str(tmp_path / "table.json")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    servers: list[int] = []
    try:
        servers = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(servers) == 2, servers
        parent.kill()
        parent.wait(10)

        # reparented and exited but not yet reaped (a zombie) counts as gone
        wait_for(lambda: all(exited(pid) for pid in servers), timeout_s=30)
    finally:
        parent.kill()
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
