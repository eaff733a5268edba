"""Soak: an agent and the router under steady load for a bounded time, watched
for growth in memory and open files.

One real `tiered agent --tier edge` serving `slow` (ResNet-18 at 96 px, one
engine thread, one request at a time) and one real `tiered router` in front
of it, on loopback. The agent's capacity is measured first (one request at a
time, direct); then an open-loop client (bench/common.py's paced open loop on
`tritonclient.grpc.aio`) sends requests through the router at about half that
rate, each with a deadline, for `--seconds`. Every `--sample-s` seconds both
processes' RSS (/proc/PID/status VmRSS) and open file descriptors
(/proc/PID/fd) are read.

At the end: growth of the mean of the last third of the samples over the
first third (the first sample, the warm-up, is left out), requests sent /
answered / failed / hung, a table, and JSON in bench/results/soak.json. Exit
status 1 when RSS grew more than 20% or open fds by more than 10 in either
process, or when a request was lost (neither answered nor refused in time).
`--smoke --out PATH` soaks for a few seconds to check that the harness still
runs: growth over seconds means nothing, so there it is reported, not judged;
a lost request, a dead process or a malformed row still fail it.

Run: `.venv/bin/python bench/soak.py` (180 s by default; `--seconds`,
`--out`); `make bench` runs it last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

from bench import common
from tiered.agent.repository import model_file, write_config
from tiered.local.processes import RouterProcess
from tiered.models import zoo

RSS_GROWTH_LIMIT = 0.20  # fraction
FD_GROWTH_LIMIT = 10  # descriptors
DEADLINE_S = 5.0
LOAD_FRACTION = 0.5  # of measured capacity
CAPACITY_S = 3.0
SMOKE_SECONDS, SMOKE_SAMPLE_S, SMOKE_CAPACITY_S = 1.5, 0.25, 0.5


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def footprint(pids: dict[str, int]) -> dict[str, float]:
    return {f"{name}_{what}": f(pid) for name, pid in pids.items()
            for what, f in (("rss_mib", rss_mib), ("fds", open_fds))}


def growth(samples: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """Mean of the first and last thirds, the warm-up sample left out."""
    values = [s[key] for s in samples[1:]] or [samples[0][key]]
    third = max(1, len(values) // 3)
    return float(np.mean(values[:third])), float(np.mean(values[-third:]))


def growth_rows(samples: list[dict[str, Any]]) -> tuple[list[dict[str, Any]],
                                                       list[common.Target]]:
    rows, targets = [], []
    for process in ("agent", "router"):
        first_rss, last_rss = growth(samples, f"{process}_rss_mib")
        first_fds, last_fds = growth(samples, f"{process}_fds")
        rss_growth = (last_rss - first_rss) / first_rss
        rows.append({"process": process, "rss_first_mib": round(first_rss, 1),
                     "rss_last_mib": round(last_rss, 1),
                     "rss_growth_pct": round(100 * rss_growth, 1),
                     "fds_first": round(first_fds, 1), "fds_last": round(last_fds, 1),
                     "fds_growth": round(last_fds - first_fds, 1)})
        targets += [
            common.judge(f"{process} RSS", "growth, last third over first (%)",
                         100 * rss_growth, "<=", 100 * RSS_GROWTH_LIMIT),
            common.judge(f"{process} fds", "growth, last third over first",
                         last_fds - first_fds, "<=", FD_GROWTH_LIMIT),
        ]
    return rows, targets


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    common.add_arguments(parser, "soak")
    args = common.parse(parser, argv, "soak")
    capacity_s = CAPACITY_S
    if args.smoke:
        args.seconds, args.sample_s, capacity_s = SMOKE_SECONDS, SMOKE_SAMPLE_S, SMOKE_CAPACITY_S
    result = common.record("soak", args.smoke)
    load = common.Load.random("slow", "input", (1, 3, 96, 96), timeout_s=DEADLINE_S)

    with tempfile.TemporaryDirectory(prefix="tiered-soak-") as work:
        root = Path(work) / "repository"
        zoo.resnet18(model_file(root, "slow", 1), image_size=96, num_classes=10)
        write_config(root, "slow", {"max_batch_size": 1, "max_queue_size": 8,
                                    "engine": {"intra_op_threads": 1}})
        with common.agent("edge", root) as agent:
            table = Path(work) / "routing.yaml"
            table.write_text(json.dumps({"version": 1, "models": {"slow": {
                "tiers": {"edge": {"agents": [agent.address], "stable": 1}}}}}))
            with RouterProcess(table, metrics_port=None) as router:
                capacity = common.closed_loop([agent.address], load, 1, 0.0, capacity_s)
                measured = capacity.summary()["throughput"]
                rate = LOAD_FRACTION * measured
                common.progress(f"capacity {measured:.1f} req/s direct; soaking through the "
                                f"router at {rate:.1f} req/s for {args.seconds:.0f} s")
                sampler = common.Sampler(
                    lambda: footprint({"agent": agent.pid, "router": router.pid}),
                    args.sample_s).start()
                try:
                    offered = common.open_loop(router.address, load, rate, args.seconds)
                finally:
                    readings = sampler.stop()
                alive = {"agent": agent.alive(), "router": router.alive()}

    started = readings[0][0]
    samples = [{"t_s": round(t - started, 1), **values} for t, values in readings]
    rows, targets = growth_rows(samples)
    latency = offered.tally.summary(args.seconds)
    result.update({
        "seconds": args.seconds, "capacity_rps": round(measured, 1),
        "offered_rps": round(rate, 1),
        "requests": {"sent": offered.sent, "answered": offered.tally.answered,
                     "failed": offered.refused, "hung": offered.hung, "lost": offered.lost},
        "latency": latency,
        "growth": rows,
        "targets": targets,
        "limits": {"rss_growth_pct": 100 * RSS_GROWTH_LIMIT, "fd_growth": FD_GROWTH_LIMIT},
        "alive_at_end": alive,
        "samples": samples,
    })
    if args.smoke:
        result["not_judged"] = "growth: a smoke run is seconds long, growth over it means nothing"
    common.write(result, args.out)

    keys = ["rss_first_mib", "rss_last_mib", "rss_growth_pct", "fds_first", "fds_last",
            "fds_growth"]
    print(common.table(["process", "RSS first MiB", "RSS last MiB", "RSS growth %",
                        "fds first", "fds last", "fds growth"],
                       [[r["process"], *(r[k] for k in keys)] for r in rows],
                       [common.overall(targets[2 * i:2 * i + 2]) for i in range(len(rows))]))
    print()
    print(common.table(["sent", "answered", "failed", "hung", "lost", "p50 ms", "p99 ms"],
                       [[offered.sent, offered.tally.answered, sum(offered.refused.values()),
                         offered.hung, offered.lost, latency["p50_ms"], latency["p99_ms"]]]))
    if offered.refused:
        print(f"failures by code: {offered.refused}")
    served = offered.lost == 0 and offered.hung == 0 and all(alive.values())
    if args.smoke:
        return common.smoke_exit({
            "latency": ([latency], ("throughput", "p50_ms", "p99_ms")),
            "growth": (rows, ("rss_first_mib", "rss_last_mib", "fds_first", "fds_last")),
        }) or (0 if served else 1)
    return 0 if served and common.overall(targets) == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
