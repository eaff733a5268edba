"""Routing policies as tables: pinned, slo-energy, cascade, canary split, shadow."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tiered.errors import InvalidArgument, NotFound
from tiered.protocol.routing import TierRoute, parse_table
from tiered.router import policies as p

E1, E2 = p.Candidate("edge", "e:1", 1), p.Candidate("edge", "e:2", 1)
R1 = p.Candidate("regional", "r:1", 1)
D1 = p.Candidate("datacenter", "d:1", 1)
ALL = (E1, E2, R1, D1)


def obs(p95_ms=None, joules=None, queue=0, service_ms=0.0, rtt_ms=0.0, in_flight=0,
        ewma_ms=None, source="nvml") -> p.AgentObservation:
    return p.AgentObservation(
        p95_s=None if p95_ms is None else p95_ms / 1000, service_s=service_ms / 1000,
        queue_depth=queue, rtt_s=rtt_ms / 1000, joules_per_inference=joules,
        energy_source=source if joules is not None else "", in_flight=in_flight,
        ewma_s=None if ewma_ms is None else ewma_ms / 1000)


def test_predicted_p95_adds_queue_and_round_trip():
    assert obs(p95_ms=10, queue=3, service_ms=2, rtt_ms=1).predicted_p95_s() == \
        pytest.approx(0.017)
    assert obs(ewma_ms=4).predicted_p95_s() == pytest.approx(0.004)  # no telemetry yet
    assert obs().predicted_p95_s() is None


PINNED = {
    "edge-hint": ("edge", {}, {"e:1", "e:2"}),
    "regional-hint": ("regional", {}, {"r:1"}),
}


@pytest.mark.parametrize("tier, observations, agents", PINNED.values(), ids=PINNED)
def test_pinned_keeps_only_the_hinted_tier(tier, observations, agents):
    ranking = p.Pinned().choose(ALL, p.RouteRequest("m", tier=tier), observations,
                                random.Random(0))
    assert {c.agent for c in ranking.candidates} == agents


def test_pinned_refuses_unknown_or_absent_tiers():
    with pytest.raises(InvalidArgument, match="tiered-tier: unknown tier 'moon'"):
        p.Pinned().choose(ALL, p.RouteRequest("m", tier="moon"), {}, random.Random(0))
    with pytest.raises(NotFound, match="no agents on tier 'datacenter'"):
        p.Pinned().choose((E1, R1), p.RouteRequest("m", tier="datacenter"), {}, random.Random(0))


def test_power_of_two_choices_puts_the_less_loaded_of_two_first():
    observations = {"e:1": obs(in_flight=9), "e:2": obs(in_flight=1)}
    for seed in range(20):  # with two agents, both are always drawn
        ranked = p.order_agents([E1, E2], observations, random.Random(seed))
        assert ranked == [E2, E1]


SLO_ENERGY = {
    "lowest-energy-among-meeting": (
        50, {"e:1": obs(10, 0.5), "e:2": obs(10, 0.5), "r:1": obs(5, 0.2), "d:1": obs(2, 0.9)},
        "regional"),
    "slow-cheap-tier-excluded-by-slo": (
        8, {"e:1": obs(10, 0.5), "e:2": obs(10, 0.5), "r:1": obs(20, 0.2), "d:1": obs(2, 0.9)},
        "datacenter"),
    "queue-pushes-a-tier-over-the-slo": (
        20, {"e:1": obs(5, 0.1, queue=10, service_ms=2), "e:2": obs(5, 0.1, queue=10,
             service_ms=2), "r:1": obs(5, 0.3), "d:1": obs(5, 0.9)}, "regional"),
    "round-trip-counts": (
        20, {"e:1": obs(5, 0.1, rtt_ms=30), "e:2": obs(5, 0.1, rtt_ms=30),
             "r:1": obs(5, 0.3), "d:1": obs(5, 0.9)}, "regional"),
    "none-meets-fastest-first": (
        1, {"e:1": obs(10, 0.1), "e:2": obs(10, 0.1), "r:1": obs(4, 0.3), "d:1": obs(6, 0.9)},
        "regional"),
    "energy-tie-broken-by-load": (
        50, {"e:1": obs(5, 0.2, in_flight=5), "e:2": obs(5, 0.2, in_flight=5),
             "r:1": obs(5, 0.2, in_flight=1), "d:1": obs(5, 0.9)}, "regional"),
    "unknown-energy-ranks-after-known": (
        50, {"e:1": obs(5), "e:2": obs(5), "r:1": obs(5), "d:1": obs(5, 0.9)}, "datacenter"),
}


@pytest.mark.parametrize("slo_ms, observations, first_tier", SLO_ENERGY.values(), ids=SLO_ENERGY)
def test_slo_energy_picks_the_cheapest_tier_meeting_the_slo(slo_ms, observations, first_tier):
    ranking = p.SloEnergy(default_slo_ms=100).choose(
        ALL, p.RouteRequest("m", slo_ms=slo_ms), observations, random.Random(0))
    assert ranking.candidates[0].tier == first_tier
    assert sorted(ranking.candidates, key=str) == sorted(ALL, key=str)  # all kept for failover
    assert not ranking.energy_incomparable


def edge(p95_ms, joules, source):
    return {"e:1": obs(p95_ms, joules, source=source), "e:2": obs(p95_ms, joules, source=source)}


# slo ms, observations -> tier order, whether energy could not decide
SLO_ENERGY_SOURCES = {
    "one-measured-source-ranks-by-energy": (
        50, {**edge(10, 0.1, "rapl"), "r:1": obs(5, 0.5, source="rapl"), "d:1": obs(2, 0.9,
             source="rapl")}, ["edge", "regional", "datacenter"], False),
    "one-modeled-source-ranks-by-energy-too": (
        50, {**edge(10, 0.1, "model"), "r:1": obs(5, 0.5, source="model"),
             "d:1": obs(2, 0.9, source="model")}, ["edge", "regional", "datacenter"], False),
    "modeled-edge-against-nvml-gpus-goes-fastest-first": (
        50, {**edge(10, 0.001, "model"), "r:1": obs(5, 0.5), "d:1": obs(2, 0.9)},
        ["datacenter", "regional", "edge"], True),
    "rapl-against-nvml-does-not-compare-either": (
        50, {**edge(10, 0.001, "rapl"), "r:1": obs(5, 0.5), "d:1": obs(2, 0.9)},
        ["datacenter", "regional", "edge"], True),
    "a-tier-of-mixed-sources-does-not-compare": (
        50, {"e:1": obs(10, 0.1, source="model"), "e:2": obs(10, 0.1), "r:1": obs(5, 0.5),
             "d:1": obs(2, 0.9)}, ["datacenter", "regional", "edge"], True),
    "only-meeting-tiers-must-compare": (
        8, {**edge(10, 0.001, "model"), "r:1": obs(5, 0.5), "d:1": obs(2, 0.9)},
        ["regional", "datacenter", "edge"], False),
    "no-figure-yet-is-no-other-source": (
        50, {**edge(10, None, ""), "r:1": obs(5, 0.5), "d:1": obs(2, 0.9)},
        ["regional", "datacenter", "edge"], False),
}


@pytest.mark.parametrize("slo_ms, observations, tiers, incomparable",
                         SLO_ENERGY_SOURCES.values(), ids=SLO_ENERGY_SOURCES)
def test_slo_energy_ranks_by_energy_only_among_figures_of_one_source(
        slo_ms, observations, tiers, incomparable):
    ranking = p.SloEnergy(default_slo_ms=100).choose(
        ALL, p.RouteRequest("m", slo_ms=slo_ms), observations, random.Random(0))
    assert list(dict.fromkeys(c.tier for c in ranking.candidates)) == tiers
    assert ranking.energy_incomparable == incomparable


ONE_CANDIDATE = {
    "meets-the-slo": (50, {"r:1": obs(5, 0.5)}),
    "misses-the-slo": (1, {"r:1": obs(5, 0.5)}),
    "modeled-energy": (50, {"r:1": obs(5, 0.5, source="model")}),
    "nothing-known": (50, {}),
}


@pytest.mark.parametrize("slo_ms, observations", ONE_CANDIDATE.values(), ids=ONE_CANDIDATE)
def test_slo_energy_with_one_candidate_ranks_it_whatever_is_known(slo_ms, observations):
    ranking = p.SloEnergy(default_slo_ms=100).choose(
        (R1,), p.RouteRequest("m", slo_ms=slo_ms), observations, random.Random(0))
    assert ranking == p.Ranking((R1,), energy_incomparable=False)


def test_slo_energy_uses_the_model_default_without_a_hint():
    observations = {"e:1": obs(30, 0.1), "e:2": obs(30, 0.1), "r:1": obs(5, 0.5),
                    "d:1": obs(5, 0.9)}
    choose = p.SloEnergy(default_slo_ms=10).choose
    assert choose(ALL, p.RouteRequest("m"), observations, random.Random(0)) \
        .candidates[0].tier == "regional"
    assert choose(ALL, p.RouteRequest("m", slo_ms=50), observations, random.Random(0)) \
        .candidates[0].tier == "edge"


def test_cascade_orders_tiers_as_configured():
    ranking = p.Cascade(("regional", "edge")).choose(ALL, p.RouteRequest("m"), {},
                                                     random.Random(0))
    assert [c.tier for c in ranking.candidates] == ["regional", "edge", "edge"]


logits_sure = np.array([[0.0, 9.0, 0.0]], np.float32)
logits_unsure = np.array([[1.0, 1.1, 0.9]], np.float32)
ESCALATE = {
    "confident-logits": ({"logits": logits_sure}, 0.9, "", False),
    "unsure-logits": ({"logits": logits_unsure}, 0.9, "", True),
    "probabilities-used-as-is": ({"p": np.array([[0.85, 0.1, 0.05]])}, 0.9, "", True),
    "probabilities-confident": ({"p": np.array([[0.95, 0.05, 0.0]])}, 0.9, "", False),
    "batch-escalates-on-its-least-sure-row": (
        {"logits": np.concatenate([logits_sure, logits_unsure])}, 0.9, "", True),
    "named-confidence-output": (
        {"logits": logits_unsure, "confidence": np.array([[0.97]])}, 0.9, "confidence", False),
    "named-logits-output": ({"logits": logits_unsure, "other": logits_sure}, 0.9, "logits",
                            True),
    "threshold-zero-never-escalates": ({"logits": logits_unsure}, 0.0, "", False),
}


@pytest.mark.parametrize("outputs, threshold, name, escalate", ESCALATE.values(), ids=ESCALATE)
def test_should_escalate(outputs, threshold, name, escalate):
    assert p.should_escalate(outputs, threshold, name) is escalate


def test_escalation_needs_a_name_when_outputs_are_several():
    with pytest.raises(InvalidArgument, match="cascade.output"):
        p.should_escalate({"a": logits_sure, "b": logits_sure}, 0.9)
    with pytest.raises(NotFound, match="no output 'c'"):
        p.should_escalate({"a": logits_sure}, 0.9, "c")


canary_route = TierRoute(agents=("e:1",), stable=1, canary=2, canary_weight=0.1,
                         shadow_fraction=0.5)
VERSIONS = {
    "no-canary": (TierRoute(agents=("e:1",), stable=3), "k", 3),
    "weight-one-all-canary": (TierRoute(agents=("e:1",), stable=1, canary=2,
                                        canary_weight=1.0), "k", 2),
    "weight-zero-all-stable": (TierRoute(agents=("e:1",), stable=1, canary=2), "k", 1),
}


@pytest.mark.parametrize("route, key, version", VERSIONS.values(), ids=VERSIONS)
def test_pick_version(route, key, version):
    assert p.pick_version(route, key, random.Random(0)).version == version


def test_a_key_keeps_its_version_whatever_the_rng():
    for key in ("alice", "bob", "carol", "dave"):
        picks = {p.pick_version(canary_route, key, random.Random(seed)).version
                 for seed in range(20)}
        assert len(picks) == 1


def test_any_key_a_client_sends_has_its_place_invalid_utf8_too():
    """A lone surrogate (what a JSON escape or an undecodable header byte
    gives) hashes to a fixed place instead of raising."""
    for key in ("\udcff", "user-\ud800", "caf\u00e9"):
        place = p.key_point(key)
        assert 0 <= place < 1 and place == p.key_point(key)
        assert p.pick_version(canary_route, key, random.Random(0)).version in (1, 2)


def test_raising_the_weight_only_moves_keys_to_the_canary():
    low = TierRoute(agents=("e:1",), stable=1, canary=2, canary_weight=0.1)
    high = TierRoute(agents=("e:1",), stable=1, canary=2, canary_weight=0.3)
    for i in range(2000):
        if p.pick_version(low, f"k{i}", random.Random(0)).canary:
            assert p.pick_version(high, f"k{i}", random.Random(0)).canary


def test_a_tenth_of_5000_keys_see_the_canary_within_two_points():
    share = sum(p.pick_version(canary_route, f"user-{i}", random.Random(0)).canary
                for i in range(5000)) / 5000
    assert abs(share - 0.1) <= 0.02


def test_without_a_key_the_split_follows_the_rng():
    rng = random.Random(1)
    share = sum(p.pick_version(canary_route, None, rng).canary for _ in range(5000)) / 5000
    assert abs(share - 0.1) <= 0.02


def test_shadow_only_for_stable_requests_with_a_canary():
    rng = random.Random(2)
    stable, canary = p.VersionChoice(1, False), p.VersionChoice(2, True)
    share = sum(p.should_shadow(canary_route, stable, rng) for _ in range(4000)) / 4000
    assert abs(share - 0.5) <= 0.03
    assert not any(p.should_shadow(canary_route, canary, rng) for _ in range(100))
    no_canary = TierRoute(agents=("e:1",), stable=1)
    assert not any(p.should_shadow(no_canary, stable, rng) for _ in range(100))


def test_top1_per_row():
    assert p.top1({"logits": np.array([[0, 3, 1], [5, 0, 0]])}) == (1, 0)


def test_candidates_of_a_canary_with_its_own_agents():
    route = parse_table({"version": 1, "models": {"m": {"tiers": {
        "edge": {"agents": ["s:1", "s:2"], "stable": 1, "canary": 2, "canary_weight": 0.5,
                 "canary_agents": ["c:1"]},
        "regional": {"agents": ["r:1"], "stable": 1}}}}}).models["m"]
    canary = p.candidates_of(route, {"edge": 2, "regional": 1})
    assert [(c.tier, c.agent, c.version) for c in canary] == [
        ("edge", "c:1", 2), ("regional", "r:1", 1)]
    stable = p.candidates_of(route, {"edge": 1, "regional": 1})
    assert [c.agent for c in stable] == ["s:1", "s:2", "r:1"]


# -- a tier hint is a preference; agents held down go last ------------------------------

PREFERRED = {
    "edge-then-up-the-tiers": ("edge", ALL, ["edge", "edge", "regional", "datacenter"]),
    "regional-then-bigger-then-smaller": ("regional", ALL,
                                          ["regional", "datacenter", "edge", "edge"]),
    "datacenter-then-nearest-down": ("datacenter", ALL,
                                     ["datacenter", "regional", "edge", "edge"]),
    "a-hinted-tier-the-model-lacks": ("datacenter", (E1, R1), ["regional", "edge"]),
}


@pytest.mark.parametrize("tier, candidates, tiers", PREFERRED.values(), ids=PREFERRED)
def test_preferred_puts_the_hinted_tier_first_then_falls_back(tier, candidates, tiers):
    ranking = p.Preferred().choose(candidates, p.RouteRequest("m", tier=tier), {},
                                   random.Random(0))
    assert [c.tier for c in ranking.candidates] == tiers
    assert sorted(ranking.candidates, key=ALL.index) == sorted(candidates, key=ALL.index)


def test_preferred_refuses_an_unknown_tier():
    with pytest.raises(InvalidArgument, match="tiered-tier: unknown tier 'moon'"):
        p.Preferred().choose(ALL, p.RouteRequest("m", tier="moon"), {}, random.Random(0))


def test_fallback_tiers_go_up_then_down_nearest_first():
    tiers = ("edge", "regional", "datacenter")
    assert p.fallback_tiers("edge", tiers) == ["regional", "datacenter"]
    assert p.fallback_tiers("regional", tiers) == ["datacenter", "edge"]
    assert p.fallback_tiers("datacenter", tiers) == ["regional", "edge"]


def test_a_hint_is_a_preference_unless_strict():
    route = parse_table({"version": 1, "models": {"m": {"policy": "cascade", "tiers": {
        t: {"agents": [f"{t}:1"]} for t in ("edge", "regional", "datacenter")}}}}).models["m"]
    assert isinstance(p.policy_for(route, p.RouteRequest("m", tier="edge")), p.Preferred)
    assert isinstance(p.policy_for(route, p.RouteRequest("m", tier="edge", strict=True)),
                      p.Pinned)
    assert isinstance(p.policy_for(route, p.RouteRequest("m")), p.Cascade)


HEALTHY_FIRST = {
    "nothing-down": ((E1, R1, D1), set(), (E1, R1, D1), ()),
    "first-down-goes-last": ((E1, R1, D1), {"e:1"}, (R1, D1, E1), (E1,)),
    "a-later-one-down": ((E1, R1, D1), {"r:1"}, (E1, D1, R1), ()),
    "two-down-keep-their-order": ((E1, E2, R1, D1), {"e:1", "e:2"}, (R1, D1, E1, E2),
                                  (E1, E2)),
    "all-down-order-stands": ((E1, R1), {"e:1", "r:1"}, (E1, R1), ()),
    "unknown-down-agents-ignored": ((E1, R1), {"x:9"}, (E1, R1), ()),
}


@pytest.mark.parametrize("ranked, down, order, passed", HEALTHY_FIRST.values(),
                         ids=HEALTHY_FIRST)
def test_agents_held_down_go_after_every_agent_that_is_up(ranked, down, order, passed):
    ranking = p.healthy_first(p.Ranking(ranked, energy_incomparable=True), down)
    assert ranking.candidates == order
    assert ranking.passed_over == passed
    assert ranking.energy_incomparable  # the policy's other findings stand


def test_rank_reads_health_for_every_policy():
    hint = p.RouteRequest("m", tier="edge")
    ranking = p.rank(p.Preferred(), (E1, R1, D1), hint, {}, random.Random(0), {"e:1"})
    assert [c.agent for c in ranking.candidates] == ["r:1", "d:1", "e:1"]
    assert ranking.passed_over == (E1,)
    strict = p.rank(p.Pinned(), (E1, R1, D1), p.RouteRequest("m", tier="edge", strict=True),
                    {}, random.Random(0), {"e:1"})
    assert strict.candidates == (E1,) and strict.passed_over == ()  # nowhere else to go
    cascade = p.rank(p.Cascade(("edge", "regional", "datacenter")), (E1, R1, D1),
                     p.RouteRequest("m"), {}, random.Random(0), {"e:1"})
    assert [c.tier for c in cascade.candidates] == ["regional", "datacenter", "edge"]
    unhealthy = p.rank(p.SloEnergy(100), (E1, R1), p.RouteRequest("m"),
                       {"e:1": obs(1, 0.1), "r:1": obs(1, 0.9)}, random.Random(0), {"e:1"})
    assert unhealthy.candidates == (R1, E1)


def gen(ttft_p95_ms=None, j_per_token=None, source="nvml", ttft_p50_ms=None, p95_ms=None,
        joules=None, in_flight=0) -> p.AgentObservation:
    """A generative model's agent: token telemetry, maybe beside whole-request figures."""
    def ms(value):
        return None if value is None else value / 1000

    return p.AgentObservation(
        p95_s=ms(p95_ms), joules_per_inference=joules, energy_source=source if joules else "",
        ttft_p95_s=ms(ttft_p95_ms),
        ttft_p50_s=ms(ttft_p50_ms if ttft_p50_ms is not None else ttft_p95_ms),
        joules_per_output_token=j_per_token,
        token_energy_source=source if j_per_token is not None else "", in_flight=in_flight)


