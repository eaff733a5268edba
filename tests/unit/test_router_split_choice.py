"""The choice of split or whole for an image request (`policies.choose_image_path`)
as a table, the observer's EWMAs of each path, and the dataplane's use of it."""

from __future__ import annotations

import math

import pytest

from tiered.errors import InvalidArgument
from tiered.protocol.routing import SplitRoute, parse_table
from tiered.router import observations as o
from tiered.router import policies as p
from tiered.router.hints import read_hints

EDGE, DC = p.ImagePath("edge", "edge"), p.ImagePath("datacenter", "datacenter")
SPLIT = p.ImagePath("edge", "datacenter")
PATHS = p.image_paths(("edge", "datacenter"), SplitRoute("edge", "datacenter"))


def tier(name: str, joules: float | None, source: str = "nvml") -> p.TierEstimate:
    return p.TierEstimate(name, 0.0, math.inf if joules is None else joules,
                          "" if joules is None else source, 0)


def seen(whole_edge_ms, whole_dc_ms, vision_ms, decode_ms) -> dict:
    """Each path's EWMAs in ms (None: not measured)."""
    def s(ms):
        return None if ms is None else ms / 1000
    return {EDGE: p.PathObservation(s(whole_edge_ms)), DC: p.PathObservation(s(whole_dc_ms)),
            SPLIT: p.PathObservation(s(decode_ms), s(vision_ms))}


ENERGY = {"edge": tier("edge", 0.5), "datacenter": tier("datacenter", 2.0)}

# name: (seen, energy, slo_ms, expected path, reason)
CASES = {
    "split cheaper and meets the SLO: split": (
        seen(300, 200, 20, 60), {"edge": tier("edge", 0.5), "datacenter": tier("datacenter",
                                                                              3.0)},
        100, SPLIT, p.MEETS),
    "split misses the SLO, whole meets it: whole": (
        seen(300, 80, 40, 70), ENERGY, 100, DC, p.MEETS),
    "every path meets: the least energy, whole on the edge": (
        seen(50, 40, 10, 30), ENERGY, 100, EDGE, p.MEETS),
    "none meets: the fastest, the split": (
        seen(300, 250, 40, 100), ENERGY, 100, SPLIT, p.FASTEST),
    "none meets: the fastest, whole": (
        seen(300, 120, 40, 100), ENERGY, 100, DC, p.FASTEST),
    "the split never taken is tried": (
        seen(50, 40, None, None), ENERGY, 100, SPLIT, p.UNMEASURED),
    "a split whose vision stage is unknown is tried": (
        seen(50, 40, None, 30), ENERGY, 100, SPLIT, p.UNMEASURED),
    "the first unmeasured path in order goes first": (
        seen(None, None, None, None), ENERGY, 100, EDGE, p.UNMEASURED),
    "unknown energy ranks after known": (
        seen(50, 40, 10, 20), {"edge": tier("edge", None), "datacenter": tier("datacenter",
                                                                             2.0)},
        100, DC, p.MEETS),
    "energy ties: the faster": (
        seen(50, 40, 10, 20), {"edge": tier("edge", 1.0), "datacenter": tier("datacenter",
                                                                            1.0)},
        100, DC, p.MEETS),
    "energy of two sources decides nothing: the fastest meeting": (
        seen(50, 40, 10, 20), {"edge": tier("edge", 0.1, "model"),
                               "datacenter": tier("datacenter", 2.0, "nvml")},
        100, SPLIT, p.MEETS),
}


@pytest.mark.parametrize("observed, energy, slo_ms, expected, reason", CASES.values(), ids=CASES)
def test_the_image_path_choice(observed, energy, slo_ms, expected, reason):
    choice = p.choose_image_path(PATHS, observed, energy, slo_ms / 1000)
    assert (choice.path, choice.reason) == (expected, reason)
    assert [e.path for e in choice.estimates] == list(PATHS)  # the numbers it used


def test_ties_go_to_the_earlier_path_whatever_the_order_of_what_was_seen():
    same = p.PathObservation(0.02)
    observed = {SPLIT: p.PathObservation(0.01, 0.01), DC: same, EDGE: same}
    flat = {"edge": tier("edge", 1.0), "datacenter": tier("datacenter", 1.0)}
    for _ in range(3):
        assert p.choose_image_path(PATHS, observed, flat, 0.1).path == EDGE
        observed = dict(reversed(observed.items()))
    # Split and whole alike in time and energy: whole.
    even = {EDGE: p.PathObservation(0.03), DC: p.PathObservation(0.03),
            SPLIT: p.PathObservation(0.02, 0.01)}
    cheap_edge = {"edge": tier("edge", 0.0), "datacenter": tier("datacenter", 1.0)}
    assert p.choose_image_path(PATHS, even, cheap_edge, 0.1).path == EDGE
    assert p.choose_image_path(PATHS[1:], even, cheap_edge, 0.1).path == DC


