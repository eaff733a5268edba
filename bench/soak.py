"""Soak: an agent and the router under steady load for a bounded time, watched
for growth in memory and open files.

One real `tiered agent --tier edge` serving `slow` (ResNet-18 at 96 px, one
engine thread, one request at a time) and one real `tiered router` in front
of it, on loopback. The agent's capacity is measured first (one request at a
time, direct); then an open-loop client (`tritonclient.grpc.aio`) sends
requests through the router at about half that rate, each with a deadline,
for `--seconds`. Every `--sample-s` seconds both processes' RSS
(/proc/PID/status VmRSS) and open file descriptors (/proc/PID/fd) are read.

At the end: growth of the mean of the last third of the samples over the
first third (the first sample, the warm-up, is left out), requests sent /
answered / failed / hung, a table, and JSON in bench/results/soak.json. Exit
status 1 when RSS grew more than 20% or open fds by more than 10 in either
process, or when a request was lost (neither answered nor refused in time).

Run: `.venv/bin/python bench/soak.py` (180 s by default; `--seconds`,
`--out`). Not part of `make bench`.
"""

from __future__ import annotations

import argparse
import asyncio
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

import tritonclient.grpc.aio as aioclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tiered.agent.repository import model_file, write_config  # noqa: E402
from tiered.models import zoo  # noqa: E402
from tiered.processes import AgentProcess, RouterProcess  # noqa: E402
from tiered.tables import render  # noqa: E402

RSS_GROWTH_LIMIT = 0.20  # fraction
FD_GROWTH_LIMIT = 10  # descriptors
DEADLINE_S = 5.0
LOAD_FRACTION = 0.5  # of measured capacity


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def image_input() -> list[aioclient.InferInput]:
    array = np.random.default_rng(0).random((1, 3, 96, 96), dtype=np.float32)
    item = aioclient.InferInput("input", list(array.shape), "FP32")
    item.set_data_from_numpy(array)
    return [item]


class Counts:
    def __init__(self) -> None:
        self.sent = self.answered = self.hung = 0
        self.failed: dict[str, int] = {}
        self.latencies_s: list[float] = []


async def call(client, inputs, counts: Counts) -> None:
    counts.sent += 1
    started = time.monotonic()
    try:
        await asyncio.wait_for(client.infer("slow", inputs, client_timeout=DEADLINE_S),
                               DEADLINE_S + 5)
    except asyncio.TimeoutError:
        counts.hung += 1
        return
    except InferenceServerException as error:
        code = str(error.status())
        counts.failed[code] = counts.failed.get(code, 0) + 1
        return
    counts.answered += 1
    counts.latencies_s.append(time.monotonic() - started)


async def capacity(address: str, seconds: float = 3.0) -> float:
    inputs, counts = image_input(), Counts()
    async with aioclient.InferenceServerClient(address) as client:
        for _ in range(10):
            await call(client, inputs, Counts())
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            await call(client, inputs, counts)
        return counts.answered / (time.monotonic() - started)


async def soak(address: str, rate: float, seconds: float, sample_s: float,
               pids: dict[str, int]) -> tuple[Counts, list[dict[str, Any]]]:
    inputs, counts, samples = image_input(), Counts(), []
    async with aioclient.InferenceServerClient(address) as client:
        calls: set[asyncio.Task] = set()
        started = time.monotonic()
        next_sample, index = started, 0
        while (now := time.monotonic()) - started < seconds:
            if now >= next_sample:
                samples.append({"t_s": round(now - started, 1), **{
                    f"{name}_{what}": f(pid) for name, pid in pids.items()
                    for what, f in (("rss_mib", rss_mib), ("fds", open_fds))}})
                next_sample += sample_s
            delay = started + index / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(call(client, inputs, counts))
            calls.add(task)
            task.add_done_callback(calls.discard)
            index += 1
        if calls:
            await asyncio.gather(*calls)
        samples.append({"t_s": round(time.monotonic() - started, 1), **{
            f"{name}_{what}": f(pid) for name, pid in pids.items()
            for what, f in (("rss_mib", rss_mib), ("fds", open_fds))}})
    return counts, samples


