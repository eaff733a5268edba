"""Benchmark: the router in front of one agent, beside the same agent called
directly, in one run.

One real `tiered agent --tier edge` and one real `tiered router` (routing
table: the agent alone, pinned by nothing) on loopback; the client is
`tritonclient.grpc.aio` with N concurrent workers sending batch-1 requests
for a fixed time after a warm-up (bench/common.py's load generator). Two
models: `mlp` (tiny: the request is all protocol) and `sized` (a ReduceMean
over a ResNet-18-sized input, [1, 3, 224, 224] FP32 = 602 KB, so the
forwarding of big payloads shows and the engine does not hide it). A third
arm, `bench/passthrough_server.py`, forwards every request's bytes to the
agent and does nothing else: the floor of a Python gRPC hop, so that what the
router adds beyond it shows. Direct, pass-through and routed windows
alternate, so each is measured beside the others in time; the client, router
and agent share this machine's cores.

Targets (small model, set for a 16-core host): added P50 <= 0.5 ms at c=1;
routed throughput >= 90% of direct at c=16. PASS / FAIL are printed and
written; the exit code does not depend on them (a `--smoke` run's is 1 when
its rows are not well-formed).

Run: `.venv/bin/python bench/router.py` (about 3 minutes), `--seconds` per
window, `--rounds` alternations, `--out` for the JSON path, `--smoke` for a
few seconds' check that it still runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

import onnx
from onnx import TensorProto, helper

from bench import common
from tiered.agent.repository import model_file, write_config
from tiered.local.processes import RouterProcess
from tiered.models import zoo
from tiered.router.server import event_loop_factory

MODELS = {
    "mlp": ("input", (1, 16)),
    "sized": ("input", (1, 3, 224, 224)),
}
TARGET_ADDED_P50_MS = 0.5  # mlp at c=1
TARGET_THROUGHPUT_RATIO = 0.9  # mlp at c=16, routed over direct


@dataclass(frozen=True)
class Settings:
    seconds: float = 5.0  # measured per window
    warmup_s: float = 1.0  # per window
    rounds: int = 2  # direct/router alternations
    concurrency: tuple[int, ...] = (1, 16)


SMOKE = Settings(seconds=0.5, warmup_s=0.1, rounds=1, concurrency=(1,))


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


def drive(address: str, model: str, concurrency: int, settings: Settings) -> dict[str, Any]:
    name, shape = MODELS[model]
    load = common.Load.random(model, name, shape)
    return common.closed_loop([address], load, concurrency, settings.warmup_s,
                              settings.seconds).summary()


def merge(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of the rounds, per figure."""
    keys = ("throughput", "p50_ms", "p95_ms", "p99_ms")
    out = {k: float(np.median([w[k] for w in windows if w[k] is not None])) for k in keys}
    out["requests"] = sum(w["requests"] for w in windows)
    out["errors"] = sum(w["errors"] for w in windows)
    return out


def measure(addresses: dict[str, str], settings: Settings) -> list[dict[str, Any]]:
    rows = []
    for model in MODELS:
        for concurrency in settings.concurrency:
            runs: dict[str, list] = {target: [] for target in addresses}
            for round_ in range(settings.rounds):
                order = list(addresses) if round_ % 2 == 0 else list(reversed(addresses))
                for target in order:
                    runs[target].append(drive(addresses[target], model, concurrency, settings))
                    common.progress(f"{model} c={concurrency} {target}: "
                                    f"{runs[target][-1]['throughput']:.0f} req/s")
            direct, routed = merge(runs["direct"]), merge(runs["router"])
            hop = merge(runs["passthrough"])
            rows.append({
                "model": model, "concurrency": concurrency,
                "direct": direct, "router": routed, "passthrough": hop,
                "added_p50_ms": routed["p50_ms"] - direct["p50_ms"],
                "throughput_ratio": routed["throughput"] / direct["throughput"],
                # What a bare Python gRPC hop costs, and the router beyond it.
                "hop_added_p50_ms": hop["p50_ms"] - direct["p50_ms"],
                "router_beyond_hop_p50_ms": routed["p50_ms"] - hop["p50_ms"],
                "hop_throughput_ratio": hop["throughput"] / direct["throughput"],
            })
    return rows


def targets(rows: Sequence[dict[str, Any]]) -> list[common.Target]:
    def row_of(model: str, concurrency: int) -> dict[str, Any]:
        return next((r for r in rows if r["model"] == model and
                     r["concurrency"] == concurrency), {})

    return [
        common.judge("mlp added P50 at c=1", "routed P50 - direct P50 (ms)",
                     row_of("mlp", 1).get("added_p50_ms"), "<=", TARGET_ADDED_P50_MS),
        common.judge("mlp throughput at c=16 vs direct", "routed req/s / direct req/s",
                     row_of("mlp", 16).get("throughput_ratio"), ">=", TARGET_THROUGHPUT_RATIO),
    ]


def report(result: dict[str, Any]) -> str:
    rows = common.table(
        ["model", "c", "direct req/s", "p50", "p99", "router req/s", "p50", "p99", "+p50 ms",
         "ratio", "hop req/s", "hop p50", "hop ratio"],
        [[r["model"], r["concurrency"], r["direct"]["throughput"], r["direct"]["p50_ms"],
          r["direct"]["p99_ms"], r["router"]["throughput"], r["router"]["p50_ms"],
          r["router"]["p99_ms"], r["added_p50_ms"], r["throughput_ratio"],
          r["passthrough"]["throughput"], r["passthrough"]["p50_ms"],
          r["hop_throughput_ratio"]] for r in result["rows"]],
    )
    return f"{rows}\n\nTargets\n{common.targets_table(result['targets'])}"


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Settings]:
    return common.parse_windows(argv, "router", __doc__.split("\n\n")[0], Settings(), SMOKE,
                                "direct/router alternations")


def main(argv: Sequence[str] | None = None) -> int:
    args, settings = parse_args(argv)
    result = common.record("router", args.smoke)
    with tempfile.TemporaryDirectory(prefix="tiered-bench-router-") as tmp:
        repository = build_repository(Path(tmp) / "models")
        with common.agent("edge", repository) as agent:
            table = Path(tmp) / "routing.json"
            table.write_text(json.dumps({"version": 1, "models": {
                model: {"max_in_flight": 1024, "tiers": {"edge": {"agents": [agent.address]}}}
                for model in MODELS}}))
            router = RouterProcess(table, metrics_port=None)
            passthrough = common.passthrough_server(agent.address)
            with common.serving([router, passthrough]):
                rows = measure({"direct": agent.address, "router": router.address,
                                "passthrough": passthrough.address}, settings)

    result.update({
        "config": {**asdict(settings),
                   # the router's and the pass-through's (uvloop where installed)
                   "event_loop": "uvloop" if event_loop_factory() else "asyncio",
                   "note": "client, router and agent share this machine's cores"},
        "rows": rows,
        "targets": targets(rows),
    })
    print(report(result))
    common.write(result, args.out)
    if args.smoke:
        fields = [f"{arm}.{figure}" for arm in ("direct", "router", "passthrough")
                  for figure in ("throughput", "p50_ms", "p99_ms")]
        return common.smoke_exit({"rows": (rows, fields)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