def edges(observation):
    return {"e:1": observation, "e:2": observation}


# slo ms (time to first token), observations -> tier order, whether energy could not decide
TOKENS = {
    "cheapest-joules-per-token-meeting-the-ttft-slo": (
        200, {**edges(gen(150, 0.02)), "r:1": gen(60, 0.01), "d:1": gen(20, 0.05)},
        ["regional", "edge", "datacenter"], False),
    "whole-request-latency-does-not-count": (  # seconds per answer, milliseconds per token
        200, {**edges(gen(150, 0.001, p95_ms=4000, joules=2.0)), "r:1": gen(60, 0.01),
              "d:1": gen(20, 0.05)}, ["edge", "regional", "datacenter"], False),
    "joules-per-answer-does-not-count": (
        200, {**edges(gen(150, 0.02, p95_ms=100, joules=0.001)), "r:1": gen(60, 0.01),
              "d:1": gen(20, 0.05)}, ["regional", "edge", "datacenter"], False),
    "a-slow-first-token-is-excluded": (
        100, {**edges(gen(150, 0.001)), "r:1": gen(60, 0.01), "d:1": gen(20, 0.05)},
        ["regional", "datacenter", "edge"], False),
    "none-meets-fastest-median-first": (
        10, {**edges(gen(150, 0.001)), "r:1": gen(60, 0.01, ttft_p50_ms=50),
             "d:1": gen(70, 0.05, ttft_p50_ms=30)}, ["datacenter", "regional", "edge"], False),
    "per-token-energy-of-other-sources-decides-nothing": (
        200, {**edges(gen(150, 0.001, source="model")), "r:1": gen(60, 0.01),
              "d:1": gen(20, 0.05)}, ["datacenter", "regional", "edge"], True),
    "a-tier-without-token-telemetry-yet-is-tried": (  # predicts 0, no energy: after known
        200, {**edges(gen(150, 0.02)), "r:1": gen(p95_ms=5000, joules=3.0),
              "d:1": gen(20, 0.05)}, ["edge", "datacenter", "regional"], False),
}


