"""Detection power of the rollout judge at the settings users run, beside a
Flagger-style fixed threshold, on simulated traffic.

Seeded rollouts go through the real `tiered.rollout.engine.decide`, one look
per `interval_s`, with each stage's timing (weights, min_requests,
min_duration_s, max_duration_s) and analysis taken from the settings:
examples/digits.yaml ("local"), examples/digits-v2.yaml ("demo": the
demo's pace, a rollout in a minute or two), examples/kubernetes/digits.yaml
("kubernetes") and the spec defaults ("defaults": three stages shaped like
the examples', every other field the spec's default). Each scenario runs
with 5% and with 20% canary traffic in the first stage; later stages keep
the settings' weights.

Traffic: --rate requests/s (100) through each tier, Poisson; each request
goes to the canary with the stage's weight. The judge sees what the
controller collects (`tiered.controller.measure`): per tier and version the
stage's cumulative requests and errors, a uniform latency reservoir of
RESERVOIR samples, one J/inference figure per window, and the router's
cumulative shadow comparisons (shadow_fraction of the stable requests on the
stage's tiers). Latency is lognormal (median 6, 4, 2.5 ms on edge, regional,
datacenter; sigma 0.5: edge p95 14 ms, inside the Kubernetes example's 25 ms
bound); errors 0.5%; J/inference 0.5, 1, 2 J per window, lognormal noise of
sqrt(0.05^2 + 0.3^2 / n) for a window of n inferences, standing for a measured
counter (source nvml: the judge tests only measured energy unless a spec sets
allow_modeled); agreement 100%.

Scenarios: (a) every canary latency +20%; (b) the canary's slowest 10% x1.5,
median unchanged; (c) canary errors 0.5% -> 2%; (d) canary J/inference +30%;
(e) agreement 100% -> 90%; (f) an unchanged canary; (g) an unchanged canary
while both versions run 2x slower in 10 s bursts (a quarter of the 10 s
blocks on each tier: a noisy neighbour).

Outcomes per rollout: caught (rolled back on a Failed analysis, so within its
stage's maxDurationSeconds), timed out (undecided at maxDurationSeconds:
paused under onUndecided's default, rolled back under onUndecided: rollback)
or promoted. Targets: a regression caught in >= 99% of rollouts; an
unchanged canary stopped (either way) in <= 0.5%. Each rate comes with its 95%
Wilson interval: 100 rollouts a regression row and 150 an unchanged one
(three times as many for the demo's cheap rows) bound what a few minutes on
two cores can show.

Beside each row, a Flagger-style check on the same seeds (identical traffic
until the two arms' stages diverge): at each look, per tier, the canary's p95
over that interval's requests against 1.1 x stable's, 5 failed checks in a
row roll back; stages advance on the same min_requests and min_duration_s.
It judges latency only, as its name says.

Before the simulation, the evidence each stage of the demo's files can
collect (`stage_evidence`, exact, no simulation): at the demo's own traffic
(`tiered.demo.rollouts`: 80 requests/s over the tiers in its client mix; the
generative act's `tiered load` at 20/s over three tiers), how many seconds
a healthy canary's stage needs before every test can pass (min samples per
version, a bound on stable's p95, agreement shown above its min at the
agreement the demo's healthy versions have, the stage's minRequests and
minDurationSeconds), against its maxDurationSeconds. Target: each stage
decides a healthy version in at most half its maximum duration, so that a
machine serving at half the pace still decides it.

`--smoke --out PATH` runs two rollouts per row of the demo's settings, to
show the bench still runs (its rates mean nothing); the evidence table is
the same in both modes.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

from bench import common  # noqa: E402
from tiered import names  # noqa: E402
from tiered.controller.measure import RESERVOIR, WINDOWS  # noqa: E402
from tiered.rollout import engine  # noqa: E402
from tiered.rollout.analysis import (  # noqa: E402
    Measurements,
    TierSamples,
    VersionSamples,
    binomial_log_e,
    rollout_tests,
)
from tiered.rollout.analysis import quantile_upper_rank as engine_quantile_rank  # noqa: E402
from tiered.rollout.spec import TieredModel, load_tiered_model  # noqa: E402
from tiered.rollout.wire import to_plain  # noqa: E402

SHARES = (5.0, 20.0)
# Rollouts per row. A regression's rollout ends when it is caught; an
# unchanged canary's runs every stage to promotion, hundreds of looks, so
# those rows cost the most. The demo's short stages are cheap: more of them.
TRIALS = {"regression": 100, "unchanged": 150}
MORE_TRIALS = {"demo": 3}
SMOKE_TRIALS, SMOKE_PROFILE = 2, "demo"
CAUGHT_TARGET, FALSE_ROLLBACK_TARGET = 0.99, 0.005
FLAGGER_RATIO, FLAGGER_CHECKS = 1.1, 5


# --------------------------------------------------------------------------- what is simulated


@dataclass(frozen=True)
class Traffic:
    """How both versions behave when nothing regressed."""

    rate_per_tier: float = 100.0  # requests/s through each tier, both versions together
    median_ms: Mapping[str, float] = field(default_factory=lambda: {
        "edge": 6.0, "regional": 4.0, "datacenter": 2.5})
    sigma: float = 0.5  # of log latency
    error_rate: float = 0.005
    joules: Mapping[str, float] = field(default_factory=lambda: {
        "edge": 0.5, "regional": 1.0, "datacenter": 2.0})
    # sigma of log J/inference per window: a floor (meter, clocks) and what
    # averaging over the window's n inferences leaves: sqrt(floor^2 + spread^2 / n)
    energy_floor: float = 0.05
    energy_spread: float = 0.3
    burst_s: float = 10.0
    burst_share: float = 0.25  # of burst_s blocks, per tier
    burst_factor: float = 2.0


@dataclass(frozen=True)
class Scenario:
    key: str
    what: str
    regression: bool
    latency_scale: float = 1.0
    tail_scale: float = 1.0  # on the canary's slowest 10%
    canary_error: float | None = None  # None: the traffic's
    energy_scale: float = 1.0
    agreement: float = 1.0
    bursts: bool = False


SCENARIOS = (
    Scenario("a", "every latency +20%", True, latency_scale=1.2),
    Scenario("b", "slowest 10% x1.5", True, tail_scale=1.5),
    Scenario("c", "errors 0.5% -> 2%", True, canary_error=0.02),
    Scenario("d", "J/inference +30%", True, energy_scale=1.3),
    Scenario("e", "agreement 100% -> 90%", True, agreement=0.9),
    Scenario("f", "unchanged", False),
    Scenario("g", "unchanged, noisy neighbour", False, bursts=True),
)
ENERGY_SOURCE = "nvml"  # what the simulated J/inference stands for: a measured counter
_TAIL_Z = 1.2815515655446004  # standard normal 0.9 quantile: the slowest 10% start here


def profiles() -> dict[str, dict[str, Any]]:
    """The settings users run, as flat TieredModel documents (Python field names)."""
    def example(path: str) -> dict[str, Any]:
        document = yaml.safe_load((REPO_ROOT / "examples" / path).read_text())
        return to_plain(load_tiered_model(document), spell=None)

    defaults = {
        "name": "digits", "artifact": {"uri": "digits.onnx", "sha256": "0" * 64},
        "tiers": {"edge": {}, "regional": {}, "datacenter": {}},
        "rollout": {"stages": [
            {"name": "edge", "weights": {"edge": 5}},
            {"name": "region", "weights": {"edge": 50, "regional": 50}},
            {"name": "everywhere", "weights": {"edge": 50, "regional": 50, "datacenter": 50}},
        ]},
    }
    return {"local": example("digits.yaml"), "demo": example("digits-v2.yaml"),
            "kubernetes": example("kubernetes/digits.yaml"), "defaults": defaults}


def with_first_share(document: Mapping[str, Any], share: float) -> TieredModel:
    """The settings with the first stage's canary weight set to `share` percent."""
    stages = [dict(s) for s in document["rollout"]["stages"]]
    stages[0]["weights"] = {tier: share for tier, w in stages[0]["weights"].items() if w > 0}
    return load_tiered_model({**document, "rollout": {**document["rollout"], "stages": stages}})


