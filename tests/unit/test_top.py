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
    table = [("a:1", "edge", "m", "1", "cpu", "2.0", "-", "0.0", "1.00", "2.00", "3.00",
              "0.10", "-", "-", "-", "0", "0", "-", "-", "-", "-", "-")]
    text = top.render(table)
    header, row = text.splitlines()
    assert header.index("req/s") == row.index("2.0")


def test_a_modeled_figure_is_called_an_estimate():
    row = ("a:1", "edge", "m", "1", "cpu", "2.0", "-", "0.0", "1.00", "2.00", "3.00",
           "0.10", "0.002", "model", "5", "0", "0", "-", "-", "-", "-", "-")
    *_, note = top.render([row]).splitlines()
    assert "estimate" in note
    source = top.SOURCE
    assert "estimate" not in top.render([(*row[:source], "rapl", *row[source + 1:])])


def test_client_errors_are_a_rate_of_their_own_beside_the_servers_error_share():
    from tiered.protocol import telemetry_pb2 as tpb

    version = tpb.VersionStats(model_name="m", model_version="2", device="cpu", success=90,
                               failure=10, client_errors=300)
    [row] = top.rows("a:1", tpb.StatsResponse(tier="edge", start=0, end=10, versions=[version]))
    fields = dict(zip(top.HEADERS, row))
    assert (fields["err%"], fields["client-err/s"]) == ("10.0", "30.0")


def test_generative_versions_show_their_token_figures():
    from tiered.protocol import telemetry_pb2 as tpb

    first, gap = Histogram(), Histogram()
    first.record(0.02)
    for _ in range(9):
        gap.record(0.005)
    version = tpb.VersionStats(model_name="llm", model_version="1", device="cpu", success=1,
                               generation=tpb.Generation(
        output_tokens=10, tokens_per_s=5.0, running=1, max_sequences=4,
        time_to_first_token=telemetry_messages.histogram_message(first, LOWEST_S, GROWTH),
        time_per_output_token=telemetry_messages.histogram_message(gap, LOWEST_S, GROWTH),
        joules_per_output_token=0.25))
    plain = tpb.VersionStats(model_name="cnn", model_version="1", device="cpu")
    [llm, cnn] = top.rows("a:1", tpb.StatsResponse(tier="edge", start=0, end=2,
                                                    versions=[version, plain]))
    tokens = dict(zip(top.HEADERS, llm))
    assert tokens["tok/s"] == "5.0" and tokens["J/tok"] == "0.25" and tokens["running"] == "1/4"
    assert float(tokens["ttft p50"]) == pytest.approx(20, rel=0.02)
    assert float(tokens["tpot p50"]) == pytest.approx(5, rel=0.02)
    assert cnn[-5:] == ("-",) * 5


def test_a_version_over_several_devices_lists_them_and_marks_one_down():
    from tiered.protocol import telemetry_pb2 as tpb

    version = tpb.VersionStats(model_name="cnn", model_version="1", device="cuda:0,cuda:1",
                               devices=[tpb.DeviceShare(device="cuda:0", up=True),
                                        tpb.DeviceShare(device="cuda:1", up=False,
                                                        down_reason="restart failed")])
    idle = [tpb.Energy(device="cuda:0", idle_watts=60.0), tpb.Energy(device="cuda:1",
                                                                      idle_watts=70.0)]
    [row] = top.rows("a:1", tpb.StatsResponse(tier="datacenter", start=0, end=2,
                                              versions=[version], devices=idle))
    fields = dict(zip(top.HEADERS, row))
    assert fields["dev"] == "cuda:0,cuda:1 DOWN"
    assert fields["idle W"] == "130"