@pytest.mark.parametrize("slo_ms, observations, tiers, incomparable", TOKENS.values(),
                         ids=TOKENS)
def test_slo_energy_ranks_a_generative_model_by_first_token_and_joules_per_token(
        slo_ms, observations, tiers, incomparable):
    ranking = p.SloEnergy(default_slo_ms=100).choose(
        ALL, p.RouteRequest("m", slo_ms=slo_ms), observations, random.Random(0))
    assert list(dict.fromkeys(c.tier for c in ranking.candidates)) == tiers
    assert ranking.energy_incomparable == incomparable


def test_without_token_telemetry_a_generative_model_is_ranked_as_before():
    # Only whole-request figures (no Generation has arrived yet): today's rule.
    observations = {**edges(gen(p95_ms=30, joules=0.1)), "r:1": gen(p95_ms=5, joules=0.5),
                    "d:1": gen(p95_ms=5, joules=0.9)}
    first = p.SloEnergy(100).choose(ALL, p.RouteRequest("m", slo_ms=10), observations,
                                    random.Random(0)).candidates[0]
    assert first.tier == "regional"


# mean token log-probability, threshold -> escalate; exp(-0.1) is about 0.905
GENERATION_ESCALATE = {
    "confident-stays": (-0.1, 0.9, False),
    "unsure-escalates": (-0.1, 0.91, True),
    "threshold-zero-never": (-50.0, 0.0, False),
    "threshold-one-always": (-1e-9, 1.0, True),
    "certain-never-escalates-below-one": (0.0, 0.99, False),
}


