"""Benchmark: the datacenter torch engine on a GPU, served and in-process, in one run.

- served: a real `tiered agent --tier datacenter` process serving ResNet-18
  (tiered.models.zoo, random weights) through the torch engine (FP16, CUDA
  graphs per batch bucket, pinned staging, two streams), dynamic batching up to
  `max_batch_size`; batch-1 FP32 requests from `tritonclient.grpc.aio` workers
  spread over several client processes (one Python client process cannot
  saturate the agent), at each concurrency level, for a fixed window after a
  warm-up. Throughput, latency percentiles, the batch the agent formed, and
  the agent's own ModelStatistics per request (queue, merge, engine, split).
- in-process, the same model and precision, at fixed batch sizes:
  (a) data already on the GPU: eager, and a replayed CUDA graph;
  (b) numpy inputs/outputs in host memory, which is what a server receives:
      naive eager (pageable copies), and the torch engine's own `run` (pinned
      staging, graph replay) from one thread and from two threads at once;
  plus the host-side costs of one batch taken apart (request decode, merge,
  staging copy, host-to-device copy, compute, copy back).
- diagnostics, same requests and clients: the transport floor
  (`bench/floor_server.py`, a gRPC server on the same stack that does no
  work: what one Python process can take in at all), the agent with a 0.5 ms
  GIL switch interval (its code unchanged), and several agent processes
  sharing the GPU (scale-out).
- energy: NVML's total-energy counter read around every timed window, as
  joules per image (the whole GPU, idle share included).

The in-process host-memory reference is measured again, after the served
runs, at the batch size the agent actually formed; the target is served
throughput at the highest concurrency >= 50% of it.

Run on a GPU machine: `python bench/gpu.py` (about 4 minutes; `--quick` about 2).
It writes bench/results/gpu.json and prints tables. `--device cpu` runs the
same harness on a CPU (tiny sizes with `--image-size 32`) to check it; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing as mp
import os
import platform
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
if importlib.util.find_spec("tiered") is None:  # a checkout without `pip install -e`
    sys.path.insert(0, str(REPO_ROOT))

from tiered.tables import cell
from tiered.tables import render as render_table

MODEL = "resnet18"
INPUT, OUTPUT = "input", "logits"
TARGET_SERVED_VS_HOST = 0.5


@dataclass(frozen=True)
class RunSettings:
    device: str = "cuda"
    precision: str = "fp16"
    image_size: int = 224
    max_batch_size: int = 64
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    max_queue_delay_us: int = 500
    instance_count: int = 2
    concurrency: tuple[int, ...] = (1, 16, 64)
    client_processes: int = 8  # at most; never more than the concurrency
    warmup_s: float = 4.0
    duration_s: float = 10.0
    inprocess_batches: tuple[int, ...] = (1, 16, 64)
    inprocess_s: float = 1.5  # per in-process point
    request_timeout_s: float = 60.0
    diagnostics: bool = True  # transport floor, GIL switch interval, scale-out
    scale_out_agents: int = 4


QUICK = dict(warmup_s=2.0, duration_s=5.0, inprocess_s=0.8)


# --------------------------------------------------------------------------- pure helpers


def percentiles_ms(latencies_s: Sequence[float]) -> dict[str, float | None]:
    if not latencies_s:
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None, "mean_ms": None}
    ms = np.asarray(latencies_s, dtype=np.float64) * 1e3
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99),
            "mean_ms": float(ms.mean())}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def split_workers(concurrency: int, processes: int) -> list[int]:
    """Workers per client process: as even as possible, no empty process."""
    processes = max(1, min(processes, concurrency))
    base, extra = divmod(concurrency, processes)
    return [base + (1 if i < extra else 0) for i in range(processes)]


def _count(value: Any) -> int:
    return int(value) if value not in (None, "") else 0  # protobuf JSON: int64 as strings


def stats_totals(stats_json: Mapping[str, Any]) -> dict[str, int]:
    """Cumulative counters of the model from `get_inference_statistics(as_json=True)`."""
    totals: dict[str, int] = {"inference_count": 0, "execution_count": 0}
    for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        totals[f"{key}_count"] = 0
        totals[f"{key}_ns"] = 0
    for entry in stats_json.get("model_stats", []):
        totals["inference_count"] += _count(entry.get("inference_count"))
        totals["execution_count"] += _count(entry.get("execution_count"))
        inference = entry.get("inference_stats", {})
        for key in ("success", "fail", "queue", "compute_input", "compute_infer",
                    "compute_output"):
            totals[f"{key}_count"] += _count(inference.get(key, {}).get("count"))
            totals[f"{key}_ns"] += _count(inference.get(key, {}).get("ns"))
    return totals


def per_request_ms(delta: Mapping[str, int]) -> dict[str, float | None]:
    """The agent's own accounting per successful request, in ms."""
    requests = delta.get("success_count") or 0

    def mean(key: str) -> float | None:
        return delta[f"{key}_ns"] / requests / 1e6 if requests else None

    return {
        "total": mean("success"),
        "queue": mean("queue"),
        "merge": mean("compute_input"),
        "engine": mean("compute_infer"),
        "split": mean("compute_output"),
    }


