"""Benchmark: one edge agent served over gRPC, beside in-process ONNX Runtime
and beside a gRPC server that does no work, all in one run.

- the agent: a real `tiered agent --tier edge` process on loopback, driven by
  `tritonclient.grpc.aio` with N concurrent asyncio workers sending batch-1
  requests for a fixed time after a warm-up (bench/common.py's load
  generator); throughput, latency percentiles, the batch the dynamic batcher
  actually formed (from the agent's own statistics), errors. Two models, each
  served three times from the same ONNX file: `<m>` with dynamic batching,
  `<m>_waits` with Triton's rule for it (a batch waits the queue delay even
  while the engine is idle: `wait_when_idle`, the agent's rule before an idle
  engine ran at once) and `<m>_nobatch` without.
- the transport floor (`bench/floor_server.py`): the same requests to a server
  on the same grpcio stack that answers at once, so what gRPC in Python costs
  here is visible apart from what the agent adds.
- the in-process baseline: the same ONNX file in this process with the same
  session settings, at batch 1 and at the batch size the agent formed.

The floor and the baseline are measured right after each agent point, while
the agent is idle: this machine's speed drifts by tens of percent within a
minute, so only neighbours in time are compared.

It prints tables and writes everything to JSON (default
bench/results/agent.json). Targets are reported as PASS / FAIL / N/A (missing
data is never a pass); the exit code does not depend on them (it is 1 only when
the agent could not be measured at all, or a `--smoke` run's rows are not
well-formed). The client shares the machine with the agent: on a 2-core box its
cost is part of every agent and floor number, and the baseline pays no such
cost. Each window records who used the CPU (client, server, anything else) so a
disturbed run says so.

Run: `.venv/bin/python bench/agent.py` (about 10 minutes on 2 cores),
`--quick` (about 2 minutes) or `--smoke --out PATH` (seconds: does it still
run?). `--help` lists the knobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

import onnxruntime as ort
import tritonclient.grpc as grpcclient
import yaml

from bench import common
from tiered.engines.onnxruntime_engine import OrtSettings
from tiered.local.processes import AgentError, ServerProcess
from tiered.models import zoo
from tiered.tables import cell

# --------------------------------------------------------------------------- settings

# ONNX Runtime settings the agent is told to use (config.yaml `engine:`) and the
# in-process baseline uses too, so the two run the same session.
ENGINE_SETTINGS: dict[str, Any] = {"intra_op_threads": 2, "inter_op_threads": 1}


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked model: how to build it and how the agent serves it.

    The repository gets it three times from one ONNX file (VARIANTS).
    """

    name: str
    build: Callable[[Path], Path]
    input_name: str
    input_shape: tuple[int, ...]  # without the batch dim
    output_name: str
    output_shape: tuple[int, ...]  # without the batch dim
    max_batch_size: int
    max_queue_delay_us: int
    preferred_batch_sizes: tuple[int, ...]
    max_queue_size: int = 512
    # Baseline batch sizes always measured, whatever the batcher forms.
    baseline_batches: tuple[int, ...] = (1,)

    def config(self, *, batching: bool, wait_when_idle: bool = False) -> dict[str, Any]:
        config: dict[str, Any] = {
            "max_batch_size": self.max_batch_size,
            "inputs": [
                {"name": self.input_name, "datatype": "FP32", "dims": list(self.input_shape)}
            ],
            "outputs": [
                {"name": self.output_name, "datatype": "FP32", "dims": list(self.output_shape)}
            ],
        }
        if batching:
            config["dynamic_batching"] = {
                "max_queue_delay_us": self.max_queue_delay_us,
                "preferred_batch_sizes": list(self.preferred_batch_sizes),
                "max_queue_size": self.max_queue_size,
                "wait_when_idle": wait_when_idle,
            }
        config["instance_count"] = 1
        config["engine"] = dict(ENGINE_SETTINGS)
        return config

    def describe(self) -> dict[str, Any]:
        return {
            "input": {"name": self.input_name, "shape": ["N", *self.input_shape]},
            "output": {"name": self.output_name, "shape": ["N", *self.output_shape]},
            **{f"config{suffix or '_batched'}": self.config(batching=batching, wait_when_idle=waits)
               for suffix, batching, waits in VARIANTS},
            "baseline_batches": list(self.baseline_batches),
        }