@pytest.mark.parametrize("mean_logprob, threshold, escalate", GENERATION_ESCALATE.values(),
                         ids=GENERATION_ESCALATE)
def test_a_generation_escalates_on_its_geometric_mean_token_probability(
        mean_logprob, threshold, escalate):
    assert p.should_escalate_generation(mean_logprob, threshold) == escalate


# -- a live stage's floor: un-hinted requests reach the staged tiers ---------------------

def staged_route(policy="slo-energy", weights=None, floor=None, cascade=None):
    """digits on every tier, version 2 a canary at `weights` (tier -> share)."""
    weights = {"edge": 0.2} if weights is None else weights
    tiers = {}
    for tier, agent in (("edge", "e:1"), ("regional", "r:1"), ("datacenter", "d:1")):
        tiers[tier] = {"agents": [agent], "stable": 1, "canary": 2,
                       "canary_weight": weights.get(tier, 0.0)}
    route = {"policy": policy, "tiers": tiers}
    if floor is not None:
        route["stage_floor"] = floor
    if cascade is not None:
        route["cascade"] = {"tiers": cascade}
    return parse_table({"version": 1, "models": {"m": route}}).models["m"]


# The README's case: datacenter models the fewest joules, so slo-energy sends
# every request there and a stage on edge saw none.
DC_CHEAPEST = {"e:1": obs(5, 0.19, source="model"), "r:1": obs(5, 0.1, source="model"),
               "d:1": obs(5, 0.041, source="model")}


