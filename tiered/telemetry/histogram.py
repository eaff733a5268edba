"""Latency histograms good for P50/P95/P99 from 50 µs to 60 s, cumulative ones
with Prometheus's fixed buckets, and reservoirs.

Buckets grow geometrically by 2%, so any quantile read back is within 1% of
the true value (the midpoint of a bucket is at most half a bucket away). A
`Reservoir` keeps a bounded, uniform sample of raw values for the statistical
tests rollouts run. Sliding windows are built from these in
`tiered.telemetry.recorder`. Pure data and arithmetic; randomness is injected.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field

import numpy as np

LOWEST_S = 50e-6
HIGHEST_S = 60.0
GROWTH = 1.02  # bucket i covers [LOWEST_S * GROWTH**i, LOWEST_S * GROWTH**(i+1))
_LOG_GROWTH = math.log(GROWTH)
# Bucket 0 holds everything below LOWEST_S, the last one everything above HIGHEST_S.
BUCKETS = 2 + math.ceil(math.log(HIGHEST_S / LOWEST_S) / _LOG_GROWTH)


def bucket_of(seconds: float) -> int:
    if seconds < LOWEST_S:
        return 0
    index = 1 + int(math.log(seconds / LOWEST_S) / _LOG_GROWTH)
    return min(index, BUCKETS - 1)


def bucket_value(index: int) -> float:
    """The value a bucket stands for: its geometric midpoint."""
    if index == 0:
        return LOWEST_S
    return LOWEST_S * GROWTH ** (index - 1) * math.sqrt(GROWTH)


@dataclass
class Histogram:
    counts: np.ndarray = field(default_factory=lambda: np.zeros(BUCKETS, np.int64))
    total_s: float = 0.0

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def record(self, seconds: float) -> None:
        self.counts[bucket_of(seconds)] += 1
        self.total_s += seconds

    def merge(self, other: Histogram) -> None:
        self.counts += other.counts
        self.total_s += other.total_s

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0..1) in seconds; None when empty."""
        total = self.count
        if total == 0:
            return None
        rank = max(1, math.ceil(q * total))
        index = int(np.searchsorted(np.cumsum(self.counts), rank))
        return bucket_value(index)

    def mean(self) -> float | None:
        return self.total_s / self.count if self.count else None


# Seconds: from 100 µs (a small model on a GPU) to 10 s (a queue under overload).
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                     0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class CumulativeHistogram:
    """Prometheus-style: counts per fixed `le` bucket since start (the last is
    +Inf), so the histograms of several replicas sum."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass
class Reservoir:
    """At most `size` samples, each kept with equal probability (Algorithm R)."""

    size: int
    rng: random.Random
    samples: list[float] = field(default_factory=list)
    seen: int = 0

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.samples) < self.size:
            self.samples.append(value)
            return
        slot = self.rng.randrange(self.seen)
        if slot < self.size:
            self.samples[slot] = value

