"""The agent's telemetry over the wire: the tiered.v1.Telemetry Stats RPC and
Prometheus /metrics, against a real agent process."""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc


def send(address: str, count: int) -> None:
    with grpcclient.InferenceServerClient(address) as client:
        for _ in range(count):
            inputs = []
            for name in ("INPUT0", "INPUT1"):
                item = grpcclient.InferInput(name, [1, 16], "FP32")
                item.set_data_from_numpy(np.ones((1, 16), np.float32))
                inputs.append(item)
            client.infer("add_sub", inputs)


def stats(address: str, cursor: float = 0.0) -> tpb.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return tpb_grpc.TelemetryStub(channel).Stats(
            tpb.StatsRequest(model_name="add_sub", cursor=cursor), timeout=10)


def wait_for_next_slot() -> None:
    time.sleep(1.2)  # slots are one second; a read returns completed slots only


def test_stats_since_a_cursor_count_each_request_once(agent):
    wait_for_next_slot()  # no earlier test's requests share the cursor's slot
    first = stats(agent.address)
    send(agent.address, 12)
    wait_for_next_slot()
    second = stats(agent.address, cursor=first.end)
    (version,) = second.versions
    assert (version.model_name, version.model_version, version.device) == ("add_sub", "1", "cpu")
    assert version.success == 12 and version.inferences == 12
    assert sum(version.latency.count) == 12 and version.latency.sum_s > 0
    assert len(version.latency_samples_s) == 12
    assert all(0 < s < 5 for s in version.latency_samples_s)
    assert version.busy_s > 0
    third = stats(agent.address, cursor=second.end)
    assert [v.success for v in third.versions] == [0]


READ_SKEW_S = 0.1  # how late after its slot mark a meter reading may be taken


def test_stats_attribute_active_energy_with_its_source_and_idle_draw(agent):
    time.sleep(2.2)  # a whole slot with no engine work: a counter's idle draw is measured
    start = stats(agent.address)
    send(agent.address, 20)
    wait_for_next_slot()
    response = stats(agent.address, cursor=start.end)
    assert response.tier == "edge" and response.window_s == 60
    (cpu,) = [d for d in response.devices if d.device == "cpu"]
    assert cpu.source in ("rapl", "model") and cpu.joules > 0
    assert cpu.HasField("idle_watts") and cpu.idle_watts >= 0
    if cpu.source == "model":
        assert cpu.idle_watts == 5.0  # the model's configured idle draw, not a measurement
    (version,) = response.versions
    assert version.has_energy and version.energy.source == cpu.source
    assert version.energy.idle_watts == cpu.idle_watts
    active = cpu.joules - cpu.idle_watts * (response.end - response.start)
    # Above idle only. The agent times idle draw between its meter's readings,
    # each taken a little after its slot mark (READ_SKEW_S at most here), so the
    # marks' span can differ from it by that much at either end.
    skew = cpu.idle_watts * 2 * READ_SKEW_S
    assert 0 <= version.energy.joules <= max(active, 0.0) + skew + 1e-9
    assert version.joules_per_inference == pytest.approx(version.energy.joules / 20)


# Triton's own metric names and types (its metrics documentation), which its
# dashboards and alerts query: counters with no `_total` suffix.
TRITON_METRICS = {
    "nv_inference_request_success": "counter", "nv_inference_request_failure": "counter",
    "nv_inference_count": "counter", "nv_inference_exec_count": "counter",
    "nv_inference_request_duration_us": "counter", "nv_inference_queue_duration_us": "counter",
    "nv_inference_compute_input_duration_us": "counter",
    "nv_inference_compute_infer_duration_us": "counter",
    "nv_inference_compute_output_duration_us": "counter",
    "nv_inference_pending_request_count": "gauge",
}


def test_metrics_use_triton_names_and_label_energy_sources(agent):
    send(agent.address, 3)
    with grpcclient.InferenceServerClient(agent.address) as client:
        triton = client.get_inference_statistics("add_sub").model_stats[0]
    text = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
    for name, kind in TRITON_METRICS.items():  # exactly as Triton writes them
        assert f"# TYPE {name} {kind}\n" in text, name
        assert re.search(rf'^{name}{{model="add_sub",version="1",tier="edge"}} ', text,
                         re.MULTILINE), name
    families = {f.name: f for f in text_string_to_metric_families(text)}  # and it parses
    success = {s.labels["model"]: s.value for s in families["nv_inference_request_success"].samples}
    assert success["add_sub"] >= triton.inference_stats.success.count >= 3
    energy = families["tiered_energy_joules"].samples
    assert {s.labels["device"] for s in energy} >= {"cpu"}
    assert all(s.labels["source"] in ("rapl", "model", "nvml") and s.value > 0 for s in energy)
    idle = {s.labels["device"]: s for s in families["tiered_idle_watts"].samples}
    assert idle["cpu"].labels["source"] in ("rapl", "model") and idle["cpu"].value >= 0


def test_latency_histograms_count_every_answer_and_sum_across_replicas(agent):
    send(agent.address, 4)
    text = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    success = {s.labels["model"]: s.value for s in families["nv_inference_request_success"].samples}
    for name in ("tiered_request_duration_seconds", "tiered_queue_duration_seconds",
                 "tiered_compute_duration_seconds"):
        assert families[name].type == "histogram"
        samples = [s for s in families[name].samples if s.labels["model"] == "add_sub"]
        buckets = [s for s in samples if s.name.endswith("_bucket")]
        counts = [s.value for s in buckets]
        assert counts == sorted(counts), f"{name}: buckets are not cumulative"
        assert buckets[-1].labels["le"] == "+Inf"
        (total,) = [s.value for s in samples if s.name.endswith("_count")]
        assert total == counts[-1] == success["add_sub"]  # one observation per answer
        # Fixed bounds, the same on every replica: what lets Prometheus sum them.
        assert [b.labels["le"] for b in buckets][:3] == ["0.0001", "0.00025", "0.0005"]


def test_tiered_top_prints_a_row_per_model_version(agent):
    import subprocess
    import sys

    from tiered.cli import top

    send(agent.address, 5)
    wait_for_next_slot()
    result = subprocess.run(
        [sys.executable, "-m", "tiered", "top", agent.address, "--once", "--model", "add_sub",
         "--insecure"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    header, *lines = result.stdout.strip().splitlines()
    assert header.split()[:4] == ["agent", "tier", "model", "ver"]
    row, *notes = lines
    fields = row.split()
    assert fields[:5] == [agent.address, "edge", "add_sub", "1", "cpu"]
    assert float(fields[5]) > 0  # req/s over the window
    if fields[top.HEADERS.index("source")] == "model":  # called an estimate under the table
        assert len(notes) == 1 and "estimate" in notes[0]
    else:
        assert notes == []
