"""Benchmark: the router in front of one agent, beside the same agent called
directly, in one run.

One real `tiered agent --tier edge` and one real `tiered router` (routing
table: the agent alone, pinned by nothing) on loopback; the client is
`tritonclient.grpc.aio` with N concurrent workers sending batch-1 requests
for a fixed time after a warm-up. Two models: `mlp` (tiny: the request is all
protocol) and `sized` (a ReduceMean over a ResNet-18-sized input,
[1, 3, 224, 224] FP32 = 602 KB, so the forwarding of big payloads shows and
the engine does not hide it). A third arm, `bench/passthrough_server.py`,
forwards every request to the agent and does nothing else: the cost of a
bare Python gRPC hop, so that what the router adds beyond it shows. Direct,
pass-through and routed windows alternate, so each is measured beside the
others in time; the client, router and agent share this machine's cores.

Targets (small model): added P50 <= 0.5 ms at c=1; routed throughput >= 80%
of direct at c=16. PASS / FAIL are printed and written; the exit code does
not depend on them.

Run: `.venv/bin/python bench/router.py` (about 3 minutes), `--seconds` per
window, `--rounds` alternations, `--out` for the JSON path.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("tiered") is None:  # run from a checkout without `pip install -e`
    sys.path.insert(0, str(REPO_ROOT))

import onnx  # noqa: E402
import tritonclient.grpc.aio as aioclient  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from tiered.agent.repository import model_file, write_config  # noqa: E402
from tiered.models import zoo  # noqa: E402
from tiered.processes import AgentProcess, RouterProcess, ServerProcess  # noqa: E402

MODELS = {
    "mlp": ("input", (1, 16)),
    "sized": ("input", (1, 3, 224, 224)),
}


def sized_model(path: Path) -> Path:
    """ReduceMean over [batch, 3, 224, 224] -> [batch, 3]: big input, no compute."""
    node = helper.make_node("ReduceMean", ["input"], ["mean"], axes=[2, 3], keepdims=0)
    graph = helper.make_graph(
        [node], "sized",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("mean", TensorProto.FLOAT, ["batch", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def build_repository(root: Path) -> Path:
    zoo.mlp(model_file(root, "mlp", 1), seed=1)
    write_config(root, "mlp", {"max_batch_size": 16})
    sized_model(model_file(root, "sized", 1))
    write_config(root, "sized", {"max_batch_size": 1})
    return root


async def drive(address: str, model: str, concurrency: int, seconds: float,
                warmup_s: float) -> dict[str, Any]:
    name, shape = MODELS[model]
    array = np.random.default_rng(0).random(shape, dtype=np.float32)
    latencies: list[float] = []
    errors = 0
    async with aioclient.InferenceServerClient(address) as client:
        item = aioclient.InferInput(name, list(shape), "FP32")
        item.set_data_from_numpy(array)
        start = time.perf_counter()
        measure_from, end = start + warmup_s, start + warmup_s + seconds

        async def worker() -> None:
            nonlocal errors
            while (now := time.perf_counter()) < end:
                try:
                    await client.infer(model, [item])
                except Exception:  # noqa: BLE001 -- counted, the run goes on
                    errors += 1
                    continue
                if now >= measure_from:
                    latencies.append(time.perf_counter() - now)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    values = np.array(latencies) * 1000
    return {
        "requests": len(latencies), "errors": errors,
        "throughput_rps": len(latencies) / seconds,
        "p50_ms": float(np.percentile(values, 50)) if len(values) else None,
        "p95_ms": float(np.percentile(values, 95)) if len(values) else None,
        "p99_ms": float(np.percentile(values, 99)) if len(values) else None,
    }


def merge(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of the rounds, per figure."""
    keys = ("throughput_rps", "p50_ms", "p95_ms", "p99_ms")
    out = {k: float(np.median([w[k] for w in windows if w[k] is not None])) for k in keys}
    out["requests"] = sum(w["requests"] for w in windows)
    out["errors"] = sum(w["errors"] for w in windows)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per window")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per window")
    parser.add_argument("--rounds", type=int, default=2, help="direct/router alternations")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench/results/router.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tiered-bench-router-") as tmp:
        repository = build_repository(Path(tmp) / "models")
        with AgentProcess("edge", repository) as agent:
            table = Path(tmp) / "routing.json"
            table.write_text(json.dumps({"version": 1, "models": {
                model: {"max_in_flight": 1024, "tiers": {"edge": {"agents": [agent.address]}}}
                for model in MODELS}}))
            passthrough = ServerProcess(
                [sys.executable, str(REPO_ROOT / "bench" / "passthrough_server.py"),
                 "--upstream", agent.address], "passthrough")
            with RouterProcess(table, metrics_port=None) as router, passthrough:
                addresses = {"direct": agent.address, "router": router.address,
                             "passthrough": passthrough.address}
                rows = []
                for model in MODELS:
                    for concurrency in args.concurrency:
                        runs: dict[str, list] = {target: [] for target in addresses}
                        for round_ in range(args.rounds):
                            order = list(addresses) if round_ % 2 == 0 else \
                                list(reversed(addresses))
                            for target in order:
                                runs[target].append(asyncio.run(drive(
                                    addresses[target], model, concurrency, args.seconds,
                                    args.warmup)))
                                print(f"  {model} c={concurrency} {target}: "
                                      f"{runs[target][-1]['throughput_rps']:.0f} req/s",
                                      file=sys.stderr, flush=True)
                        direct, routed = merge(runs["direct"]), merge(runs["router"])
                        hop = merge(runs["passthrough"])
                        rows.append({
                            "model": model, "concurrency": concurrency,
                            "direct": direct, "router": routed, "passthrough": hop,
                            "added_p50_ms": routed["p50_ms"] - direct["p50_ms"],
                            "throughput_ratio": routed["throughput_rps"]
                            / direct["throughput_rps"],
                            # What a bare Python gRPC hop costs, and the router beyond it.
                            "hop_added_p50_ms": hop["p50_ms"] - direct["p50_ms"],
                            "router_beyond_hop_p50_ms": routed["p50_ms"] - hop["p50_ms"],
                            "hop_throughput_ratio": hop["throughput_rps"]
                            / direct["throughput_rps"],
                        })

    def row_of(model: str, concurrency: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["model"] == model and
                     r["concurrency"] == concurrency), None)

    targets = []
    c1, c16 = row_of("mlp", 1), row_of("mlp", 16)
    if c1:
        targets.append({"name": "mlp added P50 at c=1", "value": c1["added_p50_ms"],
                        "target": "<= 0.5 ms", "pass": c1["added_p50_ms"] <= 0.5})
    if c16:
        targets.append({"name": "mlp throughput at c=16 vs direct",
                        "value": c16["throughput_ratio"], "target": ">= 0.80",
                        "pass": c16["throughput_ratio"] >= 0.8})
    result = {
        "benchmark": "router",
        "created_unix": time.time(),
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor(),
                    "python": platform.python_version(),
                    "versions": {p: importlib.metadata.version(p)
                                 for p in ("grpcio", "tritonclient", "onnxruntime")}},
        "config": {"seconds": args.seconds, "warmup_s": args.warmup, "rounds": args.rounds,
                   "note": "client, router and agent share this machine's cores"},
        "rows": rows,
        "targets": targets,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))

    header = f"{'model':6} {'c':>3} | {'direct rps':>10} {'p50':>7} {'p99':>7} | " \
             f"{'router rps':>10} {'p50':>7} {'p99':>7} | {'+p50 ms':>7} {'ratio':>6} | " \
             f"{'hop rps':>8} {'hop p50':>7} {'hop ratio':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        d, t = r["direct"], r["router"]
        print(f"{r['model']:6} {r['concurrency']:>3} | {d['throughput_rps']:>10.0f} "
              f"{d['p50_ms']:>7.2f} {d['p99_ms']:>7.2f} | {t['throughput_rps']:>10.0f} "
              f"{t['p50_ms']:>7.2f} {t['p99_ms']:>7.2f} | {r['added_p50_ms']:>7.2f} "
              f"{r['throughput_ratio']:>6.2f} | {r['passthrough']['throughput_rps']:>8.0f} "
              f"{r['passthrough']['p50_ms']:>7.2f} {r['hop_throughput_ratio']:>9.2f}")
    for t in targets:
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['name']}: {t['value']:.3f} "
              f"(target {t['target']})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
