"""Chaos on the local system during a rollout, every client request counted:
`bench/chaos.py --smoke`, run as a user runs it (its JSON read back, its
tables printed).

`tiered up`'s processes (an agent per tier, the router, the controller,
supervised) serve digits under an open-loop load through the router, each
request hinted at its client's tier; v2 rolls out while, one at a time: the
edge agent is SIGKILLed, then the regional agent; the datacenter agent is
SIGSTOPped for 10 s (hung, its connections open); the controller is
SIGKILLed; the router is restarted; and at the start of the second stage the
edge agent is unreachable (SIGSTOP) for 20 s. The smoke run is the bench's
(which runs the full six minutes in `make bench`) with shorter stages.

No client request fails in an agent or controller fault; through the router
restart they fail only while it is away; the rollout never advances while an
agent's telemetry is unreadable, holds saying so while edge is away, and v2
is promoted.
"""

from __future__ import annotations

import pytest

from tests.bench.test_bench_smoke import assert_header, run_smoke

pytest.importorskip("tritonclient.grpc")

OFFLINE_S = 20.0  # bench/chaos.py's SMOKE.offline_s
RATE = 60.0  # and its rate


@pytest.fixture(scope="module")
def run(tmp_path_factory, digits_models):
    result, stdout = run_smoke("chaos", tmp_path_factory.mktemp("chaos"),
                               "--models", str(digits_models), timeout_s=420)
    assert result["settings"]["offline_s"] == OFFLINE_S and result["settings"]["rate"] == RATE
    assert_header(stdout, "fault", "sent", "answered", "failed")
    assert_header(stdout, "target", "what", "value", "needs", "verdict")
    return result


def rows(run) -> dict[str, dict]:
    return {row["fault"]: row for row in run["rows"]}


def test_no_client_request_fails_in_an_agent_or_controller_fault(run):
    found = rows(run)
    assert list(found) == ["none (baseline)", "none (v2 built, its rollout starts)",
                           "edge agent SIGKILL", "regional agent SIGKILL",
                           "datacenter agent hung", "controller SIGKILL", "router restart",
                           "none (the rest of stage 1)", "edge offline 20 s mid-stage",
                           "none (to the end)"]
    # Every request sent is in one window, and ended: answered or failed.
    assert sum(row["sent"] for row in found.values()) == run["requests"]["sent"]
    assert run["requests"]["unfinished"] == 0
    for name, row in found.items():
        if name == "router restart":
            continue
        assert row["sent"] > 0 and row["answered"] == row["sent"], row
    # Requests meant for a faulty tier were answered, by another tier while it was away.
    for name in ("edge agent SIGKILL", "regional agent SIGKILL", "datacenter agent hung",
                 "edge offline 20 s mid-stage"):
        row = found[name]
        assert set(row["hinted_answered_by"]) - {row["hinted_tier"]}, row
    offline = found["edge offline 20 s mid-stage"]
    assert offline["hinted_answered_by"].get("regional", 0) > 5 * RATE * 0.6, offline


def test_through_a_router_restart_requests_fail_only_while_it_is_away(run):
    row = rows(run)["router restart"]
    assert row["answered"] > 0 and row["unfinished"] == 0, row
    # Refused while it is away. The calls it had taken in at its SIGTERM are
    # answered (its drain); one that arrives in the instant its server stops is CANCELLED.
    assert set(row["failed_by_code"]) <= {"UNAVAILABLE", "CANCELLED"}, row
    assert row["failed_outside_restart"] == 0, row
    assert 0 < row["restart_window_s"] < 60, row


def test_the_rollout_holds_while_telemetry_is_unreadable_and_then_promotes(run):
    checks = run["rollout"]
    assert [f["fault"] for f in checks["faults"]] == [
        "edge agent SIGKILL", "regional agent SIGKILL", "datacenter agent hung",
        "edge offline 20 s mid-stage"]
    for fault in checks["faults"]:
        assert fault["advanced_or_promoted"] == 0, fault
    offline = checks["faults"][-1]
    assert offline["held_unreadable"] >= 1 and offline["stages"] == [1], offline
    assert offline["decided_after"] is not None, offline  # it went on once edge was back
    assert not checks["went_back_a_stage"] and not checks["rolled_back"], checks["decisions"]
    assert checks["promoted"], checks["decisions"]


def test_every_target_of_the_bench_passes(run):
    failed = [t for t in run["targets"] if t["verdict"] != "PASS"]
    assert not failed and len(run["targets"]) >= len(run["rows"]), failed