# --------------------------------------------------------------------------- stage evidence

# What the demo's healthy versions are like: digits v2, retrained, answers as
# v1 does on about 98% of inputs (0.978-0.980 seen in demo runs); tinyllama v2
# gives the same greedy output.
DEMO_AGREEMENT = {"demo": 0.975, "demo-generative": 0.99}
EVIDENCE_MARGIN = 2.0  # maxDurationSeconds / the seconds a healthy stage needs


def demo_rates() -> dict[str, dict[str, float]]:
    """Requests/s per tier the demo's two acts send (both versions together)."""
    from tiered.demo import rollouts

    generative_rate = float(rollouts.GENERATIVE_LOAD[rollouts.GENERATIVE_LOAD.index(
        "--rate") + 1])
    return {"demo": {t: rollouts.RATE_PER_S * share for t, share in rollouts.TIER_MIX.items()},
            "demo-generative": {t: generative_rate / 3 for t in names.TIERS}}


def _least_n(passes: Any, start: int, limit: int = 10 ** 7) -> int | None:
    """The least n >= start with passes(n), by doubling then bisection
    (passes is monotone in n); None beyond limit."""
    high = max(start, 1)
    while not passes(high):
        high *= 2
        if high > limit:
            return None
    low = max(start, high // 2)
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if not passes(middle) else (low, middle)
    return high


def stage_evidence(profile: str, spec: TieredModel, rates: Mapping[str, float],
                   agreement: float) -> list[dict[str, Any]]:
    """Per stage: the seconds until a healthy canary (same latencies as
    stable, `agreement` with it) can pass each test of its analysis at
    `rates` requests/s per tier, the largest of them, and the stage's
    maxDurationSeconds against it."""
    analysis = spec.rollout.analysis
    alpha = (1 - analysis.confidence) / rollout_tests(analysis, spec.rollout.stages, spec.kind)
    judged = analysis.judged(spec.kind)
    tails = [m for m in ("latency_p95", "latency_p99", "ttft_p95") if m in judged]
    # Generative shadows are whole-text requests only (the rest stream).
    shadowed_share = 0.7 if spec.kind == names.ModelKind.GENERATIVE else 1.0
    rows = []
    for index, stage in enumerate(spec.rollout.stages):
        weights = {t: w / 100 for t, w in stage.weights.items() if w > 0}
        needs: dict[str, float] = {"minDurationSeconds": stage.min_duration_s,
                                   "minRequests": stage.min_requests
                                   / sum(rates[t] * w for t, w in weights.items())}
        for tier, w in weights.items():
            stable, canary = rates[tier] * (1 - w), rates[tier] * w
            needs[f"minSamples on {tier}"] = analysis.min_samples / min(stable, canary)
            for metric in tails:
                q = 0.99 if metric.endswith("p99") else 0.95
                n = _least_n(lambda n: engine_quantile_rank(n, q, alpha / 2) is not None, 1)
                needs[f"{metric} bound on {tier}"] = math.inf if n is None else n / stable
        if analysis.agreement is not None:
            shadows = spec.rollout.shadow_fraction * shadowed_share * sum(
                rates[t] * (1 - w) for t, w in weights.items())
            floor = math.log(1 / alpha)
            n = _least_n(lambda n: binomial_log_e(int(agreement * n), n, analysis.agreement.min)
                         >= floor, analysis.min_samples) if agreement > analysis.agreement.min \
                else None
            needs["agreement"] = math.inf if n is None or shadows == 0 else n / shadows
        slowest = max(needs, key=needs.get)
        seconds = needs[slowest]
        margin = stage.max_duration_s / seconds if seconds > 0 else math.inf
        rows.append({
            "profile": profile, "stage": index + 1, "name": stage.name,
            "weights": dict(stage.weights), "rates": dict(rates), "agreement": agreement,
            "needs_s": {k: round(v, 1) for k, v in needs.items()}, "slowest": slowest,
            "seconds": round(seconds, 1), "max_duration_s": stage.max_duration_s,
            "margin": round(margin, 2),
            "target": common.judge(f"{profile} stage {index + 1}", "a healthy canary decided "
                                   "within maxDurationSeconds / margin", margin, ">=",
                                   EVIDENCE_MARGIN)})
    return rows


def evidence_rows() -> list[dict[str, Any]]:
    documents = {"demo": "digits-v2.yaml", "demo-generative": "tinyllama-v2.yaml"}
    rates = demo_rates()
    return [row for profile, path in documents.items()
            for row in stage_evidence(profile, load_tiered_model(yaml.safe_load(
                (REPO_ROOT / "examples" / path).read_text())), rates[profile],
                DEMO_AGREEMENT[profile])]


def print_evidence(rows: Sequence[Mapping[str, Any]]) -> None:
    print("stage evidence: seconds until a healthy canary can pass every test at the demo's "
          "traffic (the slowest test named), against maxDurationSeconds")
    headers = ["settings", "stage", "needs s", "slowest", "max s", "margin", "target"]
    print(common.table(headers, [
        [r["profile"], f"{r['stage']} {r['name']}", r["seconds"], r["slowest"],
         f"{r['max_duration_s']:g}", r["margin"], f">= {EVIDENCE_MARGIN:g}"] for r in rows],
        [r["target"].verdict for r in rows]))


# --------------------------------------------------------------------------- one rollout


class _Series:
    """One version on one tier over a stage, as the controller accumulates it."""

    __slots__ = ("requests", "errors", "reservoir", "size", "seen", "windows", "last")

    def __init__(self) -> None:
        self.requests = self.errors = self.size = self.seen = 0
        self.reservoir = np.empty(RESERVOIR)
        self.windows: list[float] = []
        self.last = np.empty(0)  # this interval's latencies (the Flagger-style check)

    def add(self, latencies: np.ndarray, errors: int, joules: float | None,
            rng: np.random.Generator) -> None:
        self.requests += len(latencies)
        self.errors += errors
        self.last = latencies
        room = min(RESERVOIR - self.size, len(latencies))
        self.reservoir[self.size:self.size + room] = latencies[:room]
        self.size += room
        rest = latencies[room:]
        if len(rest):  # reservoir sampling: the i-th value seen stays with RESERVOIR / i
            position = self.seen + room + 1 + np.arange(len(rest))
            kept = rng.random(len(rest)) < RESERVOIR / position
            self.reservoir[rng.integers(0, RESERVOIR, int(kept.sum()))] = rest[kept]
        self.seen += len(latencies)
        if joules is not None:
            self.windows.append(joules)
            del self.windows[:-WINDOWS]

    def samples(self) -> VersionSamples:
        return VersionSamples(self.reservoir[:self.size], self.requests, self.errors,
                              self.windows, ENERGY_SOURCE)


@dataclass(frozen=True)
class Outcome:
    arm: str  # judge | flagger
    result: str  # caught | timed_out | promoted
    stage: int  # where it ended (0-based)
    seconds: float  # from the rollout's start
    looks: int
    metrics: tuple[str, ...] = ()  # the failed metrics that rolled it back


class _World:
    """The traffic of one seeded trial: what each look brings on each tier."""

    def __init__(self, scenario: Scenario, traffic: Traffic, seed: Sequence[int]) -> None:
        self.scenario, self.traffic = scenario, traffic
        self.rng = np.random.default_rng(list(seed))
        self.bursts: dict[str, np.ndarray] = {}

    def _burst_factor(self, tier: str, times: np.ndarray) -> np.ndarray | float:
        if not self.scenario.bursts:
            return 1.0
        blocks = (times / self.traffic.burst_s).astype(int)
        flags = self.bursts.get(tier, np.empty(0, bool))
        if blocks.max(initial=0) >= len(flags):
            more = self.rng.random(int(blocks.max()) + 1024 - len(flags)) < self.traffic.burst_share
            flags = self.bursts[tier] = np.r_[flags, more]
        return np.where(flags[blocks], self.traffic.burst_factor, 1.0)

    def serve(self, tier: str, weight: float, start: float, seconds: float,
              series: Mapping[str, _Series]) -> int:
        """One interval on one tier, into each version's series; returns the
        stable requests served (the router shadows a share of them)."""
        t, s, rng = self.traffic, self.scenario, self.rng
        arrivals = rng.poisson(t.rate_per_tier * seconds)
        to_canary = rng.random(arrivals) < weight / 100.0
        times = start + rng.random(arrivals) * seconds
        base = t.median_ms[tier] * np.exp(t.sigma * rng.standard_normal(arrivals))
        latency = base * self._burst_factor(tier, times)
        canary = latency[to_canary] * s.latency_scale
        if s.tail_scale != 1.0:
            slowest = base[to_canary] > t.median_ms[tier] * math.exp(t.sigma * _TAIL_Z)
            canary = np.where(slowest, canary * s.tail_scale, canary)
        canary_error = t.error_rate if s.canary_error is None else s.canary_error
        for version, values, error_rate, energy_scale in (
                ("stable", latency[~to_canary], t.error_rate, 1.0),
                ("canary", canary, canary_error, s.energy_scale)):
            noise = math.sqrt(t.energy_floor ** 2 + t.energy_spread ** 2 / max(len(values), 1))
            joules = (t.joules[tier] * energy_scale
                      * math.exp(noise * rng.standard_normal())) if len(values) else None
            series[version].add(values, int(rng.binomial(len(values), error_rate)), joules,
                                rng)
        return arrivals - len(canary)

    def shadow(self, stable_requests: int, fraction: float) -> tuple[int, int]:
        """This interval's shadow comparisons: (compared, agreed)."""
        compared = int(self.rng.binomial(stable_requests, fraction))
        return compared, int(self.rng.binomial(compared, self.scenario.agreement))


def _flagger_failing(stage_series: Mapping[str, Mapping[str, _Series]]) -> bool:
    """This interval's canary p95 above FLAGGER_RATIO x stable's on any tier."""
    for series in stage_series.values():
        canary, stable = series["canary"].last, series["stable"].last
        if len(canary) and len(stable) and (
                np.quantile(canary, 0.95) > FLAGGER_RATIO * np.quantile(stable, 0.95)):
            return True
    return False


def run_rollout(spec: TieredModel, scenario: Scenario, traffic: Traffic, seed: Sequence[int],
                arm: str) -> Outcome:
    """One rollout from its first stage to promotion or rollback."""
    world = _World(scenario, traffic, seed)
    interval = spec.rollout.analysis.interval_s
    status = engine.start(spec, 1, 2, 0.0)
    now, looks = 0.0, 0
    for index, stage in enumerate(spec.rollout.stages):
        weights = {tier: w for tier, w in stage.weights.items() if w > 0}
        series = {tier: {"stable": _Series(), "canary": _Series()} for tier in weights}
        compared = agreed = failures = 0
        began = now
        while True:
            start, now, looks = now, now + interval, looks + 1
            stable_served = sum(world.serve(tier, w, start, interval, series[tier])
                                for tier, w in weights.items())
            new_compared, new_agreed = world.shadow(stable_served,
                                                    spec.rollout.shadow_fraction)
            compared, agreed = compared + new_compared, agreed + new_agreed
            if arm == "judge":
                measurements = Measurements(
                    window=looks, stage=index,
                    tiers={tier: TierSamples(v["stable"].samples(), v["canary"].samples())
                           for tier, v in series.items()},
                    shadow_compared=compared, shadow_agreed=agreed)
                decision = engine.decide(spec, status, measurements, now)
                status = decision.status
                if decision.action == names.Action.ADVANCE:
                    break
                if decision.action == names.Action.PROMOTE:
                    return Outcome(arm, "promoted", index, now, looks)
                if decision.action in (names.Action.ROLLBACK, names.Action.PAUSE):
                    run = decision.analysis
                    if run is not None and run.verdict == names.Outcome.FAILED:
                        return Outcome(arm, "caught", index, now, looks, tuple(sorted(
                            {m.metric for m in run.with_outcome(names.Outcome.FAILED)})))
                    return Outcome(arm, "timed_out", index, now, looks)
                continue
            failing = _flagger_failing(series)
            failures = failures + 1 if failing else 0
            if failures >= FLAGGER_CHECKS:
                return Outcome(arm, "caught", index, now, looks, ("latency_p95",))
            served = sum(v["canary"].requests for v in series.values())
            if not failing and now - began >= stage.min_duration_s \
                    and served >= stage.min_requests:
                break
            if now - began >= stage.max_duration_s:
                return Outcome(arm, "timed_out", index, now, looks)
    return Outcome(arm, "promoted", len(spec.rollout.stages) - 1, now, looks)


# --------------------------------------------------------------------------- many rollouts


@dataclass(frozen=True)
class Task:
    profile: str
    share: float
    scenario: Scenario
    first: int  # trial numbers first..first+count-1
    count: int
    traffic: Traffic


def _run_task(task: Task) -> tuple[Task, list[Outcome]]:
    spec = with_first_share(profiles()[task.profile], task.share)
    row = (list(profiles()).index(task.profile), SHARES.index(task.share)
           if task.share in SHARES else 99, "abcdefg".index(task.scenario.key))
    outcomes = []
    for trial in range(task.first, task.first + task.count):
        for arm in ("judge", "flagger"):
            # Both arms on the same seed: the same traffic until their stages diverge.
            outcomes.append(run_rollout(spec, task.scenario, task.traffic, (*row, trial), arm))
    return task, outcomes


def tasks(profile_names: Sequence[str], trials: Mapping[str, int], traffic: Traffic,
          scale: Mapping[str, int], chunk: int = 25) -> Iterator[Task]:
    for profile in profile_names:
        for share in SHARES:
            for scenario in SCENARIOS:
                count = (trials["regression" if scenario.regression else "unchanged"]
                         * scale.get(profile, 1))
                for first in range(0, count, chunk):
                    yield Task(profile, share, scenario, first, min(chunk, count - first),
                               traffic)


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of a rate of k in n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(outcomes: Sequence[Outcome], regression: bool) -> dict[str, Any]:
    """One arm's figures over a row's rollouts."""
    n = len(outcomes)
    count = {r: sum(o.result == r for o in outcomes) for r in ("caught", "timed_out",
                                                                 "promoted")}
    caught = [o for o in outcomes if o.result == "caught"]
    # The rate the target judges: regressions caught, or good canaries rolled back.
    k = count["caught"] if regression else count["caught"] + count["timed_out"]
    low, high = wilson(k, n)
    seconds = sorted(o.seconds for o in caught)
    by_metric: dict[str, int] = {}
    for o in caught:
        for metric in o.metrics:
            by_metric[metric] = by_metric.get(metric, 0) + 1
    return {
        "rollouts": n, **count, "rate": k / n if n else None, "rate_ci95": [low, high],
        "caught_in_first_stage": sum(o.stage == 0 for o in caught),
        "median_s_to_catch": seconds[len(seconds) // 2] if seconds else None,
        "p99_s_to_catch": seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))]
        if seconds else None,
        "mean_s": sum(o.seconds for o in outcomes) / n if n else None,
        "mean_looks": sum(o.looks for o in outcomes) / n if n else None,
        "failed_metrics": by_metric,
    }