def growth(samples: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """Mean of the first and last thirds, the warm-up sample left out."""
    values = [s[key] for s in samples[1:]] or [samples[0][key]]
    third = max(1, len(values) // 3)
    return float(np.mean(values[:third])), float(np.mean(values[-third:]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "soak.json")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="tiered-soak-") as work:
        root = Path(work) / "repository"
        zoo.resnet18(model_file(root, "slow", 1), image_size=96, num_classes=10)
        write_config(root, "slow", {"max_batch_size": 1, "max_queue_size": 8,
                                    "engine": {"intra_op_threads": 1}})
        with AgentProcess("edge", root) as agent:
            table = Path(work) / "routing.yaml"
            table.write_text(json.dumps({"version": 1, "models": {"slow": {
                "tiers": {"edge": {"agents": [agent.address], "stable": 1}}}}}))
            with RouterProcess(table, metrics_port=None) as router:
                measured = asyncio.run(capacity(agent.address))
                rate = LOAD_FRACTION * measured
                print(f"capacity {measured:.1f} req/s direct; soaking through the router at "
                      f"{rate:.1f} req/s for {args.seconds:.0f} s", flush=True)
                counts, samples = asyncio.run(soak(
                    router.address, rate, args.seconds, args.sample_s,
                    {"agent": agent.pid, "router": router.pid}))
                alive = {"agent": agent.alive(), "router": router.alive()}

    rows, verdicts = [], []
    for process in ("agent", "router"):
        first_rss, last_rss = growth(samples, f"{process}_rss_mib")
        first_fds, last_fds = growth(samples, f"{process}_fds")
        rss_growth = (last_rss - first_rss) / first_rss
        fd_growth = last_fds - first_fds
        held = rss_growth <= RSS_GROWTH_LIMIT and fd_growth <= FD_GROWTH_LIMIT
        verdicts.append(held)
        rows.append([process, round(first_rss, 1), round(last_rss, 1),
                     round(100 * rss_growth, 1), round(first_fds, 1), round(last_fds, 1),
                     round(fd_growth, 1), "ok" if held else "GREW"])
    lost = counts.sent - counts.answered - sum(counts.failed.values())
    latencies = np.array(counts.latencies_s or [0.0]) * 1e3
    result = {
        "benchmark": "soak", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "seconds": args.seconds, "capacity_rps": round(measured, 1),
        "offered_rps": round(rate, 1),
        "requests": {"sent": counts.sent, "answered": counts.answered,
                     "failed": counts.failed, "hung": counts.hung, "lost": lost},
        "latency_ms": {"p50": round(float(np.percentile(latencies, 50)), 1),
                       "p99": round(float(np.percentile(latencies, 99)), 1)},
        "growth": [dict(zip(["process", "rss_first_mib", "rss_last_mib", "rss_growth_pct",
                             "fds_first", "fds_last", "fds_growth", "verdict"], row))
                   for row in rows],
        "limits": {"rss_growth_pct": 100 * RSS_GROWTH_LIMIT, "fd_growth": FD_GROWTH_LIMIT},
        "alive_at_end": alive,
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(render(["process", "RSS first MiB", "RSS last MiB", "RSS growth %", "fds first",
                  "fds last", "fds growth", "verdict"], rows))
    print()
    print(render(["sent", "answered", "failed", "hung", "lost", "p50 ms", "p99 ms"],
                 [[counts.sent, counts.answered, sum(counts.failed.values()), counts.hung,
                   lost, result["latency_ms"]["p50"], result["latency_ms"]["p99"]]]))
    if counts.failed:
        print(f"failures by code: {counts.failed}")
    print(f"wrote {args.out}")
    ok = all(verdicts) and lost == 0 and counts.hung == 0 and all(alive.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
