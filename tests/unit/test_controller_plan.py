"""The one reconcile step (`plan.plan`): which decisions become Events."""

from __future__ import annotations

from tiered import names
from tiered.controller import plan
from tiered.rollout.spec import (
    ArtifactVersion,
    RolloutStatus,
    TieredModelStatus,
    load_tiered_model,
    to_plain,
)

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
