"""Benchmark: generative serving against the engine alone, in one run.

The tiny Llama v1 (trained in code, its end of sequence taken out so that
sequences run to --max-tokens: `endless_checkpoint`; any that end sooner are
named under the table) is built for a tier with `tiered build` (edge:
onnxruntime-genai INT4 on the CPU; `--tier datacenter --device cuda`: the torch
engine, FP16, on a GPU) and measured three ways at 1, 8 and 64 concurrent
sequences, greedy, one prompt each from tinyllama-eval.json:

- in-process: the built version's engine alone (`open_generative`), the
  sequences started together and stepped until all end;
- agent: a real `tiered agent` serving that version, one tritonclient gRPC
  stream per sequence (ModelStreamInfer, a response per token), from a
  client process for every 16 streams (`--streams-per-client`): one Python
  client reading 64 token streams can be the slowest part of the run; a
  process's streams share one connection, as one tritonclient's do, or
  each has its own (`--channel-per-stream`, as separate users' would). Each
  client process connects first and all start their streams once every one
  has (a barrier), as the in-process arm starts its sequences together: a
  round measures serving, not a channel's connect or a pool's hand-out of
  work;
- router: the same through a real `tiered router` whose table names the agent.

Per row: output tokens/s over the round (first start to last token), TTFT
(start to first token) and TPOT (between a sequence's tokens) P50/P95 over
every sequence of every round, and mJ per output token: a device-wide
counter (NVML's GPU 0 on cuda; RAPL on the CPU where readable, else none)
read around each round, less the idle draw measured before the first row;
"-" where an arm's rounds were metered for less than 2 s in all or used no
more than the idle estimate (too short to read, not free).
The arms alternate round by round, so each is measured beside the others in
time (and a round's energy is its arm's); client, router and agent share
this machine's cores.

Targets (the issue's, for a datacenter torch run on an H200): at 64 streams
the agent's tokens/s >= 85% of in-process, the router's >= 80%, and each
one's TTFT P50 <= 2x in-process; at 1 stream TPOT P50 within 10% of
in-process through the agent, 15% through the router. PASS / MISS are
printed as measured here; the exit code does not depend on them (a
`--smoke` run's is 1 when its rows are not well-formed).

Run: `.venv/bin/python bench/generate.py` (a few minutes on 2 cores);
`--tier datacenter --device cuda --model 300m` on a GPU; `--smoke` for a short
check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

import yaml  # noqa: E402

from bench import common  # noqa: E402
from bench.generative import endless_checkpoint  # noqa: E402
from tiered.local.processes import RouterProcess  # noqa: E402
from tiered.models import tinyllama  # noqa: E402
from tiered.router.forward import AGENT_CONNECTIONS  # noqa: E402

MODEL = "tinyllama"
# Each served arm's targets: tokens/s at 64 streams (at least this x in-process),
# TPOT P50 at 1 stream and TTFT P50 at 64 streams (at most this x in-process).
TARGETS = {"agent": {"tokens": 0.85, "tpot": 1.10, "ttft": 2.0},
           "router": {"tokens": 0.80, "tpot": 1.15, "ttft": 2.0}}
ARMS = ("in-process", "agent", "router")
IDLE_S = 3.0  # the idle draw is measured over this long, before the first row
# The longest a round's client process waits for the others to connect
CONNECT_TIMEOUT_S = 30.0
# --model: the trained tiny v1, or a Llama of about 300 million parameters with
# random weights (the datacenter model; its vocabulary stays tiny)
MODELS: dict[str, str | tinyllama.TinyLlama] = {
    "tiny": "v1",
    "300m": tinyllama.TinyLlama(layers=24, hidden=1024, heads=16, kv_heads=4,
                                intermediate=2816, context=512, train_steps=0),
    # TinyLlama-1.1B's shape (its 32,000-token vocabulary too), random weights
    "1b": tinyllama.TinyLlama(layers=22, hidden=2048, heads=32, kv_heads=4,
                              intermediate=5632, context=2048, train_steps=0,
                              padded_vocab=32000),
}
# Bytes a weight takes in each precision: the weight bytes one decode step
# reads, for the effective bandwidth (gpt-fast's figure: weight bytes x tok/s).
BYTES_PER_WEIGHT = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0,
                    "int4": 0.5}
CORE_MODULE = "tiered.agent.engine_core"


def build(checkpoint: Path, repository: Path, tier: str, device: str,
          max_sequences: int, tokens_per_response: int, engine_core: str,
          precision: str | None = None) -> Path:
    """The tier's build of the checkpoint (in `precision`, else the tier's),
    its config set to run `max_sequences` at once (and on `device`, for the
    torch engine), streaming up to `tokens_per_response` ready tokens a
    response."""
    prompts = checkpoint.parent / tinyllama.EVAL_FILE
    built = subprocess.run(
        [sys.executable, "-m", "tiered", "build", str(checkpoint), "--tier", tier,
         "--repository", str(repository), "--model", MODEL, "--version", "1",
         "--eval", str(prompts), *(["--precision", precision] if precision else []),
         # past the end of its sentences (no EOS here) the model's greedy tokens
         # are near ties that INT4 flips: speed is measured, not the gate
         "--allow-accuracy-drop"], capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        raise SystemExit(f"tiered build failed:\n{built.stderr[-3000:]}")
    path = repository / MODEL / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["engine"] = {**(config.get("engine") or {}), "max_sequences": max_sequences}
    config["generation"] = {**(config.get("generation") or {}),
                            "max_tokens_per_response": tokens_per_response,
                            "engine_core": engine_core}
    if config.get("backend") == "torch-generative":
        config["engine"]["device"] = device
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return repository / MODEL / "1"


class Round:
    """One round's token times: per sequence, when it started and each token came."""

    def __init__(self) -> None:
        self.starts: dict[int, float] = {}
        self.tokens: dict[int, list[float]] = {}
        self.errors: list[str] = []
        self.active_j: float | None = None  # the meter's joules over the round, less idle
        self.metered_s = 0.0  # how long the meter's two readings lie apart
        self.engine_cpu_s: float | None = None  # the engine's process, over an agent round
        # the agent's own process (its text side), where the engine is a core
        self.agent_cpu_s: float | None = None
        self.steps: int | None = None  # the engine's steps over the round
        self.step_s: float | None = None  # and their time in the engine's step
        # a request's mean wait in the agent from its arrival to its admission
        # into the engine's batch (its sequence started), over an agent round
        self.queue_s: float | None = None
        # the agent's own first-token times over an agent round (its telemetry:
        # from a request's arrival in its scheduler to the end of the step that
        # made its first token), their sum and count
        self.agent_ttft: tuple[float, int] | None = None
        self.client_cpu_s: float | None = None  # the client processes', served arms
        # the router's processes (its workers too), over a router round
        self.router_cpu_s: float | None = None

    @classmethod
    def merged(cls, rounds: Sequence[Round]) -> Round:
        """Client processes' shares of one round (their sequences numbered apart)."""
        whole = cls()
        for part in rounds:
            whole.starts.update(part.starts)
            whole.tokens.update(part.tokens)
            whole.errors += part.errors
        whole.client_cpu_s = sum(part.client_cpu_s or 0.0 for part in rounds)
        return whole

    def figures(self) -> dict[str, Any]:
        ended = [t[-1] for t in self.tokens.values() if t]
        count = sum(len(t) for t in self.tokens.values())
        span = max(ended) - min(self.starts.values()) if ended else None
        ttft = [t[0] - self.starts[s] for s, t in self.tokens.items() if t]
        tpot = [b - a for t in self.tokens.values() for a, b in zip(t, t[1:])]
        starts = list(self.starts.values())
        return {"tokens": count, "seconds": span, "ttft_s": ttft, "tpot_s": tpot,
                "start_spread_s": max(starts) - min(starts) if starts else None,
                "errors": len(self.errors), "active_j": self.active_j,
                "metered_s": self.metered_s, "engine_cpu_s": self.engine_cpu_s,
                "agent_cpu_s": self.agent_cpu_s, "steps": self.steps, "step_s": self.step_s,
                "queue_s": self.queue_s, "agent_ttft": self.agent_ttft,
                "client_cpu_s": self.client_cpu_s, "router_cpu_s": self.router_cpu_s}