def test_a_split_costs_its_vision_tier_and_its_decoder_tier():
    estimate = p.estimate_path(SPLIT, p.PathObservation(0.05, 0.01), ENERGY)
    assert estimate.joules == pytest.approx(2.5) and estimate.energy_source == "nvml"
    assert estimate.ttft_s == pytest.approx(0.06)
    mixed = p.estimate_path(SPLIT, p.PathObservation(), {
        "edge": tier("edge", 0.5, "model"), "datacenter": tier("datacenter", 2.0, "nvml")})
    assert (mixed.energy_source, mixed.ttft_s) == (p.MIXED, None)
    unknown = p.estimate_path(SPLIT, p.PathObservation(), {
        "edge": tier("edge", None), "datacenter": tier("datacenter", 2.0)})
    assert (unknown.joules, unknown.energy_source) == (math.inf, "")


def test_the_choice_reads_the_hint_or_the_routes_slo_and_each_tiers_best_agent():
    route = parse_table({"version": 1, "models": {"vlm": {
        "slo_ms": 100, "split": {"vision": "edge", "decoder": "datacenter"},
        "tiers": {"edge": {"agents": ["e:1"]}, "datacenter": {"agents": ["d:1", "d:2"]}}}
    }}).models["vlm"]
    candidates = p.candidates_of(route, {"edge": 1, "datacenter": 1})
    observed = {"e:1": p.AgentObservation(joules_per_inference=0.5, energy_source="nvml"),
                "d:1": p.AgentObservation(joules_per_inference=3.0, energy_source="nvml"),
                "d:2": p.AgentObservation(joules_per_inference=1.0, energy_source="nvml")}
    paths = seen(300, 80, 10, 60)
    # The route's 100 ms: whole on the datacenter (80 ms) meets it and costs
    # 1.0 J (its best agent's) against the split's 0.5 + 1.0.
    choice = p.image_path_for(route, candidates, p.RouteRequest("vlm"), observed, paths)
    assert (choice.path, choice.reason) == (DC, p.MEETS)
    assert {e.path: e.joules for e in choice.estimates} == {EDGE: 0.5, DC: 1.0, SPLIT: 1.5}
    hinted = p.image_path_for(route, candidates, p.RouteRequest("vlm", slo_ms=75), observed,
                              paths)
    assert (hinted.path, hinted.reason) == (SPLIT, p.MEETS)  # 70 ms: only the split meets
    tight = p.image_path_for(route, candidates, p.RouteRequest("vlm", slo_ms=50), observed,
                             paths)
    assert (tight.path, tight.reason) == (SPLIT, p.FASTEST)


def test_the_observer_keeps_an_ewma_of_each_path_and_forgets_stale_ones():
    now = [0.0]
    observer = o.Observer(lambda: now[0], stale_after_s=10.0, alpha=0.5)
    observer.record_image_path("vlm", SPLIT, 0.04, 0.02)
    observer.record_image_path("vlm", SPLIT, 0.08, 0.04)
    observer.record_image_path("vlm", DC, 0.1)
    assert observer.image_paths("vlm") == {SPLIT: p.PathObservation(0.06, pytest.approx(0.03)),
                                           DC: p.PathObservation(0.1, None)}
    assert observer.image_paths("other") == {}
    now[0] = 10.5
    assert observer.image_paths("vlm") == {}  # stale: each path is tried again
    observer.record_image_path("vlm", DC, 0.2)
    assert observer.image_paths("vlm") == {DC: p.PathObservation(0.2, None)}  # started afresh
    observer.keep_models(["other"])
    assert observer.image_paths("vlm") == {}


def test_a_split_hint_decides_instead_of_the_figures():
    route = parse_table({"version": 1, "models": {"vlm": {
        "split": {"vision": "edge", "decoder": "datacenter"},
        "tiers": {"edge": {"agents": ["e:1"]}, "datacenter": {"agents": ["d:1"]}}}
    }}).models["vlm"]
    ranked = list(reversed(p.candidates_of(route, {"edge": 1, "datacenter": 1})))
    paths = seen(None, None, None, None)  # nothing measured: unhinted, whole on the edge
    assert p.image_path_for(route, ranked, p.RouteRequest("vlm"), {}, paths).path == EDGE
    split = p.image_path_for(route, ranked, p.RouteRequest("vlm", split=True), {}, paths)
    assert (split.path, split.reason, split.estimates) == (SPLIT, p.HINTED, ())
    whole = p.image_path_for(route, ranked, p.RouteRequest("vlm", split=False), {}, paths)
    assert (whole.path, whole.reason) == (DC, p.HINTED)  # the tier policy's first


def test_the_split_hint_reads_as_a_boolean_from_metadata_or_parameters():
    assert read_hints("vlm", {}, [("tiered-split", "true")]).split is True
    assert read_hints("vlm", {}, [("tiered-split", "0")]).split is False
    assert read_hints("vlm", {}, None).split is None
    with pytest.raises(InvalidArgument, match="tiered-split: expected true or false"):
        read_hints("vlm", {}, [("tiered-split", "maybe")])