# --------------------------------------------------------------------------- I/O: meters

_STARTED = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


class EnergyMeter:
    """NVML's total energy counter (mJ since driver load); None where absent."""

    def __init__(self) -> None:
        self._handle = None
        self.note = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            self._nvml = pynvml
        except Exception as error:  # no driver, no library, or no counter
            self._handle = None
            self.note = f"no NVML energy counter: {error}"

    def read_j(self) -> float | None:
        if self._handle is None:
            return None
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3


def _clock_ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def process_cpu_s(pid: int) -> float | None:
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(rest[11]) + int(rest[12])) / _clock_ticks()


@dataclass
class Window:
    """Time, energy and CPU between `start` and `stop`."""

    energy: EnergyMeter
    pid: int | None = None
    seconds: float = 0.0
    joules: float | None = None
    cpu_s: float | None = None

    def start(self) -> Window:
        self._t = time.perf_counter()
        self._j = self.energy.read_j()
        self._cpu = process_cpu_s(self.pid) if self.pid else None
        return self

    def stop(self) -> Window:
        self.seconds = time.perf_counter() - self._t
        j = self.energy.read_j()
        self.joules = None if j is None or self._j is None else j - self._j
        if self.pid and self._cpu is not None:
            now = process_cpu_s(self.pid)
            self.cpu_s = None if now is None else now - self._cpu
        return self


# --------------------------------------------------------------------------- in-process


def timed_loop(
    fn: Callable[[], Any], images_per_call: int, seconds: float, energy: EnergyMeter,
    threads: int = 1,
) -> dict[str, Any]:
    """Call `fn` (which returns when its work is done) for `seconds` from
    `threads` threads; throughput, per-call latency and joules per image."""
    for _ in range(3):
        fn()
    latencies: list[list[float]] = [[] for _ in range(threads)]
    deadline = [0.0]

    def worker(index: int) -> None:
        own = latencies[index]
        while time.perf_counter() < deadline[0]:
            t0 = time.perf_counter()
            fn()
            own.append(time.perf_counter() - t0)

    window = Window(energy).start()
    deadline[0] = time.perf_counter() + seconds
    if threads == 1:
        worker(0)
    else:
        pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    window.stop()
    calls = sum(len(own) for own in latencies)
    images = calls * images_per_call
    return {
        "calls": calls,
        "seconds": window.seconds,
        "img_per_s": images / window.seconds,
        **percentiles_ms([x for own in latencies for x in own]),
        "j_per_img": None if window.joules is None else window.joules / images,
        "watts": None if window.joules is None else window.joules / window.seconds,
    }


