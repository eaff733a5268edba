"""Benchmark: joules per inference as the agent reports it, checked against NVML.

For each request batch size B (default 8 and 64), in one run:

- served: a `tiered agent --tier datacenter` process serves ResNet-18
  (tiered.models.zoo, random weights, 224x224) through the torch engine with
  the datacenter profile's settings (FP16, CUDA graphs, pinned staging, two
  streams); its config.yaml sets `max_batch_size: B`, so batch-B requests run
  as engine batches of exactly B. Client processes (tritonclient aio) keep
  about `--in-flight-images` images in flight. After a warm-up, a window of
  `--duration` whole one-second slots [S, E) is measured three ways:
    agent   its own `tiered.v1.Telemetry/Stats` over [S, E) (cursor S, read
            half a slot after E): inferences, the GPU's energy over the span
            as the agent read it (NVML), its idle draw as the agent measured
            it, and the version's active J/inference (above idle; the figure
            versions are judged on, shown beside);
    direct  this process reads NVML's total-energy counter itself, every
            `--sample-ms`, on the same monotonic clock as the agent's slots;
            the counter is interpolated at S and E (the agent's reported
            span), and divided by the inferences the agent counted;
    clients the same direct joules over the images the clients saw answered
            in [S, E) (independent of the agent's counts).
  The check: agent J/inference / direct J/inference within 1 +- `--tolerance`,
  both the device's whole energy (idle included) over the agent's inferences.
- in-process: the same model with tiered.engines.torch_engine.TorchEngine and
  the same profile settings, `engine.run` on host arrays of B images from as
  many threads as the engine has streams, for `--inprocess` seconds, NVML read
  around it: (a) flat out, (b) paced to the served throughput at B. Flat out
  is the GPU's best J/image; served J/inference is higher because the GPU
  idles (drawing power) while the agent's Python handles gRPC. The paced run
  is the like-for-like: same batch, same rate, no serving.

NVML reads the whole GPU, idle draw included; the idle watts before any work
are reported too. Run on a GPU machine (about 3 minutes):

    python bench/energy.py            # writes bench/results/energy.json, prints a table

`--device cpu --image-size 32` runs the same harness without a GPU to check
it: there the agent's energy is "model" (its CPU time x configured watts) and
the direct reading is the same model computed here from the agent's
/proc/PID/stat, so the check still exercises the slot alignment; its numbers
mean nothing (the JSON says what it left out under `skipped_without_cuda`).
`--smoke --out PATH` (with `--device cpu` where there is no GPU) is that check
in seconds: one small batch size, a one-slot window; its exit status says only
whether the rows came out well-formed.

The clients, the servers and the record come from bench/common.py.
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

from bench import common
from bench.common import split_workers  # noqa: F401 - its unit test reads it here
from tiered.tables import cell

MODEL = "resnet18"
INPUT, OUTPUT = "input", "logits"
TIER = "datacenter"
SLOT_S = 1.0  # tiered.telemetry.recorder.SLOT_S; the window is whole slots of it


@dataclass(frozen=True)
class Settings:
    device: str = "cuda"
    image_size: int = 224
    batches: tuple[int, ...] = (8, 64)
    in_flight_images: int = 512  # requests in flight = this / B (at least 2)
    client_processes: int = 8  # at most; never more than the requests in flight
    warmup_s: float = 5.0
    duration_s: int = 15  # whole slots
    inprocess_s: float = 8.0  # per in-process point
    paced: bool = True  # also run in-process at the served throughput
    sample_ms: float = 10.0  # how often the direct counter is read during the window
    tolerance: float = 0.10
    request_timeout_s: float = 60.0
    idle_s: float = 2.0  # the idle draw is read over this before any work


SMOKE = dict(image_size=32, batches=(4,), in_flight_images=8, client_processes=2,
             warmup_s=0.5, duration_s=1, inprocess_s=0.3, idle_s=0.3)
# What a run on a CPU leaves out, said in its JSON.
WITHOUT_CUDA = [
    "NVML: on --device cpu the agent's energy and the direct reading are both the "
    "CPU-time model ('model'), so the check exercises the slot alignment, not a meter",
]


# --------------------------------------------------------------------------- pure helpers


def window_bounds(now: float, warmup_s: float, duration_s: int,
                  slot_s: float = SLOT_S) -> tuple[float, float]:
    """The first slot boundary at least `warmup_s` after `now`, and `duration_s`
    whole slots later: the measured span [start, end) on the slot clock."""
    start = math.ceil((now + warmup_s) / slot_s) * slot_s
    return start, start + duration_s * slot_s


def value_at(samples: Sequence[tuple[float, float]], t: float) -> float:
    """A cumulative counter at time `t`, linearly interpolated between the
    (time, value) samples around it; `t` must lie within the samples."""
    if not samples or not samples[0][0] <= t <= samples[-1][0]:
        span = (samples[0][0], samples[-1][0]) if samples else None
        raise ValueError(f"t={t} is outside the sampled span {span}")
    times = [s[0] for s in samples]
    i = bisect.bisect_left(times, t)
    if times[i] == t:
        return samples[i][1]
    (t0, v0), (t1, v1) = samples[i - 1], samples[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def counter_updates(samples: Sequence[tuple[float, float]]) -> dict[str, float | None]:
    """How often the counter actually moved: the median time between changes
    of its value and the median step (its granularity as read)."""
    changes = [(t, v) for (t, v), (_, prev) in zip(samples[1:], samples) if v != prev]
    gaps = [b[0] - a[0] for a, b in zip(changes, changes[1:])]
    steps = [b[1] - a[1] for a, b in zip(changes, changes[1:])]
    return {
        "samples": len(samples),
        "changes": len(changes),
        "median_update_s": statistics.median(gaps) if gaps else None,
        "median_step_j": statistics.median(steps) if steps else None,
    }


def per_slot_joules(samples: Sequence[tuple[float, float]], start: float, end: float,
                    slot_s: float = SLOT_S) -> list[float]:
    """The counter's increase over each slot of [start, end)."""
    bounds = [start + i * slot_s for i in range(round((end - start) / slot_s) + 1)]
    values = [value_at(samples, b) for b in bounds]
    return [b - a for a, b in zip(values, values[1:])]


