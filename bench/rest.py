"""Benchmark: KServe v2 REST beside gRPC against the same agent, in one run.

One real `tiered agent --tier edge --front-ends 0` on loopback serves gRPC and
REST (aiohttp) from one process over the same servicer. Three arms send the same batch-1 requests: gRPC
(`tritonclient.grpc.aio`, the baseline), REST with Triton's binary-data
extension (`tritonclient.http.aio`, binary inputs and outputs) and REST with
JSON tensors (the same client, `binary_data=False` both ways). Each arm runs
N concurrent workers in one asyncio loop for a fixed time after a warm-up;
arms alternate, so each is measured beside the others in time. Two models:
`mlp` (tiny: the request is all protocol) and `sized` (a ReduceMean over a
ResNet-18-sized input, [1, 3, 224, 224] FP32 = 602 KB, so moving the payload
shows). Besides client-side throughput and latency, the agent's own CPU
seconds per answered request (from /proc) say what each protocol costs the
server. Client and agent share this machine's cores.

Targets (set for a 16-core host): REST binary >= 70% of gRPC's throughput at
c=8, for each model. PASS / FAIL are printed and written;
the exit code does not depend on them (a `--smoke` run's is 1 when its rows
are not well-formed).

Run: `.venv/bin/python bench/rest.py` (about 2 minutes), `--seconds` per
window, `--rounds` alternations, `--concurrency` levels, `--out` for the JSON
path, `--smoke` for a few seconds' check that it still runs.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpc_aio
import tritonclient.http as httpclient
import tritonclient.http.aio as http_aio

from bench import common
from bench.router import sized_model
from tiered.agent.repository import model_file, write_config
from tiered.models import zoo

MODELS = {  # name: (input, shape with the batch dimension, output)
    "mlp": ("input", (1, 16), "probabilities"),
    "sized": ("input", (1, 3, 224, 224), "mean"),
}
ARMS = ("grpc", "rest_binary", "rest_json")
TARGET_THROUGHPUT_RATIO = 0.7  # REST binary over gRPC, at TARGET_CONCURRENCY
TARGET_CONCURRENCY = 8


@dataclass(frozen=True)
class Settings:
    seconds: float = 5.0  # measured per window
    warmup_s: float = 1.0  # per window
    rounds: int = 2  # alternations of the three arms
    concurrency: tuple[int, ...] = (1, 8)


# Two seconds a window: beside a busy loop, one JSON request of the sized
# model took longer than the 0.6 s windows had been, and a window held none.
SMOKE = Settings(seconds=2.0, warmup_s=0.2, rounds=1, concurrency=(1,))


def build_repository(root: Path) -> Path:
    zoo.mlp(model_file(root, "mlp", 1), seed=1)
    write_config(root, "mlp", {"max_batch_size": 16})
    sized_model(model_file(root, "sized", 1))
    write_config(root, "sized", {"max_batch_size": 1})
    return root


class Arm:
    """One protocol's client and its prepared request (built once, sent many times)."""

    def __init__(self, arm: str, agent, model: str) -> None:
        name, shape, output = MODELS[model]
        data = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
        self.model, self.output = model, output
        if arm == "grpc":
            self.client: Any = grpc_aio.InferenceServerClient(agent.address)
            item = grpcclient.InferInput(name, list(shape), "FP32")
            item.set_data_from_numpy(data)
            self.inputs = [item]
            self.outputs = [grpcclient.InferRequestedOutput(output)]
        else:
            binary = arm == "rest_binary"
            self.client = http_aio.InferenceServerClient(agent.http_address, conn_limit=256)
            item = httpclient.InferInput(name, list(shape), "FP32")
            item.set_data_from_numpy(data, binary_data=binary)
            self.inputs = [item]
            self.outputs = [httpclient.InferRequestedOutput(output, binary_data=binary)]

    async def send(self) -> str | None:
        """One request; why it failed, or None."""
        try:
            result = await self.client.infer(self.model, self.inputs, outputs=self.outputs)
            return None if result.as_numpy(self.output) is not None else "no output"
        except Exception as error:  # noqa: BLE001 -- one odd reply must not end the run
            return f"{type(error).__name__}: {error}"

    async def close(self) -> None:
        await self.client.close()


async def window(arm: Arm, concurrency: int, settings: Settings, agent_pid: int
                 ) -> dict[str, Any]:
    """Closed loop: `concurrency` workers, each with one request in flight."""
    tally = common.Tally()
    first = await arm.send()
    if first is not None:
        raise RuntimeError(f"the first request failed: {first}")
    schedule = common.Schedule.after(settings.warmup_s, settings.seconds)

    async def worker() -> None:
        while (started := time.monotonic()) < schedule.stop:
            error = await arm.send()
            ended = time.monotonic()
            if schedule.start <= ended < schedule.end:
                tally.record(ended - started, ended, error)
            if error is not None:
                await asyncio.sleep(common.ERROR_PAUSE_S)

    async def agent_cpu() -> float | None:
        await asyncio.sleep(max(0.0, schedule.start - time.monotonic()))
        before = common.process_cpu_s(agent_pid)
        await asyncio.sleep(max(0.0, schedule.end - time.monotonic()))
        return common.difference(common.process_cpu_s(agent_pid), before)

    cpu, *_ = await asyncio.gather(agent_cpu(), *(worker() for _ in range(concurrency)))
    summary = tally.summary(schedule.seconds)
    summary["agent_cpu_ms_per_request"] = common.ratio(
        None if cpu is None else cpu * 1000, tally.answered or None)
    return summary


