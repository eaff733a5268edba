"""Benchmark: the datacenter torch engine on a GPU, served and in-process, in one run.

- served: a real `tiered agent --tier datacenter` process serving ResNet-18
  (tiered.models.zoo, random weights) through the torch engine (FP16, CUDA
  graphs per batch bucket, pinned staging, two streams), dynamic batching up to
  `max_batch_size`; batch-1 FP32 requests from `tritonclient.grpc.aio` workers
  spread over several client processes (one Python client process cannot
  saturate the agent; bench/common.py's load generator), at each concurrency
  level, for a fixed window after a warm-up. Throughput, latency percentiles,
  the batch the agent formed, and the agent's own ModelStatistics per request
  (queue, merge, engine, split).
- in-process, the same model and precision, at fixed batch sizes:
  (a) data already on the GPU: eager, and a replayed CUDA graph;
  (b) numpy inputs/outputs in host memory, which is what a server receives:
      naive eager (pageable copies), and the torch engine's own `run` (pinned
      staging, graph replay) from one thread and from two threads at once;
  plus the host-side costs of one batch taken apart (request decode, merge,
  staging copy, host-to-device copy, compute, copy back).
- the batcher's rule beside Triton's: the same agent with front ends, its
  batches held for the queue delay while the engine is idle
  (`wait_when_idle: true`), at every concurrency level.
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
numbers mean nothing. `--smoke --out PATH` (with `--device cpu` where there is
no GPU) is that check in seconds: tiny sizes and windows, each diagnostic at
one load level, the setups on agents alike measured one after another on one
agent (`share_agents`: fewer agent starts); what needs CUDA (graphs, pinned
copies, NVML) is skipped on a CPU and listed under `skipped_without_cuda` in
the JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

import tritonclient.grpc as grpcclient

from bench import common
from tiered.local.processes import ServerProcess
from tiered.tables import cell

MODEL = "resnet18"
INPUT, OUTPUT = "input", "logits"
TARGET_SERVED_VS_HOST = 0.5
TARGET_SHM_VS_HOST = 0.9  # served from system shared memory
TARGET_PERF_SYSTEM_VS_HOST = 0.8  # perf_analyzer --shared-memory system (also with -b)
TARGET_PERF_WIRE_VS_HOST = 0.5  # perf_analyzer, tensors on the wire
TARGET_C1_P50_MS = {"system": 1.0, "none": 1.5}  # perf_analyzer at concurrency 1
TARGET_J_PER_IMG_VS_HOST = 1.3  # served J/img over the in-process reference's
PERF_ANALYZER = "perf_analyzer"
SHARE_COUNT = "TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT"  # slots a channel of perf_analyzer's
THREAD_ROWS = 6  # the engine process's busiest threads reported per row
ONE_PROCESS = "1 agent, one process"


def front_ends_setup(settings: RunSettings) -> str:
    return f"1 agent, {settings.front_ends} front ends"


def shared_memory_setup(settings: RunSettings) -> str:
    return f"{front_ends_setup(settings)}, inputs in system shared memory"


def batched_setup(setup: str, images: int) -> str:
    return f"{setup}, {images} images a request, system shared memory"


def waiting_setup(settings: RunSettings) -> str:
    """The front-ended agent with its batches held for the queue delay while
    the engine is idle (Triton's rule): what the batcher's default is compared with."""
    return f"{front_ends_setup(settings)}, batches wait when idle"


def perf_analyzer_setup(setup: str, memory: str, images: int = 1,
                        channel_per_slot: bool = False) -> str:
    batch = f", -b {images}" if images > 1 else ""
    channels = ", a channel per slot" if channel_per_slot else ""
    return f"perf_analyzer, shared memory {memory}{batch}{channels}: {setup}"


@dataclass(frozen=True)
class RunSettings:
    device: str = "cuda"
    precision: str = "fp16"
    image_size: int = 224
    max_batch_size: int = 64
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    max_queue_delay_us: int = 500
    wait_when_idle: bool = False  # the batcher's: wait the delay while no batch runs too
    instance_count: int = 2
    concurrency: tuple[int, ...] = (1, 16, 64)
    client_processes: int = 8  # at most; never more than the concurrency
    warmup_s: float = 4.0
    duration_s: float = 10.0
    inprocess_batches: tuple[int, ...] = (1, 16, 64)
    inprocess_s: float = 1.5  # per in-process point
    request_timeout_s: float = 60.0
    diagnostics: bool = True  # transport floor, GIL switch interval, scale-out
    scale_out_agents: int = 8  # the simplest alternative to front ends: whole agents
    front_ends: int = 8  # the agent's design: N front-end processes, one engine process
    request_images: int = 8  # images a request in the rows that send several
    diagnostics_at_every_level: bool = True  # False: each at the top concurrency only
    idle_s: float = 1.0  # the GPU's idle draw is read over this, before any work
    # The agent's own setups on agents alike (its front ends) measured on one
    # agent, one after another; False: each on a fresh agent.
    share_agents: bool = False


QUICK = dict(warmup_s=2.0, duration_s=5.0, inprocess_s=0.8)
SMOKE = dict(image_size=32, max_batch_size=4, buckets=(1, 2, 4), concurrency=(2,),
             request_images=2,
             client_processes=2, warmup_s=0.2, duration_s=0.5, inprocess_batches=(1,),
             inprocess_s=0.2, scale_out_agents=2, front_ends=2,
             diagnostics_at_every_level=False, idle_s=0.2, share_agents=True)
# What a run on a CPU leaves out, said in its JSON.
WITHOUT_CUDA = [
    "in-process device graph: CUDA graphs need CUDA",
    "breakdown: pinned staging, host-to-device, graph compute and device-to-host copies",
    "energy: no NVML counter is read for --device cpu (J/img and W are empty)",
]


# --------------------------------------------------------------------------- pure helpers


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


def engine_cpu(cpu_s: float | None, delta: Mapping[str, int]) -> dict[str, float | None]:
    """CPU microseconds of the agent's own process alone (the engine process
    when front ends take in the requests) per request it answered and per
    batch it ran."""
    us = None if cpu_s is None else cpu_s * 1e6
    return {"engine_cpu_us_per_request": common.ratio(us, delta.get("success_count") or None),
            "engine_cpu_us_per_batch": common.ratio(us, delta.get("execution_count") or None)}


# --------------------------------------------------------------------------- I/O: meters


class EnergyMeter:
    """NVML's total energy counter for the windows; None (and a note why) where absent."""

    def __init__(self, device: str) -> None:
        self._nvml: common.NvmlEnergy | None = None
        self.note = ""
        if device != "cuda":
            self.note = "not read (--device cpu)"
            return
        try:
            self._nvml = common.NvmlEnergy()
        except Exception as error:  # no driver, no library, or no counter
            self.note = f"no NVML energy counter: {error}"

    def read_j(self) -> float | None:
        return None if self._nvml is None else self._nvml.read()


