"""`bench/gpu.py --devices N`: one agent over several GPUs, against one GPU, in one run.

ResNet-18 (random weights) on the datacenter torch engine (FP16, CUDA graphs,
pinned staging), served by one agent with front-end processes, requests
carrying `request_batch` images each whose input tensors lie in system shared
memory (each client process registers a region; requests name it). Setups,
each at a concurrency that grows with its devices:

- `in the agent's process`: today's one-GPU agent (`--devices none`), the
  baseline every ratio divides by;
- `k engine processes`: `--devices 0,..,k-1`, one engine process per GPU, for
  k = 1, 2, 4 .. N (those the machine has); k = 1 shows what the hop to an
  engine process costs on one GPU.

Per setup: images/s, latency percentiles, the batch each device formed, the
share of images each device ran (the agent's own per-device Stats), and
energy from each GPU's NVML counter over the window: J/image per device and
for the node (every GPU the setup used). With `--device cpu`, CPU engine
processes stand in for GPUs (`cpu` entries) and no energy is read: the
numbers check the harness, they mean nothing.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import tritonclient.grpc as grpcclient

from bench import common
from tiered.agent.devices import nvml_gpu_count
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc
from tiered.tables import cell

MODEL, INPUT, OUTPUT = "resnet18", "input", "logits"  # as bench/gpu.py writes it

TARGETS = {2: 1.8, 4: 3.5}  # images/s over one GPU's
IN_PROCESS = "in the agent's process, 1 device"


def engine_processes(count: int) -> str:
    return f"{count} engine process{'es' if count > 1 else ''}"


def device_counts(available: int) -> list[int]:
    """1, 2, 4, ... up to what the machine has, and the whole machine."""
    counts, k = [], 1
    while k <= available:
        counts.append(k)
        k *= 2
    if available not in counts:
        counts.append(available)
    return counts


class Meters:
    """Each GPU's NVML energy counter; none on a CPU."""

    def __init__(self, count: int, on_gpu: bool) -> None:
        self.meters = [common.NvmlEnergy(i) for i in range(count)] if on_gpu else []

    def read(self) -> list[float]:
        return [m.read() for m in self.meters]