# How each model is served: (name suffix, dynamic batching, wait_when_idle).
# `_waits` is measured beside the default, not against the floor or in-process.
VARIANTS = (("", True, False), ("_waits", True, True), ("_nobatch", False, False))
WAITS = "_waits"

MODELS: tuple[ModelSpec, ...] = (
    ModelSpec(
        name="resnet18",
        build=lambda path: zoo.resnet18(path, image_size=224),
        input_name="input",
        input_shape=(3, 224, 224),
        output_name="logits",
        output_shape=(1000,),
        max_batch_size=16,
        # ~27 ms per image at any batch size on 2 cores; waiting 0.2 ms for
        # company is noise under load and fits the 1 ms budget at concurrency 1.
        max_queue_delay_us=200,
        preferred_batch_sizes=(16,),
        baseline_batches=(1, 16),
    ),
    ModelSpec(
        name="mlp",
        build=zoo.mlp,
        input_name="input",
        input_shape=(16,),
        output_name="probabilities",
        output_shape=(4,),
        max_batch_size=64,
        # Compute is microseconds; the queue delay is what lets a batch form
        # between the client's requests.
        max_queue_delay_us=500,
        preferred_batch_sizes=(64,),
        baseline_batches=(1,),
    ),
)


@dataclass(frozen=True)
class RunSettings:
    """Durations and load levels, built from the command line in `main()`."""

    concurrency: tuple[int, ...]
    duration_s: float  # measured window per agent point
    warmup_s: float  # load before the window, per point
    baseline_duration_s: float  # per baseline batch size
    baseline_min_calls: int
    request_timeout_s: float = 60.0
    startup_timeout_s: float = 180.0
    input_pool: int = 8  # distinct pre-built inputs per model, cycled by workers


FULL = RunSettings(
    concurrency=(1, 4, 16, 64),
    duration_s=15.0,
    warmup_s=3.0,
    baseline_duration_s=6.0,
    baseline_min_calls=8,
)
QUICK = RunSettings(
    concurrency=(1, 16),
    duration_s=4.0,
    warmup_s=1.5,
    baseline_duration_s=2.0,
    baseline_min_calls=4,
)
SMOKE = RunSettings(
    concurrency=(1,),
    duration_s=0.6,
    warmup_s=0.1,
    baseline_duration_s=0.3,
    baseline_min_calls=2,
)

# Targets (not asserts): evaluated on the numbers, printed, written to JSON.
TARGET_THROUGHPUT_VS_ORT = 0.90  # (a) resnet18 @c16 vs in-process batch 16
TARGET_P50_OVERHEAD_MS = 1.0  # (b) resnet18 @c1 P50 minus in-process batch-1 P50
TARGET_BATCHING_SPEEDUP = 2.0  # (c) mlp @c16 batched vs unbatched
TARGET_VS_WAITING = 0.95  # (d) every point: req/s with an idle engine running at once / waiting


# --------------------------------------------------------------------------- pure helpers


def matching_batch(formed: float | None) -> int:
    """The in-process batch size an agent row is compared with."""
    if formed is None or not math.isfinite(formed):
        return 1
    return max(1, int(round(formed)))


def paired_batches(spec: ModelSpec, row: Mapping[str, Any]) -> list[int]:
    """In-process batch sizes measured right after an agent point: the batch the
    agent formed, plus batch 1 at concurrency 1 or the spec's largest otherwise."""
    extra = 1 if row["concurrency"] == 1 else max(spec.baseline_batches)
    return sorted({matching_batch(row.get("formed_batch")), extra})


def _pair_key(row: Mapping[str, Any]) -> tuple[str, int]:
    return (row["pair"][0], row["pair"][1])