@dataclass(frozen=True)
class Reading:
    """The clock, GPU energy and some processes' CPU time at one instant;
    two readings make a window."""

    t: float
    joules: float | None
    cpu_s: tuple[float | None, ...]  # each process with its children (front ends)
    own_cpu_s: float | None = None  # the first process alone (the engine process)
    threads: Mapping[str, float] = field(default_factory=dict)  # its threads, by name

    @classmethod
    def take(cls, energy: EnergyMeter, pids: Sequence[int] = ()) -> Reading:
        first = pids[0] if pids else None
        return cls(time.monotonic(), energy.read_j(),
                   tuple(common.process_cpu_s(pid) for pid in pids),
                   common.process_cpu_s(first, children=False), common.thread_cpu_s(first))

    def engine_cpu(self, later: Reading) -> tuple[float | None, dict[str, float]]:
        """CPU seconds of the first process alone up to `later`, and by thread
        name in cores (the busiest first)."""
        seconds = later.t - self.t
        own = None if self.own_cpu_s is None or later.own_cpu_s is None \
            else later.own_cpu_s - self.own_cpu_s
        threads = {name: (cpu - self.threads.get(name, 0.0)) / seconds
                   for name, cpu in later.threads.items()}
        busiest = sorted(threads.items(), key=lambda item: -item[1])[:THREAD_ROWS]
        return own, {name: round(cores, 3) for name, cores in busiest if cores > 0}

    def until(self, later: Reading) -> tuple[float, float | None, float | None]:
        """Seconds, joules and CPU seconds (the processes together) up to `later`."""
        cpu = [None if a is None or b is None else b - a
               for a, b in zip(self.cpu_s, later.cpu_s)]
        joules = None if self.joules is None or later.joules is None \
            else later.joules - self.joules
        return later.t - self.t, joules, None if None in cpu else sum(cpu)


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

    start = Reading.take(energy)
    deadline[0] = time.perf_counter() + seconds
    if threads == 1:
        worker(0)
    else:
        pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    elapsed, joules, _ = start.until(Reading.take(energy))
    calls = sum(len(own) for own in latencies)
    images = calls * images_per_call
    return {
        "calls": calls,
        "seconds": elapsed,
        "img_per_s": images / elapsed,
        **common.percentiles_ms([x for own in latencies for x in own]),
        "j_per_img": common.ratio(joules, images),
        "watts": common.ratio(joules, elapsed),
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
        common.progress("in-process: loading engines (graphs captured at load)")
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
            "wait_when_idle": settings.wait_when_idle,
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


def served_point(setup: str, servers: Sequence[ServerProcess], concurrency: int,
                 settings: RunSettings, energy: EnergyMeter,
                 shared_memory: bool = False, images: int = 1) -> dict[str, Any]:
    """One load level against `servers`, client processes spread over them;
    `shared_memory`: each client's inputs in system shared memory; `images`
    a request."""
    stats_clients = [grpcclient.InferenceServerClient(s.address) for s in servers]

    def probe() -> tuple[Reading, dict[str, int]]:
        totals = [common.stats_totals(c.get_inference_statistics(MODEL, as_json=True), MODEL)
                  for c in stats_clients]
        return (Reading.take(energy, [s.pid for s in servers]),
                {key: sum(t[key] for t in totals) for key in totals[0]})

    size = settings.image_size
    load = common.Load.random(MODEL, INPUT, (images, 3, size, size), outputs={OUTPUT: None},
                              timeout_s=settings.request_timeout_s,
                              shared_memory=shared_memory)
    try:
        window = common.closed_loop(
            [s.address for s in servers], load, concurrency, settings.warmup_s,
            settings.duration_s, processes=max(settings.client_processes, 2 * len(servers)),
            probe=probe)
    finally:
        for client in stats_clients:
            client.close()
    (start, before), (end, after) = window.before, window.after
    seconds, joules, server_cpu_s = start.until(end)
    engine_cpu_s, threads = start.engine_cpu(end)
    delta = common.stats_delta(before, after)
    summary = window.summary()
    served_images = summary["requests"] * images
    return {
        "setup": setup,
        "servers": len(servers),
        "concurrency": concurrency,
        "client_processes": len(window.workers),
        "workers_per_process": list(window.workers),
        **summary,
        "images_per_request": images,
        "throughput": common.ratio(served_images, summary["duration_s"]),  # images per second
        "formed_batch": common.formed_batch(delta),
        "agent_ms_per_request": per_request_ms(delta),
        "agent_stats_delta": delta,
        # Energy per image served: the whole GPU over the window, over completed requests.
        "j_per_img": common.ratio(joules, served_images or None),
        "watts": common.ratio(joules, seconds),
        "server_cpu_cores": common.ratio(server_cpu_s, seconds),
        **engine_cpu(engine_cpu_s, delta),
        "engine_threads_cores": threads,
        "client_cpu_cores": window.tally.cpu_s / window.schedule.seconds,
    }


def perf_analyzer_point(setup: str, agent: ServerProcess, memory: str, concurrency: int,
                        settings: RunSettings, energy: EnergyMeter, images: int = 1,
                        channel_per_slot: bool = False) -> dict[str, Any]:
    """Triton's own load generator against one agent: tensors on the wire
    (`none`), or in system or CUDA shared memory, `images` a request; the
    agent's statistics around its run give the batch it formed. By default
    it shares a gRPC channel (a connection) among up to 6 concurrency slots,
    and the kernel spreads connections, not requests, over the front ends;
    `channel_per_slot` gives each slot its own."""
    with grpcclient.InferenceServerClient(agent.address) as client:
        def totals() -> dict[str, int]:
            return common.stats_totals(client.get_inference_statistics(MODEL, as_json=True),
                                       MODEL)

        with tempfile.TemporaryDirectory(prefix="tiered-perf-") as tmp:
            report = Path(tmp) / "report.csv"
            before, start = totals(), Reading.take(energy, [agent.pid])
            run = subprocess.run(
                [PERF_ANALYZER, "-m", MODEL, "-u", agent.address, "-i", "grpc",
                 "--shared-memory", memory, "--concurrency-range", str(concurrency),
                 "-b", str(images), "--stability-percentage", "25",
                 "--measurement-interval", str(int(settings.duration_s * 1000)),
                 "-f", str(report)], capture_output=True, text=True, timeout=600,
                env={**os.environ, **({SHARE_COUNT: "1"} if channel_per_slot else {})})
            end, after = Reading.take(energy, [agent.pid]), totals()
            if run.returncode != 0:
                return {"setup": setup, "concurrency": concurrency, "error": (run.stdout + run.stderr)[-600:]}
            header, row = report.read_text().splitlines()[:2]
    figures = dict(zip(header.split(","), row.split(","), strict=True))
    seconds, joules, server_cpu_s = start.until(end)
    engine_cpu_s, threads = start.engine_cpu(end)
    delta = common.stats_delta(before, after)
    throughput = float(figures["Inferences/Second"])
    return {
        "setup": setup, "concurrency": concurrency, "client_processes": 1, "throughput": throughput,
        "p50_ms": float(figures["p50 latency"]) / 1000, "p99_ms": float(figures["p99 latency"]) / 1000,
        "errors": 0, "formed_batch": common.formed_batch(delta),
        "agent_ms_per_request": per_request_ms(delta), "agent_stats_delta": delta,
        "j_per_img": common.ratio(joules, throughput * seconds or None),
        "watts": common.ratio(joules, seconds),
        "server_cpu_cores": common.ratio(server_cpu_s, seconds), "client_cpu_cores": None,
        **engine_cpu(engine_cpu_s, delta), "engine_threads_cores": threads,
    }


# --------------------------------------------------------------------------- the run


def run(settings: RunSettings, smoke: bool, out: Path | None = None) -> dict[str, Any]:
    """The whole bench. With `out`, the rows measured so far are written there
    after each served row (`partial` says so), so that a run cut short by a
    machine's time limit still leaves them; the finished result replaces them."""
    energy = EnergyMeter(settings.device)
    result = common.record("gpu", smoke, with_gpu=settings.device == "cuda")
    if settings.device != "cuda":
        result["skipped_without_cuda"] = WITHOUT_CUDA
    result.update(settings=asdict(settings), energy=energy.note or "NVML total energy counter")
    common.progress(f"machine: {result['machine']}")
    with tempfile.TemporaryDirectory(prefix="tiered-gpu-bench-") as tmp:
        repo = Path(tmp) / "repository"
        onnx_path = write_repository(repo, settings)
        idle = Reading.take(energy)
        time.sleep(settings.idle_s)
        idle_s, idle_j, _ = idle.until(Reading.take(energy))
        result["idle_watts"] = common.ratio(idle_j, idle_s)

        inprocess = InProcess(onnx_path, settings, energy)
        rows: list[dict[str, Any]] = []
        for batch in settings.inprocess_batches:
            common.progress(f"in-process batch {batch}")
            rows += inprocess.device_modes(batch)
            rows += inprocess.host_modes(batch)
        result["breakdown"] = [inprocess.breakdown(b) for b in (1, settings.max_batch_size)]
        inprocess.close()  # the agent gets the GPU to itself

        served: list[dict[str, Any]] = []
        top = max(settings.concurrency)

        def keep(row: dict[str, Any]) -> None:
            served.append(row)
            if out is not None:
                common.write({**result, "served": served, "inprocess": rows, "partial":
                              "cut short: the rows measured so far, no comparison or targets"},
                             out, quiet=True)

        # A setup measured: (name, load levels, diagnostic, shared memory, images a request).
        Point = tuple[str, Sequence[int], bool, bool, int]

        def measure(setup: str, servers: Sequence[ServerProcess], levels: Sequence[int],
                    diagnostic: bool = True, shared_memory: bool = False,
                    images: int = 1) -> None:
            measure_on(servers, [(setup, levels, diagnostic, shared_memory, images)])

        def measure_on(servers: Sequence[ServerProcess], points: Sequence[Point]) -> None:
            """Start `servers`, measure each setup on them in turn, stop them."""
            common.progress(f"starting: {'; '.join(point[0] for point in points)}")
            with common.serving(servers) as started:
                for setup, levels, diagnostic, shared_memory, images in points:
                    if diagnostic and not settings.diagnostics_at_every_level:
                        levels = (top,)
                    try:
                        for concurrency in levels:
                            row = served_point(setup, started, concurrency, settings, energy,
                                               shared_memory, images)
                            common.progress(
                                f"  {setup} c={concurrency}: {row['throughput']:.0f} img/s, "
                                f"p50 {cell(row['p50_ms'])} ms, batch "
                                f"{cell(row['formed_batch'])}, server cpu "
                                f"{cell(row['server_cpu_cores'])}, errors {row['errors']}")
                            keep(row)
                    finally:
                        result.setdefault("server_log_tails", {})[setup] = [
                            s.log_tail(8) for s in started]

        def agent(switch_interval_s: float | None = None, front_ends: int = 0,
                  repository: Path = repo) -> ServerProcess:
            return common.agent("datacenter", repository, switch_interval_s=switch_interval_s,
                                extra_args=["--front-ends", str(front_ends)])

        fronted, images = front_ends_setup(settings), settings.request_images
        # The agent's own setups, each with the front ends of the agent it runs on.
        own: list[tuple[int, Point]] = [
            (0, (ONE_PROCESS, settings.concurrency, False, False, 1)),
            (settings.front_ends, (fronted, settings.concurrency, False, False, 1)),
            (settings.front_ends,
             (shared_memory_setup(settings), settings.concurrency, False, True, 1)),
            (0, (batched_setup(ONE_PROCESS, images), (top,), False, True, images)),
            (settings.front_ends, (batched_setup(fronted, images), (top,), False, True, images)),
        ]
        if settings.share_agents:
            for front_ends in dict.fromkeys(f for f, _ in own):
                measure_on([agent(front_ends=front_ends)], [p for f, p in own if f == front_ends])
        else:
            for front_ends, point in own:
                measure_on([agent(front_ends=front_ends)], [point])
        if not settings.wait_when_idle:  # the batcher's rule beside Triton's
            waiting = Path(tmp) / "repository-waiting"
            write_repository(waiting, replace(settings, wait_when_idle=True))
            measure(waiting_setup(settings),
                    [agent(front_ends=settings.front_ends, repository=waiting)],
                    settings.concurrency, diagnostic=False)
        if shutil.which(PERF_ANALYZER):
            memories = ("none", "system", "cuda") if settings.device == "cuda" else (
                "none", "system")
            # (setup, its front ends, [(memory, concurrency, images a request, a
            # channel per slot)]): the agent's design at every level, with several
            # images a request, and with a connection per slot; one process beside
            # it at the top level.
            plan = ((ONE_PROCESS, 0, [(memory, top, 1, False) for memory in memories]),
                    (fronted, settings.front_ends,
                     [(memory, level, 1, False) for memory in memories
                      for level in sorted({1, top})]
                     + [("system", top, settings.request_images, False),
                        ("system", top, 1, True)]))
            for setup, front_ends, points in plan:
                with common.serving([agent(front_ends=front_ends)]) as (one,):
                    for memory, level, images, channel_per_slot in points:
                        name = perf_analyzer_setup(setup, memory, images, channel_per_slot)
                        common.progress(f"{name}, c={level}")
                        row = perf_analyzer_point(name, one, memory, level, settings, energy,
                                                  images, channel_per_slot)
                        common.progress(f"  {row.get('throughput', row.get('error'))} img/s, "
                                        f"p50 {cell(row.get('p50_ms'))} ms")
                        keep(row)
        else:
            result["perf_analyzer"] = f"not run: {PERF_ANALYZER} is not on PATH"
        if settings.diagnostics:
            measure("transport floor (no work)", [common.floor_server({OUTPUT: 1000})], (1, top))
            measure("1 agent, GIL switch 0.5 ms", [agent(0.0005)], (top,))
            agents = settings.scale_out_agents
            measure(f"{agents} agents, one GPU", [agent() for _ in range(agents)],
                    (top, 2 * top))
        result["served"] = served

        # The reference at the batch the agent actually formed, measured now.
        formed = sorted({
            max(1, round(r["formed_batch"])) for r in served if r.get("formed_batch")
        } - set(settings.inprocess_batches))
        if formed:
            inprocess = InProcess(onnx_path, settings, energy)
            for batch in formed:
                common.progress(f"in-process batch {batch} (formed by the agent)")
                rows += inprocess.host_modes(batch, naive=False)
            inprocess.close()
        result["inprocess"] = rows
    result["comparison"] = compare(served, rows)
    result["targets"] = targets(result["comparison"], settings)
    return result


def compare(served: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]]) -> list:
    """Each served row against the in-process host-memory engine at the batch it formed."""
    by = {(r["mode"], r["batch"]): r for r in rows}
    out = []
    for row in served:
        if not row.get("formed_batch"):
            continue  # the transport floor runs no model; a perf_analyzer run that failed
        batch = max(1, round(row["formed_batch"]))
        x1 = by.get(("host engine.run x1 (pinned, graph)", batch), {}).get("img_per_s")
        x2 = by.get(("host engine.run x2 threads", batch), {}).get("img_per_s")
        best = max((v for v in (x1, x2) if v is not None), default=None)
        reference_j = min((r["j_per_img"] for r in (by.get((mode, batch)) for mode in (
            "host engine.run x1 (pinned, graph)", "host engine.run x2 threads"))
            if r and r.get("j_per_img")), default=None)
        out.append({
            "setup": row["setup"],
            "concurrency": row["concurrency"],
            "formed_batch": row["formed_batch"],
            "reference_batch": batch,
            "served_img_per_s": row["throughput"],
            "host_engine_x1_img_per_s": x1,
            "host_engine_x2_img_per_s": x2,
            "served_vs_best_host": common.ratio(row["throughput"], best),
            "p50_ms": row["p50_ms"],
            "j_per_img": row["j_per_img"],
            "j_per_img_vs_host": common.ratio(row["j_per_img"], reference_j),
        })
    return out


