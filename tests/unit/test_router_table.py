"""The routing table document: strict loading, errors that name the field, and
writing it back (what the controller writes is what the router reads)."""

from __future__ import annotations

import json

import pytest
import yaml

from tiered.errors import ConfigError
from tiered.protocol.routing import (
    DEFAULT_STAGE_FLOOR,
    CascadeSettings,
    ModelRoute,
    RoutingTable,
    TierRoute,
    dump_table,
    load_table,
    parse_table,
    table_document,
)


def table(**model) -> dict:
    route = {"tiers": {"edge": {"agents": ["127.0.0.1:1"]}}}
    route.update(model)
    return {"version": 1, "models": {"m": route}}


def tier(**fields) -> dict:
    return table(tiers={"edge": {"agents": ["127.0.0.1:1"], **fields}})


def test_a_full_table_loads_into_frozen_values(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({
        "version": 3,
        "models": {"digits": {
            "policy": "cascade", "slo_ms": 20, "failover_attempts": 2, "max_in_flight": 8,
            "cascade": {"tiers": ["edge", "datacenter"], "threshold": 0.8, "output": "logits"},
            "tiers": {
                "edge": {"agents": ["127.0.0.1:1", "127.0.0.1:2"], "stable": 1, "canary": 2,
                         "canary_weight": 0.1, "shadow_fraction": 0.5},
                "datacenter": {"agents": ["127.0.0.1:3"]},
            },
        }},
    }))
    loaded = load_table(path)
    route = loaded.models["digits"]
    assert loaded.version == 3
    assert route.cascade.tiers == ("edge", "datacenter")
    assert route.tiers["edge"].canary_weight == 0.1
    assert route.ordered_tiers() == ("edge", "datacenter")
    assert loaded.agents() == {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}
    with pytest.raises(AttributeError):
        route.slo_ms = 5  # frozen


@pytest.mark.parametrize("document, message", [
    pytest.param({"models": {}}, "version", id="version-missing"),
    pytest.param(table(policy="fastest"), "models.m.policy: unknown policy 'fastest'",
                 id="unknown-policy"),
    pytest.param(table(tiers={"moon": {"agents": ["h:1"]}}), "unknown tier 'moon'",
                 id="unknown-tier"),
    pytest.param(table(tiers={"edge": {"agents": []}}),
                 "models.m.tiers.edge.agents: needs at least one", id="empty-agents"),
    pytest.param(table(tiers={"edge": {"agents": ["nohost"]}}),
                 "models.m.tiers.edge.agents[0]: expected HOST:PORT", id="bad-address"),
    pytest.param(tier(canary=2, canary_weight=1.5), "models.m.tiers.edge.canary_weight: "
                 "expected 0..1", id="weight-above-one"),
    pytest.param(tier(canary=2, canary_weight=-0.1), "canary_weight: expected 0..1",
                 id="weight-negative"),
    pytest.param(tier(canary_weight=0.2), "canary_weight: is above 0 but no canary version",
                 id="weight-without-canary"),
    pytest.param(tier(shadow_fraction=0.2), "shadow_fraction: is above 0 but no canary",
                 id="shadow-without-canary"),
    pytest.param(tier(colour="red"), "unknown key 'colour'", id="unknown-key"),
    pytest.param(table(slo_ms=0), "models.m.slo_ms: expected > 0", id="slo-zero"),
    pytest.param(table(failover_attempts=0), "failover_attempts: expected 1..",
                 id="no-attempts"),
    pytest.param(table(max_in_flight=0), "max_in_flight: expected >= 1", id="no-in-flight"),
    pytest.param(table(policy="cascade", cascade={"tiers": ["edge", "regional"]}),
                 "cascade: tier 'regional' has no entry in tiers", id="cascade-tier-missing"),
    pytest.param(table(cascade={"threshold": 2}), "cascade.threshold: expected 0..1",
                 id="threshold-range"),
    pytest.param(table(cascade={"tiers": ["edge", "edge"]}), "listed twice",
                 id="cascade-tier-twice"),
    pytest.param(tier(stable="one"), "stable: expected an integer", id="version-type"),
    pytest.param(table(stage_floor=1.5), "models.m.stage_floor: expected 0..1",
                 id="stage-floor-above-one"),
    pytest.param(table(stage_floor=-0.1), "stage_floor: expected 0..1",
                 id="stage-floor-negative"),
])
def test_an_invalid_table_is_rejected_naming_the_field(document, message):
    with pytest.raises(ConfigError) as caught:
        parse_table(document)
    assert message in str(caught.value)