def rows_of(results: Mapping[tuple[str, float, str], list[Outcome]],
            settings: Mapping[str, TieredModel]) -> list[dict[str, Any]]:
    rows = []
    for (profile, share, key), outcomes in results.items():
        scenario = next(s for s in SCENARIOS if s.key == key)
        judge = summarize([o for o in outcomes if o.arm == "judge"], scenario.regression)
        flagger = summarize([o for o in outcomes if o.arm == "flagger"], scenario.regression)
        spec = settings[profile]
        target = common.judge(
            f"{profile} {share:g}% {key}",
            f"{scenario.what}: " + ("caught" if scenario.regression else "rolled back"),
            judge["rate"], ">=" if scenario.regression else "<=",
            CAUGHT_TARGET if scenario.regression else FALSE_ROLLBACK_TARGET)
        rows.append({
            "profile": profile, "canary_percent": share, "scenario": key,
            "what": scenario.what, "regression": scenario.regression,
            "interval_s": spec.rollout.analysis.interval_s,
            "first_stage_max_duration_s": spec.rollout.stages[0].max_duration_s,
            "judge": judge, "flagger": flagger, "target": target,
        })
    order = {p: i for i, p in enumerate(profiles())}
    rows.sort(key=lambda r: (order[r["profile"]], r["canary_percent"], r["scenario"]))
    return rows


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def print_tables(rows: Sequence[Mapping[str, Any]]) -> None:
    print(f"judge: % of rollouts with the regression caught (a-e) or the good canary rolled "
          f"back (f, g), its 95% interval, how many of those timed out, the median seconds "
          f"to a catch; Flagger-style: canary p95 > {FLAGGER_RATIO:g}x stable for "
          f"{FLAGGER_CHECKS} checks in a row, on the same seeds")
    headers = ["settings", "canary %", "scenario", "rollouts", "judge %", "95% CI",
               "timed out", "median s", "Flagger %", "target"]
    table_rows = []
    for r in rows:
        j, f = r["judge"], r["flagger"]
        low, high = j["rate_ci95"]
        table_rows.append([
            r["profile"], int(r["canary_percent"]), f"{r['scenario']} {r['what']}",
            j["rollouts"], _percent(j["rate"]), f"{100 * low:.1f}-{100 * high:.1f}",
            j["timed_out"], j["median_s_to_catch"], _percent(f["rate"]),
            ("caught >= " if r["regression"] else "rolled back <= ")
            + f"{100 * r['target'].threshold:g}%"])
    print(common.table(headers, table_rows, [r["target"].verdict for r in rows]))


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=Traffic.rate_per_tier,
                        help="requests/s through each tier")
    parser.add_argument("--trials", type=int, default=None,
                        help="rollouts per row (default: regression rows "
                             f"{TRIALS['regression']}, unchanged {TRIALS['unchanged']}; "
                             f"x{MORE_TRIALS['demo']} for the demo's)")
    parser.add_argument("--profiles", nargs="+", default=list(profiles()),
                        choices=list(profiles()))
    parser.add_argument("--workers", type=int, default=2)
    common.add_arguments(parser, "judge")
    args = common.parse(parser, argv, "judge")
    trials, scale = dict(TRIALS), dict(MORE_TRIALS)
    if args.trials is not None or args.smoke:
        count = SMOKE_TRIALS if args.smoke else args.trials
        trials, scale = {k: count for k in trials}, {}
    if args.smoke:
        args.profiles = [SMOKE_PROFILE]
    traffic = Traffic(rate_per_tier=args.rate)
    result = common.record("judge", args.smoke)
    settings = {p: load_tiered_model(profiles()[p]) for p in args.profiles}
    work = list(tasks(args.profiles, trials, traffic, scale))
    common.progress(f"{len(work)} tasks, {args.workers} workers")
    started = time.monotonic()
    results: dict[tuple[str, float, str], list[Outcome]] = {}
    context = mp.get_context("fork" if sys.platform != "win32" else "spawn")
    with context.Pool(args.workers) as pool:
        for done, (task, outcomes) in enumerate(pool.imap_unordered(_run_task, work), 1):
            key = (task.profile, task.share, task.scenario.key)
            results.setdefault(key, []).extend(outcomes)
            if done % 20 == 0:
                common.progress(f"{done}/{len(work)} tasks")
    rows = rows_of(results, settings)
    evidence = evidence_rows()
    targets = [r["target"] for r in evidence + rows]
    result.update({
        "seconds": round(time.monotonic() - started, 1),
        "traffic": traffic, "trials": trials, "more_trials": scale,
        "flagger": {"ratio": FLAGGER_RATIO, "checks_in_a_row": FLAGGER_CHECKS},
        "settings": {p: {"rollout": to_plain(spec.rollout),
                         "tests_in_rollout": rollout_tests(spec.rollout.analysis,
                                                           spec.rollout.stages)}
                     for p, spec in settings.items()},
        "stage_evidence": evidence, "rows": rows, "targets": targets,
        "verdict": common.overall(targets),
    })
    common.write(result, args.out)
    print_evidence(evidence)
    print_tables(rows)
    if args.smoke:
        return common.smoke_exit({"rows": (rows, ("judge.rollouts", "judge.mean_looks",
                                                  "flagger.rollouts", "flagger.mean_looks")),
                                  "stage_evidence": (evidence, ("seconds", "margin"))})
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
