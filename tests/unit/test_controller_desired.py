"""Desired state as tables: version numbering, how a spec change moves the
rollout, the versions agents serve, and the routing table (which must load)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from tiered import names
from tiered.controller.desired import (
    STAGE_FLOOR,
    ArtifactVersion,
    build_args,
    explain_starvation,
    follow_spec,
    live,
    next_table,
    routing_table,
    same_agents,
    served_versions,
    starved_stage,
    unrouted_tiers,
    version_of,
    wanted_versions,
)
from tiered.controller.reconciler import Stored, routed
from tiered.errors import ConfigError
from tiered.protocol import routing
from tiered.protocol.routing import DEFAULT_STAGE_FLOOR, dump_table, parse_table
from tiered.rollout import engine
from tiered.rollout.spec import Artifact, load_tiered_model
from tiered.rollout.status import RolloutStatus, TieredModelStatus
from tiered.rollout.wire import to_plain

SHA_A, SHA_B, SHA_C = "aa" * 32, "bb" * 32, "cc" * 32
NOW = 1000.0
EDGE, REGIONAL, DATACENTER = "10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001"
ALL_AGENTS = {"edge": [EDGE], "regional": [REGIONAL], "datacenter": [DATACENTER]}


STAGES = [{"name": "edge-10", "weights": {"edge": 10}},
          {"name": "half", "weights": {"edge": 50, "regional": 50}}]


def model(name="digits", tiers=("edge", "regional"), agreement=True, routing=None,
          shadow=0.1, stages=STAGES):
    analysis = {} if agreement else {"agreement": None}
    data = {
        "name": name,
        "artifact": {"uri": "digits.onnx", "sha256": SHA_A},
        "tiers": {tier: {} for tier in tiers},
        "rollout": {
            "stages": stages,
            "analysis": analysis, "shadow_fraction": shadow,
        },
    }
    if routing is not None:
        data["routing"] = routing
    return load_tiered_model(data)


SPEC = model()


def status(**changes):
    base = RolloutStatus(stable_version=1, canary_version=2, stage_index=0,
                         phase=names.Phase.PROGRESSING, stage_started_at=NOW)
    return dataclasses.replace(base, **changes)


# --- version_of -------------------------------------------------------------

KNOWN = (ArtifactVersion(1, "/a.onnx", SHA_A), ArtifactVersion(3, "/b.onnx", SHA_B))


@pytest.mark.parametrize(("sha", "uri", "known", "version", "count"), [
    (SHA_A, "/a.onnx", (), 1, 1),                    # first ever: version 1
    (SHA_A, "/a.onnx", KNOWN, 1, 2),                 # same digest: same version
    (SHA_B, "/moved/b.onnx", KNOWN, 3, 2),           # same bytes elsewhere: same version
    (SHA_C, "/c.onnx", KNOWN, 4, 3),                 # new digest: max + 1 (2 never reused)
])
def test_version_of(sha, uri, known, version, count):
    got, registry = version_of(Artifact(uri=uri, sha256=sha), known)
    assert got == version
    assert len(registry) == count
    assert registry[: len(known)] == known  # nothing known is renumbered or dropped
    assert next(e for e in registry if e.sha256 == sha).version == version


def test_version_of_registers_new_digest_with_its_uri():
    _, registry = version_of(Artifact(uri="/c.onnx", sha256=SHA_C), KNOWN)
    assert registry[-1] == ArtifactVersion(4, "/c.onnx", SHA_C)


def test_version_numbers_are_never_reused_across_a_sequence():
    registry: tuple[ArtifactVersion, ...] = ()
    seen = []
    for sha in (SHA_A, SHA_B, SHA_A, SHA_C, SHA_B):
        version, registry = version_of(Artifact(uri="/x.onnx", sha256=sha), registry)
        seen.append(version)
    assert seen == [1, 2, 1, 3, 2]
    assert [e.version for e in registry] == [1, 2, 3]


def test_version_of_unpinned_artifact_raises():
    with pytest.raises(ValueError, match="artifact.sha256"):
        version_of(Artifact(uri="/x.onnx"), KNOWN)


# --- follow_spec ------------------------------------------------------------


def test_first_version_serves_at_once():
    t = follow_spec(SPEC, None, 1, NOW)
    assert t is not None and t.action == "promote"
    assert t.status.stable_version == 1
    assert t.status.canary_version is None
    assert t.status.phase == names.Phase.PROMOTED
    assert t.status.stage_started_at == NOW
    assert "first version 1" in t.reason


def test_new_version_starts_at_stage_zero_with_reason():
    t = follow_spec(SPEC, status(canary_version=None, phase=names.Phase.PROMOTED), 2, NOW + 5)
    assert t is not None and t.action == "start"
    assert (t.status.stable_version, t.status.canary_version) == (1, 2)
    assert t.status.stage_index == 0
    assert t.status.phase == names.Phase.PROGRESSING
    assert t.status.stage_started_at == NOW + 5
    assert t.reason == "rolling out version 2 over 1: stage 1/2 'edge-10'"
    assert t.status.message == t.reason


@pytest.mark.parametrize("current", [
    status(),                                          # same canary, progressing
    status(phase=names.Phase.PAUSED, paused=True),          # same canary, paused
    status(phase=names.Phase.ROLLED_BACK),                  # re-applying the rolled-back one
    status(phase=names.Phase.ABORTED),                      # re-applying the aborted one
    status(stable_version=2, canary_version=None, phase=names.Phase.PROMOTED),  # promoted
])
def test_nothing_to_do(current):
    assert follow_spec(SPEC, current, 2, NOW) is None


@pytest.mark.parametrize("current", [
    status(canary_version=None, phase=names.Phase.PROMOTED),
    status(phase=names.Phase.ROLLED_BACK),
    status(phase=names.Phase.ABORTED),
])
def test_back_to_stable_when_not_live_is_nothing(current):
    assert follow_spec(SPEC, current, 1, NOW) is None


@pytest.mark.parametrize("phase", [names.Phase.PROGRESSING, names.Phase.PAUSED])
def test_back_to_stable_while_live_aborts(phase):
    t = follow_spec(SPEC, status(phase=phase, paused=phase == names.Phase.PAUSED), 1, NOW)
    assert t is not None and t.action == "abort"
    assert t.status.phase == names.Phase.ABORTED
    assert t.status.stable_version == 1
    assert not live(t.status)
    assert t.reason == ("spec is back at stable version 1: canary version 2 aborted, all "
                        "traffic to version 1")


def test_new_version_while_canary_live_replaces_it():
    t = follow_spec(SPEC, status(stage_index=1), 3, NOW + 7)
    assert t is not None and t.action == "start"
    assert (t.status.stable_version, t.status.canary_version) == (1, 3)
    assert t.status.stage_index == 0
    assert t.status.stage_started_at == NOW + 7
    assert "(replaces canary version 2)" in t.reason


def test_new_version_after_rollback_does_not_say_replaces():
    t = follow_spec(SPEC, status(phase=names.Phase.ROLLED_BACK), 3, NOW)
    assert t is not None and t.action == "start"
    assert t.status.canary_version == 3
    assert "replaces" not in t.reason


# --- live / served_versions ---------------------------------------------------


@pytest.mark.parametrize(("current", "is_live", "served"), [
    (None, False, ()),
    (status(), True, (1, 2)),
    (status(phase=names.Phase.PAUSED, paused=True), True, (1, 2)),
    (status(phase=names.Phase.ROLLED_BACK), False, (1,)),
    (status(phase=names.Phase.ABORTED), False, (1,)),
    (status(stable_version=2, canary_version=None, phase=names.Phase.PROMOTED), False, (2,)),
    (status(canary_version=None), False, (1,)),  # progressing with no canary: not live
])
def test_live_and_served_versions(current, is_live, served):
    assert live(current) is is_live
    assert served_versions(current) == served


# --- routing_table ----------------------------------------------------------


def table(models, agents=ALL_AGENTS, version=7):
    """The table as written (fields at their defaults left out) and as the
    router reads it back, which must be the table made."""
    made = routing_table(version, models, same_agents(agents))
    document = yaml.safe_load(dump_table(made))
    parsed = parse_table(document)  # must always load
    assert parsed == made and parsed.version == version
    return document, parsed


def test_table_while_live_has_stage_weights_as_fractions():
    document, parsed = table([(SPEC, status(stage_index=1))])
    route = document["models"]["digits"]
    assert parsed.models["digits"].policy == "slo-energy" and route["slo_ms"] == 50.0
    assert set(route["tiers"]) == {"edge", "regional"}  # datacenter not in spec
    assert route["tiers"]["edge"] == {"agents": [EDGE], "stable": 1, "canary": 2,
                                      "canary_weight": 0.5, "shadow_fraction": 0.1}
    assert route["tiers"]["regional"]["canary_weight"] == 0.5
    assert parsed.models["digits"].tiers["edge"].canary == 2


def test_table_stage_zero_gives_unlisted_tier_zero_weight():
    document, parsed = table([(SPEC, status())])
    tiers = document["models"]["digits"]["tiers"]
    assert tiers["edge"]["canary_weight"] == 0.1
    assert parsed.models["digits"].tiers["regional"].canary_weight == 0.0
    assert tiers["regional"]["canary"] == 2  # still routed: shadow traffic may go there


def test_table_paused_keeps_canary():
    document, _ = table([(SPEC, status(phase=names.Phase.PAUSED, paused=True))])
    assert document["models"]["digits"]["tiers"]["edge"]["canary_weight"] == 0.1


@pytest.mark.parametrize("current", [
    status(phase=names.Phase.ROLLED_BACK),
    status(phase=names.Phase.ABORTED),
    status(stable_version=2, canary_version=None, phase=names.Phase.PROMOTED),
])
def test_table_without_live_rollout_has_only_stable(current):
    document, parsed = table([(SPEC, current)])
    for route in document["models"]["digits"]["tiers"].values():
        assert route == {"agents": route["agents"], "stable": current.stable_version}
    assert all(r.canary is None and r.canary_weight == 0.0
               for r in parsed.models["digits"].tiers.values())


def test_table_shadow_zero_when_agreement_not_judged():
    _, parsed = table([(model(agreement=False), status())])
    assert all(r.shadow_fraction == 0.0 for r in parsed.models["digits"].tiers.values())


def test_table_shadow_uses_spec_fraction():
    document, _ = table([(model(shadow=0.25), status())])
    assert document["models"]["digits"]["tiers"]["edge"]["shadow_fraction"] == 0.25


def test_table_omits_tiers_without_agents():
    document, _ = table([(SPEC, status())], agents={"edge": [EDGE, "10.0.0.9:8001"],
                                                    "regional": []})
    tiers = document["models"]["digits"]["tiers"]
    assert list(tiers) == ["edge"]
    assert tiers["edge"]["agents"] == [EDGE, "10.0.0.9:8001"]


def test_table_omits_models_with_no_tiers():
    other = model(name="other", tiers=("datacenter",),
                  stages=[{"name": "dc", "weights": {"datacenter": 20}}])
    document, parsed = table([(SPEC, status()), (other, status())],
                             agents={"edge": [EDGE]})
    assert list(document["models"]) == ["digits"]
    assert list(parsed.models) == ["digits"]


def test_table_with_no_models_is_empty_and_loads():
    document, parsed = table([], agents={})
    assert document == {"version": 7, "models": {}}
    assert dict(parsed.models) == {}


def test_table_multiple_models_keep_their_own_status():
    other = model(name="other")
    document, _ = table([(SPEC, status()),
                         (other, status(stable_version=5, canary_version=None,
                                        phase=names.Phase.PROMOTED))])
    assert document["models"]["digits"]["tiers"]["edge"]["canary"] == 2
    assert document["models"]["other"]["tiers"]["edge"] == {"agents": [EDGE], "stable": 5}


CASCADE = {"policy": "cascade", "slo_ms": 20,
           "cascade": {"tiers": ["edge", "regional", "datacenter"], "threshold": 0.7,
                       "output": "probs"}}


def test_table_cascade_tiers_filtered_to_routed_tiers():
    spec = model(tiers=("edge", "regional", "datacenter"), routing=CASCADE)
    document, parsed = table([(spec, status())],
                             agents={"edge": [EDGE], "regional": [REGIONAL]})
    route = document["models"]["digits"]
    assert route["policy"] == "cascade" and route["slo_ms"] == 20
    assert route["cascade"] == {"tiers": ["edge", "regional"], "threshold": 0.7,
                                "output": "probs"}
    assert parsed.models["digits"].cascade.tiers == ("edge", "regional")


def test_table_cascade_with_every_tier_routed():
    spec = model(tiers=("edge", "regional", "datacenter"), routing=CASCADE)
    _, parsed = table([(spec, status())])
    assert parsed.models["digits"].cascade.tiers == ("edge", "regional", "datacenter")


def test_table_cascade_with_none_of_its_tiers_up_routes_by_slo_energy():
    spec = model(routing={"policy": "cascade", "cascade": {"tiers": ["regional"]}})
    document, parsed = table([(spec, status())], agents={"edge": [EDGE]})
    assert list(document["models"]["digits"]["tiers"]) == ["edge"]
    assert "cascade" not in document["models"]["digits"]
    assert parsed.models["digits"].policy == "slo-energy"


@pytest.mark.parametrize(("current", "target", "wanted"), [
    (None, 1, (1,)),                                                    # first version
    (RolloutStatus(stable_version=1, phase=names.Phase.PROMOTED), 1, (1,)),  # serving it
    (RolloutStatus(stable_version=1, phase=names.Phase.PROMOTED), 2, (1, 2)),  # to roll out
    (RolloutStatus(stable_version=1, canary_version=2, phase=names.Phase.PROGRESSING), 2, (1, 2)),
    (RolloutStatus(stable_version=1, canary_version=2, phase=names.Phase.ROLLED_BACK), 2, (1,)),
    (RolloutStatus(stable_version=1, canary_version=2, phase=names.Phase.ABORTED), 2, (1,)),
    (RolloutStatus(stable_version=1, canary_version=2, phase=names.Phase.PROGRESSING), 3, (1, 2, 3)),
])
def test_wanted_versions(current, target, wanted):
    assert wanted_versions(current, target) == wanted


def test_build_args_pin_the_digest_and_carry_the_tier_settings():
    spec = load_tiered_model({
        "name": "digits",
        "artifact": {"uri": "/m/digits.onnx", "sha256": SHA_A, "eval": "/m/eval.npz"},
        "tiers": {"edge": {}, "datacenter": {"precision": "fp32",
                                             "batching": {"max_batch_size": 4,
                                                          "max_queue_delay_us": 250}}},
        "rollout": {"stages": STAGES[:1]}})
    args = build_args(spec, "datacenter", ArtifactVersion(3, "/m/digits.onnx", SHA_B), "/repo")
    assert args[:2] == ["build", "/m/digits.onnx"]
    flags = dict(zip(args[2::2], args[3::2]))
    assert flags == {"--sha256": SHA_B, "--tier": "datacenter", "--repository": "/repo",
                     "--model": "digits", "--version": "3", "--max-batch-size": "4",
                     "--max-queue-delay-us": "250", "--precision": "fp32",
                     "--eval": "/m/eval.npz"}
    edge = build_args(spec, "edge", ArtifactVersion(3, "/m/digits.onnx", SHA_B), "/repo")
    assert "--precision" not in edge and "--backend" not in edge  # the profile's own


# --- a stage's tiers get un-hinted traffic, or the stage says why not --------

THREE = ("edge", "regional", "datacenter")
EDGE_FIRST = [{"name": "edge-canary", "weights": {"edge": 20}},
              {"name": "region", "weights": {"edge": 50, "regional": 50}}]


def cascade(*tiers):
    return {"policy": "cascade", "cascade": {"tiers": list(tiers)}}


def test_the_table_carries_the_stage_floor_at_its_documented_default():
    document, parsed = table([(model(tiers=THREE, stages=EDGE_FIRST), status())])
    assert STAGE_FLOOR == DEFAULT_STAGE_FLOOR == pytest.approx(1 / 3)
    assert "stage_floor" not in document["models"]["digits"]  # the default: left out
    route = parsed.models["digits"]
    assert route.stage_floor == STAGE_FLOOR and route.staged_tiers() == ("edge",)


# routing, stage index, rollout phase -> staged tiers no un-hinted request reaches
UNROUTED = {
    "slo-energy-reaches-every-tier-by-its-floor": (None, 0, names.Phase.PROGRESSING, ()),
    "cascade-listing-the-tier": (cascade("edge", "datacenter"), 0, names.Phase.PROGRESSING,
                                 ()),
    "cascade-pinned-to-datacenter": (cascade("datacenter"), 0, names.Phase.PROGRESSING,
                                     ("edge",)),
    "cascade-without-edge-stage-two": (cascade("regional", "datacenter"), 1,
                                       names.Phase.PROGRESSING, ("edge",)),
    "cascade-pinned-stage-two": (cascade("datacenter"), 1, names.Phase.PROGRESSING,
                                 ("edge", "regional")),
    "paused-is-still-live": (cascade("datacenter"), 0, names.Phase.PAUSED, ("edge",)),
    "rolled-back-stages-nothing": (cascade("datacenter"), 0, names.Phase.ROLLED_BACK, ()),
}


@pytest.mark.parametrize("routing, stage, phase, tiers", UNROUTED.values(), ids=UNROUTED)
def test_unrouted_tiers(routing, stage, phase, tiers):
    spec = model(tiers=THREE, stages=EDGE_FIRST, routing=routing)
    assert unrouted_tiers(spec, status(stage_index=stage, phase=phase)) == tiers


def test_a_rollout_into_a_starved_stage_says_why_as_it_starts():
    spec = model(tiers=THREE, stages=EDGE_FIRST, routing=cascade("datacenter"))
    t = follow_spec(spec, status(canary_version=None, phase=names.Phase.PROMOTED), 2, NOW)
    assert t is not None and t.action == "start"
    assert t.reason == (
        "rolling out version 2 over 1: stage 1/2 'edge-canary': the routing policy (a cascade "
        "of datacenter alone) pins every request without a tiered-tier hint to datacenter, "
        "so edge gets none; only requests hinted 'tiered-tier: edge' reach the canary there "
        "(list edge in routing.cascade.tiers, or send such requests)")
    assert t.status.message == t.reason


def test_slo_energy_starts_without_a_warning():
    spec = model(tiers=THREE, stages=EDGE_FIRST)
    t = follow_spec(spec, status(canary_version=None, phase=names.Phase.PROMOTED), 2, NOW)
    assert t is not None and t.reason == "rolling out version 2 over 1: stage 1/2 'edge-canary'"
    assert starved_stage(spec, t.status) is None


def test_an_advance_into_a_starved_stage_says_why_and_each_hold_keeps_saying_it():
    spec = model(tiers=THREE, stages=EDGE_FIRST, routing=cascade("edge", "datacenter"))
    advanced = dataclasses.replace(status(), stage_index=1, message="stage 1/2 passed")
    decision = engine.Decision(names.Action.ADVANCE, "stage 1/2 passed", advanced)
    explained = explain_starvation(spec, decision)
    why = ("stage 2/2 'region': the routing policy (a cascade over edge, datacenter) sends no "
           "request without a tiered-tier hint to regional; only requests hinted "
           "'tiered-tier: regional' reach the canary there (list regional in "
           "routing.cascade.tiers, or send such requests)")
    assert explained.reason == f"stage 1/2 passed; {why}"
    assert explained.status.message == explained.reason
    assert explain_starvation(spec, explained) == explained  # said once, not piled up
    fine = model(tiers=THREE, stages=EDGE_FIRST)
    assert explain_starvation(fine, decision) is decision


def test_a_vision_language_split_reaches_the_table_while_both_its_tiers_are_there():
    def vlm(split: dict | None, kind: str = "vision-language"):
        return load_tiered_model({
            "name": "vlm", "kind": kind,
            "artifact": {"uri": "/m/vlm", "sha256": SHA_A},
            "tiers": {"edge": {}, "datacenter": {}},
            "routing": {"split": split} if split else {},
            "rollout": {"stages": STAGES[:1], "analysis": {"agreement": None}}})

    split = {"vision": "edge", "decoder": "datacenter"}
    serving = RolloutStatus(stable_version=1, phase=names.Phase.PROMOTED)
    both = {"edge": ("e:1",), "datacenter": ("d:1",)}
    table = routing_table(1, [(vlm(split), serving)], same_agents(both))
    assert table.models["vlm"].split == routing.SplitRoute("edge", "datacenter")
    assert parse_table(yaml.safe_load(dump_table(table))) == table  # it survives the file
    edge_only = routing_table(1, [(vlm(split), serving)], same_agents({"edge": ("e:1",)}))
    assert edge_only.models["vlm"].split is None  # served whole until the decoder tier is up
    with pytest.raises(ConfigError, match="routing.split: only for kind vision-language"):
        vlm(split, kind="generative")
    with pytest.raises(ConfigError, match="routing.split.decoder: tier 'regional' is not"):
        vlm({"vision": "edge", "decoder": "regional"})


# --- the table across a model that cannot be read ----------------------------


def stored_model(name: str, spec: dict, rollout: RolloutStatus) -> Stored:
    return Stored(name, {"name": name, **spec}, to_plain(TieredModelStatus(rollout=rollout)), 1)


def test_a_model_that_cannot_be_read_keeps_its_routes_and_a_deleted_one_loses_them():
    """A spec edited into one the controller refuses (or a status it cannot
    read) must not take the model off the routers: its routes stay as the
    last table had them, while the other models' routes follow their rollouts."""
    spec = {"artifact": {"uri": "digits.onnx", "sha256": SHA_A},
            "tiers": {"edge": {}, "regional": {}}, "rollout": {"stages": STAGES}}
    good = [stored_model("digits", spec, status()), stored_model("other", spec, status())]
    agents = same_agents(ALL_AGENTS)
    first = next_table(None, routed(good).models, agents)
    assert set(first.models) == {"digits", "other"}

    refused = {**spec, "tiers": {"edge": {"replicas": -1}}}  # a field the loader refuses
    moved = dataclasses.replace(status(), stage_index=1)
    now = routed([stored_model("digits", refused, status()), stored_model("other", spec, moved)])
    assert now.unreadable == {"digits"} and [s.name for s, _ in now.models] == ["other"]
    second = next_table(first, now.models, agents, now.unreadable)
    assert second.version == first.version + 1
    assert second.models["digits"] == first.models["digits"]
    assert second.models["other"] != first.models["other"]  # its stage moved

    gone = routed([stored_model("other", spec, moved)])  # digits deleted
    third = next_table(second, gone.models, agents, gone.unreadable)
    assert set(third.models) == {"other"}
