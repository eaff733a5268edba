"""Measurements of a live rollout, accumulated from what agents and the router report.

The controller polls each agent's Telemetry.Stats (counts, raw latency
samples, J/inference per window) and reads the router's shadow-agreement
counters; this module turns those readings into the rollout engine's
`Measurements` for the current stage. Pure: readings in, a frozen value out;
the polling itself is the controller's I/O.

Samples count only from the moment the stage (canary version, stage index)
was first seen and the canary has served, so one stage never judges another's
traffic and stable is measured over the same time as the canary. Stable and
canary are kept per tier, for the tiers where the stage sends canary
traffic, so each tier's canary is compared with that tier's stable.

A generative version also reports its tokens (Telemetry's Generation): each
poll's time-to-first-token histogram is offered to a TTFT reservoir whole
(one value a request), and from its time-per-output-token histogram as many
intervals as the poll had requests are drawn at random into a TPOT
reservoir (one token a request on average: the tokens of one sequence are
not independent draws, see `tiered.rollout.analysis`); J per output token
is pooled per window like J/inference. A histogram's values are its
buckets' midpoints, each within 1% of the value it stands for.

A stage's samples survive a controller restart: `state()` is written into
the status at every look and `StageAccumulator.restore` takes it back.
Counts, energy windows and shadow counts come back exact; the latency, TTFT
and TPOT reservoirs come back as the centres of the 2%-wide log buckets they
were kept in (each sample within 1% of itself), so a restarted controller
decides on the same evidence to that precision.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiered import names
from tiered.rollout.analysis import Measurements, TierSamples, VersionSamples
from tiered.rollout.snapshot import Compared, Figures, StageFigures

RESERVOIR = 4000  # latency (TTFT, TPOT) samples kept per (tier, version); uniform over the stage
WINDOWS = 600  # J/inference (J/token) windows kept per (tier, version)
BUCKET_GROWTH = 1.02  # a stored latency is kept to within 1%
BUCKET_LOWEST_MS = 1e-3


@dataclass
class _Reservoir:
    """A bounded uniform sample of the values offered (milliseconds)."""

    values: list[float] = field(default_factory=list)
    seen: int = 0  # values offered

    def offer(self, value: float, rng: np.random.Generator) -> None:
        self.seen += 1
        if len(self.values) < RESERVOIR:
            self.values.append(value)
            return
        slot = int(rng.integers(self.seen))
        if slot < RESERVOIR:
            self.values[slot] = value


@dataclass
class _Series:
    requests: int = 0
    errors: int = 0
    client_errors: int = 0
    latency: _Reservoir = field(default_factory=_Reservoir)
    # window -> [joules, inferences]: J/inference is judged per window, pooled
    # over that window's polls (a single second holds too few inferences)
    energy: dict[int, list[float]] = field(default_factory=dict)
    energy_sources: set[str] = field(default_factory=set)  # nvml, rapl, model; "" unknown
    # A generative version's: time to first token, time per output token,
    # output tokens, and window -> [joules, output tokens].
    ttft: _Reservoir = field(default_factory=_Reservoir)
    tpot: _Reservoir = field(default_factory=_Reservoir)
    output_tokens: int = 0
    token_energy: dict[int, list[float]] = field(default_factory=dict)

    @property
    def energy_source(self) -> str:
        """The figures' one source; "" when unknown or mixed."""
        return next(iter(self.energy_sources)) if len(self.energy_sources) == 1 else ""

    def joules_per_inference(self) -> list[float]:
        return [joules / count for joules, count in self.energy.values() if count > 0]

    def joules_per_token(self) -> list[float]:
        return [joules / count for joules, count in self.token_energy.values() if count > 0]


@dataclass(frozen=True)
class VersionReading:
    """One agent's report for one version over one poll."""

    tier: str
    version: int
    success: int
    failure: int  # what the server caused
    latency_samples_s: tuple[float, ...] = ()
    joules_per_inference: float | None = None
    energy_source: str = ""  # of the energy figures: nvml, rapl, model; "" unknown
    # A generative version's (Telemetry's Generation): histograms as (seconds,
    # count) pairs, and J per output token.
    output_tokens: int = 0
    first_token_s: tuple[tuple[float, int], ...] = ()
    per_token_s: tuple[tuple[float, int], ...] = ()
    joules_per_output_token: float | None = None
    client_errors: int = 0  # refused for what the client sent: shown, not judged