def merge_slot_counts(counts: Sequence[Mapping[int, int]]) -> dict[int, int]:
    merged: dict[int, int] = {}
    for one in counts:
        for slot, n in one.items():
            merged[slot] = merged.get(slot, 0) + n
    return merged


def slot_counts(completed_at: Sequence[float], images: int) -> dict[int, int]:
    """Images answered per slot of the monotonic clock."""
    counts: dict[int, int] = {}
    for t in completed_at:
        slot = math.floor(t / SLOT_S)
        counts[slot] = counts.get(slot, 0) + images
    return counts


def images_in_span(slot_counts: Mapping[int, int], start: float, end: float) -> int:
    """Images answered in the slots that lie within [start, end)."""
    return sum(n for slot, n in slot_counts.items() if start <= slot and slot + SLOT_S <= end)


def requests_in_flight(batch: int, in_flight_images: int) -> int:
    return max(2, math.ceil(in_flight_images / batch))


def modeled_cpu_joules(cpu_s: float, wall_s: float, watts_per_busy_core: float,
                       idle_watts: float) -> float:
    """tiered.telemetry.energy.ModeledCpuMeter's formula, for the CPU dry run."""
    return cpu_s * watts_per_busy_core + wall_s * idle_watts


def agreement(agent: float | None, direct: float | None, tolerance: float) -> dict[str, Any]:
    """agent / direct, and whether it lies within 1 +- tolerance."""
    target = common.judge("agreement", "agent J/inference / direct J/inference",
                          common.ratio(agent, direct), "within", tolerance)
    return {"agent_over_direct": target.value, "tolerance": tolerance, "verdict": target.verdict}


# --------------------------------------------------------------------------- I/O: meters


class DirectMeter:
    """A cumulative joule counter read here, not by the agent: NVML's total
    energy counter of GPU 0, or (no NVML) the agent's CPU-time model recomputed
    from /proc/PID/stat. Its origin is arbitrary; only differences count."""

    def __init__(self, device: str, pid: int | None = None) -> None:
        self.pid = pid or os.getpid()
        self._nvml: common.NvmlEnergy | None = None
        if device == "cuda":
            self._nvml = common.NvmlEnergy()
            self.source = "nvml"
        else:
            from tiered.telemetry.energy import CpuPowerModel

            self._model = CpuPowerModel()
            self.source = "model"

    def read(self) -> float:
        if self._nvml is not None:
            return self._nvml.read()
        cpu_s = common.process_cpu_s(self.pid)
        if cpu_s is None:
            raise RuntimeError(f"no CPU time for pid {self.pid}: has it exited?")
        return modeled_cpu_joules(cpu_s, time.monotonic(), self._model.watts_per_busy_core,
                                  self._model.idle_watts)


