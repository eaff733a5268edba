"""The harness every benchmark in bench/ shares.

- servers: real `tiered agent` / `tiered router` processes, and the benches'
  own floor and pass-through servers, started on loopback and waited for;
- load: closed-loop clients (N workers with one request in flight each, on a
  thread of this process or spread over client processes) and a paced open
  loop, both on tritonclient's asyncio client; a sampler for counters read
  while the load runs;
- statistics: percentiles, throughput and errors of a measured window, with
  the windows of several client processes merged;
- the record: the machine, targets judged PASS / FAIL / N/A, JSON under
  bench/results/NAME.json, tables that show the rows missing a target beside
  those meeting it;
- smoke mode: `--smoke --out PATH`, and the check that a smoke run's rows are
  well-formed.

It measures and records; what a bench compares and which targets it holds
stay in the bench. Nothing here imports a bench.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from tiered.local.processes import AgentProcess, ServerProcess
from tiered.tables import render

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "bench" / "results"
T = TypeVar("T")

# --------------------------------------------------------------------------- progress

_STARTED = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def sleep_until(t: float) -> None:
    """Sleep until `t` on the monotonic clock (the one every bench and agent slot uses)."""
    time.sleep(max(0.0, t - time.monotonic()))


# --------------------------------------------------------------------------- the machine

PACKAGES = ("numpy", "onnxruntime", "onnx", "grpcio", "protobuf", "tritonclient", "torch")


def machine() -> dict[str, Any]:
    """Where a run happened. Taken before a bench loads the machine, so the
    load average is the neighbours'."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "processor": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": {dist: version(dist) for dist in PACKAGES},
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def gpu() -> dict[str, Any]:
    """GPU 0 as torch and NVML see it; NVML's part is a note where it is absent."""
    import torch

    info: dict[str, Any] = {
        "name": torch.cuda.get_device_name(),
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "cuda": torch.version.cuda,
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
        info["power_limit_w"] = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
    except Exception as error:  # no driver or no library: say so, the run goes on
        info["nvml"] = f"unavailable: {error}"
    return info


class NvmlEnergy:
    """NVML's total-energy counter of one GPU (mJ since driver load, Volta and
    later), in joules. Raises where there is no driver, library or counter."""

    def __init__(self, index: int = 0) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.read()  # fails here, not in the middle of a window

    def read(self) -> float:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3


def _clock_ticks() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100.0


def _stat(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # the command name may hold spaces


def process_cpu_s(pid: int | None, children: bool = True) -> float | None:
    """utime + stime of a process and (`children`) its live children (an
    agent's front ends), all their threads (Linux); None where unknown."""
    if pid is None or (own := _stat(pid)) is None:
        return None
    if not children:
        return (int(own[11]) + int(own[12])) / _clock_ticks()
    stats = [own, *(fields for _, fields in _children(pid))]
    return sum(int(f[11]) + int(f[12]) for f in stats) / _clock_ticks()


def _children(pid: int) -> list[tuple[int, list[str]]]:
    """The live children of `pid` and their /proc stat fields."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and int(fields[1]) == pid:
            found.append((int(entry.name), fields))
    return found


def children_running(pid: int | None, module: str) -> list[int]:
    """The live children of `pid` started as `python -m module`."""
    found = []
    for child, _ in _children(pid) if pid is not None else ():
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() in argv:
            found.append(child)
    return found


def thread_cpu_s(pid: int | None) -> dict[str, float]:
    """utime + stime of each thread of one process, summed by thread name
    (digits dropped: a pool's threads count together); {} where unknown."""
    by_name: dict[str, float] = {}
    if pid is None:
        return by_name
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return by_name
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = "".join(c for c in stat[stat.index("(") + 1:stat.rindex(")")] if not c.isdigit())
        fields = stat.rsplit(")", 1)[1].split()
        by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _clock_ticks()
    return by_name


def system_busy_s() -> float | None:
    """CPU seconds all cores spent not idle since boot (Linux); None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    values = [int(v) for v in fields[1:9]]  # cpu user nice system idle iowait irq softirq steal
    return (sum(values) - values[3] - values[4]) / _clock_ticks()


# --------------------------------------------------------------------------- statistics


def percentiles_ms(latencies_s: Sequence[float]) -> dict[str, float | None]:
    """P50/P95/P99 (linear interpolation) and the mean of latencies in seconds, in ms."""
    if not len(latencies_s):
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None, "mean_ms": None}
    ms = np.asarray(latencies_s, dtype=np.float64) * 1e3
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99),
            "mean_ms": float(ms.mean())}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None where either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _count(value: Any) -> int:
    return int(value) if value not in (None, "") else 0  # protobuf JSON: int64 as strings


STAT_KINDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


def stats_totals(stats_json: Mapping[str, Any], model_name: str | None = None) -> dict[str, int]:
    """Cumulative counters of a model (all its versions; every model where
    `model_name` is None) from Triton-shaped statistics,
    `get_inference_statistics(as_json=True)`: counts and nanoseconds per kind."""
    totals = {"inference_count": 0, "execution_count": 0}
    totals.update({f"{kind}_{unit}": 0 for kind in STAT_KINDS for unit in ("count", "ns")})
    for entry in stats_json.get("model_stats", []):
        if model_name is not None and entry.get("name", model_name) != model_name:
            continue
        totals["inference_count"] += _count(entry.get("inference_count"))
        totals["execution_count"] += _count(entry.get("execution_count"))
        inference = entry.get("inference_stats", {})
        for kind in STAT_KINDS:
            for unit in ("count", "ns"):
                totals[f"{kind}_{unit}"] += _count(inference.get(kind, {}).get(unit))
    return totals


def stats_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    return {key: after.get(key, 0) - before.get(key, 0) for key in after}


def formed_batch(delta: Mapping[str, int]) -> float | None:
    """Mean batch the server executed: batch elements served / batches run."""
    return ratio(delta.get("inference_count"), delta.get("execution_count") or None)


def split_workers(concurrency: int, processes: int) -> list[int]:
    """Workers per client process: as even as possible, no empty process."""
    processes = max(1, min(processes, concurrency))
    base, extra = divmod(concurrency, processes)
    return [base + (1 if i < extra else 0) for i in range(processes)]


ERROR_SAMPLES = 5


@dataclass
class Tally:
    """What clients saw of one measured window: every request that ended in
    it, answered (latency, when it ended) or failed. One per client process;
    `merge` joins them."""

    latencies_s: list[float] = field(default_factory=list)
    completed_at: list[float] = field(default_factory=list)  # monotonic s, answered ones
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    cpu_s: float = 0.0  # CPU the clients' process used during the window

    def record(self, latency_s: float, ended: float, error: str | None) -> None:
        if error is None:
            self.latencies_s.append(latency_s)
            self.completed_at.append(ended)
            return
        self.errors += 1
        if len(self.error_samples) < ERROR_SAMPLES:
            self.error_samples.append(error)

    @property
    def answered(self) -> int:
        return len(self.latencies_s)

    @classmethod
    def merge(cls, tallies: Sequence[Tally]) -> Tally:
        return cls(
            latencies_s=[x for t in tallies for x in t.latencies_s],
            completed_at=[x for t in tallies for x in t.completed_at],
            errors=sum(t.errors for t in tallies),
            error_samples=[e for t in tallies for e in t.error_samples][:ERROR_SAMPLES],
            cpu_s=sum(t.cpu_s for t in tallies),
        )

    def summary(self, seconds: float) -> dict[str, Any]:
        """The window's figures; throughput is answered requests per second."""
        return {
            "duration_s": seconds,
            "requests": self.answered,
            "errors": self.errors,
            "error_samples": list(self.error_samples),
            "throughput": ratio(self.answered, seconds),
            **percentiles_ms(self.latencies_s),
        }


# --------------------------------------------------------------------------- servers

_SWITCH_INTERVAL = (
    "import sys; sys.setswitchinterval(float(sys.argv[1])); "
    "from tiered.cli import main; raise SystemExit(main(sys.argv[2:]))"
)


def agent(tier: str, repository: Path, *, extra_args: Sequence[str] = (),
          switch_interval_s: float | None = None) -> AgentProcess:
    """`tiered agent` on a free loopback port, plaintext (`--insecure`).

    `switch_interval_s` runs the same agent under another GIL switch interval:
    a diagnostic that changes the interpreter's setting, not the agent's code.
    """
    process = AgentProcess(tier, repository, extra_args=extra_args)
    if switch_interval_s is not None:
        launcher = [sys.executable, "-m", "tiered"]
        if process.command[:3] != launcher:
            raise RuntimeError(f"unexpected agent command {process.command[:3]}")
        process.command = [sys.executable, "-c", _SWITCH_INTERVAL, str(switch_interval_s),
                           *process.command[3:]]
    return process


def floor_server(outputs: Mapping[str, int]) -> ServerProcess:
    """bench/floor_server.py: answers at once with zeros of each output's width."""
    return ServerProcess(
        [sys.executable, str(REPO_ROOT / "bench" / "floor_server.py"),
         *(f"--output={name}:{width}" for name, width in outputs.items())],
        "floor-server",
    )


def passthrough_server(upstream: str) -> ServerProcess:
    """bench/passthrough_server.py: forwards every request to `upstream`."""
    return ServerProcess(
        [sys.executable, str(REPO_ROOT / "bench" / "passthrough_server.py"),
         "--upstream", upstream],
        "passthrough",
    )


async def serve_v2(servicer: Any, name: str, max_message_bytes: int = 256 << 20) -> None:
    """Serve a v2 servicer (the benches' own stand-ins) on a free loopback port
    on the agent's grpcio settings, and say where as tiered's servers do:
    `ServerProcess` waits for that line."""
    import grpc

    from tiered.agent.server import grpc_options
    from tiered.protocol import grpc_service_pb2_grpc as pb_grpc

    server = grpc.aio.server(options=grpc_options(max_message_bytes))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"{name} listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


@contextlib.contextmanager
def serving(servers: Sequence[ServerProcess],
            timeout_s: float = 300.0) -> Iterator[list[ServerProcess]]:
    """Start every server (each waits until it prints its port); stop them all
    on the way out, also when one fails to start. They start side by side and
    stop side by side: each takes seconds (an agent imports torch; it drains)."""
    servers = list(servers)
    with futures.ThreadPoolExecutor(max(1, len(servers))) as pool:
        starts = [pool.submit(server.start, timeout_s) for server in servers]
        try:
            futures.wait(starts)  # every one up or failed before any is stopped
            for start in starts:
                start.result()
            yield servers
        finally:  # stops each and removes its log
            list(pool.map(lambda server: server.__exit__(None, None, None), servers))


# --------------------------------------------------------------------------- load


@dataclass(frozen=True)
class Load:
    """What every client sends: requests for one model, cycled from a pool of
    inputs. Plain data, so client processes receive it whole."""

    model: str
    inputs: tuple[Mapping[str, np.ndarray], ...]  # one mapping per distinct request
    # Outputs asked for by name, with the shape each answer must have (None:
    # any); none asked: the server sends them all.
    outputs: Mapping[str, tuple[int, ...] | None] = field(default_factory=dict)
    timeout_s: float = 60.0
    # Inputs from system shared memory: each client process writes each input
    # once into a region of its own and registers it; requests name the region.
    shared_memory: bool = False

    @classmethod
    def random(cls, model: str, input_name: str, shape: Sequence[int], *, pool: int = 1,
               seed: int = 0, **kwargs: Any) -> Load:
        """`pool` FP32 requests of standard-normal data, `shape` with the batch dim."""
        rng = np.random.default_rng(seed)
        inputs = tuple({input_name: rng.standard_normal(tuple(shape), dtype=np.float32)}
                       for _ in range(pool))
        return cls(model, inputs, **kwargs)

    def requests(self) -> list[list[grpcclient.InferInput]]:
        pool = []
        for arrays in self.inputs:
            request = []
            for name, array in arrays.items():
                item = grpcclient.InferInput(name, list(array.shape),
                                             np_to_triton_dtype(array.dtype))
                item.set_data_from_numpy(array)
                request.append(item)
            pool.append(request)
        return pool

    async def prepare(self, client: aioclient.InferenceServerClient
                      ) -> tuple[list[list[grpcclient.InferInput]], Callable[[], Any]]:
        """The request pool for one client, and what releases it afterwards."""
        if not self.shared_memory:
            return self.requests(), lambda: None
        import tritonclient.utils.shared_memory as shm

        pool, handles = [], []
        for index, arrays in enumerate(self.inputs):
            request = []
            for name, array in arrays.items():
                region = f"bench-{os.getpid()}-{id(client)}-{index}-{name}"
                handle = shm.create_shared_memory_region(region, f"/{region}", array.nbytes)
                handles.append(handle)
                shm.set_shared_memory_region(handle, [np.ascontiguousarray(array)])
                await client.register_system_shared_memory(region, f"/{region}", array.nbytes)
                item = grpcclient.InferInput(name, list(array.shape),
                                             np_to_triton_dtype(array.dtype))
                item.set_shared_memory(region, array.nbytes)
                request.append(item)
            pool.append(request)

        def release() -> None:
            for handle in handles:
                shm.destroy_shared_memory_region(handle)

        return pool, release

    def requested_outputs(self) -> list[grpcclient.InferRequestedOutput] | None:
        return [grpcclient.InferRequestedOutput(name) for name in self.outputs] or None

    def check(self, result: Any) -> str | None:
        """Why an answer is wrong, or None."""
        for name, shape in self.outputs.items():
            array = result.as_numpy(name)
            if array is None or (shape is not None and tuple(array.shape) != tuple(shape)):
                got = None if array is None else tuple(array.shape)
                return f"output {name!r} shape {got}, expected {shape}"
        return None


@dataclass(frozen=True)
class Schedule:
    """Monotonic times: requests ending in [start, end) are measured; no
    request starts after `stop` (>= end: load can outlast the window)."""

    start: float
    end: float
    stop: float

    @classmethod
    def after(cls, warmup_s: float, duration_s: float) -> Schedule:
        start = time.monotonic() + warmup_s
        return cls(start, start + duration_s, start + duration_s)

    @property
    def seconds(self) -> float:
        return self.end - self.start


_OVER = Schedule(0.0, 0.0, 0.0)  # sent to clients that must end without a window
ERROR_PAUSE_S = 0.001  # a failing server must not be hammered in a tight loop


async def _send(client: aioclient.InferenceServerClient, load: Load,
                request: list[grpcclient.InferInput],
                outputs: list[grpcclient.InferRequestedOutput] | None) -> str | None:
    """One request; why it failed, or None."""
    try:
        result = await client.infer(load.model, request, outputs=outputs,
                                    client_timeout=load.timeout_s)
        return load.check(result)
    except InferenceServerException as exc:
        return f"{exc.status()}: {exc.message()}"
    except Exception as exc:  # noqa: BLE001 - one odd reply must not end the run
        return f"{type(exc).__name__}: {exc}"


async def _worker(client: aioclient.InferenceServerClient, load: Load,
                  requests: list[list[grpcclient.InferInput]], offset: int,
                  schedule: Schedule, tally: Tally) -> None:
    outputs = load.requested_outputs()
    i = offset
    while (started := time.monotonic()) < schedule.stop:
        error = await _send(client, load, requests[i % len(requests)], outputs)
        ended = time.monotonic()
        i += 1
        if schedule.start <= ended < schedule.end:
            tally.record(ended - started, ended, error)
        if error is not None:
            await asyncio.sleep(ERROR_PAUSE_S)


async def _cpu_during(schedule: Schedule, tally: Tally) -> None:
    await asyncio.sleep(max(0.0, schedule.start - time.monotonic()))
    started = time.process_time()
    await asyncio.sleep(max(0.0, schedule.end - time.monotonic()))
    tally.cpu_s = time.process_time() - started


def _client_main(address: str, load: Load, workers: int, control: Any, results: Any) -> None:
    """One client (a thread or a process): connects, answers "ready" after one
    request, waits for its schedule, runs `workers` workers, sends its tally."""
    async def main() -> Tally:
        async with aioclient.InferenceServerClient(address) as client:
            requests, release = await load.prepare(client)
            try:
                error = await _send(client, load, requests[0], load.requested_outputs())
                if error is not None:
                    raise RuntimeError(f"first request to {address} failed: {error}")
                results.put(("ready", None))
                schedule = await asyncio.get_running_loop().run_in_executor(None, control.get)
                tally = Tally()
                await asyncio.gather(_cpu_during(schedule, tally), *(
                    _worker(client, load, requests, n, schedule, tally)
                    for n in range(workers)))
                return tally
            finally:
                release()

    try:
        results.put(("done", asyncio.run(main())))
    except Exception as error:  # report instead of hanging the conductor
        results.put(("failed", repr(error)))


READY_TIMEOUT_S = 300.0


class Clients:
    """Closed-loop load: `concurrency` workers, each with one request in flight.

    `processes=0` runs them as one asyncio loop on a thread of this process
    (its CPU use is then this process's); N spreads them over N client
    processes, given the addresses in turn, because one Python client process
    cannot saturate a fast server. Use: `with Clients(...) as c: c.go(schedule)`,
    conduct (read counters at the window's edges), then `c.tally()`.
    """

    def __init__(self, addresses: Sequence[str], load: Load, concurrency: int,
                 processes: int = 0) -> None:
        self.plan = split_workers(concurrency, processes or 1)
        if processes:
            # Forked from a server process that imported this module once, not
            # spawned to import it all again: a client starts in 0.15 s, not 0.7.
            context = mp.get_context("forkserver")
            context.set_forkserver_preload([__name__])
            self._results: Any = context.Queue()
            self._controls: list[Any] = [context.Queue() for _ in self.plan]
            make: Callable[..., Any] = context.Process
        else:
            self._results, self._controls = queue.Queue(), [queue.Queue()]
            make = threading.Thread
        self._clients = [
            make(target=_client_main, daemon=True,
                 args=(addresses[i % len(addresses)], load, workers, self._controls[i],
                       self._results))
            for i, workers in enumerate(self.plan)
        ]
        self._schedule: Schedule | None = None
        self._timeout_s = load.timeout_s

    def _collect(self, kind: str, timeout_s: float) -> list[Any]:
        values = []
        for _ in self._clients:
            got, value = self._results.get(timeout=timeout_s)
            if got != kind:
                raise RuntimeError(f"a client failed: {value}")
            values.append(value)
        return values

    def __enter__(self) -> Clients:
        for client in self._clients:
            client.start()
        try:
            self._collect("ready", READY_TIMEOUT_S)
        except BaseException:
            self.__exit__()
            raise
        return self

    def go(self, schedule: Schedule) -> None:
        self._schedule = schedule
        for control in self._controls:
            control.put(schedule)

    def tallies(self) -> list[Tally]:
        """Wait for every client to finish its schedule: one tally per client."""
        assert self._schedule is not None, "go() first"
        wait_s = max(0.0, self._schedule.stop - time.monotonic()) + self._timeout_s + 60
        return self._collect("done", wait_s)

    def tally(self) -> Tally:
        return Tally.merge(self.tallies())

    def __exit__(self, *exc: object) -> None:
        if self._schedule is None:
            for control in self._controls:
                control.put(_OVER)
        for client in self._clients:
            client.join(timeout=30)
            if isinstance(client, mp.process.BaseProcess) and client.is_alive():
                client.kill()


@dataclass(frozen=True)
class Window(Generic[T]):
    """A measured closed-loop window, and what `probe` read at its two edges."""

    schedule: Schedule
    tally: Tally
    before: T | None
    after: T | None
    workers: tuple[int, ...]  # per client (thread or process)

    def summary(self) -> dict[str, Any]:
        return self.tally.summary(self.schedule.seconds)


def closed_loop(addresses: Sequence[str], load: Load, concurrency: int, warmup_s: float,
                duration_s: float, *, processes: int = 0,
                probe: Callable[[], T] | None = None) -> Window[T]:
    """Load for `warmup_s`, then a window of `duration_s`; `probe()` (server
    statistics, energy, CPU) is read as the window opens and as it closes."""
    with Clients(addresses, load, concurrency, processes) as clients:
        schedule = Schedule.after(warmup_s, duration_s)
        clients.go(schedule)
        sleep_until(schedule.start)
        before = probe() if probe else None
        sleep_until(schedule.end)
        after = probe() if probe else None
        return Window(schedule, clients.tally(), before, after, tuple(clients.plan))


HANG_GRACE_S = 5.0  # past its deadline, a request still unanswered is hung


@dataclass
class Offered:
    """What a paced open loop sent and what became of it."""

    sent: int = 0
    tally: Tally = field(default_factory=Tally)  # the answers (a wrong one is an error)
    refused: dict[str, int] = field(default_factory=dict)  # by status code
    hung: int = 0  # no answer and no refusal within the deadline and its grace

    @property
    def lost(self) -> int:
        """Neither answered nor refused (the hung, and any that vanished)."""
        return self.sent - self.tally.answered - self.tally.errors - sum(self.refused.values())


async def _offer(client: aioclient.InferenceServerClient, load: Load,
                 request: list[grpcclient.InferInput],
                 outputs: list[grpcclient.InferRequestedOutput] | None, offered: Offered) -> None:
    offered.sent += 1
    started = time.monotonic()
    try:
        result = await asyncio.wait_for(
            client.infer(load.model, request, outputs=outputs, client_timeout=load.timeout_s),
            load.timeout_s + HANG_GRACE_S)
    except asyncio.TimeoutError:
        offered.hung += 1
        return
    except InferenceServerException as error:
        code = str(error.status())
        offered.refused[code] = offered.refused.get(code, 0) + 1
        return
    ended = time.monotonic()
    offered.tally.record(ended - started, ended, load.check(result))


def open_loop(address: str, load: Load, rate_rps: float, seconds: float) -> Offered:
    """Send at `rate_rps` for `seconds` whatever the answers (requests do not
    wait for each other), then wait for every request's outcome."""
    async def main() -> Offered:
        offered = Offered()
        async with aioclient.InferenceServerClient(address) as client:
            requests, outputs = load.requests(), load.requested_outputs()
            pending: set[asyncio.Task] = set()
            started, index = time.monotonic(), 0
            while time.monotonic() - started < seconds:
                await asyncio.sleep(max(0.0, started + index / rate_rps - time.monotonic()))
                task = asyncio.create_task(
                    _offer(client, load, requests[index % len(requests)], outputs, offered))
                pending.add(task)
                task.add_done_callback(pending.discard)
                index += 1
            if pending:
                await asyncio.gather(*pending)
        return offered

    return asyncio.run(main())


class Sampler(Generic[T]):
    """Calls `read()` every `period_s` on a thread, and once more at `stop()`:
    [(monotonic s, value)]."""

    def __init__(self, read: Callable[[], T], period_s: float) -> None:
        self.read = read
        self.period_s = period_s
        self.samples: list[tuple[float, T]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        value = self.read()
        self.samples.append((time.monotonic(), value))

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._sample()
            next_at += self.period_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def start(self) -> Sampler[T]:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, T]]:
        """Stop reading (again: a no-op) and return the samples."""
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            self._sample()
        return self.samples


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """A figure held against its threshold. Missing data is N/A, never a pass."""

    name: str
    description: str
    value: float | None
    comparison: str  # ">=", "<=", or "within": |value - 1| <= threshold
    threshold: float
    verdict: str  # PASS, FAIL or N/A

    @property
    def needs(self) -> str:
        if self.comparison == "within":
            return f"1 +- {self.threshold}"
        return f"{self.comparison} {self.threshold}"


def judge(name: str, description: str, value: float | None, comparison: str,
          threshold: float) -> Target:
    if value is None or not math.isfinite(value):
        verdict = "N/A"
    else:
        met = {">=": value >= threshold, "<=": value <= threshold,
               "within": abs(value - 1) <= threshold}[comparison]
        verdict = "PASS" if met else "FAIL"
    return Target(name, description, value, comparison, threshold, verdict)


def overall(targets: Sequence[Target]) -> str:
    """FAIL if any fails, PASS if all pass, else N/A."""
    verdicts = {t.verdict for t in targets}
    return "FAIL" if "FAIL" in verdicts else "PASS" if verdicts == {"PASS"} else "N/A"


# --------------------------------------------------------------------------- the record


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
          verdicts: Sequence[str | None] | None = None) -> str:
    """A plain-text table. With `verdicts`, a last column says which rows meet
    their target and which miss it: failing rows are shown, never dropped."""
    if verdicts is None:
        return render(headers, rows)
    return render([*headers, "verdict"],
                  [[*row, verdict or ""] for row, verdict in zip(rows, verdicts, strict=True)])


def targets_table(targets: Sequence[Target]) -> str:
    return table(["target", "what", "value", "needs"],
                 [[t.name, t.description, t.value, t.needs] for t in targets],
                 [t.verdict for t in targets])


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="a second or two per row at tiny concurrency, to prove the bench "
                             "still runs (its numbers mean nothing); needs --out")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write the JSON (default bench/results/{name}.json)")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
          name: str) -> argparse.Namespace:
    """Parse the command line; `args.out` is always a path after this."""
    args = parser.parse_args(argv)
    if args.out is None:
        if args.smoke:
            parser.error("--smoke needs --out: smoke numbers must not replace bench/results/")
        args.out = RESULTS / f"{name}.json"
    return args