class StageAccumulator:
    """Samples of one stage of one rollout, per (tier, version)."""

    def __init__(self, canary_version: int, stage: int, rng: np.random.Generator,
                 shadow_baseline: Mapping[tuple[str, ...], float]) -> None:
        self.canary_version = canary_version
        self.stage = stage
        self.window = 0
        self.canary_served = False  # samples count from the canary's first request on
        self._rng = rng
        self._series: dict[tuple[str, int], _Series] = {}
        self._shadow_baseline = dict(shadow_baseline)
        self._shadow: dict[tuple[str, ...], float] = dict(shadow_baseline)

    def matches(self, canary_version: int, stage: int) -> bool:
        return (self.canary_version, self.stage) == (canary_version, stage)

    def add(self, readings: Iterable[VersionReading], window: int | None = None) -> None:
        """One poll's readings; their energy counts toward `window` (default: a
        window of their own). Polls before the canary's first request are left
        out: the two versions are compared over the same time, not stable alone
        while the canary's agents load."""
        self.window += 1
        window = self.window if window is None else window
        readings = list(readings)
        if not self.canary_served:
            self.canary_served = any(
                r.version == self.canary_version and (r.success + r.failure or
                                                      r.latency_samples_s or r.output_tokens)
                for r in readings)
            if not self.canary_served:
                return
        for reading in readings:
            series = self._series.setdefault((reading.tier, reading.version), _Series())
            series.requests += reading.success + reading.failure
            series.errors += reading.failure
            series.client_errors += reading.client_errors
            for seconds in reading.latency_samples_s:
                series.latency.offer(seconds * 1000.0, self._rng)
            if reading.joules_per_inference is not None and reading.success > 0:
                _pool(series.energy, window, reading.joules_per_inference, reading.success)
                series.energy_sources.add(reading.energy_source)
            self._add_tokens(series, reading, window)

    def _add_tokens(self, series: _Series, reading: VersionReading, window: int) -> None:
        """A generative version's poll: TTFTs whole, TPOTs one a request (see
        the module docstring), J/token into its window."""
        series.output_tokens += reading.output_tokens
        for seconds, count in reading.first_token_s:
            for _ in range(count):
                series.ttft.offer(seconds * 1000.0, self._rng)
        for seconds in self._draw(reading.per_token_s, reading.success + reading.failure):
            series.tpot.offer(seconds * 1000.0, self._rng)
        if reading.joules_per_output_token is not None and reading.output_tokens > 0:
            _pool(series.token_energy, window, reading.joules_per_output_token,
                  reading.output_tokens)
            series.energy_sources.add(reading.energy_source)

    def _draw(self, histogram: tuple[tuple[float, int], ...], k: int) -> np.ndarray:
        """`k` of a histogram's values drawn without replacement (every one
        when it holds no more than k), in random order."""
        values = np.array([value for value, _ in histogram], dtype=float)
        counts = np.array([count for _, count in histogram], dtype=np.int64)
        if k < counts.sum():
            counts = self._rng.multivariate_hypergeometric(counts, k)
        return self._rng.permutation(np.repeat(values, counts))

    def set_shadow(self, counts: Mapping[tuple[str, ...], float]) -> None:
        """Cumulative shadow counts for this canary version, keyed by tuples
        whose last item is the result (agree, disagree), such as (router
        instance, tier, result). Counts of a key not read this time (a router
        unreadable, or gone) keep their last value; a key new since the stage
        began (a new or restarted router) counts from zero."""
        self._shadow.update(counts)

    def state(self) -> dict[str, Any]:
        """The stage's samples as plain data for the status (see the module
        docstring): what `restore` takes back after a restart."""
        return {
            "canary_version": self.canary_version, "stage": self.stage,
            "window": self.window, "canary_served": self.canary_served,
            "series": [{"tier": tier, "version": version, "requests": s.requests,
                        "errors": s.errors, "client_errors": s.client_errors,
                        "seen": s.latency.seen,
                        "latency_buckets": _buckets(s.latency.values),
                        "energy": [[w, j, n] for w, (j, n) in s.energy.items()],
                        "energy_sources": sorted(s.energy_sources),
                        **({"output_tokens": s.output_tokens,
                            "ttft_seen": s.ttft.seen, "ttft_buckets": _buckets(s.ttft.values),
                            "tpot_seen": s.tpot.seen, "tpot_buckets": _buckets(s.tpot.values),
                            "token_energy": [[w, j, n] for w, (j, n) in s.token_energy.items()]}
                           if s.output_tokens or s.ttft.seen else {})}
                       for (tier, version), s in sorted(self._series.items())],
            "shadow_baseline": [[*key, v] for key, v in self._shadow_baseline.items()],
            "shadow": [[*key, v] for key, v in self._shadow.items()],
        }

    @classmethod
    def restore(cls, state: Mapping[str, Any], rng: np.random.Generator) -> StageAccumulator:
        stage = cls(int(state["canary_version"]), int(state["stage"]), rng,
                    {tuple(k[:-1]): float(k[-1]) for k in state.get("shadow_baseline", ())})
        stage.window = int(state.get("window", 0))
        stage.canary_served = bool(state.get("canary_served", False))
        stage._shadow.update({tuple(k[:-1]): float(k[-1]) for k in state.get("shadow", ())})
        for kept in state.get("series", ()):
            stage._series[(kept["tier"], int(kept["version"]))] = _Series(
                requests=int(kept["requests"]), errors=int(kept["errors"]),
                client_errors=int(kept.get("client_errors", 0)),
                latency=_restored(kept.get("latency_buckets", ()), kept["seen"]),
                energy={int(w): [float(j), float(n)] for w, j, n in kept.get("energy", ())},
                energy_sources=set(kept.get("energy_sources", ())),
                ttft=_restored(kept.get("ttft_buckets", ()), kept.get("ttft_seen", 0)),
                tpot=_restored(kept.get("tpot_buckets", ()), kept.get("tpot_seen", 0)),
                output_tokens=int(kept.get("output_tokens", 0)),
                token_energy={int(w): [float(j), float(n)]
                              for w, j, n in kept.get("token_energy", ())})
        return stage

    def measurements(self, stable_version: int, tiers: Iterable[str],
                     window: int | None = None) -> Measurements:
        """Stable and canary on each of `tiers`; agreement over every tier. `window`
        numbers the analysis (default: the count of polls)."""
        shadow = {key: self._shadow.get(key, 0.0) - self._shadow_baseline.get(key, 0.0)
                  for key in self._shadow}
        agreed = int(sum(v for key, v in shadow.items() if key[-1] == "agree"))
        disagreed = int(sum(v for key, v in shadow.items() if key[-1] == "disagree"))
        return Measurements(
            window=self.window if window is None else window, stage=self.stage,
            tiers={tier: TierSamples(self._samples(tier, stable_version),
                                     self._samples(tier, self.canary_version))
                   for tier in tiers},
            shadow_compared=agreed + disagreed, shadow_agreed=agreed)

    def _samples(self, tier: str, version: int) -> VersionSamples:
        series = self._series.get((tier, version))
        if series is None:
            return VersionSamples()
        return VersionSamples(latencies_ms=tuple(series.latency.values),
                              requests=series.requests, errors=series.errors,
                              client_errors=series.client_errors,
                              joules_per_inference=tuple(series.joules_per_inference()),
                              energy_source=series.energy_source,
                              ttft_ms=tuple(series.ttft.values),
                              tpot_ms=tuple(series.tpot.values),
                              output_tokens=series.output_tokens,
                              joules_per_token=tuple(series.joules_per_token()))

    def summary(self, stable_version: int, tiers: Iterable[str],
                kind: str = names.ModelKind.PREDICTIVE) -> StageFigures:
        """The headline figures for progress lines and history snapshots, with
        the source of each version's energy figures (nvml, rapl, model); the
        same per tier that served the canary. The figures are those the
        model's `kind` is judged on: request p95 and J/inference, or a
        generative model's output tokens, TTFT and TPOT p95 and J per output
        token."""
        m = self.measurements(stable_version, tiers)
        generative = names.ModelKind(kind).streams_tokens

        def headline(samples: VersionSamples, energy_source: str | None = None) -> Figures:
            if generative:
                return Figures(requests=samples.requests, output_tokens=samples.output_tokens,
                               ttft_p95_ms=_p95(samples.ttft_ms),
                               tpot_p95_ms=_p95(samples.tpot_ms),
                               jpt=_median(samples.joules_per_token),
                               energy_source=energy_source)
            return Figures(requests=samples.requests, p95_ms=_p95(samples.latencies_ms),
                           jpi=_median(samples.joules_per_inference),
                           energy_source=energy_source)

        stable, canary = m.pooled("stable"), m.pooled("canary")
        return StageFigures(
            stable=headline(stable, stable.energy_source),
            canary=headline(canary, canary.energy_source),
            agreement=(m.shadow_agreed / m.shadow_compared if m.shadow_compared else None),
            agreement_compared=m.shadow_compared,
            # Each tier on its own, as the analysis judges it (the report's per-tier charts).
            tiers={tier: Compared(headline(samples.stable), headline(samples.canary))
                   for tier, samples in m.tiers.items() if samples.canary.requests})