def compute_ratios(
    agent_rows: Sequence[Mapping[str, Any]],
    baseline_rows: Sequence[Mapping[str, Any]],
    floor_rows: Sequence[Mapping[str, Any]] = (),
) -> dict[str, list[dict[str, Any]]]:
    """The comparisons the report is about, as plain rows."""
    # Each agent point has its own in-process measurements, taken right after it:
    # this machine's speed drifts by tens of percent within a minute.
    baseline = {(*_pair_key(r), r["batch"]): r for r in baseline_rows}
    agent = {(r["model_name"], r["concurrency"]): r for r in agent_rows}
    floor = {_pair_key(r): r for r in floor_rows}

    vs_inprocess = []
    for row in agent_rows:
        batch = matching_batch(row.get("formed_batch"))
        base = baseline.get((row["model_name"], row["concurrency"], batch), {})
        vs_inprocess.append({
            "model_name": row["model_name"],
            "concurrency": row["concurrency"],
            "inprocess_batch": batch,
            "agent_throughput": row.get("throughput"),
            "inprocess_throughput": base.get("throughput"),
            "ratio": common.ratio(row.get("throughput"), base.get("throughput")),
        })

    p50_overhead = []
    for row in agent_rows:
        if row["concurrency"] != 1:
            continue
        base = baseline.get((row["model_name"], 1, 1), {})
        overhead = common.difference(row.get("p50_ms"), base.get("p50_ms"))
        transport = floor.get((row["model_name"], 1), {}).get("p50_ms")
        p50_overhead.append({
            "model_name": row["model_name"],
            "agent_p50_ms": row.get("p50_ms"),
            "inprocess_p50_ms": base.get("p50_ms"),
            "overhead_ms": overhead,
            "floor_p50_ms": transport,
            # What the agent adds beyond gRPC itself (the floor includes the client).
            "overhead_beyond_floor_ms": common.difference(overhead, transport),
        })

    batching_speedup, vs_waiting = [], []
    for row in agent_rows:
        if not row["batching"] or row["model_name"].endswith(WAITS):
            continue
        waits = agent.get((row["model_name"] + WAITS, row["concurrency"]), {})
        vs_waiting.append({
            "model": row["model"],
            "concurrency": row["concurrency"],
            "throughput": row.get("throughput"),
            "waiting_throughput": waits.get("throughput"),
            "ratio": common.ratio(row.get("throughput"), waits.get("throughput")),
            "p50_ms": row.get("p50_ms"),
            "waiting_p50_ms": waits.get("p50_ms"),
            "formed_batch": row.get("formed_batch"),
            "waiting_formed_batch": waits.get("formed_batch"),
        })
        unbatched = agent.get((f"{row['model']}_nobatch", row["concurrency"]), {})
        transport = floor.get((row["model_name"], row["concurrency"]), {}).get("throughput")
        batching_speedup.append({
            "model": row["model"],
            "concurrency": row["concurrency"],
            "batched_throughput": row.get("throughput"),
            "unbatched_throughput": unbatched.get("throughput"),
            "ratio": common.ratio(row.get("throughput"), unbatched.get("throughput")),
            "floor_throughput": transport,
            # No batcher can beat a server that does no work: the best ratio possible.
            "ceiling_ratio": common.ratio(transport, unbatched.get("throughput")),
        })
    return {
        "agent_vs_inprocess_throughput": vs_inprocess,
        "p50_overhead_at_c1": p50_overhead,
        "batched_vs_unbatched_throughput": batching_speedup,
        "runs_at_once_vs_waits": vs_waiting,
    }


FLOOR_CONCURRENCY = (1, 16)  # levels at which the transport floor is measured