class InProcess:
    """The in-process measurements: the converted module and the engine itself."""

    def __init__(self, onnx_path: Path, settings: RunSettings, energy: EnergyMeter) -> None:
        import onnx
        import torch

        from tiered.engines.onnx_to_torch import convert
        from tiered.engines.torch_engine import TorchEngine, TorchSettings

        self.torch = torch
        self.settings = settings
        self.energy = energy
        self.cuda = settings.device == "cuda"
        self.dev = torch.device(settings.device)
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
            settings.precision
        ]
        module = convert(onnx.load(str(onnx_path)), dtype)
        if self.cuda:
            torch.backends.cudnn.benchmark = True
            module.use_channels_last()
        self.module = module.to(self.dev).eval()
        engine_settings = TorchSettings(
            device=settings.device, precision=settings.precision,
            cuda_graph_batch_sizes=settings.buckets, streams=1,
        )
        progress("in-process: loading engines (graphs captured at load)")
        self.engine_1 = TorchEngine(onnx_path, engine_settings)
        self.engine_2 = TorchEngine(onnx_path, replace(engine_settings, streams=2))
        self.rng = np.random.default_rng(0)

    def images(self, batch: int) -> np.ndarray:
        size = self.settings.image_size
        return self.rng.standard_normal((batch, 3, size, size), dtype=np.float32)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def device_modes(self, batch: int) -> list[dict[str, Any]]:
        torch, seconds = self.torch, self.settings.inprocess_s
        rows = []
        with torch.inference_mode():
            x = torch.from_numpy(self.images(batch)).to(self.dev)

            def eager() -> None:
                self.module(x)
                self.sync()

            rows.append({"mode": "device eager", **timed_loop(eager, batch, seconds, self.energy)})
            if self.cuda:
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self.module(x)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    self.module(x)

                def replay() -> None:
                    graph.replay()
                    self.sync()

                rows.append({"mode": "device graph",
                             **timed_loop(replay, batch, seconds, self.energy)})
                del graph
        return [{"batch": batch, **r} for r in rows]

    def host_modes(self, batch: int, naive: bool = True) -> list[dict[str, Any]]:
        torch, seconds = self.torch, self.settings.inprocess_s
        host = self.images(batch)
        rows = []
        if naive:
            def eager_pageable() -> None:
                with torch.inference_mode():
                    (out,) = self.module(torch.from_numpy(host).to(self.dev))
                    out.cpu().numpy()

            rows.append({"mode": "host eager (pageable copies)",
                         **timed_loop(eager_pageable, batch, seconds, self.energy)})
        feeds = {INPUT: host}
        rows.append({"mode": "host engine.run x1 (pinned, graph)",
                     **timed_loop(lambda: self.engine_1.run(feeds), batch, seconds, self.energy)})
        rows.append({"mode": "host engine.run x2 threads",
                     **timed_loop(lambda: self.engine_2.run(feeds), batch, seconds, self.energy,
                                  threads=2)})
        return [{"batch": batch, **r} for r in rows]

    def breakdown(self, batch: int) -> dict[str, Any]:
        """One batch's host-side path taken apart, each step timed alone (ms per batch)."""
        torch = self.torch
        from tiered.protocol import grpc_service_pb2 as pb
        from tiered.protocol import messages

        one = self.images(1)
        request = pb.ModelInferRequest(model_name=MODEL)
        request.inputs.add(name=INPUT, datatype="FP32", shape=list(one.shape))
        request.raw_input_contents.append(one.tobytes())
        wire = request.SerializeToString()
        singles = [self.images(1) for _ in range(batch)]
        merged = np.concatenate(singles)

        def each(fn: Callable[[], Any], repeat: int) -> float:
            fn()
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn()
            self.sync()
            return (time.perf_counter() - t0) / repeat * 1e3

        def decode() -> None:
            messages.decode_infer_request(pb.ModelInferRequest.FromString(wire))

        result: dict[str, Any] = {
            "batch": batch,
            "request_bytes": len(wire),
            "decode_one_request_ms": each(decode, 200),
            "merge_ms": each(lambda: np.concatenate(singles), 20),
        }
        if self.cuda:
            pinned = torch.empty(merged.shape, dtype=torch.float32, pin_memory=True)
            device = torch.empty(merged.shape, dtype=torch.float32, device=self.dev)
            result["stage_to_pinned_ms"] = each(lambda: np.copyto(pinned.numpy(), merged), 20)
            result["h2d_pinned_ms"] = each(lambda: device.copy_(pinned, non_blocking=True), 20)
            result["h2d_pageable_ms"] = each(
                lambda: device.copy_(torch.from_numpy(merged)), 20
            )
            with torch.inference_mode():
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self.module(device)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    (out,) = self.module(device)
                result["compute_graph_ms"] = each(graph.replay, 20)
                host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                result["d2h_ms"] = each(lambda: host_out.copy_(out), 20)
                del graph
        result["engine_run_ms"] = each(lambda: self.engine_1.run({INPUT: merged}), 10)
        return result

    def close(self) -> None:
        self.engine_1.close()
        self.engine_2.close()


