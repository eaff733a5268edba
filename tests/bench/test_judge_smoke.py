"""bench/judge.py's `--smoke` mode, run as a user runs it, so it cannot rot.

The smoke run simulates two rollouts per row for the demo's settings (each
scenario at 5% and 20% canary traffic, both arms: the judge and the
Flagger-style threshold); its rates mean nothing, its rows must all be there
and well-formed, and its table must print with the verdict column.
"""

from __future__ import annotations

import pytest

from tests.bench.test_bench_smoke import VERDICTS, assert_header, positive, run_smoke

SCENARIOS = set("abcdefg")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return run_smoke("judge", tmp_path_factory.mktemp("judge"))


def test_judge_bench_simulates_every_scenario_at_both_shares_beside_a_fixed_threshold(smoke):
    result, stdout = smoke
    rows = result["rows"]
    assert {(r["profile"], r["canary_percent"], r["scenario"]) for r in rows} == {
        ("demo", share, key) for share in (5.0, 20.0) for key in SCENARIOS}
    for row in rows:
        for arm in ("judge", "flagger"):
            figures = row[arm]
            assert figures["rollouts"] == 2
            assert figures["caught"] + figures["timed_out"] + figures["promoted"] == 2
            assert 0.0 <= figures["rate"] <= 1.0 and positive(figures["mean_looks"])
        target = row["target"]
        assert target["verdict"] in VERDICTS
        assert target["comparison"] == (">=" if row["regression"] else "<=")
    assert result["settings"]["demo"]["tests_in_rollout"] >= 1
    assert result["flagger"] == {"ratio": 1.1, "checks_in_a_row": 5}
    assert_header(stdout, "settings", "canary", "%", "scenario", "rollouts")
    assert "verdict" in stdout


def test_every_stage_of_the_demo_decides_a_healthy_canary_with_room_to_spare(smoke):
    """The stage-evidence table is exact (no simulation): at the demo's own
    traffic each stage of the demo's files can pass a healthy version (digits
    v2 agreeing on 97.5%, tinyllama v2 on 99%) within half its
    maxDurationSeconds. A setting changed beyond that fails here, before a
    demo rolls back a good version for lack of samples."""
    result, stdout = smoke
    rows = result["stage_evidence"]
    assert {(r["profile"], r["stage"]) for r in rows} == {
        ("demo", 1), ("demo", 2), ("demo", 3), ("demo-generative", 1), ("demo-generative", 2)}
    for row in rows:
        assert 0 < row["seconds"] <= row["max_duration_s"] / 2, row
        assert row["target"]["verdict"] == "PASS", row
    assert_header(stdout, "settings", "stage", "needs", "s", "slowest", "max", "s", "margin")