def targets(comparison: Sequence[Mapping[str, Any]],
            settings: RunSettings) -> list[common.Target]:
    """The issue's targets, judged on the agent's design (front ends feeding one
    engine process); the one-process rows stand beside them in the tables."""
    top = max(settings.concurrency)
    fronted = front_ends_setup(settings)

    def row(setup: str, concurrency: int = top) -> Mapping[str, Any]:
        return next((r for r in comparison
                     if r["setup"] == setup and r["concurrency"] == concurrency), {})

    def ratio(setup: str) -> float | None:
        return row(setup).get("served_vs_best_host")

    reference = "best in-process host-memory img/s at the formed batch"
    system = ratio(perf_analyzer_setup(fronted, "system"))
    own_system = ratio(shared_memory_setup(settings))
    images = settings.request_images
    cuda, system_rate = (row(perf_analyzer_setup(fronted, memory)).get("served_img_per_s")
                         for memory in ("cuda", "system"))
    energy = row(perf_analyzer_setup(fronted, "system")).get("j_per_img_vs_host")
    return [
        common.judge("served vs host", f"{fronted}: served img/s @c{top}, tensors on the "
                     f"wire / {reference}", ratio(fronted), ">=", TARGET_SERVED_VS_HOST),
        common.judge("system shm vs host", f"{fronted}: served img/s @c{top}, tensors in "
                     f"system shared memory (tritonclient) / {reference}", own_system,
                     ">=", TARGET_SHM_VS_HOST),
        common.judge("perf_analyzer system shm vs host",
                     f"perf_analyzer --shared-memory system @c{top} against {fronted} / "
                     f"{reference}", system, ">=", TARGET_PERF_SYSTEM_VS_HOST),
        common.judge("perf_analyzer wire vs host",
                     f"perf_analyzer, tensors on the wire, @c{top} against {fronted} / "
                     f"{reference}", ratio(perf_analyzer_setup(fronted, "none")), ">=",
                     TARGET_PERF_WIRE_VS_HOST),
        common.judge(f"perf_analyzer -b {images} system shm vs host",
                     f"perf_analyzer -b {images} --shared-memory system @c{top} against "
                     f"{fronted} / {reference}",
                     ratio(perf_analyzer_setup(fronted, "system", images)), ">=",
                     TARGET_PERF_SYSTEM_VS_HOST),
        common.judge("perf_analyzer cuda shm vs system shm",
                     f"perf_analyzer img/s @c{top} against {fronted}: --shared-memory cuda / "
                     "--shared-memory system", common.ratio(cuda, system_rate), ">=", 1.0),
        *(common.judge(f"perf_analyzer c=1 p50 ms, shared memory {memory}",
                       f"perf_analyzer --shared-memory {memory} @c1 against {fronted}: P50 "
                       "latency, ms", row(perf_analyzer_setup(fronted, memory), 1).get("p50_ms"),
                       "<=", limit) for memory, limit in TARGET_C1_P50_MS.items()),
        common.judge("served J/img vs host",
                     f"perf_analyzer --shared-memory system @c{top} against {fronted}: J/img "
                     "(nvml, whole GPU) / the in-process reference's at the formed batch",
                     energy, "<=", TARGET_J_PER_IMG_VS_HOST),
    ]