# --------------------------------------------------------------------------- served


def write_model(root: Path, settings: Settings) -> Path:
    from tiered.agent.repository import model_file
    from tiered.models import zoo

    return zoo.resnet18(model_file(root, MODEL, 1), image_size=settings.image_size)


def write_config(root: Path, batch: int, settings: Settings) -> None:
    """Profile defaults for everything but the batch: batch-B requests, engine batch B."""
    from tiered.agent.repository import write_config as write

    size = settings.image_size
    engine = {} if settings.device == "cuda" else {"device": "cpu", "precision": "fp32"}
    write(root, MODEL, {
        "backend": "torch",
        "max_batch_size": batch,
        "inputs": [{"name": INPUT, "datatype": "FP32", "dims": [3, size, size]}],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "dims": [1000]}],
        "dynamic_batching": {"preferred_batch_sizes": [batch]},
        "engine": engine,
    })


def stats(address: str, cursor: float) -> Any:
    import grpc

    from tiered.protocol import telemetry_pb2 as tpb
    from tiered.protocol import telemetry_pb2_grpc as tpb_grpc

    with grpc.insecure_channel(address) as channel:
        return tpb_grpc.TelemetryStub(channel).Stats(
            tpb.StatsRequest(model_name=MODEL, cursor=cursor), timeout=30)