# --------------------------------------------------------------------------- served


def write_repository(root: Path, settings: RunSettings) -> Path:
    import yaml

    from tiered.models import zoo

    onnx_path = zoo.resnet18(root / MODEL / "1" / "model.onnx", image_size=settings.image_size)
    size = settings.image_size
    config = {
        "backend": "torch",
        "max_batch_size": settings.max_batch_size,
        "inputs": [{"name": INPUT, "datatype": "FP32", "dims": [3, size, size]}],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "dims": [1000]}],
        "dynamic_batching": {
            "max_queue_delay_us": settings.max_queue_delay_us,
            "preferred_batch_sizes": [settings.max_batch_size],
            "max_queue_size": 4096,
        },
        "instance_count": settings.instance_count,
        "engine": {
            "device": settings.device,
            "precision": settings.precision,
            "cuda_graph_batch_sizes": list(settings.buckets),
            "streams": settings.instance_count,
        },
    }
    (root / MODEL / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return onnx_path


def client_process(
    address: str, workers: int, image_size: int, timeout_s: float, seed: int,
    control: Any, results: Any,
) -> None:
    """One load-generating process: `workers` asyncio workers, batch-1 requests."""
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as aioclient

    rng = np.random.default_rng(seed)
    image = rng.standard_normal((1, 3, image_size, image_size), dtype=np.float32)

    async def main() -> dict[str, Any]:
        client = aioclient.InferenceServerClient(address)
        item = grpcclient.InferInput(INPUT, list(image.shape), "FP32")
        item.set_data_from_numpy(image)
        outputs = [grpcclient.InferRequestedOutput(OUTPUT)]
        results.put(("ready", seed))
        window_start, window_end = await asyncio.get_running_loop().run_in_executor(
            None, control.get
        )
        latencies: list[float] = []
        errors: list[str] = []
        completed = 0

        async def worker() -> None:
            nonlocal completed
            while True:
                t0 = time.time()
                if t0 >= window_end:
                    return
                try:
                    answer = await client.infer(MODEL, [item], outputs=outputs,
                                                client_timeout=timeout_s)
                    answer.as_numpy(OUTPUT)
                except Exception as error:  # counted, the load goes on
                    if t0 >= window_start and len(errors) < 20:
                        errors.append(str(error)[:200])
                    continue
                t1 = time.time()
                if t0 >= window_start and t1 <= window_end:
                    latencies.append(t1 - t0)
                    completed += 1

        cpu = {}

        async def cpu_marks() -> None:
            await asyncio.sleep(max(0.0, window_start - time.time()))
            cpu["start"] = time.process_time()
            await asyncio.sleep(max(0.0, window_end - time.time()))
            cpu["end"] = time.process_time()

        await asyncio.gather(cpu_marks(), *(worker() for _ in range(workers)))
        await client.close()
        return {"completed": completed, "latencies": latencies, "errors": errors,
                "cpu_s": cpu.get("end", 0.0) - cpu.get("start", 0.0)}

    try:
        results.put(("done", asyncio.run(main())))
    except Exception as error:  # report instead of hanging the parent
        results.put(("failed", repr(error)))


def served_point(
    setup: str,
    servers: Sequence[Any],
    concurrency: int,
    settings: RunSettings,
    energy: EnergyMeter,
) -> dict[str, Any]:
    """One load level against `servers` (client processes spread over them)."""
    import tritonclient.grpc as grpcclient

    context = mp.get_context("spawn")
    processes_wanted = max(settings.client_processes, 2 * len(servers))
    plan = split_workers(concurrency, processes_wanted)
    controls = [context.Queue() for _ in plan]
    results = context.Queue()
    processes = [
        context.Process(
            target=client_process,
            args=(servers[seed % len(servers)].address, workers, settings.image_size,
                  settings.request_timeout_s, seed, controls[seed], results),
            daemon=True,
        )
        for seed, workers in enumerate(plan)
    ]
    for p in processes:
        p.start()
    for _ in processes:
        kind, value = results.get(timeout=120)
        if kind != "ready":
            raise RuntimeError(f"a client process failed to start: {value}")
    window_start = time.time() + settings.warmup_s
    window_end = window_start + settings.duration_s
    for control in controls:
        control.put((window_start, window_end))
    stats_clients = [grpcclient.InferenceServerClient(s.address) for s in servers]

    def totals() -> dict[str, int]:
        summed: dict[str, int] = {}
        for client in stats_clients:
            for key, value in stats_totals(
                client.get_inference_statistics(MODEL, as_json=True)
            ).items():
                summed[key] = summed.get(key, 0) + value
        return summed

    time.sleep(max(0.0, window_start - time.time()))
    before = totals()
    windows = [Window(energy if i == 0 else _NO_ENERGY, s.pid).start()
               for i, s in enumerate(servers)]
    time.sleep(max(0.0, window_end - time.time()))
    for window in windows:
        window.stop()
    after = totals()
    for client in stats_clients:
        client.close()
    outcomes = []
    for _ in processes:
        kind, value = results.get(timeout=settings.request_timeout_s + 60)
        if kind != "done":
            raise RuntimeError(f"a client process failed: {value}")
        outcomes.append(value)
    for p in processes:
        p.join(timeout=30)
    delta = {k: after[k] - before[k] for k in after}
    completed = sum(o["completed"] for o in outcomes)
    latencies = [x for o in outcomes for x in o["latencies"]]
    errors = [e for o in outcomes for e in o["errors"]]
    joules = windows[0].joules
    server_cpu = [w.cpu_s for w in windows]
    return {
        "setup": setup,
        "servers": len(servers),
        "concurrency": concurrency,
        "client_processes": len(plan),
        "workers_per_process": plan,
        "requests": completed,
        "img_per_s": completed / settings.duration_s,
        **percentiles_ms(latencies),
        "errors": len(errors),
        "error_samples": errors[:5],
        "formed_batch": ratio(delta["inference_count"], delta["execution_count"] or None),
        "agent_ms_per_request": per_request_ms(delta),
        "agent_stats_delta": delta,
        # Energy per image served: the whole GPU over the window, over completed requests.
        "j_per_img": None if joules is None or not completed else joules / completed,
        "watts": None if joules is None else joules / windows[0].seconds,
        "server_cpu_cores": None if None in server_cpu
        else sum(server_cpu) / windows[0].seconds,
        "client_cpu_cores": sum(o["cpu_s"] for o in outcomes) / settings.duration_s,
    }


class _NoEnergy(EnergyMeter):
    def __init__(self) -> None:
        self._handle = None
        self.note = "not read"


_NO_ENERGY = _NoEnergy()


def agent_command(repo: Path, switch_interval_s: float | None) -> list[str]:
    """`tiered agent --tier datacenter`, optionally with another GIL switch interval
    (a diagnostic: the agent's code is unchanged, only the interpreter setting)."""
    args = ["agent", "--tier", "datacenter", "--model-repository", str(repo),
            "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    if switch_interval_s is None:
        return [sys.executable, "-m", "tiered", *args]
    code = (
        "import sys; sys.setswitchinterval(float(sys.argv[1])); "
        "from tiered.cli import main; raise SystemExit(main(sys.argv[2:]))"
    )
    return [sys.executable, "-c", code, str(switch_interval_s), *args]


def start_servers(commands: Sequence[Sequence[str]], name: str) -> list[Any]:
    from tiered.processes import ServerProcess

    servers = []
    try:
        for index, command in enumerate(commands):
            servers.append(ServerProcess(command, f"{name}-{index}").start(timeout_s=300))
    except Exception:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: Sequence[Any]) -> list[str]:
    tails = []
    for server in servers:
        tails.append(server.log_tail(8))
        server.stop()
    return tails


# --------------------------------------------------------------------------- the run


def environment(settings: RunSettings, energy: EnergyMeter) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "energy": energy.note or "NVML total energy counter",
    }
    try:
        import grpc

        env["grpcio"] = grpc.__version__
    except ImportError:
        pass
    if settings.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        env["cuda"] = torch.version.cuda
    return env