def report(result: Mapping[str, Any]) -> str:
    inprocess = common.table(
        ["batch", "mode", "img/s", "p50 ms", "p99 ms", "J/img", "W"],
        [[r["batch"], r["mode"], r["img_per_s"], r["p50_ms"], r["p99_ms"], r["j_per_img"],
          r["watts"]] for r in result["inprocess"]],
    )
    served = common.table(
        ["setup", "c", "procs", "img/s", "p50 ms", "p99 ms", "batch", "err", "queue", "merge",
         "engine", "split", "server cpu", "us/req", "us/batch", "client cpu", "J/img", "W"],
        [[r["setup"], r["concurrency"], r["client_processes"], r["throughput"], r["p50_ms"],
          r["p99_ms"], r["formed_batch"], r["errors"], r["agent_ms_per_request"]["queue"],
          r["agent_ms_per_request"]["merge"], r["agent_ms_per_request"]["engine"],
          r["agent_ms_per_request"]["split"], r["server_cpu_cores"],
          r["engine_cpu_us_per_request"], r["engine_cpu_us_per_batch"], r["client_cpu_cores"],
          r["j_per_img"], r["watts"]] for r in result["served"] if "error" not in r],
    )
    comparison = common.table(
        ["setup", "c", "formed batch", "ref batch", "served img/s", "host x1 img/s",
         "host x2 img/s", "served/best"],
        [[r["setup"], r["concurrency"], r["formed_batch"], r["reference_batch"],
          r["served_img_per_s"], r["host_engine_x1_img_per_s"], r["host_engine_x2_img_per_s"],
          r["served_vs_best_host"]] for r in result["comparison"]],
    )
    threads = common.table(
        ["setup", "c", "engine process threads, cores (busiest first)"],
        [[r["setup"], r["concurrency"],
          ", ".join(f"{name} {cores:.2f}" for name, cores in r["engine_threads_cores"].items())]
         for r in result["served"] if r.get("engine_threads_cores")],
    )
    keys = ["request_bytes", "decode_one_request_ms", "merge_ms", "stage_to_pinned_ms",
            "h2d_pinned_ms", "h2d_pageable_ms", "compute_graph_ms", "d2h_ms", "engine_run_ms"]
    breakdown = common.table(["batch", *keys],
                             [[b["batch"], *(b.get(k) for k in keys)] for b in result["breakdown"]])
    return "\n\n".join([
        f"Machine: {result['machine']}\nEnergy: {result['energy']}; idle W: "
        f"{cell(result.get('idle_watts'))}"
        + "".join(f"\nSkipped: {s}" for s in result.get("skipped_without_cuda", [])),
        "In-process (same model and precision)\n" + inprocess,
        "Served (batch-1 FP32 requests; queue/merge/engine/split = the agent's per-request "
        "means in ms;\nserver cpu: cores of the agent's processes (front ends included); "
        "us/req, us/batch: CPU of the engine\nprocess alone per request and per batch; J/img = whole-GPU energy over the window / images)\n"
        + served,
        "Served vs in-process host-memory reference at the formed batch\n" + comparison,
        "Where the engine process's CPU goes\n" + threads,
        "One batch's host path, each step alone (ms per batch)\n" + breakdown,
        "Targets\n" + common.targets_table(result["targets"]),
        *failures(result),
    ])


