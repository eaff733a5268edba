"""The controller's side of judging a generative model: agents' Stats replies
with a Generation (built by the agent's own recorder and message code) read
into per-tier TTFT and TPOT samples, output tokens and J/token windows,
through the stage accumulator (and a restart) to the rollout engine's
decision; the headline numbers, progress line and report that name them."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from tiered import names
from tiered.controller import plan, verbs
from tiered.controller.judge import readings_of
from tiered.controller.measure import StageAccumulator, VersionReading
from tiered.controller.plan import make_snapshot
from tiered.demo import report
from tiered.protocol import telemetry_messages
from tiered.protocol import telemetry_pb2 as tpb
from tiered.rollout import engine
from tiered.rollout.progress import progress_line
from tiered.rollout.snapshot import from_history
from tiered.rollout.spec import load_tiered_model
from tiered.rollout.status import TieredModelStatus
from tiered.telemetry.histogram import GROWTH, LOWEST_S
from tiered.telemetry.recorder import VersionEnergy, VersionRecorder

STABLE, CANARY = 1, 2
POLL_S = 10.0
TOKENS = 12  # output tokens a request
SPEC = load_tiered_model({
    "name": "chat", "kind": "generative",
    "artifact": {"uri": "checkpoints/tinyllama-v2", "sha256": "ab" * 32},
    "tiers": {"edge": {}, "regional": {}},
    "rollout": {"stages": [{"name": "edge-20", "weights": {"edge": 20}, "min_requests": 600,
                            "min_duration_s": 60, "max_duration_s": 600},
                           {"name": "all", "weights": {"edge": 50, "regional": 50}}],
                "analysis": {"agreement": None, "interval_s": POLL_S,
                             "energy_per_token": {"min_windows": 3}}}})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Agent:
    """One edge agent serving stable and canary, as far as its telemetry goes:
    each version's recorder gets every request and token, and `stats`
    answers as TelemetryServicer.Stats does (version_stats + generation_stats
    over the span since the cursor)."""

    def __init__(self, tpot_factor: float = 1.0, ttft_tail: float = 1.0, seed: int = 0,
                 with_generation: bool = True) -> None:
        self.clock = Clock()
        self.rng = np.random.default_rng(seed)
        self.recorders = {v: VersionRecorder(self.clock, random.Random(v)) for v in (1, 2)}
        self.tpot_factor, self.ttft_tail = tpot_factor, ttft_tail
        self.with_generation = with_generation
        self.cursor = self.clock.now
        self.ttfts: dict[int, list[float]] = {1: [], 2: []}  # every one recorded

    def serve(self, requests: dict[int, int]) -> None:
        """One poll interval of traffic; the clock ends at its end."""
        for version, count in requests.items():
            recorder = self.recorders[version]
            canary = version == CANARY
            for _ in range(count):
                ttft = self.rng.lognormal(math.log(0.120), 0.4)
                if canary and ttft > 0.2:  # the slowest 10%, median unchanged
                    ttft *= self.ttft_tail
                gaps = self.rng.lognormal(math.log(0.015), 0.2, TOKENS - 1) * (
                    self.tpot_factor if canary else 1.0)
                recorder.token(ttft, first=True)
                self.ttfts[version].append(ttft)
                for gap in gaps:
                    recorder.token(float(gap), first=False)
                recorder.request_succeeded(ttft + float(gaps.sum()), 0.0, 0.01, 1)
                recorder.batch_ran(0.01, "cpu", 1)
        self.clock.now += POLL_S

    def stats(self) -> tpb.StatsResponse:
        end = self.clock.now
        reply = tpb.StatsResponse(tier="edge", start=self.cursor, end=end, window_s=60.0,
                                  instance="agent-1")
        for version, recorder in self.recorders.items():
            summary = recorder.since(self.cursor, end)
            energy = VersionEnergy(0.02 * summary.output_tokens, 0.02 * TOKENS, "nvml", 5.0)
            stats = telemetry_messages.version_stats("chat", version, "cuda", summary, energy,
                                                     0, 0, LOWEST_S, GROWTH)
            if self.with_generation:
                stats.generation.CopyFrom(telemetry_messages.generation_stats(
                    summary, energy, end - self.cursor, 3, 8, LOWEST_S, GROWTH))
            reply.versions.append(stats)
        self.cursor = end
        return reply


def roll(agent: Agent, restart_at: int | None = None, polls: int = 60
         ) -> tuple[engine.Decision, StageAccumulator]:
    """Poll the agent every interval into the stage's samples and decide,
    as RolloutJudge and the plan do, until the stage is decided; at
    `restart_at` the samples go through the status (JSON) as after a
    controller restart."""
    status = engine.start(SPEC, STABLE, CANARY, agent.clock.now)
    acc = StageAccumulator(CANARY, 0, np.random.default_rng(1), {})
    for poll in range(1, polls + 1):
        agent.serve({STABLE: 80, CANARY: 20})
        acc.add(readings_of("edge", agent.stats()), window=poll)
        if poll == restart_at:
            acc = StageAccumulator.restore(json.loads(json.dumps(acc.state())),
                                           np.random.default_rng(2))
        decision = engine.decide(SPEC, status, acc.measurements(STABLE, ["edge"], poll),
                                 agent.clock.now)
        status = decision.status
        if decision.action != names.Action.HOLD:
            break
    return decision, acc


def test_a_stats_reply_with_a_generation_reads_into_token_samples():
    agent = Agent()
    agent.serve({STABLE: 30, CANARY: 5})
    stable, canary = readings_of("edge", agent.stats())
    assert (canary.version, canary.success, canary.output_tokens) == (CANARY, 5, 5 * TOKENS)
    assert sum(count for _, count in canary.first_token_s) == 5
    assert sum(count for _, count in canary.per_token_s) == 5 * (TOKENS - 1)
    assert canary.joules_per_output_token == pytest.approx(0.02)
    assert canary.energy_source == "nvml"
    # Each histogram value stands for its bucket, within 1% of every value in it.
    read = sorted(seconds for seconds, count in stable.first_token_s for _ in range(count))
    assert read == pytest.approx(sorted(agent.ttfts[STABLE]), rel=0.01)


def test_a_version_without_generation_reads_as_no_tokens():
    agent = Agent(with_generation=False)
    agent.serve({STABLE: 30, CANARY: 5})
    canary = readings_of("edge", agent.stats())[1]
    assert (canary.output_tokens, canary.first_token_s, canary.per_token_s,
            canary.joules_per_output_token) == (0, (), (), None)


def test_tpot_is_drawn_one_a_request_and_ttft_kept_whole():
    acc = StageAccumulator(CANARY, 0, np.random.default_rng(0), {})
    reading = VersionReading("edge", CANARY, 10, 0, output_tokens=120,
                             first_token_s=((0.1, 6), (0.2, 4)),
                             per_token_s=((0.010, 100), (0.020, 10)),
                             joules_per_output_token=0.5, energy_source="rapl")
    acc.add([reading, VersionReading("edge", STABLE, 1, 0, per_token_s=((0.01, 3),))],
            window=7)
    canary = acc.measurements(STABLE, ["edge"]).tiers["edge"].canary
    assert sorted(canary.ttft_ms) == pytest.approx([100.0] * 6 + [200.0] * 4)
    assert len(canary.tpot_ms) == 10 and set(canary.tpot_ms) <= {10.0, 20.0}
    assert (canary.output_tokens, canary.joules_per_token, canary.energy_source) == (
        120, (0.5,), "rapl")
    # Fewer intervals than requests: every one is kept.
    stable = acc.measurements(STABLE, ["edge"]).tiers["edge"].stable
    assert stable.tpot_ms == pytest.approx((10.0,))


def test_a_canary_30_percent_slower_per_token_is_rolled_back_on_tpot_p95():
    decision, _ = roll(Agent(tpot_factor=1.3, seed=3))
    assert decision.action == names.Action.ROLLBACK, decision.reason
    failed = decision.analysis.with_outcome(names.Outcome.FAILED)
    assert [m.label for m in failed] == ["tpot_p95 on edge"], decision.analysis.summary()
    assert failed[0].numbers["p95_ratio"] == pytest.approx(1.3, rel=0.1)


def test_a_slower_ttft_tail_is_caught_by_ttft_p95_across_a_controller_restart():
    decision, _ = roll(Agent(ttft_tail=1.5, seed=4), restart_at=15)
    assert decision.action == names.Action.ROLLBACK, decision.reason
    assert "ttft_p95 on edge" in decision.reason and "tpot" not in decision.reason


def test_an_unchanged_canary_passes_the_stage():
    decision, acc = roll(Agent(seed=5), restart_at=20)
    assert decision.action == names.Action.ADVANCE, decision.reason
    assert decision.analysis.verdict == names.Outcome.SUCCESSFUL
    judged = {m.metric for m in decision.analysis.metrics}
    assert judged == {"ttft_p95", "ttft_shift", "tpot_p95", "error_rate", "energy_per_token"}


def test_missing_token_telemetry_holds_inconclusive_until_the_stage_ends():
    decision, _ = roll(Agent(seed=6, with_generation=False))
    assert decision.action == names.Action.PAUSE  # onUndecided: pause, the default
    assert "undecided at maxDurationSeconds" in decision.reason
    pending = {m.metric for m in decision.analysis.with_outcome(names.Outcome.INCONCLUSIVE)}
    assert pending == {"ttft_p95", "ttft_shift", "tpot_p95", "energy_per_token"}


def test_a_restored_stage_keeps_tokens_and_j_per_token_exact_and_timings_within_1_percent():
    _, acc = roll(Agent(seed=7), polls=5)
    restored = StageAccumulator.restore(json.loads(json.dumps(acc.state())),
                                        np.random.default_rng(9))
    for version in ("stable", "canary"):
        old, new = (getattr(a.measurements(STABLE, ["edge"]).tiers["edge"], version)
                    for a in (acc, restored))
        assert (new.output_tokens, new.joules_per_token) == (old.output_tokens,
                                                             old.joules_per_token)
        for field in ("ttft_ms", "tpot_ms"):
            assert sorted(getattr(new, field)) == pytest.approx(sorted(getattr(old, field)),
                                                                rel=0.01)
    # A stage kept before generative figures existed still restores.
    state = acc.state()
    for kept in state["series"]:
        for key in ("output_tokens", "ttft_seen", "ttft_buckets", "tpot_seen", "tpot_buckets",
                    "token_energy"):
            kept.pop(key)
    assert StageAccumulator.restore(state, np.random.default_rng(0)).measurements(
        STABLE, ["edge"]).tiers["edge"].canary.ttft_ms == ()


# --- what the numbers are called where people read them -------------------------

def summary_numbers():
    _, acc = roll(Agent(seed=8), polls=6)
    return acc.summary(STABLE, ["edge"], SPEC.kind)


def test_the_summary_of_a_generative_stage_gives_ttft_tpot_and_j_per_token():
    figures = summary_numbers()
    stable, canary = figures.stable, figures.canary
    assert stable.requests == 480 and canary.output_tokens == 1440
    assert 150 < stable.ttft_p95_ms < 300
    assert 15 < canary.tpot_p95_ms < 30
    assert canary.jpt == pytest.approx(0.02)
    assert figures.tiers["edge"].canary.tpot_p95_ms == canary.tpot_p95_ms
    assert canary.energy_source == "nvml"
    assert (stable.p95_ms, stable.jpi) == (None, None)  # not what it is judged on


def test_the_progress_line_shows_ttft_tpot_and_mj_per_token():
    figures = summary_numbers()
    snap = make_snapshot(SPEC, engine.start(SPEC, 1, 2, 0.0), "hold", "waiting", figures)
    line = progress_line(0.0, snap)
    assert (f"canary n 120 ttft p95 {figures.canary.ttft_p95_ms:.2f} ms tpot p95 "
            f"{figures.canary.tpot_p95_ms:.2f} ms 20.000 mJ/tok") in line
    assert "(nvml)" in line and "mJ/inf" not in line


def test_the_report_labels_ttft_tpot_and_j_per_token():
    figures = summary_numbers()
    history = [(t, make_snapshot(SPEC, engine.start(SPEC, 1, 2, 0.0), action, "r", figures))
               for t, action in ((0, "start"), (10, "hold"))]
    page = report.render_html(history, "t", {}, verbs.report_thresholds(SPEC))
    for said in ("TTFT p95 on edge", "TPOT p95 on edge", "Energy per output token (nvml) on edge",
                 "Rollouts of generative models", "TTFT p95 canary (ms)", "J/token canary",
                 "Per tier: TTFT, TPOT and energy per output token", "limit (1.05 x stable)",
                 "limit (1.1 x stable)"):
        assert said in page, said
    assert "p95 latency" not in page and "Energy per inference" not in page
    final = report.report_json(history, "t", {})["rollouts"][0]
    assert final["kind"] == "generative"
    assert final["final"]["jpt_canary"] == pytest.approx(0.02)


def test_a_kubernetes_status_history_of_a_generative_rollout_reports_the_same():
    step = plan._step(SPEC, engine.start(SPEC, 1, 2, 0.0), "start", "go", 5.0,
                      summary_numbers())
    assert step.sources == {"jpt_stable": "nvml", "jpt_canary": "nvml"}
    (kept,) = from_history(SPEC, TieredModelStatus(history=(step,)))
    _, snap = kept
    assert snap.kind == "generative" and snap.figures.canary.energy_source == "nvml"
    page = report.render_html([kept], "t", {}, verbs.report_thresholds(SPEC))
    assert "Energy per output token (nvml) on edge" in page