def execution_counts(address: str) -> tuple[int, int]:
    """(inferences, executions) so far, from the v2 statistics: the formed batch."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(address) as client:
        totals = common.stats_totals(client.get_inference_statistics(MODEL, as_json=True), MODEL)
    return totals["inference_count"], totals["execution_count"]


def served_point(repo: Path, batch: int, settings: Settings) -> dict[str, Any]:
    write_config(repo, batch, settings)
    common.progress(f"served B={batch}: starting the agent")
    size = settings.image_size
    load = common.Load.random(MODEL, INPUT, (batch, 3, size, size), outputs={OUTPUT: None},
                              timeout_s=settings.request_timeout_s)
    in_flight = requests_in_flight(batch, settings.in_flight_images)
    with common.serving([common.agent(TIER, repo)]) as (agent,), \
            common.Clients([agent.address], load, in_flight, settings.client_processes) as clients:
        meter = DirectMeter(settings.device, agent.pid)
        sampler = common.Sampler(meter.read, settings.sample_ms / 1e3).start()
        try:
            start, end = window_bounds(time.monotonic(), settings.warmup_s, settings.duration_s)
            # Every answer counts from now on (the slots of the agent's span are picked
            # out after); load through the slot the last Stats read lands in.
            stop = end + 2 * SLOT_S
            clients.go(common.Schedule(time.monotonic(), stop, stop))
            common.progress(f"served B={batch}: {in_flight} requests in flight from "
                            f"{len(clients.plan)} processes; window [{start:.0f}, {end:.0f}) "
                            "on the monotonic clock")
            common.sleep_until(start - 0.5)
            counts_before = execution_counts(agent.address)
            common.sleep_until(start + 0.25 * SLOT_S)
            cursor = stats(agent.address, 0.0).end  # the slot that just began: S
            common.sleep_until(end + 0.5 * SLOT_S)  # the agent has marked E; the next is open
            answer = stats(agent.address, cursor)
            counts_after = execution_counts(agent.address)
            outcomes = clients.tallies()
        finally:
            samples = sampler.stop()
        log_tail = agent.log_tail(6)
    return summarize_served(Observed(
        batch=batch, plan=clients.plan, planned=(start, end), cursor=cursor, answer=answer,
        source=meter.source, samples=samples, outcomes=outcomes,
        counts_before=counts_before, counts_after=counts_after, log_tail=log_tail,
    ), settings.tolerance)


@dataclass(frozen=True)
class Observed:
    """What one served point saw, before any arithmetic."""

    batch: int
    plan: list[int]  # workers per client process
    planned: tuple[float, float]  # [S, E) as this process chose it
    cursor: float  # the Stats cursor taken just after S
    answer: Any  # the StatsResponse read after E with that cursor
    source: str  # of the direct counter
    samples: list[tuple[float, float]]  # the direct counter: (monotonic s, joules)
    outcomes: list[common.Tally]  # one per client process, the whole load
    counts_before: tuple[int, int]  # (inferences, executions) from the v2 statistics
    counts_after: tuple[int, int]
    log_tail: str


def summarize_served(seen: Observed, tolerance: float) -> dict[str, Any]:
    answer, samples, outcomes = seen.answer, seen.samples, seen.outcomes
    (start, end), batch, plan = seen.planned, seen.batch, seen.plan
    version = next(v for v in answer.versions if v.model_name == MODEL)
    span_s = answer.end - answer.start
    device = next((d for d in answer.devices if d.device == version.device), None)
    agent_j = device.joules if device is not None else None
    inferences = version.inferences
    agent_jpi = agent_j / inferences if agent_j is not None and inferences else None
    direct_j = value_at(samples, answer.end) - value_at(samples, answer.start)
    client_images = images_in_span(
        merge_slot_counts([slot_counts(o.completed_at, batch) for o in outcomes]),
        answer.start, answer.end)
    direct_jpi = direct_j / inferences if inferences else None
    executions = seen.counts_after[1] - seen.counts_before[1]
    return {
        "batch": batch,
        "requests_in_flight": sum(plan),
        "client_processes": len(plan),
        "window": {"planned": [start, end], "cursor": seen.cursor,
                   "agent_span": [answer.start, answer.end], "span_s": span_s,
                   "aligned": (answer.start, answer.end) == (start, end)},
        "agent": {
            "success": version.success,
            "failure": version.failure,
            "inferences": inferences,
            "busy_s": version.busy_s,
            "energy_source": version.energy.source if version.has_energy else None,
            "energy_device": version.energy.device if version.has_energy else None,
            "joules": agent_j,  # the device's, idle included
            "j_per_inference": agent_jpi,
            "idle_watts": (device.idle_watts if device is not None
                           and device.HasField("idle_watts") else None),
            "active_joules": version.energy.joules if version.has_energy else None,
            "active_j_per_inference": (version.joules_per_inference
                                       if version.has_energy and inferences else None),
            "devices": {d.device: {"source": d.source, "joules": d.joules,
                                   "idle_watts": d.idle_watts if d.HasField("idle_watts")
                                   else None} for d in answer.devices},
        },
        "direct": {
            "source": seen.source,
            "joules": direct_j,
            "j_per_inference": direct_jpi,
            "counter": counter_updates([s for s in samples if start - 1 <= s[0] <= end + 1]),
            "joules_per_slot": per_slot_joules(samples, answer.start, answer.end),
        },
        "clients": {
            "images": client_images,
            "j_per_image_direct": direct_j / client_images if client_images else None,
            "errors": sum(o.errors for o in outcomes),
            "error_samples": [e for o in outcomes for e in o.error_samples][:3],
        },
        "img_per_s": inferences / span_s if span_s else None,
        "watts": direct_j / span_s if span_s else None,
        "engine_busy_fraction": version.busy_s / span_s if span_s else None,
        "formed_batch": common.ratio(seen.counts_after[0] - seen.counts_before[0],
                                     executions or None),
        "agreement": agreement(agent_jpi, direct_jpi, tolerance),
        "agent_log_tail": seen.log_tail,
    }


# --------------------------------------------------------------------------- in-process


def torch_settings(settings: Settings) -> Any:
    """The datacenter profile's torch settings (device and precision overridden on CPU)."""
    from tiered.engines.torch_engine import TorchSettings
    from tiered.profiles import load_profile
    from tiered.settings import load_dataclass

    mapping = dict(load_profile(TIER).torch)
    if settings.device == "cpu":
        mapping.update(device="cpu", precision="fp32")
    return load_dataclass(TorchSettings, mapping, f"{TIER} profile torch")


