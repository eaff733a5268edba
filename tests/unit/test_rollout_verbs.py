"""The manual verbs' one rule (a verb already in effect is a no-op that says
so; one that cannot be is refused, naming why), `retry` and `undo`, as pure
decision tables; then the same verbs on a real local store."""

from __future__ import annotations

import dataclasses

import pytest

from tiered import names
from tiered.controller import desired, verbs
from tiered.controller.reconciler import decode_status
from tiered.controller.store import StateStore
from tiered.errors import InvalidArgument
from tiered.rollout import engine as e
from tiered.rollout.spec import load_tiered_model
from tiered.rollout.status import ArtifactVersion, HistoryEntry, RolloutStatus, TieredModelStatus
from tiered.rollout.wire import to_plain

SHAS = {v: f"{v:x}" * 64 for v in (1, 2, 3)}
DOCUMENT = {"name": "digits", "artifact": {"uri": "/m/v3.onnx", "sha256": SHAS[3],
                                           "eval": "/m/eval.npz"},
            "tiers": {"edge": {}, "regional": {}},
            "rollout": {"stages": [{"name": "edge", "weights": {"edge": 10}},
                                   {"name": "wide", "weights": {"edge": 50, "regional": 50}}]}}
SPEC = load_tiered_model(DOCUMENT)
ARTIFACTS = tuple(ArtifactVersion(v, f"/m/v{v}.onnx", SHAS[v]) for v in (1, 2, 3))


def rollout(phase="Progressing", canary=3, stable=2, **changes) -> RolloutStatus:
    return RolloutStatus(stable_version=stable, canary_version=canary, phase=phase,
                         paused=phase == "Paused", **changes)


# --- the one rule for repeated verbs -------------------------------------------

REPEATED = {
    # name: (verb, status before, what the no-op says)
    "pause when paused": (e.pause, rollout("Paused"), "already paused"),
    "resume when progressing": (e.resume, rollout(), "already progressing"),
    "promote when promoted": (e.promote, rollout("Promoted", canary=None), "already promoted"),
    "abort when aborted": (e.abort, rollout("Aborted"), "already aborted"),
    "retry when being rolled out": (lambda s, r, n: e.retry(s, r, n, 3), rollout(),
                                    "already being rolled out"),
}


@pytest.mark.parametrize("case", REPEATED)
def test_a_verb_already_in_effect_is_a_no_op_that_says_so(case):
    verb, before, says = REPEATED[case]
    decision = verb(SPEC, before, 100.0)
    assert decision.action == names.Action.HOLD
    assert says in decision.reason and decision.reason.endswith("nothing to do")
    assert decision.status == dataclasses_replace_message(before, decision.reason)


def dataclasses_replace_message(status, message):
    import dataclasses

    return dataclasses.replace(status, message=message)