def over_floor(
    agent_rows: Sequence[Mapping[str, Any]], floor_rows: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """What the agent adds above bare gRPC: P50 difference and throughput ratio."""
    floor = {_pair_key(r): r for r in floor_rows}
    rows = []
    for row in agent_rows:
        base = floor.get((row["model_name"], row["concurrency"]))
        if base is None:
            continue
        rows.append({
            "model_name": row["model_name"],
            "concurrency": row["concurrency"],
            "agent_p50_ms": row.get("p50_ms"),
            "floor_p50_ms": base.get("p50_ms"),
            "p50_above_floor_ms": common.difference(row.get("p50_ms"), base.get("p50_ms")),
            "agent_throughput": row.get("throughput"),
            "floor_throughput": base.get("throughput"),
            "throughput_vs_floor": common.ratio(row.get("throughput"), base.get("throughput")),
        })
    return rows


def evaluate_targets(
    agent_rows: Sequence[Mapping[str, Any]], baseline_rows: Sequence[Mapping[str, Any]],
    vs_waiting: Sequence[Mapping[str, Any]] = (),
) -> list[common.Target]:
    agent = {(r["model_name"], r["concurrency"]): r for r in agent_rows}
    baseline = {(*_pair_key(r), r["batch"]): r for r in baseline_rows}
    r18_c16 = agent.get(("resnet18", 16), {})
    r18_c1 = agent.get(("resnet18", 1), {})
    mlp_c16 = agent.get(("mlp", 16), {})
    mlp_nobatch_c16 = agent.get(("mlp_nobatch", 16), {})
    return [
        common.judge(
            "a",
            "resnet18 agent throughput @c16 / in-process ORT @batch16",
            common.ratio(r18_c16.get("throughput"),
                  baseline.get(("resnet18", 16, 16), {}).get("throughput")),
            ">=",
            TARGET_THROUGHPUT_VS_ORT,
        ),
        common.judge(
            "b",
            "resnet18 agent P50 @c1 - in-process P50 @batch1 (ms)",
            common.difference(r18_c1.get("p50_ms"),
                              baseline.get(("resnet18", 1, 1), {}).get("p50_ms")),
            "<=",
            TARGET_P50_OVERHEAD_MS,
        ),
        common.judge(
            "c",
            "mlp agent throughput @c16: batched / unbatched",
            common.ratio(mlp_c16.get("throughput"), mlp_nobatch_c16.get("throughput")),
            ">=",
            TARGET_BATCHING_SPEEDUP,
        ),
        common.judge(
            "d",
            "the lowest, over models and c: batched req/s, idle engine at once / waiting",
            worst_ratio(vs_waiting),
            ">=",
            TARGET_VS_WAITING,
        ),
    ]


def worst_ratio(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The lowest ratio; None when there is none, or any row lacks one."""
    ratios = [row.get("ratio") for row in rows]
    return None if not ratios or None in ratios else min(ratios)


def cpu_shares(
    wall_s: float, own_s: float, agent_s: float | None, system_busy_s: float | None
) -> dict[str, float | None]:
    """CPU used during a window, in cores (1.0 = one core busy throughout).

    `other` is busy time neither this process nor the agent accounts for:
    other processes, kernel threads, hypervisor steal. On a shared machine it
    is what makes a window's numbers suspect.
    """
    def cores(seconds: float | None) -> float | None:
        return None if seconds is None or wall_s <= 0 else seconds / wall_s

    other = None
    if system_busy_s is not None:
        other = max(0.0, system_busy_s - own_s - (agent_s or 0.0))
    return {"client": cores(own_s), "agent": cores(agent_s), "other": cores(other)}


NOISY_OTHER_CORES = 0.2  # others' CPU use (cores) above which a window is flagged


def noisy_windows(
    agent_rows: Iterable[Mapping[str, Any]], baseline_rows: Iterable[Mapping[str, Any]]
) -> list[str]:
    flagged = []
    for row in agent_rows:
        if (row["cpu_cores"].get("other") or 0.0) > NOISY_OTHER_CORES:
            flagged.append(f"agent {row['model_name']} c={row['concurrency']}")
    for row in baseline_rows:
        if (row["cpu_cores"].get("other") or 0.0) > NOISY_OTHER_CORES:
            flagged.append(f"in-process {row['model']} batch {row['batch']}")
    return flagged


def render_report(result: Mapping[str, Any]) -> str:
    baseline = common.table(
        ["model", "batch", "after", "calls", "img/s", "p50 ms/call", "p95 ms/call", "ms/img",
         "other cpu"],
        [
            [r["model"], r["batch"], f"{r['pair'][0]}@c{r['pair'][1]}", r["calls"],
             r["throughput"], r["p50_ms"], r["p95_ms"], common.ratio(r["p50_ms"], r["batch"]),
             r["cpu_cores"]["other"]]
            for r in result["baseline"]
        ],
    )
    vs = {(r["model_name"], r["concurrency"]): r
          for r in result["ratios"]["agent_vs_inprocess_throughput"]}
    agent = common.table(
        ["model", "c", "requests", "req/s", "p50 ms", "p95 ms", "p99 ms", "batch", "errors",
         "queue ms", "compute ms", "cpu cli/agt/oth", "vs ORT", "@batch"],
        [
            [r["model_name"], r["concurrency"], r["requests"], r["throughput"], r["p50_ms"],
             r["p95_ms"], r["p99_ms"], r["formed_batch"], r["errors"],
             r["agent_queue_ms_per_request"], r["agent_compute_ms_per_request"],
             "/".join(cell(r["cpu_cores"].get(k), 2) for k in ("client", "agent", "other")),
             vs.get((r["model_name"], r["concurrency"]), {}).get("ratio"),
             vs.get((r["model_name"], r["concurrency"]), {}).get("inprocess_batch")]
            for r in result["agent"]
        ],
    )
    at_once = common.table(
        ["model", "c", "req/s", "waiting req/s", "x", "p50 ms", "waiting p50 ms", "batch",
         "waiting batch"],
        [
            [r["model"], r["concurrency"], r["throughput"], r["waiting_throughput"], r["ratio"],
             r["p50_ms"], r["waiting_p50_ms"], r["formed_batch"], r["waiting_formed_batch"]]
            for r in result["ratios"]["runs_at_once_vs_waits"]
        ],
    )
    speedup = common.table(
        ["model", "c", "batched req/s", "unbatched req/s", "batched/unbatched",
         "floor req/s", "ceiling: floor/unbatched"],
        [
            [r["model"], r["concurrency"], r["batched_throughput"], r["unbatched_throughput"],
             r["ratio"], r["floor_throughput"], r["ceiling_ratio"]]
            for r in result["ratios"]["batched_vs_unbatched_throughput"]
        ],
    )
    overhead = common.table(
        ["model", "agent p50 ms @c1", "in-process p50 ms @b1", "overhead ms", "floor p50 ms",
         "overhead beyond floor ms"],
        [
            [r["model_name"], r["agent_p50_ms"], r["inprocess_p50_ms"], r["overhead_ms"],
             r["floor_p50_ms"], r["overhead_beyond_floor_ms"]]
            for r in result["ratios"]["p50_overhead_at_c1"]
        ],
    )
    floor = common.table(
        ["model", "c", "agent p50 ms", "floor p50 ms", "above floor ms", "agent req/s",
         "floor req/s", "agent/floor"],
        [
            [r["model_name"], r["concurrency"], r["agent_p50_ms"], r["floor_p50_ms"],
             r["p50_above_floor_ms"], r["agent_throughput"], r["floor_throughput"],
             r["throughput_vs_floor"]]
            for r in result["ratios"]["agent_over_floor"]
        ],
    )
    targets = common.targets_table(result["targets"])
    noisy = result.get("noisy_windows") or []
    noise = (
        f"\n\nNOISY: in {len(noisy)} window(s) other work on the machine used more than "
        f"{NOISY_OTHER_CORES} cores (see noisy_windows in the JSON); treat those numbers "
        "with suspicion or rerun on a quiet machine." if noisy else ""
    )
    return "\n\n".join([
        "In-process ONNX Runtime (baseline)\n" + baseline,
        "Agent over gRPC (batch-1 requests from c concurrent workers; batch = mean formed batch;\n"
        "queue/compute ms = agent-reported means per request; cpu = cores used by the load\n"
        "generator / the agent / anything else; vs ORT = req/s over in-process img/s at @batch)\n"
        + agent,
        "Dynamic batching vs none\n" + speedup,
        "An idle engine runs what is queued at once (the default) vs waits the queue delay\n"
        "for company (`<m>_waits`: wait_when_idle, Triton's rule)\n" + at_once,
        "Latency overhead at concurrency 1\n" + overhead,
        "Agent vs the transport floor (a gRPC server that does no work, same requests)\n"
        + floor,
        "Targets\n" + targets,
    ]) + noise



# --------------------------------------------------------------------------- I/O: CPU accounting


def noise_note(cpu: Mapping[str, float | None]) -> str:
    other = cpu.get("other")
    if other is None or other <= NOISY_OTHER_CORES:
        return ""
    return f"  [NOISY: other work used {other:.2f} cores]"


@dataclass(frozen=True)
class CpuSnapshot:
    """Wall clock and CPU seconds so far: this process, the agent, all cores."""

    wall: float
    own: float
    agent: float | None
    system: float | None

    @classmethod
    def take(cls, agent_pid: int | None = None) -> CpuSnapshot:
        return cls(time.perf_counter(), time.process_time(), common.process_cpu_s(agent_pid),
                   common.system_busy_s())

    def shares_until(self, later: CpuSnapshot) -> dict[str, float | None]:
        """Who used the cores between this snapshot and `later`."""
        def delta(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else b - a

        return cpu_shares(later.wall - self.wall, later.own - self.own,
                          delta(self.agent, later.agent), delta(self.system, later.system))


# --------------------------------------------------------------------------- I/O: repository


def build_repository(root: Path, specs: Sequence[ModelSpec]) -> dict[str, Path]:
    """Write each spec's VARIANTS, one ONNX file; return each model's ONNX path."""
    onnx_paths = {}
    for spec in specs:
        onnx_path = spec.build(root / spec.name / "1" / "model.onnx")
        onnx_paths[spec.name] = onnx_path
        for suffix, batching, waits in VARIANTS:
            if suffix:
                served = root / f"{spec.name}{suffix}" / "1" / "model.onnx"
                served.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(onnx_path, served)
                except OSError:
                    shutil.copyfile(onnx_path, served)
            (root / f"{spec.name}{suffix}" / "config.yaml").write_text(yaml.safe_dump(
                spec.config(batching=batching, wait_when_idle=waits), sort_keys=False))
    return onnx_paths


# --------------------------------------------------------------------------- I/O: baseline


def inprocess_session(onnx_path: Path) -> ort.InferenceSession:
    """The session the agent's config asks for (ENGINE_SETTINGS over the
    engine's defaults, idle threads not spinning included)."""
    options = OrtSettings(**ENGINE_SETTINGS).session_options()
    return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])