def timed_run(run: Callable[[], Any], batch: int, threads: int, seconds: float,
              meter: DirectMeter, rate_img_s: float | None = None) -> dict[str, Any]:
    """`run` (one batch) from `threads` threads for `seconds`, flat out or paced
    to `rate_img_s` in total; the direct meter read around it."""
    calls = [0] * threads
    interval = None if rate_img_s is None else threads * batch / rate_img_s
    t0 = time.monotonic()
    deadline = t0 + seconds

    def worker(index: int) -> None:
        next_at = t0 + (0 if interval is None else index * interval / threads)
        while True:
            if interval is not None:
                common.sleep_until(next_at)
                next_at = max(next_at + interval, time.monotonic() - interval)  # no bursts
            if time.monotonic() >= deadline:
                return
            run()
            calls[index] += 1

    j0 = meter.read()
    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.monotonic() - t0
    joules = meter.read() - j0
    images = sum(calls) * batch
    return {"mode": "flat out" if rate_img_s is None else "paced to served",
            "batch": batch, "threads": threads, "target_img_per_s": rate_img_s,
            "seconds": elapsed, "images": images, "img_per_s": images / elapsed,
            "joules": joules, "j_per_image": joules / images if images else None,
            "watts": joules / elapsed}


def inprocess_points(onnx_path: Path, settings: Settings,
                     served_rates: Mapping[int, float | None]) -> list[dict[str, Any]]:
    from tiered.engines.torch_engine import TorchEngine

    engine_settings = torch_settings(settings)
    common.progress("in-process: loading the torch engine (graphs captured at load)")
    engine = TorchEngine(onnx_path, engine_settings)
    meter = DirectMeter(settings.device)
    threads = engine_settings.streams if engine.device == "cuda" else 1
    rng = np.random.default_rng(0)
    rows = []
    try:
        for batch in settings.batches:
            feeds = {INPUT: rng.standard_normal(
                (batch, 3, settings.image_size, settings.image_size), dtype=np.float32)}
            for _ in range(5):
                engine.run(feeds)
            modes: list[float | None] = [None]
            if settings.paced and served_rates.get(batch):
                modes.append(served_rates[batch])
            for rate in modes:
                common.progress(f"in-process B={batch}: " + (
                    "flat out" if rate is None else f"paced to {rate:.0f} img/s"))
                rows.append(timed_run(lambda: engine.run(feeds), batch, threads,
                                      settings.inprocess_s, meter, rate))
    finally:
        engine.close()
    return rows


# --------------------------------------------------------------------------- the run


def run(settings: Settings, smoke: bool) -> dict[str, Any]:
    result = common.record("energy", smoke, with_gpu=settings.device == "cuda")
    if settings.device != "cuda":
        result["skipped_without_cuda"] = WITHOUT_CUDA
    result["settings"] = asdict(settings)
    common.progress(f"machine: {result['machine']}")
    meter = DirectMeter(settings.device)
    t0, j0 = time.monotonic(), meter.read()
    time.sleep(settings.idle_s)
    result["idle_watts"] = (meter.read() - j0) / (time.monotonic() - t0)
    with tempfile.TemporaryDirectory(prefix="tiered-energy-bench-") as tmp:
        repo = Path(tmp) / "repository"
        onnx_path = write_model(repo, settings)
        served = [served_point(repo, batch, settings) for batch in settings.batches]
        for row in served:
            common.progress(
                f"served B={row['batch']}: {cell(row['img_per_s'])} img/s, agent "
                f"{cell(row['agent']['j_per_inference'])} J/inf, direct "
                f"{cell(row['direct']['j_per_inference'])} J/inf: "
                f"{row['agreement']['verdict']}")
        result["served"] = served
        result["inprocess"] = inprocess_points(
            onnx_path, settings, {r["batch"]: r["img_per_s"] for r in served})
    result["targets"] = [
        common.judge(f"B={r['batch']}", "agent J/inference / direct J/inference, same slots",
                     r["agreement"]["agent_over_direct"], "within", settings.tolerance)
        for r in served]
    return result