W = TypeVar("W")


def parse_windows(argv: Sequence[str] | None, name: str, description: str, defaults: W,
                  smoke: W, rounds_help: str) -> tuple[argparse.Namespace, W]:
    """The command line of a bench measured in windows (settings with seconds,
    warmup_s, rounds and concurrency): the smoke or default settings, with what
    the flags give in their place."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seconds", type=float, help=f"measured seconds per window "
                        f"(default {defaults.seconds})")
    parser.add_argument("--warmup", type=float, help=f"warm-up seconds per window "
                        f"(default {defaults.warmup_s})")
    parser.add_argument("--rounds", type=int, help=f"{rounds_help} "
                        f"(default {defaults.rounds})")
    parser.add_argument("--concurrency", type=int, nargs="+",
                        help=f"levels (default {' '.join(map(str, defaults.concurrency))})")
    add_arguments(parser, name)
    args = parse(parser, argv, name)
    given = {"seconds": args.seconds, "warmup_s": args.warmup, "rounds": args.rounds,
             "concurrency": tuple(args.concurrency) if args.concurrency else None}
    settings = dataclasses.replace(smoke if args.smoke else defaults,
                                   **{k: v for k, v in given.items() if v is not None})
    return args, settings


def record(name: str, smoke: bool, *, with_gpu: bool = False) -> dict[str, Any]:
    """The head every result starts with; `with_gpu` adds GPU 0 to the machine."""
    return {
        "benchmark": name,
        "created_unix": time.time(),
        "command": [Path(sys.executable).name, *sys.argv],
        "smoke": smoke,
        "machine": {**machine(), **({"gpu": gpu()} if with_gpu else {})},
    }


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def write(result: Mapping[str, Any], path: Path, quiet: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=_plain) + "\n")
    if not quiet:
        progress(f"wrote {path}")


def malformed(rows: Sequence[Mapping[str, Any]], fields: Sequence[str]) -> list[str]:
    """Why a smoke run's rows are not well-formed: there are none, or a field
    (a dotted path into the row) is not a finite number > 0."""
    if not rows:
        return ["no rows"]
    problems = []
    for index, row in enumerate(rows):
        for path in fields:
            value: Any = row
            for key in path.split("."):
                value = value.get(key) if isinstance(value, Mapping) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                problems.append(f"row {index}: {path} = {value!r}")
    return problems


def smoke_exit(groups: Mapping[str, tuple[Sequence[Mapping[str, Any]], Sequence[str]]]) -> int:
    """A smoke run's exit status: 0 only if every group of rows is well-formed."""
    problems = [f"{name} {problem}" for name, (rows, fields) in groups.items()
                for problem in malformed(rows, fields)]
    for problem in problems:
        progress(f"SMOKE: malformed: {problem}")
    return 1 if problems else 0
