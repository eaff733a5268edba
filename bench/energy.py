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
            half a slot after E): inferences, energy (NVML, split by busy
            time: here one version gets it all) and joules_per_inference;
    direct  this process reads NVML's total-energy counter itself, every
            `--sample-ms`, on the same monotonic clock as the agent's slots;
            the counter is interpolated at S and E (the agent's reported
            span), and divided by the inferences the agent counted;
    clients the same direct joules over the images the clients saw answered
            in [S, E) (independent of the agent's counts).
  The check: agent J/inference / direct J/inference within 1 +- `--tolerance`.
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
mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("tiered") is None:  # a checkout without `pip install -e`
    sys.path.insert(0, str(REPO_ROOT))

from tiered.tables import cell
from tiered.tables import render as render_table

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


def images_in_span(slot_counts: Mapping[int, int], start: float, end: float) -> int:
    """Images answered in the slots that lie within [start, end)."""
    return sum(n for slot, n in slot_counts.items() if start <= slot and slot + SLOT_S <= end)


def requests_in_flight(batch: int, in_flight_images: int) -> int:
    return max(2, math.ceil(in_flight_images / batch))


def split_workers(concurrency: int, processes: int) -> list[int]:
    """Workers per client process: as even as possible, no empty process."""
    processes = max(1, min(processes, concurrency))
    base, extra = divmod(concurrency, processes)
    return [base + (1 if i < extra else 0) for i in range(processes)]


def modeled_cpu_joules(cpu_s: float, wall_s: float, watts_per_busy_core: float,
                       idle_watts: float) -> float:
    """tiered.telemetry.energy.ModeledCpuMeter's formula, for the CPU dry run."""
    return cpu_s * watts_per_busy_core + wall_s * idle_watts


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def agreement(agent: float | None, direct: float | None, tolerance: float) -> dict[str, Any]:
    """agent / direct, and whether it lies within 1 +- tolerance."""
    value = ratio(agent, direct)
    verdict = "N/A" if value is None else "PASS" if abs(value - 1) <= tolerance else "FAIL"
    return {"agent_over_direct": value, "tolerance": tolerance, "verdict": verdict}


# --------------------------------------------------------------------------- I/O: meters

_STARTED = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def process_cpu_s(pid: int) -> float:
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


class DirectMeter:
    """A cumulative joule counter read here, not by the agent: NVML's total
    energy counter of GPU 0, or (no NVML) the agent's CPU-time model recomputed
    from /proc/PID/stat. Its origin is arbitrary; only differences count."""

    def __init__(self, device: str, pid: int | None = None) -> None:
        self.pid = pid or os.getpid()
        if device == "cuda":
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)  # fails early if absent
            self.source = "nvml"
        else:
            from tiered.telemetry.energy import CpuPowerModel

            self._nvml = None
            self._model = CpuPowerModel()
            self.source = "model"

    def read(self) -> float:
        if self._nvml is not None:
            return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3
        return modeled_cpu_joules(process_cpu_s(self.pid), time.monotonic(),
                                  self._model.watts_per_busy_core, self._model.idle_watts)