def report(result: Mapping[str, Any]) -> str:
    machine = result["machine"]
    served = common.table(
        ["B", "span s", "inferences", "img/s", "batch", "busy", "W", "agent J", "direct J",
         "agent J/inf", "direct J/inf", "agent/direct", "direct J/client img", "agent idle W",
         "active J/inf"],
        [[r["batch"], r["window"]["span_s"], r["agent"]["inferences"], r["img_per_s"],
          r["formed_batch"], r["engine_busy_fraction"], r["watts"], r["agent"]["joules"],
          r["direct"]["joules"], r["agent"]["j_per_inference"], r["direct"]["j_per_inference"],
          r["agreement"]["agent_over_direct"], r["clients"]["j_per_image_direct"],
          r["agent"]["idle_watts"], r["agent"]["active_j_per_inference"]]
         for r in result["served"]],
        [r["agreement"]["verdict"] for r in result["served"]],
    )
    inprocess = common.table(
        ["B", "mode", "threads", "img/s", "W", "J/image"],
        [[r["batch"], r["mode"], r["threads"], r["img_per_s"], r["watts"], r["j_per_image"]]
         for r in result["inprocess"]],
    )
    counters = "; ".join(
        f"B={r['batch']}: counter moved every {cell(r['direct']['counter']['median_update_s'])}"
        f" s by {cell(r['direct']['counter']['median_step_j'])} J, span aligned "
        f"{r['window']['aligned']}, client errors {r['clients']['errors']}"
        for r in result["served"])
    return "\n\n".join([
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items())
        + f"; idle {cell(result['idle_watts'])} W"
        + "".join(f"\nSkipped: {s}" for s in result.get("skipped_without_cuda", [])),
        "Served (agent = its Stats over whole slots [S, E); direct = the counter read here "
        f"({result['served'][0]['direct']['source'] if result['served'] else '-'}), "
        "interpolated at S and E, over the agent's inferences;\nbatch = formed engine batch; "
        "busy = engine busy s / span (summed over lanes); W = direct J / span; active J/inf = "
        "the version's J/inference above the agent's idle W)\n" + served,
        "Direct counter: " + counters,
        "In-process torch engine, host arrays, NVML read around the run\n" + inprocess,
        "Targets (agent J/inference over direct J/inference, same slots)\n"
        + common.targets_table(result["targets"]),
    ])


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="What it measures and how: see the module docstring (bench/energy.py).",
    )
    defaults = Settings()
    parser.add_argument("--device", default=defaults.device, choices=["cuda", "cpu"],
                        help="cpu: a dry run of the harness (modeled energy, no NVML)")
    parser.add_argument("--image-size", type=int, help=f"default {defaults.image_size}")
    parser.add_argument("--batches", help="request (and engine) batch sizes, comma-separated "
                        f"(default {','.join(map(str, defaults.batches))})")
    parser.add_argument("--in-flight-images", type=int,
                        help="images kept in flight by the clients (requests = this / B; "
                             f"default {defaults.in_flight_images})")
    parser.add_argument("--client-processes", type=int,
                        help=f"default {defaults.client_processes}")
    parser.add_argument("--warmup", type=float, help="seconds of load before the window "
                        f"(default {defaults.warmup_s})")
    parser.add_argument("--duration", type=int, help="window length in whole one-second "
                        f"slots (default {defaults.duration_s})")
    parser.add_argument("--inprocess", type=float,
                        help=f"seconds per in-process point (default {defaults.inprocess_s})")
    parser.add_argument("--no-paced", action="store_true",
                        help="skip the in-process run paced to the served throughput")
    parser.add_argument("--sample-ms", type=float, default=defaults.sample_ms,
                        help="how often the direct counter is read during the window")
    parser.add_argument("--tolerance", type=float, default=defaults.tolerance)
    common.add_arguments(parser, "energy")
    args = common.parse(parser, argv, "energy")
    given = {
        "image_size": args.image_size,
        "batches": args.batches and tuple(int(b) for b in args.batches.split(",")),
        "in_flight_images": args.in_flight_images, "client_processes": args.client_processes,
        "warmup_s": args.warmup, "duration_s": args.duration, "inprocess_s": args.inprocess,
    }
    settings = replace(defaults, **SMOKE) if args.smoke else defaults
    settings = replace(settings, device=args.device, paced=not args.no_paced,
                       sample_ms=args.sample_ms, tolerance=args.tolerance,
                       **{k: v for k, v in given.items() if v is not None})
    return settings, args


def main(argv: Sequence[str] | None = None) -> int:
    settings, args = parse_args(argv)
    result = run(settings, args.smoke)
    print(report(result))
    common.write(result, args.out)
    if args.smoke:
        return common.smoke_exit({
            "served": (result["served"], ("img_per_s", "agent.inferences", "agent.joules",
                                          "direct.joules", "clients.images")),
            "inprocess": (result["inprocess"], ("img_per_s", "joules")),
        })
    return 1 if common.overall(result["targets"]) == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