def first_tiers(route, request, observations=DC_CHEAPEST, n=2000, seed=0):
    """Share of `n` requests whose ranking starts at each tier, and the rankings."""
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    rankings = []
    candidates = (E1, R1, D1)
    for _ in range(n):
        ranking = p.policy_for(route, request).choose(candidates, request, observations, rng)
        counts[ranking.candidates[0].tier] = counts.get(ranking.candidates[0].tier, 0) + 1
        rankings.append(ranking)
    return {tier: count / n for tier, count in counts.items()}, rankings


# route, request -> share of requests each tier gets first (within 0.03)
FLOOR = {
    "no-stage-the-policy-decides": (
        staged_route(weights={}), p.RouteRequest("m"), {"datacenter": 1.0}),
    "edge-stage-gets-a-third": (
        staged_route(), p.RouteRequest("m"), {"edge": 1 / 3, "datacenter": 2 / 3}),
    "two-staged-tiers-split-it": (
        staged_route(weights={"edge": 0.5, "regional": 0.5}), p.RouteRequest("m"),
        {"edge": 1 / 6, "regional": 1 / 6, "datacenter": 2 / 3}),
    "a-staged-tier-the-policy-prefers-keeps-all": (
        staged_route(weights={"datacenter": 0.2}), p.RouteRequest("m"), {"datacenter": 1.0}),
    "the-documented-setting-changes-the-share": (
        staged_route(floor=0.5), p.RouteRequest("m"), {"edge": 0.5, "datacenter": 0.5}),
    "floor-zero-is-off": (
        staged_route(floor=0.0), p.RouteRequest("m"), {"datacenter": 1.0}),
    "a-tier-hint-is-never-moved": (
        staged_route(), p.RouteRequest("m", tier="regional"), {"regional": 1.0}),
    "a-strict-pin-is-never-moved": (
        staged_route(), p.RouteRequest("m", tier="datacenter", strict=True),
        {"datacenter": 1.0}),
    "an-slo-hint-is-no-tier-hint": (
        staged_route(), p.RouteRequest("m", slo_ms=50), {"edge": 1 / 3, "datacenter": 2 / 3}),
    "a-tier-that-misses-the-slo-still-gets-its-share": (  # the stage needs it; see StageFloor
        staged_route(), p.RouteRequest("m", slo_ms=10), {"edge": 1 / 3, "datacenter": 2 / 3}),
    "cascade-starts-a-third-at-the-staged-tier": (
        staged_route("cascade", weights={"datacenter": 0.2}), p.RouteRequest("m"),
        {"edge": 2 / 3, "datacenter": 1 / 3}),
    "cascade-staged-on-its-first-tier-is-unchanged": (
        staged_route("cascade"), p.RouteRequest("m"), {"edge": 1.0}),
    "cascade-never-floors-a-tier-it-does-not-ask": (  # the controller says so instead
        staged_route("cascade", weights={"edge": 0.2}, cascade=["regional", "datacenter"]),
        p.RouteRequest("m"), {"regional": 1.0}),
}