def per_device(address: str, since: float) -> dict[str, Mapping[str, float]]:
    """The agent's own figures per device since `since` (the machine's monotonic
    clock, which the agent's telemetry keeps)."""
    with grpc.insecure_channel(address) as channel:
        reply = tpb_grpc.TelemetryStub(channel).Stats(
            tpb.StatsRequest(model_name=MODEL, cursor=since))
    return {share.device: {"inferences": share.inferences, "busy_s": share.busy_s}
            for version in reply.versions for share in version.devices}


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds of process `pid` alone, and of its live children together."""
    own = common._stat(pid)
    alone = (int(own[11]) + int(own[12])) / common._clock_ticks() if own else 0.0
    return alone, (common.process_cpu_s(pid) or 0.0) - alone


def setup_point(name: str, devices_flag: str, used: int, concurrency: int,
                settings: Any, request_batch: int, repo: Path,
                meters: Meters) -> dict[str, Any]:
    size = settings.image_size
    load = common.Load.random(MODEL, INPUT, (request_batch, 3, size, size),
                              outputs={OUTPUT: (request_batch, 1000)},
                              timeout_s=settings.request_timeout_s, shared_memory=True)
    agent = common.agent("datacenter", repo, extra_args=[
        "--devices", devices_flag, "--front-ends", str(settings.front_ends)])
    common.progress(f"starting: {name} (--devices {devices_flag})")
    with common.serving([agent]) as (started,):
        stats = grpcclient.InferenceServerClient(started.address)

        def probe() -> tuple[float, list[float], dict[str, int], tuple[float, float]]:
            totals = common.stats_totals(stats.get_inference_statistics(MODEL, as_json=True),
                                         MODEL)
            return time.monotonic(), meters.read(), totals, cpu_seconds(started.pid)

        try:
            window = common.closed_loop([started.address], load, concurrency, settings.warmup_s,
                                        settings.duration_s, processes=settings.client_processes,
                                        probe=probe)
            # whole telemetry slots: from the one the window opened in, to the
            # one it closed in (so a short window has a share too)
            common.sleep_until(math.floor(window.after[0]) + 1.2)
            shares = per_device(started.address, math.floor(window.before[0]))
        finally:
            stats.close()
        log_tail = started.log_tail(6)
    (t0, j0, before, cpu0), (t1, j1, after, cpu1) = window.before, window.after
    summary = window.summary()
    images = summary["requests"] * request_batch
    seconds = t1 - t0
    joules = [b - a for a, b in zip(j0, j1)][:used]
    ran = sum(s["inferences"] for s in shares.values()) or None
    delta = common.stats_delta(before, after)
    return {
        "setup": name, "devices": used, "devices_flag": devices_flag,
        "concurrency": concurrency, "request_batch": request_batch,
        **summary,
        "img_per_s": images / seconds if seconds > 0 else None,
        "formed_batch": common.formed_batch(delta),
        # of the images the agent ran over the window, the share each device ran
        "device_share": {d: common.ratio(s["inferences"], ran) for d, s in sorted(shares.items())},
        # CPU cores busy: the agent's own process (batchers, merge into the
        # engines' arenas), and its children (front ends, engine processes)
        "agent_cpu_cores": common.ratio(cpu1[0] - cpu0[0], seconds),
        "children_cpu_cores": common.ratio(cpu1[1] - cpu0[1], seconds),
        "j_per_img_node": common.ratio(sum(joules), images or None) if joules else None,
        "j_per_img_device": [common.ratio(j * len(joules), images or None) for j in joules],
        "watts_per_device": [common.ratio(j, seconds) for j in joules],
        "log_tail": log_tail,
    }


def run(settings: Any, count: int, request_batch: int, smoke: bool,
        write_repository: Callable[[Path, Any], Path]) -> dict[str, Any]:
    """The setups above on up to `count` devices (GPUs, or CPU stand-ins), over
    the repository bench/gpu.py writes."""
    on_gpu = settings.device == "cuda"
    available = min(count, nvml_gpu_count()) if on_gpu else count
    result = common.record("gpu", smoke, with_gpu=on_gpu)  # its --devices part
    result.update(settings=asdict(settings), request_batch=request_batch, asked_devices=count,
                  available_devices=available,
                  energy="NVML total energy counter, per GPU" if on_gpu else "not read (cpu)")
    if available < count:
        result["not_run"] = (f"{count} devices asked for, {available} present: the setups "
                             f"of more than {available} were not run")
    meters = Meters(available, on_gpu)
    entries = [str(i) if on_gpu else "cpu" for i in range(available)]
    top = max(settings.concurrency)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tiered-devices-bench-") as tmp:
        repo = Path(tmp) / "repository"
        write_repository(repo, settings)
        rows.append(setup_point(IN_PROCESS, "none", 1, top, settings, request_batch, repo,
                                meters))
        for k in device_counts(available):
            rows.append(setup_point(engine_processes(k), ",".join(entries[:k]), k, top * k,
                                    settings, request_batch, repo, meters))
    base = rows[0]["img_per_s"]
    for row in rows:
        row["vs_one_device"] = common.ratio(row["img_per_s"], base)
    result["rows"] = rows
    result["targets"] = targets(rows, count)
    return result


def targets(rows: Sequence[Mapping[str, Any]], asked: int) -> list[common.Target]:
    """>= 1.8x one GPU at 2, >= 3.5x at 4: N/A where that many were not lent."""
    judged = []
    for k, threshold in TARGETS.items():
        row = next((r for r in rows if r["setup"] == engine_processes(k)), None)
        judged.append(common.judge(
            f"{k} devices", f"img/s with {engine_processes(k)} / {IN_PROCESS}"
            + ("" if row else f" (not run: fewer than {k} devices)"),
            row["vs_one_device"] if row else None, ">=", threshold))
    return judged


def report(result: Mapping[str, Any]) -> str:
    table = common.table(
        ["setup", "c", "img/s", "x one", "p50 ms", "p99 ms", "batch", "err", "agent cpu",
         "children cpu", "device share", "J/img node", "J/img per device"],
        [[r["setup"], r["concurrency"], r["img_per_s"], r["vs_one_device"], r["p50_ms"],
          r["p99_ms"], r["formed_batch"], r["errors"], r["agent_cpu_cores"],
          r["children_cpu_cores"],
          " ".join(f"{d}:{cell(s)}" for d, s in r["device_share"].items()),
          r["j_per_img_node"], " ".join(cell(j) for j in r["j_per_img_device"])]
         for r in result["rows"]])
    lines = [table, "", common.targets_table(result["targets"])]
    if result.get("not_run"):
        lines.append(f"not run: {result['not_run']}")
    return "\n".join(lines)
