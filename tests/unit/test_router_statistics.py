"""The router's own statistics: rows per answering version, failures under "0", bounds."""

from __future__ import annotations

from tiered.router.statistics import RouterStatistics


def test_answers_count_under_their_version_and_failures_under_zero():
    stats = RouterStatistics()
    stats.succeeded("m", "1", 0.002, now=10.0)
    stats.succeeded("m", "1", 0.004, now=11.0)
    stats.succeeded("m", "2", 0.001, now=12.0)
    stats.failed("m", 0.5, now=13.0)
    rows = {r.version: r for r in stats.messages(["m"], "", now=20.0, wall_now=1000.0)}
    assert sorted(rows) == ["0", "1", "2"]
    one = rows["1"]
    assert (one.inference_stats.success.count, one.inference_stats.success.ns) == (2, 6_000_000)
    assert one.inference_count == one.execution_count == 2
    assert one.last_inference == 991_000  # 9 s before wall_now, in ms
    assert (rows["0"].inference_stats.fail.count, rows["0"].inference_stats.fail.ns) == \
        (1, 500_000_000)
    assert rows["0"].inference_stats.success.count == 0


def test_a_version_filter_and_other_models_are_kept_apart():
    stats = RouterStatistics()
    stats.succeeded("m", "1", 0.001, now=1.0)
    stats.succeeded("m", "2", 0.001, now=1.0)
    stats.succeeded("n", "1", 0.001, now=1.0)
    assert [(r.name, r.version) for r in stats.messages(["m"], "2", 1.0, 1.0)] == [("m", "2")]
    assert [(r.name, r.version) for r in stats.messages(["m", "n"], "", 1.0, 1.0)] == \
        [("m", "1"), ("m", "2"), ("n", "1")]


def test_rows_are_bounded_and_forgotten_with_their_model():
    stats = RouterStatistics(max_rows=2)
    for version in ("1", "2", "3"):
        stats.succeeded("m", version, 0.001, now=1.0)
    assert [r.version for r in stats.messages(["m"], "", 1.0, 1.0)] == ["1", "2"]
    stats.keep_only(["n"])
    assert stats.messages(["m"], "", 1.0, 1.0) == []
    stats.succeeded("m", "3", 0.001, now=1.0)
    assert [r.version for r in stats.messages(["m"], "", 1.0, 1.0)] == ["3"]
