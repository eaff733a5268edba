"""Chaos: faults injected into the local system during a rollout, under paced
client load, with every request counted.

The local system of `tiered up` (an agent per tier, the router, the
controller, all real processes on loopback, supervised: a child that dies is
started again) serves digits v1; an open-loop client sends `--rate`
requests a second through the router, each with a `tiered-tier` hint for
the tier its client sits on (edge 60%, regional 25%, datacenter 15%, as
`make demo`'s traffic) and a 10 s deadline. Then v2 is applied and, during
its rollout, one fault at a time, each waited out:

- the edge agent SIGKILLed, then the regional agent (the supervisor starts
  each again on its port);
- the datacenter agent SIGSTOPped for 10 s, then SIGCONTed: a hung node,
  not a dead one (its connections stay open);
- the controller SIGKILLed (the supervisor starts another);
- the router restarted (SIGTERM, started again on its port by the supervisor);
- at the start of the rollout's second stage, the edge agent unreachable for
  `--offline` seconds (SIGSTOP: its port and connections stay open and
  nothing answers; SIGCONT brings it back).

Per fault window (from the fault to its recovery, plus a settle of 2 s):
requests sent, answered, failed by gRPC code, which tier answered (the
router's `tiered-tier` response parameter), latency p50/p99 and, where
requests failed, the span they were sent in. For the rollout, from the
decisions the controller recorded (the store's history, each at the time its
pass began): no advance or promote by a pass begun from an agent's fault to
its serving again, the edge-offline stage held saying its telemetry is
unreadable, and v2 promoted at the end, never going back a stage. A baseline
window with no fault comes first.

Targets: no failed request in any agent or controller fault window; for the
router restart, failures only in the restart window (the router's exit
until it listens again, plus 1.5 s for the client's reconnection: its
channel tries at least every 1.2 s, a backoff capped at 1 s with gRPC's
20% jitter, and the try takes a moment) and that window's length reported; the
rollout held, never promoted on partial data, resumed and promoted.

Run: `.venv/bin/python bench/chaos.py` (about 6 minutes; `--rate`,
`--offline`, `--out`); `make bench` runs it. `--smoke --out PATH` injects the
same faults with shorter stages (60 requests/s, edge offline 20 s, about 2
minutes); `make test` runs it and checks every target
(tests/integration/test_chaos.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

from bench import common
from tiered import names
from tiered.controller.reconciler import decode_status
from tiered.controller.store import StateStore
from tiered.controller.verbs import apply_file
from tiered.demo.rollouts import TIER_MIX, USERS
from tiered.local.processes import ServerProcess
from tiered.local.supervisor import (
    ControllerSettings,
    LocalSystem,
    LocalUp,
    RouterPorts,
    prepare_sample_models,
)
from tiered.rollout import snapshot

MODEL = "digits"
DEADLINE_S = 10.0  # each request's
RECOVERY_TIMEOUT_S = 120.0  # a restarted agent loads its models on a busy machine
CLIENT_RECONNECT_S = 1.0  # the client channel's longest wait between tries to reconnect
# gRPC spreads each wait by +-20%, and the try itself takes a moment on a
# busy machine: requests fail fast until it connects.
RECONNECTED_S = CLIENT_RECONNECT_S * 1.2 + 0.3
PASS_SPAN_S = 2.0  # a controller pass begun this long before a fault may read after it
TIERS = tuple(TIER_MIX)
ADVANCING = (names.Action.ADVANCE, names.Action.PROMOTE)


@dataclass(frozen=True)
class Settings:
    rate: float = 80.0
    baseline_s: float = 20.0
    stop_s: float = 10.0  # the hung datacenter agent
    offline_s: float = 60.0  # edge unreachable mid-stage
    first_stage_s: float = 150.0  # min duration of stage 1: the first five faults fit in it
    settle_s: float = 2.0  # a window runs this long past its fault's recovery


FULL = Settings()
# Stage 1 holds the first five faults: they took 31 s from its start on an
# idle machine (recoveries included), and 55 s leaves room for slower ones.
SMOKE = Settings(rate=60.0, baseline_s=3.0, offline_s=20.0, first_stage_s=55.0)


# --------------------------------------------------------------------------- load


@dataclass
class Sent:
    """One client request: when it was sent and how it ended."""

    sent: float  # wall clock, s
    hint: str
    ended: float | None = None
    code: str | None = None  # OK or the gRPC status code's name
    tier: str | None = None  # the tier that answered (the response's tiered-tier)
    latency_s: float | None = None
    detail: str = ""


class Load:
    """An open loop through the router: requests leave on a fixed schedule
    whatever the answers, each with its client's tier hint and user key."""

    def __init__(self, address: str, images: np.ndarray, rate_per_s: float, seed: int = 0):
        self.address = address
        self.images = images
        self.rate_per_s = rate_per_s
        self.seed = seed
        self.records: list[Sent] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> Load:
        self.started = time.time()  # before its first request: the first window's start
        self._thread.start()
        return self

    def finish(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S + 30)

    def since(self, t: float) -> list[Sent]:
        return [r for r in list(self.records) if r.sent >= t]

    async def _run(self) -> None:
        import grpc

        from tiered.protocol import grpc_service_pb2 as pb
        from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
        from tiered.protocol.codec import to_raw

        rng = np.random.default_rng(self.seed)
        requests = []
        for image in self.images[:256]:
            message = pb.ModelInferRequest(model_name=MODEL)
            datatype, shape, raw = to_raw(np.ascontiguousarray(image[None], np.float32))
            message.inputs.add(name="input", datatype=datatype, shape=shape)
            message.raw_input_contents.append(raw)
            requests.append(message)
        # A lost connection (the router restarting) is retried at least every
        # second, not on gRPC's default backoff of up to 120 s.
        options = [("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", int(CLIENT_RECONNECT_S * 1000))]
        async with grpc.aio.insecure_channel(self.address, options=options) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            pending: set[asyncio.Task] = set()

            async def send(record: Sent, request, metadata) -> None:
                started = time.perf_counter()
                try:
                    reply = await stub.ModelInfer(request, timeout=DEADLINE_S,
                                                  metadata=metadata)
                    record.code = "OK"
                    served = reply.parameters.get("tiered-tier")
                    record.tier = served.string_param if served is not None else None
                except grpc.aio.AioRpcError as error:
                    record.code = error.code().name
                    record.detail = (error.details() or "")[:200]
                record.latency_s = time.perf_counter() - started
                record.ended = time.time()

            tiers, shares = list(TIER_MIX), list(TIER_MIX.values())
            began, index = time.monotonic(), 0
            while not self._stop.is_set():
                await asyncio.sleep(max(0.0, began + index / self.rate_per_s - time.monotonic()))
                hint = str(rng.choice(tiers, p=shares))
                record = Sent(time.time(), hint)
                self.records.append(record)
                metadata = (("tiered-tier", hint), ("tiered-key", f"user-{rng.integers(USERS)}"))
                task = asyncio.create_task(
                    send(record, requests[index % len(requests)], metadata))
                pending.add(task)
                task.add_done_callback(pending.discard)
                index += 1
            if pending:
                await asyncio.wait(pending, timeout=DEADLINE_S + 5)