@pytest.mark.parametrize("route, request_, shares", FLOOR.values(), ids=FLOOR)
def test_a_live_stage_gets_its_floor_of_unhinted_requests(route, request_, shares):
    if request_.slo_ms == 10:  # edge predicted at 30 ms: it misses the SLO
        observations = {**DC_CHEAPEST, "e:1": obs(30, 0.19, source="model")}
    else:
        observations = DC_CHEAPEST
    got, rankings = first_tiers(route, request_, observations)
    assert set(got) == set(shares), got
    for tier, share in shares.items():
        assert got[tier] == pytest.approx(share, abs=0.03), (tier, got)
    if request_.tier is None and route.policy == "slo-energy":  # all kept, for failover
        assert all(sorted(r.candidates, key=str) == sorted((E1, R1, D1), key=str)
                   for r in rankings)


def test_the_floor_is_seeded_by_the_injected_rng():
    route = staged_route(weights={"edge": 0.5, "regional": 0.5})
    _, once = first_tiers(route, p.RouteRequest("m"), n=200, seed=7)
    _, again = first_tiers(route, p.RouteRequest("m"), n=200, seed=7)
    assert once == again


def test_a_floored_request_keeps_the_policys_order_behind_it():
    route = staged_route(weights={"regional": 0.2})
    _, rankings = first_tiers(route, p.RouteRequest("m"), n=300)
    moved = [r for r in rankings if r.floored]
    assert moved and all(r.floored == "regional" for r in moved)
    # regional first, then slo-energy's order of the rest: datacenter, edge
    assert {tuple(c.tier for c in r.candidates) for r in moved} == {
        ("regional", "datacenter", "edge")}
    assert not any(r.floored for r in rankings if r.candidates[0].tier == "datacenter")


