"""One agent, one engine process per device: CPU engine processes stand in
for GPUs (`--devices cpu,cpu,cpu`), behind two front-end processes. Requests spread by load, each device
forms its own batches, statistics and energy are kept per device and summed
per version, a dead engine process is restarted while its requests go to the
others (none lost), and a device that cannot come back is reported.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from importlib import resources
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import engine_processes, environ_of
from tests.integration.test_front_ends import add_sub
from tiered.agent.repository import model_file, write_config
from tiered.controller.judge import RolloutJudge
from tiered.local.processes import AgentProcess
from tiered.models import zoo
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc

DEVICES = ("cpu:0", "cpu:1", "cpu:2")


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("devices")
    zoo.add_sub(model_file(root, "add_sub", 1))
    write_config(root, "add_sub", {"max_batch_size": 8,
                                   "dynamic_batching": {"max_queue_delay_us": 2000}})
    # ms per image: queues build up, so the spread by load shows
    zoo.resnet18(model_file(root, "slow", 1), image_size=64, num_classes=10)
    write_config(root, "slow", {"max_batch_size": 4,
                                "dynamic_batching": {"max_queue_delay_us": 1000}})
    return root


@pytest.fixture(scope="module")
def agent(repository, tmp_path_factory):
    # the edge profile with small arenas: 6 engine processes need not hold 1.5 GiB
    profile = yaml.safe_load(resources.files("tiered.profiles").joinpath("edge.yaml").read_text())
    profile.setdefault("limits", {})["device_arena_mib"] = 8
    path = tmp_path_factory.mktemp("profile") / "edge.yaml"
    path.write_text(yaml.safe_dump(profile))
    with AgentProcess("edge", repository, extra_args=[
            "--profile", str(path), "--devices", "cpu,cpu,cpu", "--front-ends", "2"]) as process:
        yield process
        assert process.alive(), process.log_tail()
        engines = [pid for pids in engine_processes(process).values() for pid in pids]
    # a stopped agent leaves no engine process behind
    assert engines and not [pid for pid in engines if Path(f"/proc/{pid}").exists()]


def stats(agent, model: str) -> tpb.VersionStats:
    with grpc.insecure_channel(agent.address) as channel:
        reply = tpb_grpc.TelemetryStub(channel).Stats(tpb.StatsRequest(model_name=model))
    (version,) = reply.versions
    return version


def health(agent) -> int:
    with grpc.insecure_channel(agent.address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status


def shares(agent, model: str) -> dict[str, tpb.DeviceShare]:
    return {share.device: share for share in stats(agent, model).devices}


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def image_inputs(count: int = 1):
    item = grpcclient.InferInput("input", [count, 3, 64, 64], "FP32")
    item.set_data_from_numpy(np.random.default_rng(count).standard_normal(
        (count, 3, 64, 64)).astype(np.float32))
    return [item]


class Load:
    """Threads sending `slow` requests until stopped; every answer is checked."""

    def __init__(self, agent, threads: int) -> None:
        self.agent, self.sent, self.errors = agent, 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send) for _ in range(threads)]
        self._lock = threading.Lock()

    def _send(self) -> None:
        with grpcclient.InferenceServerClient(self.agent.address) as client:
            while not self._stop.is_set():
                try:
                    result = client.infer("slow", image_inputs())
                    assert result.as_numpy("logits").shape == (1, 10)
                    with self._lock:
                        self.sent += 1
                except InferenceServerException as error:
                    with self._lock:
                        self.errors.append(str(error))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def test_every_device_runs_the_model_in_a_process_of_its_own(agent):
    processes = engine_processes(agent)
    assert len(processes["slow"]) == len(processes["add_sub"]) == len(DEVICES), processes
    with grpcclient.InferenceServerClient(agent.address) as client:
        rows = np.arange(32, dtype=np.float32).reshape(2, 16)
        result = client.infer("add_sub", add_sub(rows))
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), rows + rows)
        config = client.get_model_config("slow", as_json=True)["config"]
    assert stats(agent, "slow").device == ",".join(DEVICES)
    facts = {k: v["string_value"] for k, v in config["parameters"].items()}
    assert facts["devices"] == ",".join(DEVICES) and facts["engine"] == "onnxruntime"


def test_load_spreads_over_devices_and_is_counted_per_device_and_summed(agent):
    before = {d: s.inferences for d, s in shares(agent, "slow").items()}
    with Load(agent, threads=6) as load:
        time.sleep(4.0)
    assert not load.errors, load.errors[:3]
    time.sleep(1.2)  # the last slot closes
    version = stats(agent, "slow")
    ran = {s.device: s.inferences - before.get(s.device, 0) for s in version.devices}
    assert set(ran) == set(DEVICES)
    assert all(count > 0 for count in ran.values()), ran  # every device took work
    # the version's figures are the devices' figures summed
    assert sum(s.inferences for s in version.devices) == version.inferences
    assert sum(s.busy_s for s in version.devices) == pytest.approx(version.busy_s, rel=1e-6)
    # each device's energy (modeled from its engine processes' CPU time) split
    # among the versions on it, and the version's the sum of its parts
    joules = [s.joules for s in version.devices if s.HasField("joules")]
    assert version.has_energy and version.energy.source == "model"
    assert len(joules) == len(DEVICES) and all(j > 0 for j in joules), joules
    assert sum(joules) == pytest.approx(version.energy.joules, rel=1e-6)
    with urllib.request.urlopen(agent.metrics_url) as answer:
        metrics = answer.read().decode().splitlines()
    for device in DEVICES:
        up = [line for line in metrics if line.startswith("tiered_engine_up{")
              and f'device="{device}"' in line and 'model="slow"' in line]
        assert len(up) == 1 and float(up[0].rsplit(" ", 1)[1]) == 1, up
        assert any(line.startswith("tiered_energy_joules_total{") and f'device="{device}"' in line
                   and 'source="model"' in line for line in metrics), device


def test_a_dead_engine_process_is_restarted_and_loses_no_request(agent):
    victim_device = "cpu:1"
    restarts = shares(agent, "slow")[victim_device].restarts
    with Load(agent, threads=6) as load:
        time.sleep(1.0)
        (victim,) = [pid for pid in engine_processes(agent)["slow"]
                     if _device_of(pid) == victim_device]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: shares(agent, "slow")[victim_device].restarts > restarts, 30,
                 "the engine process to be restarted")
        served_before = load.sent
        time.sleep(1.5)
    assert not load.errors, load.errors[:3]  # its requests went to the other devices
    assert load.sent > served_before
    share = shares(agent, "slow")[victim_device]
    assert share.up and not share.down_reason
    assert victim not in engine_processes(agent)["slow"]
    assert "engine process exited with code -9" in agent.log_tail()


def _device_of(pid: int) -> str:
    """An engine process's device, from the environment it was started with."""
    return environ_of(pid)["TIERED_DEVICE"]