# --------------------------------------------------------------------------- the system


def spec(models: Path, variant: str, first_stage_s: float) -> dict[str, Any]:
    """digits at `variant`, rolled out in two stages: edge at 50% for at least
    `first_stage_s`, then every tier at 50% for at least 10 s; a stage undecided
    after 600 s more rolls back."""
    stage = {"min_requests": 40, "max_duration_s": 600 + first_stage_s}
    return {
        "apiVersion": "tiered.dev/v1alpha1", "kind": "TieredModel",
        "metadata": {"name": MODEL},
        "spec": {
            "artifact": {"uri": str(models / f"digits-{variant}.onnx"),
                         "calibration": str(models / "digits-calibration.npz"),
                         "eval": str(models / "digits-eval.npz")},
            "tiers": {tier: {"batching": {"max_batch_size": 1}}
                      | ({"engine": "onnxruntime", "precision": "fp32"}
                         if tier == "datacenter" else {}) for tier in TIERS},
            "rollout": {
                "stages": [{"name": "edge", "weights": {"edge": 50},
                            "min_duration_s": first_stage_s, **stage},
                           {"name": "wide", "weights": {t: 50 for t in TIERS},
                            "min_duration_s": 10, **stage}],
                # Loose latency tests: the faults stall and restart the agents
                # mid-stage, which moves every latency the stage sees (beside a
                # busy loop the healthy v2's edge median moved 1.11x, past the
                # default shift bound of 1.05, and v2 was rolled back).
                "analysis": {"latency_p95": {"max_ratio": 1.5},
                             "latency_shift": {"max_ratio": 1.5},
                             "agreement": {"min": 0.9}, "min_samples": 50, "interval_s": 1,
                             "consecutive_failure_limit": 2},
                "shadow_fraction": 0.3,
            },
        },
    }