def in_process(engine, prompts: Sequence[list[int]], streams: int, max_tokens: int) -> Round:
    from tiered.engines.generative.base import Sampling

    record = Round()
    for index in range(streams):
        record.starts[engine.start(prompts[index % len(prompts)],
                                   Sampling(max_tokens=max_tokens))] = time.perf_counter()
    record.tokens = {sequence: [] for sequence in record.starts}
    record.steps, record.step_s = 0, 0.0
    while engine.running:
        started = time.perf_counter()
        tokens = engine.step()
        now = time.perf_counter()
        record.steps += 1
        record.step_s += now - started
        for token in tokens:
            record.tokens[token.sequence].append(now)
    return record


async def served(address: str, prompts: Sequence[str], streams: int, max_tokens: int,
                 first: int = 0, together: Any = None, channel_per_stream: bool = False
                 ) -> Round:
    """`streams` sequences at once, each on a tritonclient stream of its own
    (numbered from `first`), and this process's CPU over them; the streams
    share one channel (one connection), or with `channel_per_stream` each
    has its own. The channels connect before the streams start; with
    `together` (a barrier of the round's client processes) they start once
    every process has connected."""
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as aioclient

    record = Round()

    async def one(index: int, client) -> None:
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([prompts[index % len(prompts)].encode()],
                                          dtype=object))

        async def requests():
            yield {"model_name": MODEL, "inputs": [text],
                   "parameters": {"max_tokens": max_tokens, "temperature": 0.0}}

        times = record.tokens.setdefault(index, [])
        record.starts[index] = time.perf_counter()
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                record.errors.append(str(error))
                return
            now = time.perf_counter()
            response = result.get_response()
            ids = result.as_numpy("token_ids")
            times.extend([now] * (0 if ids is None else ids.size))  # a response may carry several
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return

    # gRPC shares one connection among a process's channels to one address
    # unless each keeps its own subchannels.
    apart = [("grpc.max_send_message_length", 2**31 - 1),
             ("grpc.max_receive_message_length", 2**31 - 1),
             ("grpc.use_local_subchannel_pool", 1)] if channel_per_stream else None
    clients = [aioclient.InferenceServerClient(address, channel_args=apart)
               for _ in range(streams if channel_per_stream else 1)]
    try:  # connected, as a client that keeps its channel is
        await asyncio.gather(*(client.is_server_live() for client in clients))
        if together is not None:
            with contextlib.suppress(threading.BrokenBarrierError):  # one failed: go on
                together.wait(CONNECT_TIMEOUT_S)
        cpu_before = time.process_time()
        await asyncio.gather(*(one(first + i, clients[i % len(clients)])
                               for i in range(streams)))
        record.client_cpu_s = time.process_time() - cpu_before
    finally:
        await asyncio.gather(*(client.close() for client in clients))
    return record


