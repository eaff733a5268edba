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

A stage's samples survive a controller restart: `state()` is written into
the status at every look and `StageAccumulator.restore` takes it back.
Counts, energy windows and shadow counts come back exact; the latency
reservoir comes back as the centres of the 2%-wide log buckets it was kept
in (each sample within 1% of itself), so a restarted controller decides on
the same evidence to that precision.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiered.rollout.analysis import Measurements, TierSamples, VersionSamples

RESERVOIR = 4000  # latency samples kept per (tier, version); uniform over the stage
WINDOWS = 600  # J/inference windows kept per (tier, version)
BUCKET_GROWTH = 1.02  # a stored latency is kept to within 1%
BUCKET_LOWEST_MS = 1e-3


@dataclass
class _Series:
    requests: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    seen: int = 0  # latency samples offered, for reservoir sampling
    # window -> [joules, inferences]: J/inference is judged per window, pooled
    # over that window's polls (a single second holds too few inferences)
    energy: dict[int, list[float]] = field(default_factory=dict)
    energy_sources: set[str] = field(default_factory=set)  # nvml, rapl, model; "" unknown

    @property
    def energy_source(self) -> str:
        """The figures' one source; "" when unknown or mixed."""
        return next(iter(self.energy_sources)) if len(self.energy_sources) == 1 else ""

    def joules_per_inference(self) -> list[float]:
        return [joules / count for joules, count in self.energy.values() if count > 0]


@dataclass(frozen=True)
class VersionReading:
    """One agent's report for one version over one poll."""

    tier: str
    version: int
    success: int
    failure: int
    latency_samples_s: tuple[float, ...] = ()
    joules_per_inference: float | None = None
    energy_source: str = ""  # of joules_per_inference: nvml, rapl, model; "" unknown


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
                                                      r.latency_samples_s)
                for r in readings)
            if not self.canary_served:
                return
        for reading in readings:
            series = self._series.setdefault((reading.tier, reading.version), _Series())
            series.requests += reading.success + reading.failure
            series.errors += reading.failure
            for seconds in reading.latency_samples_s:
                self._offer(series, seconds * 1000.0)
            if reading.joules_per_inference is not None and reading.success > 0:
                pooled = series.energy.setdefault(window, [0.0, 0])
                pooled[0] += reading.joules_per_inference * reading.success
                pooled[1] += reading.success
                series.energy_sources.add(reading.energy_source)
                for old in list(series.energy)[:-WINDOWS]:
                    del series.energy[old]

    def _offer(self, series: _Series, value: float) -> None:
        series.seen += 1
        if len(series.latencies_ms) < RESERVOIR:
            series.latencies_ms.append(value)
            return
        slot = int(self._rng.integers(series.seen))
        if slot < RESERVOIR:
            series.latencies_ms[slot] = value

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
                        "errors": s.errors, "seen": s.seen,
                        "latency_buckets": _buckets(s.latencies_ms),
                        "energy": [[w, j, n] for w, (j, n) in s.energy.items()],
                        "energy_sources": sorted(s.energy_sources)}
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
                seen=int(kept["seen"]),
                latencies_ms=[_bucket_centre(index) for index, count in
                              kept.get("latency_buckets", ()) for _ in range(int(count))],
                energy={int(w): [float(j), float(n)] for w, j, n in kept.get("energy", ())},
                energy_sources=set(kept.get("energy_sources", ())))
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
        return VersionSamples(latencies_ms=tuple(series.latencies_ms), requests=series.requests,
                              errors=series.errors,
                              joules_per_inference=tuple(series.joules_per_inference()),
                              energy_source=series.energy_source)

    def summary(self, stable_version: int, tiers: Iterable[str]
                ) -> dict[str, float | str | None]:
        """The headline numbers for progress lines and history snapshots, and
        the source of each version's J/inference (nvml, rapl, model); the same
        per tier that served the canary, as 'edge.p95_canary_ms'."""
        m = self.measurements(stable_version, tiers)
        stable, canary = m.pooled("stable"), m.pooled("canary")

        def p95(samples: VersionSamples) -> float | None:
            return (float(np.percentile(samples.latencies_ms, 95))
                    if samples.latencies_ms else None)

        def jpi(samples: VersionSamples) -> float | None:
            values = samples.joules_per_inference
            return float(np.median(values)) if values else None

        return {
            "stable_requests": stable.requests, "canary_requests": canary.requests,
            "p95_stable_ms": p95(stable), "p95_canary_ms": p95(canary),
            "jpi_stable": jpi(stable), "jpi_canary": jpi(canary),
            "energy_source_stable": stable.energy_source,
            "energy_source_canary": canary.energy_source,
            "agreement": (m.shadow_agreed / m.shadow_compared if m.shadow_compared else None),
            "agreement_compared": m.shadow_compared,
            # Each tier on its own, as the analysis judges it (the report's per-tier charts).
            **{f"{tier}.{key}": value for tier, samples in m.tiers.items()
               for key, value in (("stable_requests", samples.stable.requests),
                                  ("canary_requests", samples.canary.requests),
                                  ("p95_stable_ms", p95(samples.stable)),
                                  ("p95_canary_ms", p95(samples.canary)),
                                  ("jpi_stable", jpi(samples.stable)),
                                  ("jpi_canary", jpi(samples.canary)))
               if samples.canary.requests and value is not None},
        }


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