def wait(condition: Callable[[], Any], timeout_s: float, what: str, period_s: float = 0.1):
    """`condition()` once it is truthy; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(period_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def listening(process: ServerProcess) -> bool:
    """Whether this run of the process has said it listens (it serves then)."""
    return process.alive() and "listening on" in process.log()


def family(pid: int) -> list[int]:
    """The process and its descendants."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            queue += [int(child) for child in task.read_text().split()]
    return found


class Chaos:
    """The local system under load, and the faults: each returns its window."""

    def __init__(self, local: LocalUp, store: StateStore, load: Load, settle_s: float,
                 progress: Callable[[str], None]):
        self.local = local
        self.store = store
        self.load = load
        self.settle_s = settle_s
        self.progress = progress
        self.windows: list[dict[str, Any]] = []
        self._mark: float | None = None  # where the last window ended: the next one starts

    def rollout(self):
        return decode_status(MODEL, self.store.get(MODEL).status).rollout

    def _served_by(self, tier: str, after: float) -> bool:
        return any(r.code == "OK" and r.tier == tier for r in self.load.since(after))

    def _window(self, fault: str, how: str, start: float, recovered: float, **extra) -> None:
        """A fault's window: requests sent from the end of the last window (just
        before the fault; a request in flight when it struck is its) to its
        recovery plus `settle_s`."""
        time.sleep(self.settle_s)
        rollout = self.rollout() if self.store.get(MODEL) is not None else None
        window = {"fault": fault, "how": how, "from": self._mark or start, "start": start,
                  "recovered": recovered, "end": time.time(),
                  "stage_index": rollout.stage_index if rollout is not None else None, **extra}
        self.windows.append(window)
        self._mark = window["end"]
        self.progress(f"{fault}: recovered {recovered - start:.1f} s after")

    def baseline(self, seconds: float) -> None:
        self._mark = self.load.started  # every request sent falls in a window
        time.sleep(seconds)
        self.quiet("none (baseline)", f"{seconds:g} s of load")

    def quiet(self, label: str, how: str = "no fault") -> None:
        """The requests sent since the last window, no fault injected: every
        request sent falls in one window."""
        now = time.time()
        self.windows.append({"fault": label, "how": how, "from": self._mark, "start": self._mark,
                             "recovered": now, "end": now})
        self._mark = now

    def kill_agent(self, tier: str) -> None:
        agent = self.local.agents[tier][0]  # the tier's one agent here (no autoscaling)
        old, start = agent.pid, time.time()
        os.kill(old, signal.SIGKILL)
        self.progress(f"{tier} agent SIGKILLed (pid {old})")
        wait(lambda: agent.pid != old and listening(agent), RECOVERY_TIMEOUT_S,
             f"the supervisor restarting the {tier} agent")
        restarted = time.time()  # it serves its models again
        wait(lambda: self._served_by(tier, restarted), RECOVERY_TIMEOUT_S,
             f"the router sending to the {tier} agent again")
        self._window(f"{tier} agent SIGKILL", "supervisor restarts it on its port", start,
                     time.time(), tier=tier, agent_back=restarted)

    def stop_agent(self, tier: str, seconds: float, fault: str) -> None:
        """SIGSTOP for `seconds`, then SIGCONT: unreachable, its sockets open."""
        pids, start = family(self.local.agents[tier][0].pid), time.time()
        for pid in pids:  # front-end processes too, where the agent has them
            os.kill(pid, signal.SIGSTOP)
        self.progress(f"{tier} agent SIGSTOPped for {seconds:g} s (pids {pids})")
        try:
            time.sleep(seconds)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        resumed = time.time()
        wait(lambda: self._served_by(tier, resumed), RECOVERY_TIMEOUT_S,
             f"the router sending to the {tier} agent again")
        self._window(fault, f"SIGSTOP {seconds:g} s, then SIGCONT", start, time.time(),
                     tier=tier, agent_back=resumed)

    def kill_controller(self) -> None:
        old, start = self.local.controller.pid, time.time()
        os.kill(old, signal.SIGKILL)
        self.progress(f"controller SIGKILLed (pid {old})")
        wait(lambda: self.local.controller.pid != old and self.local.controller.poll() is None,
             RECOVERY_TIMEOUT_S, "the supervisor restarting the controller")
        restarted = time.time()
        wait(lambda: any(t > restarted for _, t, _ in self.store.history(MODEL)),
             RECOVERY_TIMEOUT_S, "the new controller recording a pass")
        self._window("controller SIGKILL", "supervisor starts another", start, time.time())

    def restart_router(self) -> None:
        router = self.local.router
        old, start = router.pid, time.time()
        os.kill(old, signal.SIGTERM)
        self.progress(f"router SIGTERMed (pid {old})")
        wait(lambda: not router.alive() or router.pid != old, 60, "the router exiting")
        exited = time.time()
        wait(lambda: router.pid != old and listening(router), RECOVERY_TIMEOUT_S,
             "the supervisor restarting the router")
        listening_at = time.time()
        wait(lambda: any(r.code == "OK" for r in self.load.since(listening_at)),
             RECOVERY_TIMEOUT_S, "an answer through the new router")
        self._window("router restart", "SIGTERM, supervisor restarts it on its port", start,
                     time.time(), exited=exited, listening=listening_at)