def merge(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of the rounds, per figure."""
    keys = ("throughput", "p50_ms", "p95_ms", "p99_ms", "agent_cpu_ms_per_request")
    out: dict[str, Any] = {}
    for key in keys:
        values = [w[key] for w in windows if w.get(key) is not None]
        out[key] = float(np.median(values)) if values else None
    out["requests"] = sum(w["requests"] for w in windows)
    out["errors"] = sum(w["errors"] for w in windows)
    out["error_samples"] = [e for w in windows for e in w["error_samples"]][:common.ERROR_SAMPLES]
    return out


async def measure(agent, settings: Settings) -> list[dict[str, Any]]:
    rows = []
    for model in MODELS:
        arms = {name: Arm(name, agent, model) for name in ARMS}
        try:
            for concurrency in settings.concurrency:
                runs: dict[str, list] = {name: [] for name in ARMS}
                for round_ in range(settings.rounds):
                    order = ARMS if round_ % 2 == 0 else tuple(reversed(ARMS))
                    for name in order:
                        runs[name].append(await window(arms[name], concurrency, settings,
                                                       agent.pid))
                        common.progress(f"{model} c={concurrency} {name}: "
                                        f"{runs[name][-1]['throughput']:.0f} req/s")
                row: dict[str, Any] = {"model": model, "concurrency": concurrency,
                                       **{name: merge(runs[name]) for name in ARMS}}
                grpc = row["grpc"]
                for name in ARMS[1:]:
                    row[f"{name}_throughput_ratio"] = common.ratio(
                        row[name]["throughput"], grpc["throughput"])
                    row[f"{name}_added_p50_ms"] = common.difference(
                        row[name]["p50_ms"], grpc["p50_ms"])
                    row[f"{name}_agent_cpu_ratio"] = common.ratio(
                        row[name]["agent_cpu_ms_per_request"], grpc["agent_cpu_ms_per_request"])
                rows.append(row)
        finally:
            for arm in arms.values():
                await arm.close()
    return rows


def targets(rows: Sequence[dict[str, Any]]) -> list[common.Target]:
    out = []
    for model in MODELS:
        row = next((r for r in rows if r["model"] == model
                    and r["concurrency"] == TARGET_CONCURRENCY), {})
        out.append(common.judge(f"{model} REST binary throughput at c={TARGET_CONCURRENCY}",
                                "REST binary req/s / gRPC req/s",
                                row.get("rest_binary_throughput_ratio"), ">=",
                                TARGET_THROUGHPUT_RATIO))
    return out


def report(result: dict[str, Any]) -> str:
    rows = []
    for r in result["rows"]:
        for name in ARMS:
            arm = r[name]
            rows.append([r["model"], r["concurrency"], name, arm["throughput"], arm["p50_ms"],
                         arm["p99_ms"], arm["agent_cpu_ms_per_request"],
                         r.get(f"{name}_throughput_ratio", 1.0),
                         r.get(f"{name}_added_p50_ms", 0.0),
                         r.get(f"{name}_agent_cpu_ratio", 1.0)])
    table = common.table(["model", "c", "protocol", "req/s", "p50 ms", "p99 ms",
                          "agent cpu ms/req", "x gRPC req/s", "+p50 ms", "x gRPC cpu"], rows)
    return f"{table}\n\nTargets\n{common.targets_table(result['targets'])}"


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Settings]:
    return common.parse_windows(argv, "rest", __doc__.split("\n\n")[0], Settings(), SMOKE,
                                "alternations of the arms")


def main(argv: Sequence[str] | None = None) -> int:
    args, settings = parse_args(argv)
    result = common.record("rest", args.smoke)
    with tempfile.TemporaryDirectory(prefix="tiered-bench-rest-") as tmp:
        repository = build_repository(Path(tmp) / "models")
        with common.agent("edge", repository, extra_args=["--front-ends", "0"]) as agent:
            rows = asyncio.run(measure(agent, settings))
    result.update({
        "config": {**asdict(settings), "arms": list(ARMS),
                   "aiohttp": importlib.metadata.version("aiohttp"),
                   "note": "client and agent share this machine's cores; one client "
                           "process, one asyncio loop"},
        "rows": rows,
        "targets": targets(rows),
    })
    print(report(result))
    common.write(result, args.out)
    if args.smoke:
        fields = [f"{arm}.{figure}" for arm in ARMS for figure in
                  ("throughput", "p50_ms", "p99_ms")]
        return common.smoke_exit({"rows": (rows, fields)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