def run(settings: RunSettings, out_path: Path) -> dict[str, Any]:
    energy = EnergyMeter()
    result: dict[str, Any] = {"command": " ".join(sys.argv), "settings": asdict(settings),
                              "environment": environment(settings, energy)}
    progress(f"environment: {result['environment']}")
    with tempfile.TemporaryDirectory(prefix="tiered-gpu-bench-") as tmp:
        repo = Path(tmp) / "repository"
        onnx_path = write_repository(repo, settings)
        idle = Window(energy).start()
        time.sleep(1.0)
        idle.stop()
        result["idle_watts"] = None if idle.joules is None else idle.joules / idle.seconds

        inprocess = InProcess(onnx_path, settings, energy)
        rows: list[dict[str, Any]] = []
        for batch in settings.inprocess_batches:
            progress(f"in-process batch {batch}")
            rows += inprocess.device_modes(batch)
            rows += inprocess.host_modes(batch)
        result["breakdown"] = [inprocess.breakdown(b) for b in (1, settings.max_batch_size)]
        inprocess.close()  # the agent gets the GPU to itself

        served = []
        top = max(settings.concurrency)

        def measure(setup: str, commands: Sequence[Sequence[str]], levels: Sequence[int],
                    name: str = "agent") -> None:
            progress(f"starting: {setup}")
            servers = start_servers(commands, name)
            try:
                for concurrency in levels:
                    row = served_point(setup, servers, concurrency, settings, energy)
                    progress(
                        f"  {setup} c={concurrency}: {row['img_per_s']:.0f} img/s, p50 "
                        f"{cell(row['p50_ms'])} ms, batch {cell(row['formed_batch'])}, server "
                        f"cpu {cell(row['server_cpu_cores'])}, errors {row['errors']}"
                    )
                    served.append(row)
            finally:
                result.setdefault("server_log_tails", {})[setup] = stop_servers(servers)

        measure("1 agent", [agent_command(repo, None)], settings.concurrency)
        if settings.diagnostics:
            floor = [sys.executable, str(REPO_ROOT / "bench" / "floor_server.py"),
                     "--output", f"{OUTPUT}:1000"]
            measure("transport floor (no work)", [floor], (1, top), name="floor")
            measure("1 agent, GIL switch 0.5 ms", [agent_command(repo, 0.0005)], (top,))
            agents = settings.scale_out_agents
            measure(f"{agents} agents, one GPU", [agent_command(repo, None)] * agents,
                    (top, 2 * top))
        result["served"] = served

        # The reference at the batch the agent actually formed, measured now.
        formed = sorted({
            max(1, round(r["formed_batch"])) for r in served if r.get("formed_batch")
        } - set(settings.inprocess_batches))
        if formed:
            inprocess = InProcess(onnx_path, settings, energy)
            for batch in formed:
                progress(f"in-process batch {batch} (formed by the agent)")
                rows += inprocess.host_modes(batch, naive=False)
            inprocess.close()
        result["inprocess"] = rows
    result["comparison"] = compare(served, rows)
    result["target"] = target(result["comparison"], settings)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def compare(served: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]]) -> list:
    """Each served row against the in-process host-memory engine at the batch it formed."""
    by = {(r["mode"], r["batch"]): r for r in rows}
    out = []
    for row in served:
        if not row.get("formed_batch"):
            continue  # the transport floor runs no model
        batch = max(1, round(row["formed_batch"]))
        x1 = by.get(("host engine.run x1 (pinned, graph)", batch), {}).get("img_per_s")
        x2 = by.get(("host engine.run x2 threads", batch), {}).get("img_per_s")
        best = max((v for v in (x1, x2) if v is not None), default=None)
        out.append({
            "setup": row["setup"],
            "concurrency": row["concurrency"],
            "formed_batch": row["formed_batch"],
            "reference_batch": batch,
            "served_img_per_s": row["img_per_s"],
            "host_engine_x1_img_per_s": x1,
            "host_engine_x2_img_per_s": x2,
            "served_vs_best_host": ratio(row["img_per_s"], best),
        })
    return out