def test_an_unreadable_file_names_the_file(tmp_path):
    path = tmp_path / "table.yaml"
    path.write_text("version: [1\n")
    with pytest.raises(ConfigError, match="table.yaml: invalid YAML"):
        load_table(path)


def test_canary_agents_serve_the_canary_version_only():
    route = parse_table(tier(stable=1, canary=2, canary_weight=0.5,
                             canary_agents=["10.0.0.9:8001"])).models["m"].tiers["edge"]
    assert route.agents_for(2) == ("10.0.0.9:8001",)
    assert route.agents_for(1) == ("127.0.0.1:1",)
    assert parse_table(tier(stable=1, canary=2, canary_agents=["10.0.0.9:8001"])).agents() == {
        "127.0.0.1:1", "10.0.0.9:8001"}


@pytest.mark.parametrize(("fields", "message"), [
    ({"canary_agents": ["10.0.0.9:8001"]}, "canary_agents: listed but no canary version"),
    ({"canary": 2, "canary_agents": ["nope"]}, "canary_agents[0]: expected HOST:PORT"),
    ({"canary": 2, "canary_agents": ["a:1", "a:1"]}, "canary_agents: an address is listed"),
])
def test_bad_canary_agents_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_table(tier(**fields))


def full_table() -> RoutingTable:
    """Every optional part set: canary, its own agents, shadowing, a cascade."""
    return RoutingTable(version=9, timeout_s=5.0, models={
        "digits": ModelRoute(
            policy="cascade", slo_ms=20.0, failover_attempts=2, max_in_flight=8,
            stage_floor=0.5, cascade=CascadeSettings(tiers=("edge", "datacenter"), threshold=0.8,
                                    output="logits"),
            tiers={
                "edge": TierRoute(agents=("10.0.0.1:8001", "10.0.0.2:8001"), stable=1,
                                  canary=2, canary_weight=0.05, shadow_fraction=0.1,
                                  canary_agents=("10.0.0.9:8001",)),
                "datacenter": TierRoute(agents=("10.0.0.3:8001",), stable=1),
            }),
        "plain": ModelRoute(tiers={"regional": TierRoute(agents=("10.0.0.4:8001",))}),
    })


def test_a_written_table_reads_back_equal():
    table = full_table()
    assert parse_table(table_document(table)) == table
    assert parse_table(yaml.safe_load(dump_table(table))) == table


def test_the_written_document_leaves_defaults_out():
    document = table_document(full_table())
    assert document["models"]["plain"] == {"tiers": {"regional": {"agents": ["10.0.0.4:8001"]}}}
    assert document["models"]["digits"]["tiers"]["datacenter"] == {
        "agents": ["10.0.0.3:8001"], "stable": 1}
    assert document["version"] == 9 and document["timeout_s"] == 5.0


def test_a_table_built_in_code_takes_lists_and_checks_itself():
    route = TierRoute(agents=["10.0.0.1:8001"], canary=2, canary_agents=["10.0.0.9:8001"])
    assert route.agents == ("10.0.0.1:8001",) and route.canary_agents == ("10.0.0.9:8001",)
    assert CascadeSettings(tiers=["edge"]).tiers == ("edge",)
    with pytest.raises(ConfigError, match="agents: expected a list, got str"):
        TierRoute(agents="10.0.0.1:8001")
    with pytest.raises(ConfigError, match="canary_weight: is above 0 but no canary"):
        TierRoute(agents=("10.0.0.1:8001",), canary_weight=0.5)


def test_a_live_stage_names_its_tiers_and_the_floor_they_get():
    route = full_table().models["digits"]
    assert route.staged_tiers() == ("edge",)  # datacenter has no canary weight
    assert route.stage_floor == 0.5
    assert table_document(full_table())["models"]["digits"]["stage_floor"] == 0.5
    plain = full_table().models["plain"]
    assert plain.staged_tiers() == () and plain.stage_floor == DEFAULT_STAGE_FLOOR


def test_the_router_loads_a_table_written_before_its_watcher_first_looks(tmp_path):
    """The router stamps the file when it reads it at start: a table written
    between that read and the watcher's first poll is loaded (it was missed
    when the watcher took its first stamp itself)."""
    import asyncio

    from tiered.router import server

    path = tmp_path / "table.json"
    path.write_text(json.dumps(table()))
    stamp = server._stamp(path)
    path.write_text(json.dumps({**table(), "version": 22}))
    loaded = []

    class Router:
        async def use_table(self, new):
            loaded.append(new.version)

    async def watch():
        watcher = asyncio.create_task(server.watch_table(Router(), path, stamp, 0.01))
        while not loaded:
            await asyncio.sleep(0.01)
        watcher.cancel()

    asyncio.run(asyncio.wait_for(watch(), 10))
    assert loaded == [22]