# --------------------------------------------------------------------------- figures


def tally(records: Sequence[Sent], window: dict[str, Any]) -> dict[str, Any]:
    """What became of the requests sent in the window."""
    inside = [r for r in records if window["from"] <= r.sent < window["end"]]
    answered = [r for r in inside if r.code == "OK"]
    failed = [r for r in inside if r.code not in (None, "OK")]
    latencies = [r.latency_s for r in answered]
    row = {
        "fault": window["fault"], "how": window["how"],
        "seconds": round(window["end"] - window["from"], 1),
        "recovery_s": round(window["recovered"] - window["start"], 1),
        "sent": len(inside), "answered": len(answered), "failed": len(failed),
        "unfinished": len(inside) - len(answered) - len(failed),
        "failed_by_code": dict(Counter(r.code for r in failed)),
        "failure_samples": sorted({r.detail for r in failed})[:3],
        "answered_by_tier": dict(Counter(r.tier for r in answered)),
        **{k: v for k, v in common.percentiles_ms(latencies).items()
           if k in ("p50_ms", "p99_ms")},
        "failed_from_s": None, "failed_to_s": None,
    }
    if failed:  # when, after the fault (before it: < 0), the failed requests were sent
        row["failed_from_s"] = round(min(r.sent for r in failed) - window["start"], 2)
        row["failed_to_s"] = round(max(r.sent for r in failed) - window["start"], 2)
    if "tier" in window:  # requests meant for the faulty tier, and who answered them
        meant = [r for r in answered if r.hint == window["tier"]]
        row["hinted_tier"] = window["tier"]
        row["hinted_answered_by"] = dict(Counter(r.tier for r in meant))
    if "listening" in window:  # the router restart: its window, and failures outside it
        closes = window["listening"] + RECONNECTED_S
        row["restart_window_s"] = round(closes - window["start"], 2)
        row["router_down_s"] = round(window["listening"] - window["start"], 2)
        row["failed_outside_restart"] = sum(1 for r in failed if r.sent >= closes)
    return row


def rollout_checks(history: Sequence[tuple[int, float, dict]], windows: Sequence[dict],
                   version: int) -> dict[str, Any]:
    """What the controller decided during the agents' faults, from its history."""
    snaps = [(t, snapshot.from_record(kept)) for _, t, kept in history]
    mine = [(t, s) for t, s in snaps if s.canary_version == version
            or (s.stable_version == version and s.action == names.Action.PROMOTE)]
    faults = []
    for window in windows:
        if "tier" not in window:
            continue
        # A decision is recorded at the time its pass began, before it read the
        # agents: those begun from the fault until the agent served again read
        # while it was away, and so may one begun a pass before the fault.
        start, back = window["start"], window["agent_back"]
        during = [s for t, s in mine if start <= t <= back]
        around = [s for t, s in mine if start - PASS_SPAN_S <= t <= back]
        faults.append({
            "fault": window["fault"],
            "passes": len(during),
            "advanced_or_promoted": sum(1 for s in during if s.action in ADVANCING),
            "held_unreadable": sum(1 for s in around if s.action == names.Action.HOLD
                                   and "telemetry unreadable" in s.reason),
            "stages": sorted({s.stage_index for s in during}),
            "decided_after": next((f"{s.action}: {s.reason[:80]}" for t, s in mine
                                   if t > back and "telemetry unreadable" not in s.reason),
                                  None),
        })
    stages = [s.stage_index for _, s in mine if s.canary_version == version]
    return {
        "faults": faults,
        "went_back_a_stage": any(b < a for a, b in zip(stages, stages[1:])),
        "rolled_back": any(s.action == names.Action.ROLLBACK for _, s in mine),
        "promoted": any(s.action == names.Action.PROMOTE for _, s in mine),
        "decisions": [{"t": round(t - windows[0]["start"], 1), "action": s.action,
                       "stage": s.stage_index, "reason": s.reason[:160]}
                      for t, s in mine if s.action != names.Action.HOLD
                      or "telemetry unreadable" in s.reason],
    }


