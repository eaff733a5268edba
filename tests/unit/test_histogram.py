from __future__ import annotations

import random

import numpy as np
import pytest

from tiered.telemetry.histogram import (
    BUCKETS,
    HIGHEST_S,
    LOWEST_S,
    Histogram,
    Reservoir,
    bucket_of,
)


def histogram_of(values) -> Histogram:
    histogram = Histogram()
    for value in values:
        histogram.record(value)
    return histogram


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("q", [0.5, 0.95, 0.99])
def test_quantiles_are_within_one_percent_of_numpy(seed, q):
    rng = np.random.default_rng(seed)
    values = rng.lognormal(mean=np.log(0.02), sigma=1.5, size=20_000)
    values = np.clip(values, LOWEST_S, HIGHEST_S)
    exact = np.quantile(values, q, method="inverted_cdf")
    got = histogram_of(values).quantile(q)
    assert abs(got - exact) / exact <= 0.01


def test_the_range_spans_50_microseconds_to_60_seconds_in_under_a_thousand_buckets():
    assert bucket_of(LOWEST_S / 2) == 0
    assert bucket_of(HIGHEST_S * 2) == BUCKETS - 1
    assert bucket_of(LOWEST_S) == 1
    assert BUCKETS < 1000


def test_empty_histogram_has_no_quantile():
    assert Histogram().quantile(0.5) is None
    assert Histogram().mean() is None


def test_merge_adds_counts():
    a, b = histogram_of([0.001] * 3), histogram_of([0.01] * 5)
    a.merge(b)
    assert a.count == 8
    assert a.mean() == pytest.approx((0.003 + 0.05) / 8)


def test_reservoir_is_bounded_and_keeps_a_uniform_sample():
    reservoir = Reservoir(100, random.Random(1))
    for value in range(10_000):
        reservoir.add(float(value))
    assert len(reservoir.samples) == 100 and reservoir.seen == 10_000
    assert 3_500 < np.mean(reservoir.samples) < 6_500  # uniform over 0..9999