def failures(result: Mapping[str, Any]) -> list[str]:
    """The served rows that failed, and why perf_analyzer did not run."""
    return [*(f"{r['setup']} @c{r['concurrency']} failed: {r['error']}"
              for r in result["served"] if "error" in r),
            *([result["perf_analyzer"]] if "perf_analyzer" in result else [])]


def parse_args(argv: Sequence[str] | None) -> tuple[RunSettings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = RunSettings()
    parser.add_argument("--quick", action="store_true", help="shorter windows")
    parser.add_argument("--device", default=defaults.device, choices=["cuda", "cpu"])
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"],
                        help="default fp16 on cuda, fp32 on cpu (where fp16 crawls)")
    parser.add_argument("--image-size", type=int, help=f"default {defaults.image_size}")
    parser.add_argument("--concurrency", help="comma-separated levels (default "
                        f"{','.join(map(str, defaults.concurrency))})")
    parser.add_argument("--client-processes", type=int,
                        help=f"default {defaults.client_processes}")
    parser.add_argument("--max-queue-delay-us", type=int,
                        help=f"default {defaults.max_queue_delay_us}")
    parser.add_argument("--wait-when-idle", action="store_true", default=None,
                        help="batches wait the queue delay while no batch runs too "
                        "(Triton's rule; default: an idle engine runs at once)")
    parser.add_argument("--batches", help="in-process batch sizes (default "
                        f"{','.join(map(str, defaults.inprocess_batches))})")
    parser.add_argument("--no-diagnostics", action="store_true",
                        help="skip the transport floor, GIL and scale-out runs")
    parser.add_argument("--scale-out-agents", type=int,
                        help=f"whole agents sharing the GPU (default {defaults.scale_out_agents})")
    parser.add_argument("--front-ends", type=int, help="front-end processes of the agent "
                        f"measured against its one-process self (default {defaults.front_ends})")
    parser.add_argument("--devices", type=int, metavar="N",
                        help="instead: one agent over 1, 2, 4 .. N GPUs (one engine process "
                        "each), against the one-GPU agent, shared-memory inputs "
                        "(bench/devices.py; --device cpu: CPU stand-ins); writes "
                        "bench/results/gpu-devices.json unless --out")
    parser.add_argument("--request-batch", type=int, default=8,
                        help="images per request with --devices (default 8)")
    common.add_arguments(parser, "gpu")
    args = common.parse(parser, argv, "gpu")
    given = {
        "image_size": args.image_size,
        "concurrency": args.concurrency and tuple(int(c) for c in args.concurrency.split(",")),
        "client_processes": args.client_processes,
        "max_queue_delay_us": args.max_queue_delay_us,
        "wait_when_idle": args.wait_when_idle,
        "inprocess_batches": args.batches and tuple(int(b) for b in args.batches.split(",")),
        "scale_out_agents": args.scale_out_agents,
        "front_ends": args.front_ends,
    }
    settings = replace(defaults, **SMOKE) if args.smoke else defaults
    precision = args.precision or ("fp16" if args.device == "cuda" else "fp32")
    settings = replace(settings, device=args.device, precision=precision,
                       diagnostics=not args.no_diagnostics,
                       **{k: v for k, v in given.items() if v is not None})
    if args.quick:
        settings = replace(settings, **QUICK)
    return settings, args