def _served_share(address: str, prompts: Sequence[str], first: int, streams: int,
                  max_tokens: int, together: Any, channel_per_stream: bool) -> Round:
    """A client process's share of a round (`Clients`)."""
    return asyncio.run(served(address, prompts, streams, max_tokens, first, together,
                              channel_per_stream))


class Clients:
    """The served arms' client: a process for each `per_process` streams, so
    that no one interpreter's gRPC work limits what is measured. Their clocks
    agree (perf_counter is the system's monotonic clock), so their rounds
    merge into one."""

    def __init__(self, per_process: int, most_streams: int,
                 channel_per_stream: bool = False) -> None:
        self.per_process = per_process
        self.channel_per_stream = channel_per_stream
        processes = -(-most_streams // per_process)
        self._pool = self._manager = None
        if processes > 1:
            import concurrent.futures
            import multiprocessing

            spawn = multiprocessing.get_context("spawn")
            self._pool = concurrent.futures.ProcessPoolExecutor(processes, mp_context=spawn)
            self._manager = spawn.Manager()  # the rounds' barriers

    def processes(self, streams: int) -> int:
        return 1 if self._pool is None else -(-streams // self.per_process)

    def run(self, address: str, prompts: Sequence[str], streams: int, max_tokens: int
            ) -> Round:
        count = self.processes(streams)
        if count == 1:
            return asyncio.run(served(address, prompts, streams, max_tokens,
                                      channel_per_stream=self.channel_per_stream))
        firsts = [streams * n // count for n in range(count + 1)]
        together = self._manager.Barrier(count)
        shares = [self._pool.submit(_served_share, address, prompts, a, b - a, max_tokens,
                                    together, self.channel_per_stream)
                  for a, b in zip(firsts, firsts[1:])]
        return Round.merged([share.result() for share in shares])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._manager.shutdown()


def summarize(rounds: Sequence[Round]) -> dict[str, Any]:
    figures = [r.figures() for r in rounds]
    seconds = sum(f["seconds"] or 0.0 for f in figures)
    tokens = sum(f["tokens"] for f in figures)
    ttft = common.percentiles_ms([x for f in figures for x in f["ttft_s"]])
    tpot = common.percentiles_ms([x for f in figures for x in f["tpot_s"]])
    summary = {"tokens": tokens, "tokens_per_s": tokens / seconds if seconds else None,
               "ttft_p50_ms": ttft["p50_ms"], "ttft_p95_ms": ttft["p95_ms"],
               "tpot_p50_ms": tpot["p50_ms"], "tpot_p95_ms": tpot["p95_ms"],
               "j_per_token": j_per_token(figures, tokens),
               "errors": sum(f["errors"] for f in figures)}
    spreads = [f["start_spread_s"] for f in figures if f["start_spread_s"] is not None]
    if spreads:  # a round's first to last stream start: clients that start apart
        summary["start_spread_ms"] = sum(spreads) / len(spreads) * 1e3
    cpu = [f["engine_cpu_s"] for f in figures]
    steps = [f["steps"] for f in figures]
    stepping = [f["step_s"] for f in figures]
    if steps and None not in steps and None not in stepping and sum(steps):
        # more steps than in-process: sequences joined apart; longer ones: a
        # slower engine; a smaller busy share: the engine waited between steps
        summary["steps"] = sum(steps)
        summary["step_ms"] = sum(stepping) / sum(steps) * 1e3
        summary["engine_busy_share"] = sum(stepping) / seconds if seconds else None
    if cpu and None not in cpu and None not in steps and sum(steps):
        summary["engine_cpu_us_per_step"] = sum(cpu) / sum(steps) * 1e6
        summary["engine_cpu_us_per_token"] = sum(cpu) / tokens * 1e6 if tokens else None
    queued = [f["queue_s"] for f in figures]
    if queued and None not in queued:
        summary["admission_wait_ms"] = sum(queued) / len(queued) * 1e3
    firsts = [f["agent_ttft"] for f in figures]
    if firsts and None not in firsts and sum(count for _, count in firsts):
        # what of the clients' TTFT the agent's scheduler and engine account for
        summary["agent_own_ttft_ms"] = (sum(s for s, _ in firsts)
                                        / sum(count for _, count in firsts) * 1e3)
    client = [f["client_cpu_s"] for f in figures]
    if client and None not in client and tokens:
        summary["client_cpu_us_per_token"] = sum(client) / tokens * 1e6
    relaying = [f["router_cpu_s"] for f in figures]
    if relaying and None not in relaying and tokens:
        summary["router_cpu_us_per_token"] = sum(relaying) / tokens * 1e6
    text_side = [f["agent_cpu_s"] for f in figures]
    if text_side and None not in text_side and tokens:
        summary["agent_cpu_us_per_token"] = sum(text_side) / tokens * 1e6
    return summary


def measure(engine, addresses: dict[str, str], text_prompts: Sequence[str], streams: int,
            max_tokens: int, rounds: int, meter: Meter, clients: Clients,
            pids: Mapping[str, int] | None = None) -> dict[str, Any]:
    prompts = [engine.encode(p) for p in text_prompts]
    recorded: dict[str, list[Round]] = {arm: [] for arm in ARMS}
    for arm in ARMS:  # a warm-up round each, not counted
        run_arm(arm, engine, addresses, prompts, text_prompts, streams, max_tokens, meter,
                clients)
    for _ in range(rounds):
        for arm in ARMS:
            recorded[arm].append(run_arm(arm, engine, addresses, prompts, text_prompts,
                                         streams, max_tokens, meter, clients, pids))
    row: dict[str, Any] = {"streams": streams, "max_tokens": max_tokens, "rounds": rounds}
    for arm in ARMS:
        row[arm] = summarize(recorded[arm])
    for arm in ("agent", "router"):
        row[arm]["tokens_ratio"] = common.ratio(row[arm]["tokens_per_s"],
                                                row["in-process"]["tokens_per_s"])
        row[arm]["tpot_p50_ratio"] = common.ratio(row[arm]["tpot_p50_ms"],
                                                  row["in-process"]["tpot_p50_ms"])
        row[arm]["ttft_p50_ratio"] = common.ratio(row[arm]["ttft_p50_ms"],
                                                  row["in-process"]["ttft_p50_ms"])
    common.progress(f"{streams} streams: " + ", ".join(
        f"{arm} {row[arm]['tokens_per_s'] or 0:.0f} tok/s" for arm in ARMS))
    return row


class Meter:
    """A device-wide joule counter read around each round (the arms take turns,
    so a round's energy is its arm's), less the idle draw measured first:
    NVML's GPU 0 on cuda, RAPL's package counters on the CPU where readable.
    None where neither is: a modeled figure would count this process only."""

    def __init__(self, device: str, idle_s: float) -> None:
        from tiered.telemetry import energy

        self.meter = energy.gpu_meter(0) if device == "cuda" else None
        if device == "cpu":
            try:
                self.meter = energy.RaplMeter()
            except (OSError, ValueError):
                self.meter = None
        self.source = self.meter.source if self.meter is not None else None
        self.idle_w = 0.0
        if self.meter is not None:
            before = self.meter.read()
            time.sleep(idle_s)
            after = self.meter.read()
            self.idle_w = (after.joules - before.joules) / (after.at - before.at)

    def around(self, run: Callable[[], Round]) -> Round:
        if self.meter is None:
            return run()
        before = self.meter.read()
        record = run()
        after = self.meter.read()
        record.metered_s = after.at - before.at
        record.active_j = after.joules - before.joules - self.idle_w * record.metered_s
        return record


MIN_METERED_S = 2.0  # an arm's rounds together: NVML's counter moves in steps and
# a GPU's power state lags its load, so shorter spans read noise


def j_per_token(figures: Sequence[dict[str, Any]], tokens: int) -> float | None:
    """An arm's joules above idle per output token over its rounds; None where
    unmeasured, metered less than MIN_METERED_S in all, or not above the idle
    estimate (a figure of 0 there would be false, not small)."""
    energy = [f["active_j"] for f in figures]
    if not tokens or None in energy or sum(f["metered_s"] for f in figures) < MIN_METERED_S:
        return None
    return sum(energy) / tokens if sum(energy) > 0 else None


def run_arm(arm: str, engine, addresses, prompts, text_prompts, streams, max_tokens,
            meter: Meter, clients: Clients, pids: Mapping[str, Any] | None = None) -> Round:
    """One round of an arm. With `pids` ("engine", "agent", "router": their
    processes; "metrics": the agent's /metrics), an agent round also reads
    the CPU of the engine's process and, where that is an engine core, of the
    agent's own, and the agent's own first-token times; a router round the
    router's CPU."""
    if arm == "in-process":
        return meter.around(lambda: in_process(engine, prompts, streams, max_tokens))

    def served() -> Round:
        return meter.around(lambda: clients.run(addresses[arm], text_prompts, streams,
                                                max_tokens))

    if pids is None:
        return served()
    if arm == "router":
        before = common.process_cpu_s(pids["router"])  # with its workers
        record = served()
        after = common.process_cpu_s(pids["router"])
        record.router_cpu_s = None if None in (before, after) else after - before
        return record
    engine_pid, agent_pid = pids["engine"], pids["agent"]
    watched = [engine_pid] + ([agent_pid] if agent_pid != engine_pid else [])
    before, counted = [common.process_cpu_s(p, children=False) for p in watched], \
        counts(addresses[arm])
    firsts = first_tokens(pids["metrics"])
    record = served()
    record.agent_ttft = tuple(b - a for a, b in zip(firsts, first_tokens(pids["metrics"])))
    spent = [None if a is None or b is None else b - a for a, b in
             zip(before, [common.process_cpu_s(p, children=False) for p in watched])]
    record.engine_cpu_s = spent[0]
    record.agent_cpu_s = spent[1] if len(spent) > 1 else None
    steps, step_ns, requests, queue_ns = (b - a for a, b in
                                          zip(counted, counts(addresses[arm])))
    record.steps, record.step_s = steps, step_ns / 1e9
    record.queue_s = queue_ns / 1e9 / requests if requests else None
    return record


def counts(address: str) -> tuple[int, int, int, int]:
    """The agent's engine steps of the model so far (Triton's execution count)
    and their time in the engine's step (its batches' compute, ns), its
    requests answered and their time waiting to be admitted, ns."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(address) as client:
        stats = client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
    queue = stats.get("inference_stats", {}).get("queue", {})
    step_ns = sum(int(batch.get("compute_infer", {}).get("ns", 0))
                  for batch in stats.get("batch_stats", []))
    return (int(stats.get("execution_count", 0)), step_ns, int(queue.get("count", 0)),
            int(queue.get("ns", 0)))


def first_tokens(metrics_url: str) -> tuple[float, int]:
    """The agent's first-token times of the model so far, their sum (s) and
    count, from its /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found = {sample.name: sample.value for family in text_string_to_metric_families(text)
             if family.name == "tiered_time_to_first_token_seconds"
             for sample in family.samples if sample.labels.get("model") == MODEL
             and sample.name.endswith(("_sum", "_count"))}
    return (found.get("tiered_time_to_first_token_seconds_sum", 0.0),
            int(found.get("tiered_time_to_first_token_seconds_count", 0)))


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, for each served arm, where their rows were measured."""
    by_streams = {row["streams"]: row for row in rows}
    checks = []

    def check(name: str, value: float | None, ok: Callable[[float], bool]) -> None:
        checks.append({"name": name, "value": value, "verdict": _verdict(value, ok)})

    for arm, target in TARGETS.items():
        if 64 in by_streams:
            figures = by_streams[64][arm]
            check(f"{arm} tokens/s >= {target['tokens']:.0%} of in-process at 64 streams",
                  figures["tokens_ratio"], lambda v, t=target["tokens"]: v >= t)
            check(f"{arm} TTFT P50 <= {target['ttft']:g}x in-process at 64 streams",
                  figures["ttft_p50_ratio"], lambda v, t=target["ttft"]: v <= t)
        if 1 in by_streams:
            check(f"{arm} TPOT P50 within {target['tpot'] - 1:.0%} of in-process at 1 stream",
                  by_streams[1][arm]["tpot_p50_ratio"], lambda v, t=target["tpot"]: v <= t)
    return checks


def _verdict(value: float | None, ok) -> str:
    return "N/A" if value is None else ("PASS" if ok(value) else "MISS")


def report(result: dict[str, Any]) -> str:
    def number(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    rows = []
    for row in result["rows"]:
        for arm in ARMS:
            figures = row[arm]
            rows.append([row["streams"], arm, number(figures["tokens_per_s"]),
                         number(figures.get("tokens_ratio"), 2),
                         number(figures.get("start_spread_ms"), 2),
                         number(figures["ttft_p50_ms"], 2), number(figures["ttft_p95_ms"], 2),
                         number(figures.get("admission_wait_ms"), 2),
                         number(figures.get("agent_own_ttft_ms"), 2),
                         number(figures["tpot_p50_ms"], 2), number(figures["tpot_p95_ms"], 2),
                         number(figures.get("tpot_p50_ratio"), 2),
                         number(figures.get("j_per_token") and figures["j_per_token"] * 1e3, 3),
                         number(figures.get("effective_gb_s"), 0),
                         figures.get("steps", "-"), number(figures.get("step_ms"), 2),
                         number(figures.get("engine_busy_share"), 2),
                         number(figures.get("engine_cpu_us_per_step"), 0),
                         number(figures.get("agent_cpu_us_per_token")
                                or figures.get("router_cpu_us_per_token"), 0),
                         number(figures.get("client_cpu_us_per_token"), 0),
                         figures["errors"]])
    config = result["config"]
    head = (f"generate: {config['model']} ({config['parameters'] / 1e6:.1f} M parameters), "
            f"{config['tier']} {config['backend']} ({config['precision']}) on "
            f"{config['device']}, {config['max_tokens']} tokens a sequence, up to "
            f"{config.get('tokens_per_response', 1)} a response, "
            f"{config['rounds']} rounds; the agent's engine in "
            f"{config.get('engine_process', 'the agent')}; energy: " + _energy_said(config)
            + "\nstarts ms: a round's first to last stream start, mean over rounds; "
            "GB/s: weight bytes x tok/s at one stream; steps: the engine's steps "
            "over the rounds, step ms their mean time in the engine, busy the share of "
            "the rounds' time they took; eng us/step: CPU of the engine's "
            "process (the engine core, else the whole agent) per engine step, agent rounds; "
            "serve us/tok: per output token, the agent process's own CPU (its text side: "
            "tokens to responses) where the engine is a core (front ends not counted), the "
            "router's (with its workers) in router rounds; "
            "admit ms: a request's mean wait in the agent from arrival to its sequence's "
            "start (agent rounds); own ttft: the agent's own mean TTFT, from a request's "
            "arrival in its scheduler to the end of the step that made its first token "
            "(its telemetry; the rest of the clients' TTFT lies in the clients, the front "
            "ends and the agent's intake and delivery); "
            f"client us/tok: the client processes' CPU per output token (up to "
            f"{config.get('streams_per_client', 'all')} streams a process)")
    table = common.table(["streams", "arm", "tok/s", "x in-proc", "starts ms", "ttft p50", "ttft p95",
                          "admit ms", "own ttft", "tpot p50", "tpot p95", "tpot x", "mJ/tok", "GB/s",
                          "steps", "step ms", "busy",
                          "eng us/step", "serve us/tok", "client us/tok", "errors"], rows)
    # a sequence that ends early (its end of sequence, an error) weighs its start more
    short = [f"{row['streams']} streams {arm}: "
             f"{row[arm]['tokens'] / (row['streams'] * row['rounds']):.1f} of {row['max_tokens']}"
             for row in result["rows"] for arm in ARMS
             if row[arm]["tokens"] < row["streams"] * row["rounds"] * row["max_tokens"]]
    if short:
        table += "\nsequences that ended early, tokens a sequence: " + "; ".join(short)
    checks = common.table(["target (issue: H200, datacenter torch)", "measured"],
                          [[c["name"], number(c["value"], 2)] for c in result["targets"]],
                          [c["verdict"] for c in result["targets"]])
    return f"{head}\n{table}\n\n{checks}"


def _energy_said(config: dict[str, Any]) -> str:
    if "energy_source" not in config:
        return "not measured (a run from before the bench read a meter)"
    if config["energy_source"] is None:
        return "no device-wide counter here"
    return f"{config['energy_source']}, device-wide, less {config['idle_watts']:.1f} W idle"


def parameters(checkpoint: Path) -> int:
    """The checkpoint's parameter count, from its safetensors headers."""
    count = 0
    for path in checkpoint.glob("*.safetensors"):
        with path.open("rb") as file:
            header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
        count += sum(int(np.prod(t["shape"])) for name, t in header.items()
                     if name != "__metadata__")
    return count


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"want counts >= 1 separated by commas, got {text!r}")
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=common.RESULTS / "generate.json")
    parser.add_argument("--smoke", action="store_true",
                        help="1 and 8 streams, 8 tokens, one round")
    parser.add_argument("--tier", default="edge", choices=("edge", "regional", "datacenter"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="the torch engine's device (datacenter tier)")
    parser.add_argument("--model", default="tiny", choices=tuple(MODELS),
                        help="tiny: the trained tiny Llama v1; 300m: about 300 million "
                        "parameters, random weights (for a GPU)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tokens-per-response", type=int, default=1,
                        help="the agent's generation.max_tokens_per_response: 1 streams a "
                        "response a token, as Triton does; more sends the tokens ready")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--precision", default=None,
                        help="build in this precision instead of the tier's (datacenter: "
                        "fp16, or fp8 where the GPU has FP8 tensor cores)")
    parser.add_argument("--engine-core", default="auto", choices=("auto", "process", "thread"),
                        help="the agent's generation.engine_core: the engine in a process of "
                        "its own, or on a thread of the agent's (auto: a process on a GPU)")
    parser.add_argument("--front-ends", type=int, default=None,
                        help="the agent's front-end processes (default: the tier profile's; "
                        "none on a machine of fewer than 4 cores)")
    parser.add_argument("--streams", type=_counts, default=(1, 8, 64),
                        help="concurrent streams to measure, comma-separated (default 1,8,64)")
    parser.add_argument("--streams-per-client", type=int, default=16,
                        help="the served arms' streams in each client process (default 16: "
                        "4 processes at 64 streams, so that no one client's gRPC work limits "
                        "the figures)")
    parser.add_argument("--channel-per-stream", action="store_true",
                        help="each served stream on a gRPC channel (a connection) of its own, "
                        "as separate users' would be; by default a client process's streams "
                        "share one, as one tritonclient's do. The kernel spreads connections, "
                        "not streams, over front ends and router workers")
    parser.add_argument("--router-workers", type=int, default=1,
                        help="the router's --workers: processes sharing its port, over which "
                        "the kernel spreads the clients' connections")
    parser.add_argument("--router-agent-connections", type=int, default=None, metavar="N",
                        help="the router's --agent-connections: its connections to the "
                        "agent, over which the kernel spreads the routed streams among the "
                        f"agent's front ends (default: the router's, {AGENT_CONNECTIONS})")
    args = parser.parse_args(argv)
    if args.streams_per_client < 1 or args.router_workers < 1 \
            or (args.router_agent_connections or 1) < 1:
        parser.error("--streams-per-client, --router-workers, --router-agent-connections: "
                     "want 1 or more")
    streams = (1, 8) if args.smoke else args.streams
    max_tokens = 8 if args.smoke else args.max_tokens
    rounds = 1 if args.smoke else args.rounds
    result = common.record("generate", args.smoke, with_gpu=args.device == "cuda")
    with tempfile.TemporaryDirectory(prefix="tiered-bench-generate-") as tmp:
        checkpoint = endless_checkpoint(Path(tmp) / "checkpoints", MODELS[args.model])
        size = parameters(checkpoint)
        repository = Path(tmp) / "repository"
        version = build(checkpoint, repository, args.tier, args.device, max(streams),
                        args.tokens_per_response, args.engine_core, args.precision)
        config = yaml.safe_load((repository / MODEL / "config.yaml").read_text())
        facts = json.loads((version / "build.json").read_text()) \
            if (version / "build.json").is_file() else {}
        from tiered.engines.generative import open_generative

        engine = open_generative(config["backend"], version, config.get("engine") or {})
        text_prompts = tinyllama.eval_prompts()
        front_ends = [] if args.front_ends is None else ["--front-ends", str(args.front_ends)]
        with common.agent(args.tier, repository, extra_args=front_ends) as agent:
            cores = common.children_running(agent.pid, CORE_MODULE)
            engine_pid = cores[0] if cores else agent.pid
            table = Path(tmp) / "routing.json"
            table.write_text(json.dumps({"version": 1, "models": {MODEL: {
                "max_in_flight": 1024, "tiers": {args.tier: {"agents": [agent.address]}}}}}))
            connections = [] if args.router_agent_connections is None else [
                "--agent-connections", str(args.router_agent_connections)]
            router = RouterProcess(table, metrics_port=None,
                                   extra_args=["--workers", str(args.router_workers),
                                               *connections])
            with common.serving([router]):
                addresses = {"agent": agent.address, "router": router.address}
                meter = Meter(args.device, 0.5 if args.smoke else IDLE_S)
                clients = Clients(args.streams_per_client, max(streams),
                                  args.channel_per_stream)
                try:
                    pids = {"engine": engine_pid, "agent": agent.pid, "router": router.pid,
                            "metrics": agent.metrics_url}
                    rows = [measure(engine, addresses, text_prompts, n, max_tokens, rounds,
                                    meter, clients, pids) for n in streams]
                finally:
                    clients.close()
    precision = ((config.get("engine") or {}).get("precision") or facts.get("precision")
                 or facts.get("build", {}).get("precision"))
    # The engine's own count where it has one (fp8 keeps embeddings and lm_head wide)
    weight_bytes = getattr(engine, "weight_bytes", None) or (
        size * BYTES_PER_WEIGHT[precision] if precision in BYTES_PER_WEIGHT else None)
    for row in rows:
        for arm in ARMS:
            rate = row[arm]["tokens_per_s"]
            if row["streams"] == 1 and rate and weight_bytes:
                row[arm]["effective_gb_s"] = weight_bytes * rate / 1e9
    result.update({
        "config": {"tier": args.tier, "device": args.device, "backend": config["backend"],
                   "model": args.model, "parameters": size, "weight_bytes": weight_bytes,
                   "engine_core": args.engine_core,
                   "front_ends": "the profile's" if args.front_ends is None else args.front_ends,
                   "engine_process": "engine core" if cores else "agent",
                   "precision": precision,
                   "max_tokens": max_tokens, "rounds": rounds, "streams": list(streams),
                   "tokens_per_response": args.tokens_per_response,
                   "streams_per_client": args.streams_per_client,
                   "connections": "one a stream" if args.channel_per_stream
                   else "one a client process",
                   "router_workers": args.router_workers,
                   "router_agent_connections": args.router_agent_connections
                   or AGENT_CONNECTIONS,
                   "energy_source": meter.source, "idle_watts": meter.idle_w,
                   "note": "clients, router, agent and the in-process engine share this "
                   "machine's cores; tokens/s from each round's first start to its last "
                   "token"},
        "rows": rows,
        "targets": targets(rows),
    })
    print(report(result))
    common.write(result, args.out)
    if args.smoke:
        fields = [f"{arm}.{figure}" for arm in ARMS
                  for figure in ("tokens_per_s", "ttft_p50_ms", "tpot_p50_ms")]
        return common.smoke_exit({"rows": (rows, fields)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
