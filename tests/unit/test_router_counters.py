"""The router's shadow agreement tally: what the Agreement RPC and /metrics
both read, so they cannot disagree."""

from __future__ import annotations

from prometheus_client import generate_latest

from tiered.router.counters import RouterMetrics, ShadowAgreement, TierAgreement


def test_agreement_is_counted_per_canary_version_and_tier():
    tally = ShadowAgreement()
    for tier, result in [("regional", "agree"), ("edge", "agree"), ("edge", "disagree"),
                         ("edge", "agree"), ("edge", "error"), ("edge", "incomparable")]:
        tally.record("m", "2", tier, result)
    tally.record("m", "3", "edge", "disagree")
    assert tally.tiers("m", "2") == [TierAgreement("edge", 2, 1),
                                     TierAgreement("regional", 1, 0)]
    assert tally.tiers("m", "3") == [TierAgreement("edge", 0, 1)]
    assert tally.tiers("m", "9") == [] and tally.tiers("other", "2") == []


def test_each_router_instance_has_its_own_id():
    assert ShadowAgreement().instance != ShadowAgreement().instance
    assert ShadowAgreement("fixed").instance == "fixed"


def test_the_prometheus_counter_reads_the_same_tally():
    tally = ShadowAgreement()
    metrics = RouterMetrics(tally)
    tally.record("m", "2", "edge", "agree")
    tally.record("m", "2", "edge", "agree")
    tally.record("m", "2", "edge", "error")
    text = generate_latest(metrics.registry).decode()
    assert 'tiered_router_shadow_total{model="m",result="agree",tier="edge",version="2"} 2.0' \
        in text
    assert 'result="error"' in text and 'result="disagree"' not in text


def test_the_tally_keeps_the_newest_versions():
    tally = ShadowAgreement(max_versions=2)
    for version in ("1", "2", "3"):
        tally.record("m", version, "edge", "agree")
    assert tally.tiers("m", "1") == []
    assert tally.tiers("m", "3") == [TierAgreement("edge", 1, 0)]


def test_choices_energy_could_not_decide_are_counted_per_model():
    metrics = RouterMetrics(ShadowAgreement())
    for model in ("m", "m", "n"):
        metrics.ranked_without_energy(model)
    metrics.answered("m", "edge", "1", 0.002)
    text = generate_latest(metrics.registry).decode()
    assert 'tiered_router_energy_incomparable_total{model="m"} 2.0' in text
    assert 'tiered_router_energy_incomparable_total{model="n"} 1.0' in text
    assert 'tiered_router_requests_total{model="m",outcome="ok",tier="edge",version="1"} 1.0' \
        in text


def test_answers_are_timed_in_a_histogram_per_model_tier_and_version():
    metrics = RouterMetrics(ShadowAgreement())
    for seconds in (0.0004, 0.002, 0.002, 0.3):
        metrics.answered("m", "edge", "1", seconds)
    metrics.answered("m", "datacenter", "2", 0.01)
    text = generate_latest(metrics.registry).decode()
    edge = 'model="m",tier="edge",version="1"'
    assert f'tiered_router_request_duration_seconds_bucket{{le="0.0005",{edge}}} 1.0' in text
    assert f'tiered_router_request_duration_seconds_bucket{{le="0.0025",{edge}}} 3.0' in text
    assert f'tiered_router_request_duration_seconds_count{{{edge}}} 4.0' in text
    assert 'tiered_router_request_duration_seconds_count{model="m",tier="datacenter",' \
        'version="2"} 1.0' in text


def test_agents_are_up_or_held_down_per_address_and_tier():
    from tiered.router.counters import DOWN, AgentStates

    states = AgentStates()
    metrics = RouterMetrics(ShadowAgreement(), states)
    down: dict[str, object] = {}
    states.watch([("e:1", "edge"), ("r:1", "regional"), ("e:1", "edge")], down)
    down["e:1"] = "held"
    metrics.failed_over("m", "edge", DOWN)
    metrics.failed_over("m", "edge", DOWN)
    metrics.failed_over("m", "regional", "unavailable")
    text = generate_latest(metrics.registry).decode()
    assert 'tiered_router_agent_up{agent="e:1",tier="edge"} 0.0' in text
    assert 'tiered_router_agent_up{agent="r:1",tier="regional"} 1.0' in text
    assert 'tiered_router_failovers_total{model="m",reason="down",tier="edge"} 2.0' in text
    assert 'tiered_router_failovers_total{model="m",reason="unavailable",tier="regional"} 1.0' \
        in text
    states.watch([("r:1", "regional")], down)  # e:1 left the table: its series goes
    assert 'agent="e:1"' not in generate_latest(metrics.registry).decode()


def test_requests_a_stage_floor_moved_are_counted_per_model_and_tier():
    metrics = RouterMetrics(ShadowAgreement())
    for tier in ("edge", "edge", "regional"):
        metrics.floored("m", tier)
    text = generate_latest(metrics.registry).decode()
    assert 'tiered_router_stage_floor_total{model="m",tier="edge"} 2.0' in text
    assert 'tiered_router_stage_floor_total{model="m",tier="regional"} 1.0' in text
