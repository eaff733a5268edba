from __future__ import annotations

import numpy as np
import pytest

from tiered.cli import top
from tiered.protocol import telemetry_messages
from tiered.telemetry.histogram import GROWTH, LOWEST_S, Histogram


@pytest.mark.parametrize("q", [0.5, 0.95, 0.99])
def test_quantile_from_the_wire_matches_the_histogram(q):
    values = np.random.default_rng(3).lognormal(np.log(0.01), 1.0, 5000)
    histogram = Histogram()
    for value in values:
        histogram.record(value)
    message = telemetry_messages.histogram_message(histogram, LOWEST_S, GROWTH)
    assert top.quantile(message, q) == pytest.approx(histogram.quantile(q))
    assert top.quantile(message, q) == pytest.approx(np.quantile(values, q), rel=0.01)


def test_render_aligns_columns_and_shows_missing_values_as_dashes():
    table = [("a:1", "edge", "m", "1", "cpu", "2.0", "-", "1.00", "2.00", "3.00", "0.10",
              "-", "-", "-", "0", "0")]
    text = top.render(table)
    header, row = text.splitlines()
    assert header.index("req/s") == row.index("2.0")


def test_a_modeled_figure_is_called_an_estimate():
    row = ("a:1", "edge", "m", "1", "cpu", "2.0", "-", "1.00", "2.00", "3.00", "0.10",
           "0.002", "model", "5", "0", "0")
    *_, note = top.render([row]).splitlines()
    assert "estimate" in note
    assert "estimate" not in top.render([(*row[:12], "rapl", *row[13:])])