def main(argv: Sequence[str] | None = None) -> int:
    settings, args = parse_args(argv)
    if args.devices:
        return devices_main(settings, args)
    result = run(settings, args.smoke, args.out)
    print(report(result))
    common.write(result, args.out)
    if args.smoke:
        return common.smoke_exit({
            "served": (result["served"], ("throughput", "p50_ms", "p99_ms")),
            "inprocess": (result["inprocess"], ("img_per_s", "p50_ms")),
            "comparison": (result["comparison"], ("served_img_per_s", "served_vs_best_host")),
        })
    return 0


def devices_main(settings: RunSettings, args: argparse.Namespace) -> int:
    from bench import devices

    if args.devices < 1 or args.request_batch < 1:
        raise SystemExit("--devices and --request-batch: must be >= 1")
    settings = replace(settings, max_batch_size=max(settings.max_batch_size, args.request_batch))
    result = devices.run(settings, args.devices, args.request_batch, args.smoke,
                         write_repository)
    print(devices.report(result))
    out = args.out
    if out == common.RESULTS / "gpu.json":
        out = common.RESULTS / "gpu-devices.json"
    common.write(result, out)
    if args.smoke:
        return common.smoke_exit({"rows": (result["rows"], ("img_per_s", "p50_ms", "p99_ms"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