REFUSED = {
    "pause a promoted rollout": (e.pause, rollout("Promoted", canary=None), "Promoted"),
    "abort a rolled-back rollout": (e.abort, rollout("RolledBack"), "RolledBack"),
    "promote an aborted rollout": (e.promote, rollout("Aborted"), "Aborted"),
    "retry a promoted rollout": (lambda s, r, n: e.retry(s, r, n, 3),
                                 rollout("Promoted", canary=None), "Promoted"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_verb_that_cannot_be_is_refused_naming_the_phase(case):
    verb, before, phase = REFUSED[case]
    with pytest.raises(InvalidArgument, match=f"the rollout is {phase}"):
        verb(SPEC, before, 100.0)


# --- retry ---------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["RolledBack", "Aborted"])
def test_retry_sets_the_canary_aside_so_that_the_next_pass_starts_it_afresh(phase):
    before = rollout(phase, stage_index=1, consecutive_failures=2)
    decision = e.retry(SPEC, before, 500.0, target=3)
    assert decision.action == names.Action.RETRY
    after = decision.status
    assert (after.stable_version, after.canary_version, after.phase, after.stage_index,
            after.consecutive_failures, after.last_analysis) == (2, None, "Progressing", 0, 0,
                                                                 None)
    # The spec still names version 3: the next pass starts its rollout at stage 1.
    transition = desired.follow_spec(SPEC, after, 3, 600.0)
    assert transition.action == "start" and transition.status.canary_version == 3
    assert transition.status.stage_index == 0 and transition.status.stage_started_at == 600.0
    assert desired.wanted_versions(after, 3) == (2, 3)  # its agents are brought back first


def test_retry_of_a_canary_the_spec_no_longer_names_is_refused():
    with pytest.raises(InvalidArgument, match="spec names version 2, not the rolledback "
                       "canary version 3"):
        e.retry(SPEC, rollout("RolledBack"), 500.0, target=2)


# --- undo ----------------------------------------------------------------------


def step(stable, canary=None, action="promote"):
    return HistoryEntry(t=0.0, action=action, reason="", phase="Promoted",
                        stable_version=stable, canary_version=canary)


HISTORY = (step(1), step(1, 2, "start"), step(2))  # 1 served, 2 promoted over it

UNDO = {
    # name: (rollout, spec's version, --to-version, version gone back to, unchanged)
    "a live rollout goes back to its stable version": (rollout(), 3, None, 2, False),
    "a promoted version goes back to the stable before it": (
        rollout("Promoted", canary=None), 2, None, 1, False),
    "a rolled-back canary's spec goes back to stable": (rollout("RolledBack"), 3, None, 1,
                                                        False),
    "to a given version": (rollout("Promoted", canary=None), 2, 3, 3, False),
    "to the version the spec names already": (rollout("Promoted", canary=None), 2, 2, 2, True),
}


@pytest.mark.parametrize("case", UNDO)
def test_undo_goes_back_to_the_previous_stable_or_a_given_version(case):
    before, target, to_version, version, unchanged = UNDO[case]
    status = TieredModelStatus(rollout=before, artifacts=ARTIFACTS, history=HISTORY)
    found = desired.undo(status, target, to_version)
    assert (found.version, found.unchanged) == (version, unchanged)
    assert found.artifact == ARTIFACTS[version - 1]


def test_undo_of_a_live_rollout_aborts_it_at_once_through_the_spec():
    live = rollout()
    found = desired.undo(TieredModelStatus(rollout=live, artifacts=ARTIFACTS), 3)
    assert "aborted at once" in found.reason
    transition = desired.follow_spec(SPEC, live, found.version, 100.0)
    assert transition.action == "abort" and transition.status.phase == "Aborted"


def test_undo_to_an_older_version_is_a_staged_rollout():
    promoted = rollout("Promoted", canary=None)
    found = desired.undo(TieredModelStatus(rollout=promoted, artifacts=ARTIFACTS,
                                           history=HISTORY), 2)
    assert found.version == 1 and "in stages" in found.reason
    transition = desired.follow_spec(SPEC, promoted, found.version, 100.0)
    assert transition.action == "start" and transition.status.canary_version == 1


@pytest.mark.parametrize(("status", "to_version", "match"), [
    (TieredModelStatus(), None, "no version serves yet"),
    (TieredModelStatus(rollout=rollout("Promoted", canary=None), artifacts=ARTIFACTS), None,
     "no stable version before 2 on record; pass --to-version"),
    (TieredModelStatus(rollout=rollout(), artifacts=ARTIFACTS), 7,
     "7 is not a version of this model"),
])
def test_undo_with_nowhere_to_go_says_why(status, to_version, match):
    with pytest.raises(InvalidArgument, match=match):
        desired.undo(status, 2, to_version)


# --- the verbs on a store --------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    with StateStore(tmp_path / "state.db") as opened:
        yield opened


def stored(store, before: RolloutStatus, history=HISTORY):
    record = store.apply("digits", DOCUMENT)
    status = TieredModelStatus(rollout=before, artifacts=ARTIFACTS, history=history)
    return store.write_status("digits", record.revision, status=to_plain(status))


def test_a_repeated_verb_writes_nothing(store):
    record = stored(store, rollout("Aborted"))
    decision = verbs.rollout_verb(store, "digits", "abort", now=lambda: 100.0)
    assert decision.action == names.Action.HOLD
    assert store.get("digits") == record and store.history("digits") == []


def test_retry_on_a_store_writes_the_set_aside_canary(store):
    stored(store, rollout("RolledBack"))
    decision = verbs.rollout_verb(store, "digits", "retry", now=lambda: 100.0)
    assert decision.action == names.Action.RETRY
    after = decode_status("digits", store.get("digits").status).rollout
    assert (after.canary_version, after.phase) == (None, "Progressing")


def test_undo_on_a_store_points_the_spec_at_the_earlier_artifact(store):
    before = stored(store, rollout())
    found = verbs.rollout_undo(store, "digits")
    assert found.version == 2
    record = store.get("digits")
    assert record.generation == before.generation + 1
    artifact = verbs.spec_of(record).artifact
    assert (artifact.uri, artifact.sha256, artifact.eval) == ("/m/v2.onnx", SHAS[2],
                                                              "/m/eval.npz")
    again = verbs.rollout_undo(store, "digits", to_version=2)  # the spec names it already
    assert again.unchanged and store.get("digits").generation == record.generation


# --- where `rollout status --watch` ends ------------------------------------------


def watched(before: RolloutStatus, *, seen: int = 1, generation: int = 1):
    return TieredModelStatus(rollout=before, artifacts=ARTIFACTS, observed_generation=seen), \
        generation


@pytest.mark.parametrize("before, seen, end", [
    (rollout(), 1, None),  # going on
    (rollout("Paused"), 1, "Paused"),  # by hand
    (e.pause(SPEC, rollout(), 0.0).status, 1, "Paused"),
    (dataclasses.replace(rollout(), paused=True), 1, "Paused"),  # not yet seen by a pass
    (rollout("Paused"), 0, None),  # the controller has not seen the applied spec yet
    (rollout("Paused", canary=2, stable=1), 1, None),  # another version's pause
    (rollout("RolledBack"), 1, "RolledBack"),
    (rollout("Aborted"), 1, "Aborted"),
    (rollout("Promoted", canary=None, stable=3), 1, "Promoted"),
    (rollout(canary=None), 1, None),  # retried: waits for its agents
])
def test_a_watch_ends_on_an_outcome_or_a_pause(before, seen, end):
    status, generation = watched(before, seen=seen)
    assert verbs.watch_end(SPEC, status, generation) == end


@pytest.mark.parametrize("verb", ["pause", "abort"])
def test_a_manual_verb_is_a_step_of_the_status_history(store, verb):
    stored(store, rollout(), history=())
    verbs.rollout_verb(store, "digits", verb, now=lambda: 100.0)
    status = decode_status("digits", store.get("digits").status)
    (step,) = status.history
    assert (step.t, step.action, step.phase, step.stable_version, step.canary_version,
            step.stage) == (100.0, verb, status.rollout.phase, 2, 3, "1/2 edge")
    ((_, t, snap),) = store.history("digits")
    assert (t, snap["action"]) == (100.0, verb)