class Sampler:
    """Reads a meter every `period_s` on a thread: (monotonic time, joules)."""

    def __init__(self, meter: DirectMeter, period_s: float) -> None:
        self.meter = meter
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            value = self.meter.read()
            self.samples.append((time.monotonic(), value))
            next_at += self.period_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, float]]:
        """Stop reading (again: a no-op) and return the samples."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.samples


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


def client_process(address: str, batch: int, workers: int, image_size: int,
                   timeout_s: float, seed: int, control: Any, results: Any) -> None:
    """`workers` asyncio workers sending batch-`batch` requests until the stop
    time they are sent; counts answered images per slot of the monotonic clock."""
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as aioclient

    images = np.random.default_rng(seed).standard_normal(
        (batch, 3, image_size, image_size), dtype=np.float32)

    async def main() -> dict[str, Any]:
        client = aioclient.InferenceServerClient(address)
        item = grpcclient.InferInput(INPUT, list(images.shape), "FP32")
        item.set_data_from_numpy(images)
        outputs = [grpcclient.InferRequestedOutput(OUTPUT)]
        await client.infer(MODEL, [item], outputs=outputs, client_timeout=timeout_s)
        results.put(("ready", seed))
        stop_at = await asyncio.get_running_loop().run_in_executor(None, control.get)
        per_slot: dict[int, int] = {}
        errors: list[str] = []

        async def worker() -> None:
            while time.monotonic() < stop_at:
                try:
                    answer = await client.infer(MODEL, [item], outputs=outputs,
                                                client_timeout=timeout_s)
                    answer.as_numpy(OUTPUT)
                except Exception as error:  # counted; the load goes on
                    errors.append(str(error)[:200])
                    await asyncio.sleep(0.01)
                    continue
                slot = math.floor(time.monotonic() / SLOT_S)
                per_slot[slot] = per_slot.get(slot, 0) + batch

        await asyncio.gather(*(worker() for _ in range(workers)))
        await client.close()
        return {"per_slot": per_slot, "errors": len(errors), "error_samples": errors[:3]}

    try:
        results.put(("done", asyncio.run(main())))
    except Exception as error:  # report instead of hanging the parent
        results.put(("failed", repr(error)))


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

    client = grpcclient.InferenceServerClient(address)
    try:
        entries = client.get_inference_statistics(MODEL, as_json=True).get("model_stats", [])
    finally:
        client.close()
    return (sum(int(e.get("inference_count", 0)) for e in entries),
            sum(int(e.get("execution_count", 0)) for e in entries))


def served_point(repo: Path, batch: int, settings: Settings) -> dict[str, Any]:
    from tiered.processes import AgentProcess

    write_config(repo, batch, settings)
    progress(f"served B={batch}: starting the agent")
    agent = AgentProcess(TIER, repo).start(timeout_s=300)
    context = mp.get_context("spawn")
    plan = split_workers(requests_in_flight(batch, settings.in_flight_images),
                         settings.client_processes)
    controls = [context.Queue() for _ in plan]
    results = context.Queue()
    clients = [
        context.Process(target=client_process, daemon=True, args=(
            agent.address, batch, workers, settings.image_size, settings.request_timeout_s,
            seed, controls[seed], results))
        for seed, workers in enumerate(plan)
    ]
    sampler = Sampler(DirectMeter(settings.device, agent.pid), settings.sample_ms / 1e3)
    try:
        for c in clients:
            c.start()
        for _ in clients:
            kind, value = results.get(timeout=300)
            if kind != "ready":
                raise RuntimeError(f"a client process failed to start: {value}")
        sampler.start()
        start, end = window_bounds(time.monotonic(), settings.warmup_s, settings.duration_s)
        for control in controls:
            control.put(end + 2 * SLOT_S)  # load through the slot the last Stats read lands in
        progress(f"served B={batch}: {sum(plan)} requests in flight from {len(plan)} "
                 f"processes; window [{start:.0f}, {end:.0f}) on the monotonic clock")
        sleep_until(start - 0.5)
        counts_before = execution_counts(agent.address)
        sleep_until(start + 0.25 * SLOT_S)
        cursor = stats(agent.address, 0.0).end  # the slot that just began: S
        sleep_until(end + 0.5 * SLOT_S)  # the agent has marked E; the slot after is open
        answer = stats(agent.address, cursor)
        counts_after = execution_counts(agent.address)
        outcomes = []
        for _ in clients:
            kind, value = results.get(timeout=settings.request_timeout_s + 60)
            if kind != "done":
                raise RuntimeError(f"a client process failed: {value}")
            outcomes.append(value)
        for c in clients:
            c.join(timeout=30)
        samples = sampler.stop()
    finally:
        sampler.stop()
        for c in clients:
            if c.is_alive():
                c.kill()
        log_tail = agent.log_tail(6)
        agent.stop()
    return summarize_served(Observed(
        batch=batch, plan=plan, planned=(start, end), cursor=cursor, answer=answer,
        source=sampler.meter.source, samples=samples, outcomes=outcomes,
        counts_before=counts_before, counts_after=counts_after, log_tail=log_tail,
    ), settings.tolerance)


@dataclass
class Observed:
    """What one served point saw, before any arithmetic."""

    batch: int
    plan: list[int]  # workers per client process
    planned: tuple[float, float]  # [S, E) as this process chose it
    cursor: float  # the Stats cursor taken just after S
    answer: Any  # the StatsResponse read after E with that cursor
    source: str  # of the direct counter
    samples: list[tuple[float, float]]  # the direct counter: (monotonic s, joules)
    outcomes: list[dict[str, Any]]  # from the client processes
    counts_before: tuple[int, int]  # (inferences, executions) from the v2 statistics
    counts_after: tuple[int, int]
    log_tail: str


def summarize_served(seen: Observed, tolerance: float) -> dict[str, Any]:
    answer, samples, outcomes = seen.answer, seen.samples, seen.outcomes
    (start, end), batch, plan = seen.planned, seen.batch, seen.plan
    version = next(v for v in answer.versions if v.model_name == MODEL)
    span_s = answer.end - answer.start
    agent_j = version.energy.joules if version.has_energy else None
    agent_jpi = (version.joules_per_inference
                 if version.has_energy and version.inferences else None)
    direct_j = value_at(samples, answer.end) - value_at(samples, answer.start)
    client_images = images_in_span(merge_slot_counts([o["per_slot"] for o in outcomes]),
                                   answer.start, answer.end)
    inferences = version.inferences
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
            "joules": agent_j,
            "j_per_inference": agent_jpi,
            "devices": {d.device: {"source": d.source, "joules": d.joules}
                        for d in answer.devices},
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
            "errors": sum(o["errors"] for o in outcomes),
            "error_samples": [e for o in outcomes for e in o["error_samples"]][:3],
        },
        "img_per_s": inferences / span_s if span_s else None,
        "watts": direct_j / span_s if span_s else None,
        "engine_busy_fraction": version.busy_s / span_s if span_s else None,
        "formed_batch": ratio(seen.counts_after[0] - seen.counts_before[0], executions or None),
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
                sleep_until(next_at)
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
    progress("in-process: loading the torch engine (graphs captured at load)")
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
                progress(f"in-process B={batch}: " + ("flat out" if rate is None
                                                     else f"paced to {rate:.0f} img/s"))
                rows.append(timed_run(lambda: engine.run(feeds), batch, threads,
                                      settings.inprocess_s, meter, rate))
    finally:
        engine.close()
    return rows


# --------------------------------------------------------------------------- the run


def environment(settings: Settings) -> dict[str, Any]:
    import grpc
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "grpcio": grpc.__version__, "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    if settings.device == "cuda":
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
        env.update(
            gpu=name.decode() if isinstance(name, bytes) else name,
            driver=driver.decode() if isinstance(driver, bytes) else driver,
            cuda=torch.version.cuda,
            power_limit_w=pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3,
        )
    return env


def run(settings: Settings, out_path: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": asdict(settings),
        "environment": environment(settings),
    }
    progress(f"environment: {result['environment']}")
    meter = DirectMeter(settings.device)
    t0, j0 = time.monotonic(), meter.read()
    time.sleep(2.0)
    result["idle_watts"] = (meter.read() - j0) / (time.monotonic() - t0)
    with tempfile.TemporaryDirectory(prefix="tiered-energy-bench-") as tmp:
        repo = Path(tmp) / "repository"
        onnx_path = write_model(repo, settings)
        served = [served_point(repo, batch, settings) for batch in settings.batches]
        for row in served:
            progress(f"served B={row['batch']}: {cell(row['img_per_s'])} img/s, agent "
                     f"{cell(row['agent']['j_per_inference'])} J/inf, direct "
                     f"{cell(row['direct']['j_per_inference'])} J/inf: "
                     f"{row['agreement']['verdict']}")
        result["served"] = served
        result["inprocess"] = inprocess_points(
            onnx_path, settings, {r["batch"]: r["img_per_s"] for r in served})
    verdicts = [r["agreement"]["verdict"] for r in served]
    result["target"] = {
        "what": "agent J/inference over direct NVML J/inference, same slots, each batch size",
        "needs": f"within 1 +- {settings.tolerance}",
        "verdict": "PASS" if verdicts and all(v == "PASS" for v in verdicts)
        else "N/A" if all(v == "N/A" for v in verdicts) else "FAIL",
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def report(result: Mapping[str, Any]) -> str:
    env = result["environment"]
    served = render_table(
        ["B", "span s", "inferences", "img/s", "batch", "busy", "W", "agent J", "direct J",
         "agent J/inf", "direct J/inf", "agent/direct", "direct J/client img", "check"],
        [[r["batch"], r["window"]["span_s"], r["agent"]["inferences"], r["img_per_s"],
          r["formed_batch"], r["engine_busy_fraction"], r["watts"], r["agent"]["joules"],
          r["direct"]["joules"], r["agent"]["j_per_inference"], r["direct"]["j_per_inference"],
          r["agreement"]["agent_over_direct"], r["clients"]["j_per_image_direct"],
          r["agreement"]["verdict"]] for r in result["served"]],
    )
    inprocess = render_table(
        ["B", "mode", "threads", "img/s", "W", "J/image"],
        [[r["batch"], r["mode"], r["threads"], r["img_per_s"], r["watts"], r["j_per_image"]]
         for r in result["inprocess"]],
    )
    counters = "; ".join(
        f"B={r['batch']}: counter moved every {cell(r['direct']['counter']['median_update_s'])}"
        f" s by {cell(r['direct']['counter']['median_step_j'])} J, span aligned "
        f"{r['window']['aligned']}, client errors {r['clients']['errors']}"
        for r in result["served"])
    t = result["target"]
    return "\n\n".join([
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items())
        + f"; idle {cell(result['idle_watts'])} W",
        "Served (agent = its Stats over whole slots [S, E); direct = the counter read here "
        f"({result['served'][0]['direct']['source'] if result['served'] else '-'}), "
        "interpolated at S and E, over the agent's inferences;\nbatch = formed engine batch; "
        "busy = engine busy s / span (summed over lanes); W = direct J / span)\n" + served,
        "Direct counter: " + counters,
        "In-process torch engine, host arrays, NVML read around the run\n" + inprocess,
        f"Target: {t['what']}: {t['needs']}: {t['verdict']}",
    ])


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, Path]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="What it measures and how: see the module docstring (bench/energy.py).",
    )
    defaults = Settings()
    parser.add_argument("--device", default=defaults.device, choices=["cuda", "cpu"],
                        help="cpu: a dry run of the harness (modeled energy, no NVML)")
    parser.add_argument("--image-size", type=int, default=defaults.image_size)
    parser.add_argument("--batches", default=",".join(map(str, defaults.batches)),
                        help="request (and engine) batch sizes, comma-separated")
    parser.add_argument("--in-flight-images", type=int, default=defaults.in_flight_images,
                        help="images kept in flight by the clients (requests = this / B)")
    parser.add_argument("--client-processes", type=int, default=defaults.client_processes)
    parser.add_argument("--warmup", type=float, default=defaults.warmup_s,
                        help="seconds of load before the window")
    parser.add_argument("--duration", type=int, default=defaults.duration_s,
                        help="window length in whole one-second slots")
    parser.add_argument("--inprocess", type=float, default=defaults.inprocess_s,
                        help="seconds per in-process point")
    parser.add_argument("--no-paced", action="store_true",
                        help="skip the in-process run paced to the served throughput")
    parser.add_argument("--sample-ms", type=float, default=defaults.sample_ms,
                        help="how often the direct counter is read during the window")
    parser.add_argument("--tolerance", type=float, default=defaults.tolerance)
    parser.add_argument("--out", type=Path,
                        default=REPO_ROOT / "bench" / "results" / "energy.json")
    args = parser.parse_args(argv)
    settings = Settings(
        device=args.device, image_size=args.image_size,
        batches=tuple(int(b) for b in args.batches.split(",")),
        in_flight_images=args.in_flight_images, client_processes=args.client_processes,
        warmup_s=args.warmup, duration_s=args.duration, inprocess_s=args.inprocess,
        paced=not args.no_paced, sample_ms=args.sample_ms, tolerance=args.tolerance,
    )
    return settings, args.out


def main(argv: Sequence[str] | None = None) -> int:
    settings, out = parse_args(argv)
    result = run(settings, out)
    print(report(result))
    print(f"\nwrote {out}")
    return 0 if result["target"]["verdict"] != "FAIL" else 1


if __name__ == "__main__":
    sys.exit(main())
