"""The one reconcile step (`plan.plan`): which decisions become Events, and what the
conditions say."""

from __future__ import annotations

import dataclasses

import pytest

from tiered import names
from tiered.controller import plan
from tiered.rollout import engine
from tiered.rollout.spec import load_tiered_model
from tiered.rollout.status import (
    ArtifactVersion,
    Condition,
    RolloutStatus,
    TieredModelStatus,
    load_status,
)
from tiered.rollout.wire import to_plain

SHA = {1: "1" * 64, 2: "2" * 64}
SPEC = load_tiered_model({
    "name": "digits", "artifact": {"uri": "/m/digits-2.onnx", "sha256": SHA[2]},
    "tiers": {"edge": {}},
    "rollout": {"stages": [{"name": "edge", "weights": {"edge": 10}, "min_requests": 100,
                            "min_duration_s": 30, "max_duration_s": 600}]}})
ARTIFACTS = tuple(ArtifactVersion(version=v, uri=f"/m/digits-{v}.onnx", sha256=SHA[v])
                  for v in (1, 2))
READY = {("edge", v): plan.VersionState(plan.READY) for v in (1, 2)}


def passes(readings, start=1000.0):
    """The Events of successive passes, each planned on the last one's status."""
    status = TieredModelStatus(
        rollout=RolloutStatus(stable_version=1, canary_version=2, stage_started_at=start,
                              phase=names.Phase.PROGRESSING, message="started"),
        artifacts=ARTIFACTS)
    told = []
    for index, reading in enumerate(readings):
        made = plan.plan(SPEC, status, plan.Observation(1, READY, frozenset({1, 2}), reading),
                         start + 2.0 * (index + 1))
        told.append([(e.reason, e.message) for e in made.events])
        status = made.status
    return told


def unreadable(agent: str) -> plan.StageReading:
    return plan.StageReading(canary_version=2, stage_index=0, measurements=None,
                             unreadable=(agent,))


def test_a_hold_is_an_event_only_when_its_reason_changes():
    told = passes([None, None, None, unreadable("edge-0"), unreadable("edge-0"), None])
    first, same, again, changed, still, back = told
    assert len(first) == 1 and first[0][0] == "Holding" and first[0][1].startswith("hold: ")
    # The same hold, its running figures aside (seconds in, requests so far): nothing new.
    assert same == again == still == []
    assert changed == [("Holding", changed[0][1])] and "edge-0" in changed[0][1]
    assert len(back) == 1 and "unreadable" not in back[0][1]


def ready_after(routed, conditions=()):
    status = TieredModelStatus(
        rollout=RolloutStatus(stable_version=1, phase=names.Phase.PROMOTED, message="serving"),
        artifacts=ARTIFACTS[:1], conditions=conditions)
    spec = load_tiered_model({**to_plain(SPEC, spell=None),
                              "artifact": {"uri": "/m/digits-1.onnx", "sha256": SHA[1]}})
    made = plan.plan(spec, status, plan.Observation(1, READY, frozenset({1}), None, routed),
                     2000.0)
    (ready,) = [c for c in made.status.conditions if c.type == "Ready"]
    return ready, made


def test_ready_means_the_routers_route_the_model():
    ready, made = ready_after((("r0:1", True), ("r1:1", False)))
    assert (ready.status, ready.reason) == ("False", "NotRouted")
    assert "r1:1" in ready.message and "r0:1" not in ready.message
    assert made.requeue_after_s is not None and made.requeue_after_s <= plan.WAIT_S
    assert plan.asks_routers(made.status)

    ready, made = ready_after((("r0:1", True), ("r1:1", None)))
    assert (ready.status, ready.reason) == ("True", "Routed") and "r1:1" in ready.message
    assert not plan.asks_routers(made.status)  # routed once: not asked again
    # Not asked: Routed stays, with its message and time.
    again, _ = ready_after(None, made.status.conditions)
    assert again == ready

    ready, _ = ready_after((("r0:1", None),))
    assert (ready.status, ready.reason) == ("Unknown", "RoutersUnreachable")
    ready, _ = ready_after(())  # a backend with no router to ask
    assert (ready.status, ready.reason) == ("True", "Serving")
    assert "no router to ask" in ready.message


def blind_and_back(looks):
    """The rollout after each look: (time, unreadable agent or None)."""
    status = TieredModelStatus(
        rollout=RolloutStatus(stable_version=1, canary_version=2, stage_started_at=0.0,
                              phase=names.Phase.PROGRESSING, message="started"),
        artifacts=ARTIFACTS)
    seen = []
    for t, agent in looks:
        reading = (unreadable(agent) if agent else
                   plan.StageReading(canary_version=2, stage_index=0, measurements=None))
        status = plan.plan(SPEC, status, plan.Observation(1, READY, frozenset({1, 2}),
                                                          reading), t).status
        seen.append(status.rollout)
    return seen


def test_a_stage_held_blind_stops_its_clock_and_goes_on_when_it_reads_again():
    # SPEC's stage: min 30 s, max 600 s. Blind from 500 s to 900 s: past its max
    # in wall time, yet it holds, and reads again with 500 s of its 600 behind it.
    went, still, back, later, out = blind_and_back(
        [(500.0, "edge-0"), (900.0, "edge-0"), (910.0, None), (1000.0, None), (1020.0, None)])
    assert went.phase == still.phase == names.Phase.PROGRESSING
    assert went.blind_since == still.blind_since == 500.0
    assert "unreadable" in still.message and "(500 s in)" in still.message
    assert back.blind_since is None and back.stage_started_at == 410.0  # 410 s held
    assert back.phase == later.phase == names.Phase.PROGRESSING
    assert out.phase == names.Phase.PAUSED  # 610 s of its own: max reached, onUndecided
    assert "undecided at maxDurationSeconds" in out.message