def _p95(values: Sequence[float]) -> float | None:
    return float(np.percentile(values, 95)) if len(values) else None


def _median(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if len(values) else None


def _pool(windows: dict[int, list[float]], window: int, per_unit: float, units: int) -> None:
    """Add a poll's energy figure (J per unit over `units`) to its window's
    [joules, units]; the oldest windows past WINDOWS go."""
    pooled = windows.setdefault(window, [0.0, 0])
    pooled[0] += per_unit * units
    pooled[1] += units
    for old in list(windows)[:-WINDOWS]:
        del windows[old]


def _restored(buckets: Iterable[list[int]], seen: int) -> _Reservoir:
    return _Reservoir([_bucket_centre(index) for index, count in buckets
                       for _ in range(int(count))], int(seen))


def _buckets(values_ms: Iterable[float]) -> list[list[int]]:
    """[[bucket, count], ...] of values in 2%-wide log buckets."""
    counts: dict[int, int] = {}
    for value in values_ms:
        index = max(0, int(math.log(max(value, BUCKET_LOWEST_MS) / BUCKET_LOWEST_MS)
                           / math.log(BUCKET_GROWTH)))
        counts[index] = counts.get(index, 0) + 1
    return [[index, count] for index, count in sorted(counts.items())]


def _bucket_centre(index: int) -> float:
    return BUCKET_LOWEST_MS * BUCKET_GROWTH ** (index + 0.5)