def run_baseline(
    spec: ModelSpec, session: ort.InferenceSession, batch: int, settings: RunSettings
) -> dict[str, Any]:
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, *spec.input_shape), dtype=np.float32)
    feeds = {spec.input_name: x}
    for _ in range(3):
        session.run([spec.output_name], feeds)
    latencies: list[float] = []
    cpu = CpuSnapshot.take()
    started = time.perf_counter()
    deadline = started + settings.baseline_duration_s
    while time.perf_counter() < deadline or len(latencies) < settings.baseline_min_calls:
        t0 = time.perf_counter()
        (out,) = session.run([spec.output_name], feeds)
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - started
    shares = cpu.shares_until(CpuSnapshot.take())
    if out.shape != (batch, *spec.output_shape):
        raise RuntimeError(f"{spec.name}: in-process output shape {out.shape}")
    return {
        "model": spec.name,
        "batch": batch,
        "calls": len(latencies),
        "duration_s": elapsed,
        "throughput": batch * len(latencies) / elapsed,  # images (batch elements) per second
        **common.percentiles_ms(latencies),
        "cpu_cores": shares,
    }


# --------------------------------------------------------------------------- I/O: agent points


def model_load(spec: ModelSpec, settings: RunSettings) -> common.Load:
    """Batch-1 requests for `spec`, every answer's output shape checked."""
    return common.Load.random(
        spec.name, spec.input_name, (1, *spec.input_shape), pool=settings.input_pool, seed=1234,
        outputs={spec.output_name: (1, *spec.output_shape)}, timeout_s=settings.request_timeout_s)