def targets(rows: Sequence[dict], checks: dict[str, Any]) -> list[common.Target]:
    found = []
    for row in rows:
        if "restart_window_s" in row:
            found.append(common.judge(row["fault"], "failed requests sent outside the restart "
                                      "window", row["failed_outside_restart"], "<=", 0))
        else:
            found.append(common.judge(row["fault"], "failed requests", row["failed"], "<=", 0))
    for fault in checks["faults"]:
        found.append(common.judge(f"{fault['fault']}: rollout", "advances or promotes while "
                                  "its telemetry is unreadable",
                                  fault["advanced_or_promoted"], "<=", 0))
    offline = next((f for f in checks["faults"] if f["fault"].startswith("edge offline")), None)
    found += [
        common.judge("edge offline: stage held", "holds saying telemetry unreadable",
                     offline["held_unreadable"] if offline else None, ">=", 1),
        common.judge("rollout", "went back a stage or rolled back (0/1)",
                     float(checks["went_back_a_stage"] or checks["rolled_back"]), "<=", 0),
        common.judge("rollout", "v2 promoted after the faults (0/1)",
                     float(checks["promoted"]), ">=", 1),
    ]
    return found


# --------------------------------------------------------------------------- the run


def run(settings: Settings, work: Path, models: Path,
        progress: Callable[[str], None] = common.progress) -> dict[str, Any]:
    """Start the system, inject the faults, stop it all: the figures."""
    prepare_sample_models(models, progress)
    images = np.load(models / "digits-eval.npz")["input"]
    local = LocalUp(LocalSystem(state_dir=str(work / "state"), router=RouterPorts(port=0),
                                controller=ControllerSettings(interval_s=0.5)),
                    work, progress=lambda line: None)
    stop = threading.Event()
    supervisor = threading.Thread(target=local.supervise, args=(stop,), daemon=True)
    load: Load | None = None
    try:
        running = local.start()
        supervisor.start()
        with StateStore(local.layout.store) as store:
            document = work / "digits.yaml"
            apply(store, document, spec(models, "v1", settings.first_stage_s))
            wait(lambda: (s := decode_status(MODEL, store.get(MODEL).status).rollout)
                 is not None and s.stable_version == 1, 300, "v1 serving")
            from tiered.demo.rollouts import _wait_until_served

            _wait_until_served(running.router, images[:1], progress, timeout_s=120)
            load = Load(running.router, images, settings.rate).start()
            chaos = Chaos(local, store, load, settings.settle_s, progress)
            progress(f"load: {settings.rate:g} requests/s through {running.router}")
            chaos.baseline(settings.baseline_s)
            apply(store, document, spec(models, "v2", settings.first_stage_s))
            wait(lambda: (s := chaos.rollout()).canary_version == 2
                 and s.phase == names.Phase.PROGRESSING, 300, "v2 rolling out")
            progress("v2 rolling out: stage 1")
            chaos.quiet("none (v2 built, its rollout starts)")
            chaos.kill_agent("edge")
            chaos.kill_agent("regional")
            chaos.stop_agent("datacenter", settings.stop_s, "datacenter agent hung")
            chaos.kill_controller()
            chaos.restart_router()
            wait(lambda: chaos.rollout().stage_index >= 1
                 or chaos.rollout().phase != names.Phase.PROGRESSING, 900, "stage 2")
            if chaos.rollout().phase != names.Phase.PROGRESSING:
                raise RuntimeError(f"the rollout ended before stage 2: "
                                   f"{chaos.rollout().message}")
            progress("stage 2 started")
            chaos.quiet("none (the rest of stage 1)")
            chaos.stop_agent("edge", settings.offline_s,
                             f"edge offline {settings.offline_s:g} s mid-stage")
            wait(lambda: chaos.rollout().phase in (names.Phase.PROMOTED,
                                                   names.Phase.ROLLED_BACK), 600,
                 "the rollout's end")
            progress(f"rollout ended: {chaos.rollout().phase}")
            time.sleep(1.0)
            load.finish()
            chaos.quiet("none (to the end)")
            history = store.history(MODEL)
        records = load.records
        rows = [tally(records, w) for w in chaos.windows]
        checks = rollout_checks(history, chaos.windows, 2)
        return {"rows": rows, "rollout": checks, "windows": chaos.windows,
                "requests": {"sent": len(records),
                             "answered": sum(r.code == "OK" for r in records),
                             "failed": dict(Counter(r.code for r in records
                                                    if r.code not in (None, "OK"))),
                             "unfinished": sum(r.code is None for r in records)}}
    finally:
        for agent in (a for agents in local.agents.values() for a in agents):
            if agent.alive():  # never leave one stopped
                for pid in family(agent.pid):
                    os.kill(pid, signal.SIGCONT)
        if load is not None:
            load.finish()
        stop.set()
        supervisor.join(RECOVERY_TIMEOUT_S)
        local.stop()