def test_a_device_that_cannot_come_back_is_reported_and_the_others_serve(agent, repository):
    model = model_file(repository, "add_sub", 1)
    original = model.read_bytes()
    model.write_bytes(b"not an onnx model")  # what an engine process will fail to load
    try:
        pids = {_device_of(pid): pid for pid in engine_processes(agent)["add_sub"]}
        os.kill(pids["cpu:2"], signal.SIGKILL)
        wait_for(lambda: "restart failed" in shares(agent, "add_sub")["cpu:2"].down_reason,
                 30, "the restart to fail")
        share = shares(agent, "add_sub")["cpu:2"]
        assert not share.up and "cannot load the model" in share.down_reason
        # what the controller reads during a rollout, and names in Degraded
        with grpc.insecure_channel(agent.address) as channel:
            _, unreadable, down = RolloutJudge(lambda address: channel)._readings(
                "add_sub", {"edge": [agent.address]})
        assert not unreadable
        assert down == [f"{agent.address} cpu:2: {share.down_reason}"]
        rows = np.ones((1, 16), np.float32)
        with grpcclient.InferenceServerClient(agent.address) as client:
            for _ in range(20):  # the other devices answer every request
                client.infer("add_sub", add_sub(rows))
            assert client.is_model_ready("add_sub")
            for device in ("cpu:0", "cpu:1"):
                os.kill(pids[device], signal.SIGKILL)
            wait_for(lambda: not client.is_model_ready("add_sub"), 30,
                     "the model to be not ready with no device up")
            wait_for(lambda: health(agent) == health_pb2.HealthCheckResponse.NOT_SERVING, 10,
                     "health to say NOT_SERVING")
            with pytest.raises(InferenceServerException) as refused:
                client.infer("add_sub", add_sub(rows))
            assert "no device takes requests" in str(refused.value)
            assert "cpu:2: restart failed" in str(refused.value)
            model.write_bytes(original)  # the devices come back
            wait_for(lambda: client.is_model_ready("add_sub"), 60, "a device to come back")
            wait_for(lambda: all(s.up for s in shares(agent, "add_sub").values()), 60,
                     "every device to come back")
            wait_for(lambda: health(agent) == health_pb2.HealthCheckResponse.SERVING, 10,
                     "health to say SERVING again")
            result = client.infer("add_sub", add_sub(rows))
            np.testing.assert_allclose(result.as_numpy("OUTPUT0"), rows + rows)
    finally:
        model.write_bytes(original)