def target(comparison: Sequence[Mapping[str, Any]], settings: RunSettings) -> dict[str, Any]:
    top = max(settings.concurrency)
    row = next(
        (r for r in comparison if r["setup"] == "1 agent" and r["concurrency"] == top), {}
    )
    value = row.get("served_vs_best_host")
    verdict = "N/A" if value is None else "PASS" if value >= TARGET_SERVED_VS_HOST else "FAIL"
    return {"what": f"1 agent: served img/s @c{top} / best in-process host-memory img/s at "
                    "the formed batch", "value": value, "needs": f">= {TARGET_SERVED_VS_HOST}",
            "verdict": verdict}


def report(result: Mapping[str, Any]) -> str:
    inprocess = render_table(
        ["batch", "mode", "img/s", "p50 ms", "p99 ms", "J/img", "W"],
        [[r["batch"], r["mode"], r["img_per_s"], r["p50_ms"], r["p99_ms"], r["j_per_img"],
          r["watts"]] for r in result["inprocess"]],
    )
    served = render_table(
        ["setup", "c", "procs", "img/s", "p50 ms", "p99 ms", "batch", "err", "queue", "merge",
         "engine", "split", "server cpu", "client cpu", "J/img", "W"],
        [[r["setup"], r["concurrency"], r["client_processes"], r["img_per_s"], r["p50_ms"],
          r["p99_ms"], r["formed_batch"], r["errors"], r["agent_ms_per_request"]["queue"],
          r["agent_ms_per_request"]["merge"], r["agent_ms_per_request"]["engine"],
          r["agent_ms_per_request"]["split"], r["server_cpu_cores"], r["client_cpu_cores"],
          r["j_per_img"], r["watts"]] for r in result["served"]],
    )
    comparison = render_table(
        ["setup", "c", "formed batch", "ref batch", "served img/s", "host x1 img/s",
         "host x2 img/s", "served/best"],
        [[r["setup"], r["concurrency"], r["formed_batch"], r["reference_batch"],
          r["served_img_per_s"], r["host_engine_x1_img_per_s"], r["host_engine_x2_img_per_s"],
          r["served_vs_best_host"]] for r in result["comparison"]],
    )
    keys = ["request_bytes", "decode_one_request_ms", "merge_ms", "stage_to_pinned_ms",
            "h2d_pinned_ms", "h2d_pageable_ms", "compute_graph_ms", "d2h_ms", "engine_run_ms"]
    breakdown = render_table(["batch", *keys],
                      [[b["batch"], *(b.get(k) for k in keys)] for b in result["breakdown"]])
    t = result["target"]
    return "\n\n".join([
        f"Environment: {result['environment']}  idle W: {cell(result.get('idle_watts'))}",
        "In-process (same model and precision)\n" + inprocess,
        "Served (batch-1 FP32 requests; queue/merge/engine/split = the agent's per-request "
        "means in ms;\ncpu in cores; J/img = whole-GPU energy over the window / images)\n"
        + served,
        "Served vs in-process host-memory reference at the formed batch\n" + comparison,
        "One batch's host path, each step alone (ms per batch)\n" + breakdown,
        f"Target: {t['what']} = {cell(t['value'])} (needs {t['needs']}): {t['verdict']}",
    ])


def parse_args(argv: Sequence[str] | None) -> tuple[RunSettings, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated levels")
    parser.add_argument("--client-processes", type=int, default=8)
    parser.add_argument("--max-queue-delay-us", type=int, default=500)
    parser.add_argument("--batches", default="1,16,64", help="in-process batch sizes")
    parser.add_argument("--no-diagnostics", action="store_true",
                        help="skip the transport floor, GIL and scale-out runs")
    parser.add_argument("--scale-out-agents", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "gpu.json")
    args = parser.parse_args(argv)
    settings = RunSettings(
        device=args.device,
        precision=args.precision,
        image_size=args.image_size,
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        client_processes=args.client_processes,
        max_queue_delay_us=args.max_queue_delay_us,
        inprocess_batches=tuple(int(b) for b in args.batches.split(",")),
        diagnostics=not args.no_diagnostics,
        scale_out_agents=args.scale_out_agents,
    )
    if args.quick:
        settings = replace(settings, **QUICK)
    return settings, args.out


def main(argv: Sequence[str] | None = None) -> int:
    settings, out = parse_args(argv)
    result = run(settings, out)
    print(report(result))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