def apply(store: StateStore, path: Path, document: dict[str, Any]) -> None:
    import yaml

    path.write_text(yaml.safe_dump(document))
    apply_file(store, path)


def print_tables(result: dict[str, Any], found: Sequence[common.Target]) -> None:
    rows = result["rows"]
    verdicts = {t.name: t.verdict for t in found if not t.name.endswith(": rollout")}

    def window(row: dict) -> str:
        if row["failed_from_s"] is None:
            return "-"
        return f"{row['failed_from_s']:.1f}-{row['failed_to_s']:.1f} s"

    print(common.table(
        ["fault", "sent", "answered", "failed", "failed sent at", "recovery s",
         "answered by tier", "p50 ms", "p99 ms"],
        [[r["fault"], r["sent"], r["answered"],
          r["failed"] + r["unfinished"]
          if not r["failed_by_code"] else f"{r['failed']} {r['failed_by_code']}",
          window(r), r["recovery_s"],
          " ".join(f"{t[0] if t else '?'}:{n}" for t, n in sorted(
              r["answered_by_tier"].items(), key=lambda kv: str(kv[0]))),
          _ms(r["p50_ms"]), _ms(r["p99_ms"])] for r in rows],
        [verdicts.get(r["fault"], "") for r in rows]))
    router = next((r for r in rows if "restart_window_s" in r), None)
    if router is not None:
        print(f"\nrouter restart: down {router['router_down_s']} s (exit to listening), "
              f"restart window {router['restart_window_s']} s; "
              f"{router['failed_outside_restart']} failed outside it")
    print()
    print(common.targets_table(found))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, help=f"requests a second (default {FULL.rate:g})")
    parser.add_argument("--offline", type=float,
                        help=f"seconds edge is unreachable mid-stage (default {FULL.offline_s:g})")
    parser.add_argument("--models", type=Path, default=REPO_ROOT / "build" / "models",
                        help="the digits models (trained there when missing)")
    common.add_arguments(parser, "chaos")
    args = common.parse(parser, argv, "chaos")
    settings = SMOKE if args.smoke else FULL
    if args.rate:
        settings = Settings(**{**settings.__dict__, "rate": args.rate})
    if args.offline:
        settings = Settings(**{**settings.__dict__, "offline_s": args.offline})
    result = common.record("chaos", args.smoke)
    with tempfile.TemporaryDirectory(prefix="tiered-chaos-") as work:
        figures = run(settings, Path(work), args.models.resolve())
    found = targets(figures["rows"], figures["rollout"])
    result.update({"settings": settings.__dict__, "deadline_s": DEADLINE_S, **figures,
                   "targets": found})
    common.write(result, args.out)
    print_tables(result, found)
    if args.smoke:
        return common.smoke_exit({"rows": (figures["rows"], ("sent", "answered", "p50_ms"))}) \
            or (0 if common.overall(found) == "PASS" else 1)
    return 0 if common.overall(found) == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
