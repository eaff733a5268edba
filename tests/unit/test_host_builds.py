"""The pure parts of the local backend's background builds: what to start,
what the waiting message says, and why a build without a verdict failed."""

from __future__ import annotations

from tiered import names
from tiered.controller import plan
from tiered.controller.host import builds
from tiered.controller.host.builds import BuildKey
from tiered.rollout.spec import load_tiered_model
from tiered.rollout.status import ArtifactVersion, RolloutStatus

SHA = {1: "1" * 64, 2: "2" * 64}
SPEC = load_tiered_model({
    "name": "digits", "artifact": {"uri": "/m/digits-2.onnx", "sha256": SHA[2]},
    "tiers": {"edge": {}, "regional": {}, "datacenter": {}},
    "rollout": {"stages": [{"name": "edge", "weights": {"edge": 10}}]}})
ARTIFACTS = tuple(ArtifactVersion(version=v, uri=f"/m/digits-{v}.onnx", sha256=SHA[v])
                  for v in (1, 2))
WANTED = plan.Versions(target=2, artifacts=ARTIFACTS, wanted=(1, 2))
SERVING_1 = RolloutStatus(stable_version=1, phase=names.Phase.PROMOTED, message="serving")


def keys(*versions: int) -> list[BuildKey]:
    return [BuildKey("m", v, "edge") for v in versions]


def test_the_oldest_queued_builds_start_as_slots_free():
    assert builds.startable(keys(1, 2, 3), running=0, limit=2) == tuple(keys(1, 2))
    assert builds.startable(keys(1, 2, 3), running=1, limit=2) == tuple(keys(1))
    assert builds.startable(keys(1, 2), running=2, limit=2) == ()
    assert builds.startable(keys(1), running=3, limit=2) == ()  # over: none, never < 0
    assert builds.startable([], running=0, limit=2) == ()


def test_one_build_at_a_time_on_two_cores():
    assert [builds.default_max_builds(c) for c in (1, 2, 3, 4, 64)] == [1, 1, 2, 2, 2]


def test_pending_reasons_read_as_phrases():
    assert builds.building(12.4) == "building, 12 s"
    assert builds.building(-0.2) == "building, 0 s"  # a clock step back
    assert builds.queued(0) == "queued to build"
    assert builds.queued(2) == "queued to build, 2 ahead"


def test_a_build_without_a_verdict_says_how_it_ended_and_its_last_line():
    assert builds.no_verdict(-9, "") == (
        "tiered build was killed by SIGKILL and left no verdict")
    assert builds.no_verdict(1, "Traceback ...\n  boom\nMemoryError: out\n\n") == (
        "tiered build exited with code 1 and no verdict: MemoryError: out")
    assert builds.no_verdict(-99, "").startswith("tiered build was killed by signal 99")


def test_the_waiting_message_says_what_each_tier_waits_for():
    states = {("edge", 2): plan.VersionState(plan.PENDING, "building, 12 s"),
              ("regional", 2): plan.VersionState(plan.PENDING, "queued to build, 1 ahead"),
              ("datacenter", 2): plan.VersionState(plan.READY)}
    assert plan.waiting(SPEC, SERVING_1, WANTED, states) == (
        "version 2: waiting for its agents on edge (building, 12 s), "
        "regional (queued to build, 1 ahead)")


def test_a_tier_without_a_reason_is_named_alone():
    states = {("edge", 2): plan.VersionState(plan.PENDING, builds.LOADING),
              ("regional", 2): plan.VersionState(plan.PENDING)}  # nothing observed yet
    assert plan.waiting(SPEC, SERVING_1, WANTED, states) == (
        "version 2: waiting for its agents on edge (built, loading), regional, datacenter")


def test_without_reasons_the_message_is_as_before():
    """A backend that cannot tell (Kubernetes: the pod builds, then starts)."""
    states = {("edge", 2): plan.VersionState(plan.PENDING),
              ("regional", 2): plan.VersionState(plan.READY)}
    assert plan.waiting(SPEC, SERVING_1, WANTED, states) == (
        "version 2: waiting for its agents on edge, datacenter (building and starting)")


def test_a_refusal_outweighs_what_other_tiers_wait_for():
    states = {("edge", 2): plan.VersionState(plan.PENDING, "building, 3 s"),
              ("regional", 2): plan.VersionState(plan.REFUSED, "fail: agreement 0.9")}
    assert plan.waiting(SPEC, SERVING_1, WANTED, states) == (
        "version 2 refused: regional: fail: agreement 0.9")


def test_nothing_waits_once_every_tier_is_ready_or_the_version_serves():
    ready = {(t, 2): plan.VersionState(plan.READY) for t in ("edge", "regional", "datacenter")}
    assert plan.waiting(SPEC, SERVING_1, WANTED, ready) is None
    serving_2 = RolloutStatus(stable_version=2, phase=names.Phase.PROMOTED, message="serving")
    building = {(t, 2): plan.VersionState(plan.PENDING, "building, 1 s") for t in ("edge",)}
    assert plan.waiting(SPEC, serving_2, WANTED, building) is None