def run_agent_point(server: ServerProcess, spec: ModelSpec, model_name: str, concurrency: int,
                    load: common.Load, settings: RunSettings) -> dict[str, Any]:
    """One load level against `server`; its statistics and the CPU read at the window's edges."""
    with grpcclient.InferenceServerClient(server.address) as stats:
        def probe() -> tuple[dict[str, int], CpuSnapshot]:
            totals = common.stats_totals(
                stats.get_inference_statistics(model_name, as_json=True), model_name)
            return totals, CpuSnapshot.take(server.pid)

        window = common.closed_loop([server.address], dataclasses.replace(load, model=model_name),
                                    concurrency, settings.warmup_s, settings.duration_s,
                                    probe=probe)
    (before, cpu_before), (after, cpu_after) = window.before, window.after
    delta = common.stats_delta(before, after)
    return {
        "model": spec.name,
        "model_name": model_name,
        "batching": not model_name.endswith(("_nobatch", "_floor")),
        "concurrency": concurrency,
        **window.summary(),  # throughput: successful batch-1 requests per second
        "formed_batch": common.formed_batch(delta),
        # The load generator shares the cores with the agent; "other" is anyone else.
        "cpu_cores": cpu_before.shares_until(cpu_after),
        "agent_stats_delta": delta,
        "agent_queue_ms_per_request": common.ratio(delta.get("queue_ns", 0) / 1e6,
                                                   delta.get("success_count") or None),
        "agent_compute_ms_per_request": common.ratio(delta.get("compute_infer_ns", 0) / 1e6,
                                                     delta.get("success_count") or None),
    }


