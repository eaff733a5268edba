"""Benchmark: what the agent's telemetry costs, on vs off, in one run.

Two edge agents serve the same models, one with telemetry (latency windows,
reservoirs, energy attribution, the Stats RPC and /metrics being scraped each
second) and one started with `--no-telemetry`. Batch-1 requests at
concurrency 16 (bench/common.py's load generator) go to each in turn,
alternating several rounds so that the machine's drift falls on both alike.
Writes bench/results/telemetry.json and prints a table. Target: telemetry
costs <= 3% of throughput.

Run: `.venv/bin/python bench/telemetry.py [--rounds N] [--duration S]`, or
`--smoke --out PATH` for a few seconds' check that it still runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

from bench import common
from tiered.agent.repository import model_file, write_config
from tiered.models import zoo

TARGET_COST = 0.03
MODELS = {"mlp": ("input", (16,)), "resnet18": ("input", (3, 64, 64))}
WARMUP_S = 1.0
SCRAPE_INTERVAL_S = 1.0


def build(root: Path) -> None:
    zoo.mlp(model_file(root, "mlp", 1))
    write_config(root, "mlp", {"max_batch_size": 64, "dynamic_batching": {}})
    zoo.resnet18(model_file(root, "resnet18", 1), image_size=64, num_classes=10)
    write_config(root, "resnet18", {"max_batch_size": 16, "dynamic_batching": {}})


def scrape_every_second(url: str, stop: threading.Event) -> None:
    while not stop.wait(SCRAPE_INTERVAL_S):
        urllib.request.urlopen(url, timeout=5).read()


def summarize(rows: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]],
                                                       list[common.Target]]:
    """Per model: median throughput on and off, and the cost judged against its target."""
    summary, targets = [], []
    for model in MODELS:
        med = {label: statistics.median(r["throughput"] for r in rows
                                        if r["model"] == model and r["telemetry"] == label)
               for label in ("on", "off")}
        cost = 1 - med["on"] / med["off"]
        summary.append({"model": model, "median_on": med["on"], "median_off": med["off"],
                        "cost": cost})
        targets.append(common.judge(model, "1 - median req/s on / off", cost, "<=",
                                    TARGET_COST))
    return summary, targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternations per model")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, default=16)
    common.add_arguments(parser, "telemetry")
    args = common.parse(parser, argv, "telemetry")
    warmup_s = WARMUP_S
    if args.smoke:
        args.rounds, args.duration, args.concurrency, warmup_s = 1, 0.5, 2, 0.1
    result = common.record("telemetry", args.smoke)

    rows = []
    with tempfile.TemporaryDirectory(prefix="tiered-bench-") as tmp:
        root = Path(tmp)
        build(root)
        on = common.agent("edge", root)
        off = common.agent("edge", root, extra_args=["--no-telemetry", "--no-metrics"])
        with common.serving([on, off]):
            stop = threading.Event()
            scraper = threading.Thread(target=scrape_every_second, args=(on.metrics_url, stop))
            scraper.start()
            try:
                for model in MODELS:
                    name, shape = MODELS[model]
                    load = common.Load.random(model, name, (1, *shape))
                    for round_ in range(args.rounds):
                        for label, agent in (("on", on), ("off", off)):
                            window = common.closed_loop([agent.address], load, args.concurrency,
                                                        warmup_s, args.duration)
                            row = {"model": model, "telemetry": label, "round": round_,
                                   **window.summary()}
                            rows.append(row)
                            common.progress(f"[{model} round {round_}] telemetry {label}: "
                                            f"{row['throughput']:.1f} req/s, "
                                            f"p50 {row['p50_ms']:.2f} ms")
            finally:
                stop.set()
                scraper.join()

    summary, targets = summarize(rows)
    print(common.table(["model", "on req/s", "off req/s", "cost %", "needs"],
                       [[s["model"], s["median_on"], s["median_off"], 100 * s["cost"],
                         f"<= {100 * TARGET_COST:.0f}%"] for s in summary],
                       [t.verdict for t in targets]))
    result.update({
        "settings": {"rounds": args.rounds, "duration_s": args.duration, "warmup_s": warmup_s,
                     "concurrency": args.concurrency, "scrape_interval_s": SCRAPE_INTERVAL_S},
        "rows": rows, "summary": summary, "targets": targets,
    })
    common.write(result, args.out)
    if args.smoke:
        return common.smoke_exit({"rows": (rows, ("throughput", "p50_ms", "p99_ms")),
                                  "summary": (summary, ("median_on", "median_off"))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
