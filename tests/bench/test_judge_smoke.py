"""bench/judge.py's `--smoke` mode, run as a user runs it, so it cannot rot.

The smoke run simulates two rollouts per row for the demo's settings (each
scenario at 5% and 20% canary traffic, both arms: the judge and the
Flagger-style threshold); its rates mean nothing, its rows must all be there
and well-formed, and its table must print with the verdict column.
"""

from __future__ import annotations

from tests.bench.test_bench_smoke import VERDICTS, assert_header, positive, run_smoke

SCENARIOS = set("abcdefg")


def test_judge_bench_simulates_every_scenario_at_both_shares_beside_a_fixed_threshold(tmp_path):
    result, stdout = run_smoke("judge", tmp_path)
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