def check_alive(server: ServerProcess) -> None:
    if not server.alive():
        raise AgentError(f"{server.name} exited:\n{server.log_tail()}")


def run_sweep(
    agent: ServerProcess,
    floor: ServerProcess,
    specs: Sequence[ModelSpec],
    onnx_paths: Mapping[str, Path],
    settings: RunSettings,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Each agent point, then right after it the transport floor at the same load
    and the in-process engine at the batch sizes it is compared with (a batched
    point first has its `_waits` twin).

    Interleaved because this machine's speed drifts by tens of percent within a
    minute: a comparison is only fair between neighbours in time.
    """
    agent_rows, floor_rows, baseline_rows = [], [], []

    def point(spec: ModelSpec, model_name: str, concurrency: int, load: common.Load) -> dict:
        check_alive(agent)
        row = run_agent_point(agent, spec, model_name, concurrency, load, settings)
        agent_rows.append(row)
        common.progress(
            f"agent {model_name} c={concurrency}: {row['throughput']:.1f} req/s, "
            f"p50 {cell(row['p50_ms'], 3)} ms, p99 {cell(row['p99_ms'], 3)} ms, "
            f"batch {cell(row['formed_batch'])}, errors {row['errors']}"
            f"{noise_note(row['cpu_cores'])}"
        )
        return row

    for spec in specs:
        session = inprocess_session(onnx_paths[spec.name])
        load = model_load(spec, settings)
        for model_name in (spec.name, f"{spec.name}_nobatch"):
            for concurrency in settings.concurrency:
                row = point(spec, model_name, concurrency, load)
                if model_name == spec.name:  # its neighbour in time: the same, waiting
                    point(spec, spec.name + WAITS, concurrency, load)
                pair = [model_name, concurrency]
                if concurrency in FLOOR_CONCURRENCY:
                    check_alive(floor)
                    base = run_agent_point(floor, spec, f"{spec.name}_floor", concurrency, load,
                                           settings)
                    floor_rows.append({**base, "pair": pair})
                    common.progress(f"  floor c={concurrency}: {base['throughput']:.1f} req/s, "
                                    f"p50 {cell(base['p50_ms'], 3)} ms")
                for batch in paired_batches(spec, row):
                    base = run_baseline(spec, session, batch, settings)
                    baseline_rows.append({**base, "pair": pair})
                    common.progress(
                        f"  in-process batch {batch}: {base['throughput']:.1f} img/s, "
                        f"p50 {base['p50_ms']:.3f} ms/call{noise_note(base['cpu_cores'])}")
    return agent_rows, floor_rows, baseline_rows


# --------------------------------------------------------------------------- the run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/agent.py",
        description=(
            "Benchmark a tiered edge agent (gRPC, Open Inference Protocol) against in-process "
            "ONNX Runtime on the same models: resnet18 (224x224) and a tiny mlp, each served "
            "with and without dynamic batching, driven by concurrent batch-1 clients. Prints "
            "tables and PASS/FAIL targets; writes JSON. Default run: about 10 minutes on 2 cores."
        ),
    )
    parser.add_argument("--quick", action="store_true",
                        help="short run (about 2 minutes): concurrency 1 and 16, short windows")
    parser.add_argument("--duration", type=float, metavar="S",
                        help="measured seconds per agent point (default 15, quick 4)")
    parser.add_argument("--warmup", type=float, metavar="S",
                        help="load seconds before each measured window (default 3, quick 1.5)")
    parser.add_argument("--concurrency", metavar="LIST",
                        help="comma-separated worker counts (default 1,4,16,64; quick 1,16)")
    common.add_arguments(parser, "agent")
    return common.parse(parser, argv, "agent")


def settings_from(args: argparse.Namespace) -> RunSettings:
    settings = SMOKE if args.smoke else QUICK if args.quick else FULL
    overrides: dict[str, Any] = {}
    if args.duration is not None:
        if args.duration <= 0:
            raise SystemExit("--duration must be > 0")
        overrides["duration_s"] = args.duration
        overrides["baseline_duration_s"] = min(settings.baseline_duration_s, args.duration)
    if args.warmup is not None:
        overrides["warmup_s"] = max(0.0, args.warmup)
    if args.concurrency:
        try:
            levels = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
        except ValueError:
            raise SystemExit(
                f"--concurrency: not a list of integers: {args.concurrency!r}"
            ) from None
        if not levels or min(levels) < 1:
            raise SystemExit("--concurrency: every level must be >= 1")
        overrides["concurrency"] = levels
    return RunSettings(**{**asdict(settings), **overrides}) if overrides else settings


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = settings_from(args)
    result = common.record("agent", args.smoke)  # before any load of ours
    specs = MODELS
    agent_rows: list[dict[str, Any]] = []
    floor_rows: list[dict[str, Any]] = []
    baseline_rows: list[dict[str, Any]] = []
    agent_error: str | None = None
    agent_info: dict[str, Any] = {}

    with tempfile.TemporaryDirectory(prefix="tiered-bench-") as tmp:
        repository = Path(tmp) / "models"
        common.progress(f"building models into {repository}")
        onnx_paths = build_repository(repository, specs)

        agent = common.agent("edge", repository)
        floor = common.floor_server({spec.output_name: spec.output_shape[0] for spec in specs})
        common.progress(f"starting agent: {' '.join(agent.command)}")
        try:
            started = time.monotonic()
            with common.serving([agent, floor], settings.startup_timeout_s):
                agent_info["ready_after_s"] = time.monotonic() - started
                common.progress(f"agent ready after {agent_info['ready_after_s']:.1f} s on "
                                f"{agent.address}; floor server on {floor.address}")
                agent_rows, floor_rows, baseline_rows = run_sweep(
                    agent, floor, specs, onnx_paths, settings)
                agent_info["exit_code"] = agent.stop()
                agent_info["log_tail"] = agent.log_tail(20)
        except AgentError as exc:
            agent_error = str(exc)
            common.progress(f"FAILED: {agent_error}")
        agent_info["command"] = agent.command

    ratios = compute_ratios(agent_rows, baseline_rows, floor_rows)
    ratios["agent_over_floor"] = over_floor(agent_rows, floor_rows)
    result.update({
        "config": {
            "quick": args.quick,
            "settings": asdict(settings),
            "engine_settings": ENGINE_SETTINGS,
            "inprocess_session": {
                "intra_op_threads": ENGINE_SETTINGS["intra_op_threads"],
                "inter_op_threads": ENGINE_SETTINGS["inter_op_threads"],
                "graph_optimization_level": "ORT_ENABLE_ALL",
                "execution_mode": "ORT_SEQUENTIAL",
                "providers": ["CPUExecutionProvider"],
            },
            "models": {spec.name: spec.describe() for spec in specs},
            "tier": "edge",
            "request_batch": 1,
        },
        "agent_process": agent_info,
        "agent_error": agent_error,
        "baseline": baseline_rows,
        "agent": agent_rows,
        "floor": floor_rows,
        "ratios": ratios,
        "targets": evaluate_targets(agent_rows, baseline_rows,
                                    ratios["runs_at_once_vs_waits"]),
        "noisy_windows": noisy_windows(agent_rows, baseline_rows),
    })
    print(render_report(result))
    common.write(result, args.out)
    if agent_error:
        return 1
    if args.smoke:
        measured = ("throughput", "p50_ms", "p99_ms")
        return common.smoke_exit({"agent": (agent_rows, measured),
                                  "floor": (floor_rows, measured),
                                  "baseline": (baseline_rows, measured)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
