"""Benchmark: what the agent's telemetry costs, on vs off, in one run.

Two edge agents serve the same models, one with telemetry (latency windows,
reservoirs, energy attribution, the Stats RPC and /metrics being scraped each
second) and one started with `--no-telemetry`. Batch-1 requests at
concurrency 16 go to each in turn, alternating several rounds so that the
machine's drift falls on both alike. Writes bench/results/telemetry.json and
prints a table. Target: telemetry costs <= 3% of throughput.

Run: `.venv/bin/python bench/telemetry.py [--rounds N] [--duration S]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiered.agent.repository import model_file, write_config
from tiered.models import zoo
from tiered.processes import AgentProcess

TARGET_COST = 0.03
MODELS = {"mlp": ("input", (16,)), "resnet18": ("input", (3, 64, 64))}


def build(root: Path) -> None:
    zoo.mlp(model_file(root, "mlp", 1))
    write_config(root, "mlp", {"max_batch_size": 64, "dynamic_batching": {}})
    zoo.resnet18(model_file(root, "resnet18", 1), image_size=64, num_classes=10)
    write_config(root, "resnet18", {"max_batch_size": 16, "dynamic_batching": {}})


async def load(address: str, model: str, concurrency: int, duration_s: float) -> dict:
    name, shape = MODELS[model]
    data = np.random.default_rng(0).standard_normal((1, *shape)).astype(np.float32)
    latencies: list[float] = []
    async with aioclient.InferenceServerClient(address) as client:
        async def worker(stop: float) -> None:
            while time.perf_counter() < stop:
                item = grpcclient.InferInput(name, [1, *shape], "FP32")
                item.set_data_from_numpy(data)
                t0 = time.perf_counter()
                await client.infer(model, [item])
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker(time.perf_counter() + 1.0) for _ in range(concurrency)))
        latencies.clear()  # the first second warms up
        started = time.perf_counter()
        await asyncio.gather(*(worker(started + duration_s) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {"throughput": len(latencies) / elapsed,
            "p50_ms": float(np.percentile(latencies, 50) * 1e3),
            "p99_ms": float(np.percentile(latencies, 99) * 1e3)}


def scrape_every_second(url: str, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        urllib.request.urlopen(url, timeout=5).read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternations per model")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench/results/telemetry.json"))
    args = parser.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory(prefix="tiered-bench-") as tmp:
        root = Path(tmp)
        build(root)
        on = AgentProcess("edge", root)
        off = AgentProcess("edge", root, extra_args=["--no-telemetry", "--no-metrics"])
        with on, off:
            stop = threading.Event()
            scraper = threading.Thread(target=scrape_every_second, args=(on.metrics_url, stop))
            scraper.start()
            try:
                for model in MODELS:
                    for round_ in range(args.rounds):
                        for label, agent in (("on", on), ("off", off)):
                            row = asyncio.run(load(agent.address, model, args.concurrency,
                                                   args.duration))
                            rows.append({"model": model, "telemetry": label, "round": round_,
                                         **row})
                            print(f"[{model} round {round_}] telemetry {label}: "
                                  f"{row['throughput']:.1f} req/s, p50 {row['p50_ms']:.2f} ms",
                                  file=sys.stderr, flush=True)
            finally:
                stop.set()
                scraper.join()

    summary = []
    for model in MODELS:
        med = {label: statistics.median(r["throughput"] for r in rows
                                        if r["model"] == model and r["telemetry"] == label)
               for label in ("on", "off")}
        cost = 1 - med["on"] / med["off"]
        summary.append({"model": model, "median_on": med["on"], "median_off": med["off"],
                        "cost": cost, "target": TARGET_COST,
                        "verdict": "PASS" if cost <= TARGET_COST else "FAIL"})
    print(f"{'model':<10} {'on req/s':>10} {'off req/s':>10} {'cost':>8}  target <= 3%")
    for s in summary:
        print(f"{s['model']:<10} {s['median_on']:>10.1f} {s['median_off']:>10.1f} "
              f"{100 * s['cost']:>7.1f}%  {s['verdict']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "telemetry", "created_unix": time.time(),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "settings": {"rounds": args.rounds, "duration_s": args.duration,
                     "concurrency": args.concurrency, "scrape_interval_s": 1.0},
        "rows": rows, "summary": summary,
    }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