def test_a_floored_cascade_escalates_only_upwards_from_the_staged_tier():
    route = staged_route("cascade", weights={"regional": 0.2})
    _, rankings = first_tiers(route, p.RouteRequest("m"), n=300)
    orders = {tuple(c.tier for c in r.candidates) for r in rankings}
    # never back down to edge: a floored request starts at regional
    assert orders == {("edge", "regional", "datacenter"), ("regional", "datacenter")}


def test_a_floored_tier_held_down_fails_over_in_the_policys_order():
    route = staged_route()
    request = p.RouteRequest("m")
    rng = random.Random(0)
    for _ in range(200):
        ranking = p.rank(p.policy_for(route, request), (E1, R1, D1), request, DC_CHEAPEST,
                         rng, {"e:1"})
        assert ranking.candidates == (D1, R1, E1)  # edge down: as if no floor


FLOOR_DRAWS = {
    "below-the-share-picks-a-tier": (("edge", "regional"), 0.4, 0.1, "edge"),
    "its-upper-half-the-second": (("edge", "regional"), 0.4, 0.3, "regional"),
    "at-the-share-the-policy": (("edge", "regional"), 0.4, 0.4, None),
    "share-one-always-floors": (("datacenter",), 1.0, 0.999, "datacenter"),
}


class FixedRng(random.Random):
    def __init__(self, point: float) -> None:
        super().__init__(0)
        self.point = point

    def random(self) -> float:
        return self.point


@pytest.mark.parametrize("tiers, share, point, tier", FLOOR_DRAWS.values(), ids=FLOOR_DRAWS)
def test_one_draw_says_whether_and_which_staged_tier(tiers, share, point, tier):
    assert p.StageFloor(tiers, share).draw(FixedRng(point)) == tier


def test_stage_floor_of_a_route():
    assert p.stage_floor(staged_route(weights={})) is None
    assert p.stage_floor(staged_route(floor=0.0)) is None
    assert p.stage_floor(staged_route(weights={"edge": 0.2, "datacenter": 0.1})) == \
        p.StageFloor(("edge", "datacenter"), 1 / 3)
    assert p.stage_floor(staged_route(), ("regional", "datacenter")) is None
