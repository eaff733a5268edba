"""Autoscaling's pure decision (`tiered.controller.scaling`) and its place in
the plan: the HPA's arithmetic, stabilisation windows, bounded steps, scale
to zero and waking, the status round trip, Events and Kubernetes replicas;
tiers asleep in the routing table, and the router holding a request for one
until it wakes."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from tiered.controller import desired, plan, scaling
from tiered.controller.kube import render
from tiered.controller.scaling import TierLoad
from tiered.errors import ConfigError, DeadlineExceeded, ResourceExhausted
from tiered.protocol import routing
from tiered.rollout import engine
from tiered.rollout.spec import Autoscaling, load_tiered_model
from tiered.rollout.status import (
    ArtifactVersion,
    RolloutStatus,
    TieredModelStatus,
    TierScale,
    load_status,
)
from tiered.rollout.wire import to_plain
from tiered.router import demand

AUTO = Autoscaling(min_replicas=1, max_replicas=8, target=2.0, scale_down_window_s=60.0,
                   scale_period_s=0.0)


def load(concurrency: float, agents: int = 1, requests: int = 100, unmet: int = 0,
         utilization: float = 0.0) -> TierLoad:
    return TierLoad(agents, 5.0, requests, concurrency, utilization, unmet)


def follow(auto: Autoscaling, loads, start: int = 1, every_s: float = 5.0,
           t0: float = 1000.0) -> list[TierScale]:
    """Each look's scale; a number is the tier's total concurrency, spread
    over the agents of the look before."""
    scale, seen = None, []
    for index, total in enumerate(loads):
        agents = scale.replicas if scale is not None else start
        reading = total if isinstance(total, TierLoad) else load(total, agents)
        scale = scaling.decide(auto, scale, reading, start, t0 + every_s * index)
        seen.append(scale)
    return seen


def test_a_load_step_adds_the_agents_that_hold_the_target_at_once():
    first, second = follow(AUTO, [2.0, 9.0])  # at the target, then 4.5x it
    assert first.replicas == 1 and "within 10%" in first.reason
    assert second.replicas == 5  # ceil(9 / 2): the fewest that hold 2 an agent
    assert "concurrency 9 an agent over 1 (target 2): 5 agents wanted" in second.reason


def test_one_decision_adds_at_most_max_scale_up_and_never_passes_max_replicas():
    auto = Autoscaling(max_replicas=6, target=1.0, max_scale_up=2, scale_period_s=0.0)
    seen = follow(auto, [20.0, 20.0, 20.0, 20.0], start=1)
    assert [s.replicas for s in seen] == [3, 5, 6, 6]
    assert "(maxReplicas 6)" in seen[-1].reason


def test_one_change_a_period_makes_the_steps_a_rate():
    auto = Autoscaling(max_replicas=6, target=1.0, max_scale_up=2, scale_period_s=15.0)
    seen = follow(auto, [20.0] * 8, start=1)  # a look every 5 s
    assert [s.replicas for s in seen] == [3, 3, 3, 5, 5, 5, 6, 6]
    assert "scalePeriodSeconds 15, 10 s more" in seen[1].reason


def test_a_drop_scales_down_at_once_when_the_window_is_over():
    looks = [8.0, 2.0, *[2.0] * 20]  # 4 agents wanted, then a dip that stays
    seen = follow(AUTO, looks)
    replicas = [s.replicas for s in seen]
    assert replicas[0] == 4
    # The burst's 4 stays the window's highest until 60 s after it (12 looks of 5 s).
    assert replicas[1:13] == [4] * 12
    assert "the scale-down window's highest)" in seen[5].reason
    assert replicas[13:] == [1] * 9  # then one change, down to what the load wants


def test_max_scale_down_removes_at_most_that_many_agents_a_decision():
    seen = follow(dataclasses.replace(AUTO, max_scale_down=1), [8.0, 2.0, *[2.0] * 20])
    replicas = [s.replicas for s in seen]
    assert replicas[1:13] == [4] * 12
    assert replicas[13:17] == [3, 2, 1, 1]
    assert "the scale-down window's highest, at most -1)" in seen[5].reason


def test_a_steady_load_that_wobbles_around_the_target_changes_nothing():
    wobble = [6.0, 6.45, 5.55, 6.3, 5.7] * 6  # within 10% of the target on 3 agents
    assert {s.replicas for s in follow(AUTO, wobble, start=3)} == {3}


def test_a_load_that_jumps_up_and_down_changes_at_most_once_a_window():
    seen = follow(AUTO, [6.0, 1.0] * 12, start=1)  # 5 s apart: a 60 s window holds both
    changes = sum(a.replicas != b.replicas for a, b in zip(seen, seen[1:]))
    assert changes <= 1, [s.replicas for s in seen]


def test_the_scale_up_window_follows_its_lowest_recommendation():
    auto = Autoscaling(max_replicas=8, target=2.0, scale_up_window_s=10.0, scale_period_s=0.0)
    seen = follow(auto, [2.0, 8.0, 8.0, 8.0])
    assert [s.replicas for s in seen] == [1, 1, 1, 4]  # 4 wanted for the whole 10 s


def test_utilization_is_a_share_and_scales_the_same_way():
    auto = Autoscaling(metric="utilization", target=0.5, max_replicas=4)
    scale = scaling.decide(auto, None, load(0.0, agents=2, utilization=1.8), 2, 0.0)
    assert scale.replicas == 4 and "utilization 0.9 an agent over 2" in scale.reason
    with pytest.raises(ConfigError, match="at most 1"):
        Autoscaling(metric="utilization", target=1.5)


def test_an_idle_tier_goes_to_zero_and_unmet_demand_wakes_it():
    auto = Autoscaling(scale_to_zero=True, idle_s=30.0, min_replicas=2, max_replicas=4)
    quiet = load(0.0, agents=2, requests=0)
    seen = follow(auto, [quiet] * 8, start=2)
    assert [s.replicas for s in seen] == [2] * 6 + [0, 0]  # 30 s after the last request
    assert "no request for 30 s" in seen[6].reason
    asleep = seen[-1]
    still = scaling.decide(auto, asleep, load(0.0, agents=0, requests=0), 2, 2000.0)
    assert still.replicas == 0 and "no unmet demand" in still.reason
    woken = scaling.decide(auto, asleep, load(0.0, agents=0, requests=0, unmet=3), 2, 2001.0)
    assert woken.replicas == 2 and "woken: 3 requests" in woken.reason
    # Woken, it is not idle at once: its idle clock starts at the wake.
    after = scaling.decide(auto, woken, load(0.0, agents=2, requests=0), 2, 2010.0)
    assert after.replicas == 2


def test_requests_keep_a_scale_to_zero_tier_awake():
    auto = Autoscaling(scale_to_zero=True, idle_s=10.0)
    seen = follow(auto, [load(0.1, requests=1)] * 10, every_s=5.0)
    assert {s.replicas for s in seen} == {1}


def test_no_telemetry_holds_and_says_so():
    scale = scaling.decide(AUTO, TierScale(3, "x", changed_at=5.0), None, 1, 100.0)
    assert scale.replicas == 3 and scale.changed_at == 5.0
    assert "no telemetry" in scale.reason


def test_replicas_outside_new_bounds_move_inside_them_at_once():
    auto = Autoscaling(min_replicas=2, max_replicas=3)
    assert scaling.decide(auto, TierScale(7, ""), load(1.0), 1, 0.0).replicas == 3
    assert scaling.decide(auto, TierScale(1, ""), load(1.0), 1, 0.0).replicas == 2
    assert scaling.starting_replicas(auto, 10) == 3
    woken = scaling.decide(auto, TierScale(0, ""), None, 1, 0.0)  # scaleToZero now off
    assert woken.replicas == 2 and "scaleToZero is off" in woken.reason
    with pytest.raises(ConfigError, match="maxReplicas: must be at least minReplicas"):
        Autoscaling(min_replicas=5, max_replicas=2)


def test_the_recommendations_kept_are_bounded():
    seen = follow(AUTO, [float(1 + i % 7) for i in range(500)], every_s=0.01)
    assert len(seen[-1].recommendations) <= scaling.MAX_RECOMMENDATIONS


SHA = "1" * 64
SPEC = load_tiered_model({
    "name": "digits", "artifact": {"uri": "/m/digits.onnx", "sha256": SHA},
    "tiers": {"edge": {"replicas": 2, "autoscaling": {"max_replicas": 6, "target": 2.0}},
              "regional": {"replicas": 3}},
    "rollout": {"stages": [{"name": "edge", "weights": {"edge": 10}}]}})
SERVING = TieredModelStatus(rollout=RolloutStatus(stable_version=1, phase="Promoted"),
                            artifacts=(ArtifactVersion(1, "/m/digits.onnx", SHA),))
READY = {(tier, 1): plan.VersionState(plan.READY) for tier in ("edge", "regional")}


def test_the_plan_scales_autoscaled_tiers_and_says_so_in_events_and_status():
    first = plan.plan(SPEC, SERVING, plan.Observation(1, READY, frozenset({1}),
                                                      loads={"edge": load(4.0, agents=2)}), 10.0)
    assert first.replicas == {("edge", 1): 2, ("regional", 1): 3} and first.events == ()
    assert first.requeue_after_s == plan.SCALE_INTERVAL_S
    second = plan.plan(SPEC, first.status, plan.Observation(
        1, READY, frozenset({1}), loads={"edge": load(10.0, agents=2)}), 15.0)
    assert second.replicas == {("edge", 1): 5, ("regional", 1): 3}
    (event,) = second.events
    assert event.reason == "ScaledUp" and event.message.startswith("edge: 2 -> 5 agents: ")
    kept = load_status(to_plain(second.status), "status")  # survives a restart
    assert kept.scaling["edge"] == second.status.scaling["edge"]
    assert plan.replicas_of(SPEC, kept.scaling) == {"edge": 5, "regional": 3}


def test_a_live_canary_gets_agents_by_its_weight_and_stable_the_rest():
    live = RolloutStatus(stable_version=1, canary_version=2, phase="Progressing")
    sized = plan.workload_replicas(SPEC, live, {"edge": TierScale(10, "")}, (1, 2))
    # Stage 1 sends 10% of edge to the canary; regional none (3 agents, fixed).
    assert sized == {("edge", 1): 9, ("edge", 2): 1, ("regional", 1): 3, ("regional", 2): 1}
    asleep = plan.workload_replicas(SPEC, live, {"edge": TierScale(0, "")}, (1, 2))
    assert asleep[("edge", 1)] == asleep[("edge", 2)] == 0
    # No rollout live: the version serving gets them all, one still to roll out one.
    settled = plan.workload_replicas(SPEC, SERVING.rollout, {"edge": TierScale(4, "")}, (1, 2))
    assert settled == {("edge", 1): 4, ("edge", 2): 1, ("regional", 1): 3, ("regional", 2): 1}


def test_kubernetes_deployments_carry_the_decided_replicas():
    settings = render.ClusterSettings(namespace="ns")
    objects = render.desired_objects(SPEC, SERVING.artifacts, [1], render.Owner("digits", "u"),
                                     settings, {("edge", 1): 5, ("regional", 1): 3})
    sized = {o["metadata"]["name"]: o["spec"]["replicas"] for o in objects
             if o["kind"] == "Deployment"}
    assert sorted(sized.values()) == [3, 5]


def test_a_tier_that_may_sleep_and_has_no_agent_is_asleep_in_the_table():
    sleepy = load_tiered_model({
        "name": "digits", "artifact": {"uri": "/m/digits.onnx", "sha256": SHA},
        "tiers": {"edge": {"autoscaling": {"scale_to_zero": True}}, "regional": {}},
        "rollout": {"stages": [{"name": "edge", "weights": {"edge": 10}}]}})
    agents = {"regional": ("10.0.0.2:8001",)}
    table = desired.routing_table(1, [(sleepy, SERVING.rollout)], desired.same_agents(agents))
    route = table.models["digits"]
    assert set(route.tiers) == {"regional"} and route.asleep == ("edge",)
    # Asleep everywhere, the model keeps its route: its requests wait for a tier.
    table = desired.routing_table(2, [(sleepy, SERVING.rollout)], desired.same_agents({}))
    assert table.models["digits"].asleep == ("edge",) and not table.models["digits"].tiers
    # A tier without agents that may not sleep is simply not routed, as before.
    assert "regional" not in table.models["digits"].asleep
    with pytest.raises(ConfigError, match="asleep: tier 'regional' has agents"):
        routing.ModelRoute({"regional": routing.TierRoute(("a:1",), 1)}, asleep=("regional",))
    assert routing.parse_table(routing.table_document(table)) == table


def held_table(model_route: routing.ModelRoute | None) -> routing.RoutingTable:
    return routing.RoutingTable(1, {"digits": model_route} if model_route else {})


def test_a_request_held_for_a_sleeping_tier_goes_on_once_it_wakes():
    asleep = routing.ModelRoute({}, asleep=("edge",))
    awake = routing.ModelRoute({"edge": routing.TierRoute(("a:1",), 1)})
    tables = [held_table(asleep)]
    held = demand.Demand(time.monotonic)

    async def scenario():
        waiter = asyncio.create_task(held.until_awake("digits", "edge", lambda: tables[-1],
                                                      time.monotonic() + 5))
        await asyncio.sleep(0.2)
        assert held.report() == [("digits", "edge", 0, 1)] and not waiter.done()
        tables.append(held_table(awake))
        return await asyncio.wait_for(waiter, 2)

    assert asyncio.run(scenario()) == awake
    assert held.report() == []  # no longer held


def test_a_held_request_ends_at_its_deadline_and_the_holding_is_bounded(monkeypatch):
    held = demand.Demand(time.monotonic)
    asleep = held_table(routing.ModelRoute({}, asleep=("edge",)))
    with pytest.raises(DeadlineExceeded, match="did not wake within the request's deadline"):
        asyncio.run(held.until_awake("digits", None, lambda: asleep, time.monotonic() + 0.1))
    monkeypatch.setattr(demand, "MAX_WAITING", 0)
    with pytest.raises(ResourceExhausted, match="wait for tiers to wake"):
        asyncio.run(held.until_awake("digits", None, lambda: asleep, time.monotonic() + 1))


def test_a_promotion_waits_for_the_canary_at_full_count_and_a_rollback_does_not(monkeypatch):
    live = dataclasses.replace(SERVING, rollout=RolloutStatus(
        stable_version=1, canary_version=2, phase="Progressing", stage_started_at=0.0),
        artifacts=(*SERVING.artifacts, ArtifactVersion(2, "/m/digits-2.onnx", "2" * 64)),
        scaling={"edge": TierScale(4, "")})
    spec = dataclasses.replace(SPEC, artifact=dataclasses.replace(
        SPEC.artifact, uri="/m/digits-2.onnx", sha256="2" * 64))
    decide = {"now": engine.promote}
    monkeypatch.setattr(plan, "_judge", lambda spec, rollout, reading, now: (
        decide["now"](spec, rollout, now), None))

    def look(status, canary_ready: int) -> plan.Plan:
        states = {**{(t, 1): plan.VersionState(plan.READY, ready=n)
                     for t, n in (("edge", 4), ("regional", 3))},
                  **{(t, 2): plan.VersionState(plan.READY, ready=min(canary_ready, n))
                     for t, n in (("edge", 4), ("regional", 3))}}
        return plan.plan(spec, status, plan.Observation(1, states, frozenset({1, 2})), 50.0)

    # The canary (1 agent each) is promoted only once it is ready at every tier's count.
    waiting = look(live, canary_ready=1)
    rollout = waiting.status.rollout
    assert rollout.canary_version == 2 and rollout.promoting, rollout
    assert "promoting once the canary's agents are ready (edge 1 of 4, regional 1 of 3)" \
        in rollout.message
    assert waiting.replicas == {("edge", 1): 4, ("edge", 2): 4, ("regional", 1): 3,
                                ("regional", 2): 3}  # stable keeps serving meanwhile
    assert [e.reason for e in waiting.events] == ["Holding"]
    promoted = look(waiting.status, canary_ready=4)
    assert promoted.status.rollout.stable_version == 2
    assert not promoted.status.rollout.promoting
    assert [e.reason for e in promoted.events] == ["Promoted"]
    # A rollback while it waits moves the traffic back at once.
    decide["now"] = lambda spec, rollout, now: engine._rolled_back(spec, rollout, "slower", None)
    rolled = look(waiting.status, canary_ready=1)
    assert rolled.status.rollout.phase == "RolledBack" and not rolled.status.rollout.promoting
    assert rolled.replicas[("edge", 1)] == 4