def test_a_blind_stage_survives_the_status_round_trip():
    (went,) = blind_and_back([(500.0, "edge-0")])
    plain = to_plain(TieredModelStatus(rollout=went))
    assert plain["rollout"]["blindSince"] == "1970-01-01T00:08:20.000000Z"
    assert load_status(plain, "status").rollout == went


def test_an_engine_process_down_on_an_agent_degrades_the_model_naming_it():
    down = "10.0.0.7:8001 cuda:1: restart failed: the engine process did not start"
    reading = plan.StageReading(canary_version=2, stage_index=0, measurements=None,
                                devices_down=(down,))
    status = TieredModelStatus(
        rollout=RolloutStatus(stable_version=1, canary_version=2, stage_started_at=1000.0,
                              phase=names.Phase.PROGRESSING, message="started"),
        artifacts=ARTIFACTS)
    made = plan.plan(SPEC, status, plan.Observation(1, READY, frozenset({1, 2}), reading),
                     1002.0)
    (degraded,) = [c for c in made.status.conditions if c.type == "Degraded"]
    assert (degraded.status, degraded.reason) == ("True", "DeviceDown")
    assert down in degraded.message
    healthy = plan.StageReading(canary_version=2, stage_index=0, measurements=None)
    again = plan.plan(SPEC, made.status, plan.Observation(1, READY, frozenset({1, 2}), healthy),
                      1004.0)
    (degraded,) = [c for c in again.status.conditions if c.type == "Degraded"]
    assert (degraded.status, degraded.reason) == ("False", "AsExpected")


def routed_ready(version: int, message: str) -> Condition:
    return Condition(type="Ready", status="True", reason=plan.ROUTED, message=message,
                          observedGeneration=1, lastTransitionTime="2026-01-01T00:00:00Z")


V1_ROUTED = "version 1 serves on every tier and the routers route it"


@pytest.mark.parametrize("stable, before, routed, expected", [
    # Routed once and not asked again: the message follows the stable version.
    (1, routed_ready(1, V1_ROUTED), None, V1_ROUTED),
    (1, routed_ready(1, V1_ROUTED + " (r1:1 did not answer)"), None,
     V1_ROUTED + " (r1:1 did not answer)"),
    (2, routed_ready(1, V1_ROUTED), None,
     "version 2 serves on every tier and the routers route it"),
    (12, routed_ready(1, V1_ROUTED), None,
     "version 12 serves on every tier and the routers route it"),
    (2, None, None, "version 2 serves on every tier; no router to ask"),
    (2, None, (("r0:1", True),), "version 2 serves on every tier and the routers route it"),
    (2, None, (("r0:1", False),),
     "version 2 serves on every tier; routers not routing it yet: r0:1"),
])
def test_ready_names_the_stable_version(stable, before, routed, expected):
    rollout = RolloutStatus(stable_version=stable, phase=names.Phase.PROMOTED)
    (ready,) = [c for c in plan.conditions((before,) if before else (), rollout, None, {}, (),
                                           1, 3000.0, routed) if c.type == "Ready"]
    assert ready.message == expected


def test_ready_follows_a_promotion_by_hand_on_the_next_pass():
    """v1 routed; `rollout promote --full` makes v2 stable in the status (its
    conditions as they were); the next pass names version 2."""
    status = TieredModelStatus(
        rollout=RolloutStatus(stable_version=1, canary_version=2, stage_started_at=1000.0,
                              phase=names.Phase.PROGRESSING, message="started"),
        artifacts=ARTIFACTS, conditions=(routed_ready(1, V1_ROUTED),))
    promoted = engine.promote(SPEC, status.rollout, 1010.0, full=True).status
    status = dataclasses.replace(status, rollout=promoted)
    assert not plan.asks_routers(status)  # routed before: the routers are not asked again
    made = plan.plan(SPEC, status, plan.Observation(1, READY, frozenset({1, 2}), None), 1012.0)
    (ready,) = [c for c in made.status.conditions if c.type == "Ready"]
    assert (ready.status, ready.reason) == ("True", plan.ROUTED)
    assert ready.message == "version 2 serves on every tier and the routers route it"


def test_a_stage_whose_tier_the_cascade_never_asks_says_so_at_every_pass():
    spec = load_tiered_model({**to_plain(SPEC, spell=None), "tiers": {"edge": {},
                              "datacenter": {}},
                              "routing": {"policy": "cascade",
                                          "cascade": {"tiers": ["datacenter"]}}})
    status = TieredModelStatus(
        rollout=RolloutStatus(stable_version=1, canary_version=2, stage_started_at=1000.0,
                              phase=names.Phase.PROGRESSING, message="started"),
        artifacts=ARTIFACTS)
    states = {(tier, v): plan.VersionState(plan.READY) for tier in ("edge", "datacenter")
              for v in (1, 2)}
    told = []
    for at in (1002.0, 1004.0):
        made = plan.plan(spec, status, plan.Observation(1, states, frozenset({1, 2})), at)
        status = made.status
        told.append(made.events)
        (progressing,) = [c for c in status.conditions if c.type == "Progressing"]
        assert "pins every request without a tiered-tier hint to datacenter, so edge gets " \
               "none" in progressing.message
        assert progressing.message == status.rollout.message
    assert len(told[0]) == 1 and told[1] == ()  # said once as an Event, kept in the status
