"""The rollout engine: from spec + status + measurements + now to a Decision.

Level-based, like Argo Rollouts' canary reconcile: every call recomputes what
to do from its arguments alone, and all progress (stage index, when the stage
began, failures in a row, the last analysis) lives in the returned status, so
a restarted controller resumes where it stopped. The same measurement window
judged twice counts once toward the consecutive-failure limit.

A stage passes when its analysis is Successful, the canary has served
`minRequests` and `minDurationSeconds` has passed. It fails fast: a Failed
analysis counts at any time, and `consecutiveFailureLimit` failures in a
row trigger `onFailure` (rollback or pause). A stage still undecided at
`maxDurationSeconds` (too few canary requests, a test short of samples or
not yet significant, no measurements) follows `onUndecided` instead, pause
by default: no data is never a pass, and it is no failure either, so a good
version is not rolled back for want of traffic. The pause says what each
test lacks, with its numbers, and what a person can do: resume (another
`maxDurationSeconds`, on the samples so far), send more traffic, promote or
abort. A stage whose canary served no request at all pauses whatever
`onUndecided` says: there was nothing to judge, and the traffic or the
routes are what to look at. Every analysis of the rollout shares one
false-rollback budget, split over the tests of all its stages
(`analysis.rollout_tests`); the tests are anytime-valid, so judging at
every interval spends nothing more.

Reasons name spec fields as the YAML writes them (`spec.wire_key`).

The manual verbs (pause, resume, promote, abort, retry) are pure functions
of the same kind, with one rule for a verb already in effect (see below). Weight arithmetic is pure: each tier's canary percent comes from
the current stage, stable gets the rest. Pure: no clock (`now` is passed
in), no randomness, no I/O.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from tiered import names
from tiered.errors import InvalidArgument
from tiered.rollout.analysis import Measurements, analyze, rollout_tests
from tiered.rollout.spec import Stage, TieredModel
from tiered.rollout.status import AnalysisRun, RolloutStatus
from tiered.rollout.wire import wire_key

# The phases a rollout does not leave by itself.
FINISHED = (names.Phase.PROMOTED, names.Phase.ROLLED_BACK, names.Phase.ABORTED)

# A holding rollout is looked at again at least this often (seconds), sooner
# when a stage deadline comes first.
POLL_INTERVAL_S = 30.0
_FIGURES = re.compile(r"\d+(\.\d+)?")

# Spec fields as reasons name them: as the YAML writes them.
MAX_DURATION, MIN_DURATION, MIN_REQUESTS = (
    wire_key("max_duration_s"), wire_key("min_duration_s"), wire_key("min_requests"))
ON_FAILURE, ON_UNDECIDED = wire_key("on_failure"), wire_key("on_undecided")


def reason_gist(reason: str) -> str:
    """A decision's reason without its running figures ('35 of 40 requests',
    '12 s in'): two holds with one gist are the same hold."""
    return _FIGURES.sub("#", reason)


@dataclass(frozen=True)
class Decision:
    """What to do now, why, and the status to write back."""

    action: names.Action
    reason: str
    status: RolloutStatus
    analysis: AnalysisRun | None = None  # the analysis this decision used, with its numbers
    requeue_after_s: float | None = None  # None: nothing changes until a person acts


# --- weights ----------------------------------------------------------------


def _current_stage(spec: TieredModel, status: RolloutStatus) -> tuple[int, Stage]:
    # A spec edited to fewer stages leaves the rollout on its last stage.
    index = min(status.stage_index, len(spec.rollout.stages) - 1)
    return index, spec.rollout.stages[index]


def canary_weights(spec: TieredModel, status: RolloutStatus) -> Mapping[str, float]:
    """Canary percent per tier: the current stage's while the rollout is live
    (progressing or paused), else 0 everywhere; tiers a stage omits get 0."""
    tiers = [tier for tier in names.TIERS if tier in spec.tiers]
    live = (status.canary_version is not None
            and status.phase in (names.Phase.PROGRESSING, names.Phase.PAUSED))
    if not live:
        return MappingProxyType({tier: 0.0 for tier in tiers})
    _, stage = _current_stage(spec, status)
    return MappingProxyType({tier: float(stage.weights.get(tier, 0.0)) for tier in tiers})


def _decision(spec: TieredModel, action: names.Action, reason: str, status: RolloutStatus,
              analysis: AnalysisRun | None = None,
              requeue_after_s: float | None = None) -> Decision:
    status = dataclasses.replace(status, message=reason)
    return Decision(action, reason, status, analysis, requeue_after_s)


# --- the automatic decision -------------------------------------------------


def start(spec: TieredModel, stable_version: int, canary_version: int,
          now: float) -> RolloutStatus:
    """The status of a rollout of `canary_version` that begins now, at stage 0."""
    if canary_version == stable_version:
        raise InvalidArgument(f"{wire_key('canary_version')}: {canary_version} is already "
                              "the stable version")
    return RolloutStatus(stable_version=stable_version, canary_version=canary_version,
                         stage_index=0, phase=names.Phase.PROGRESSING, stage_started_at=now)


def decide(spec: TieredModel, status: RolloutStatus, measurements: Measurements | None,
           now: float) -> Decision:
    """The next step of the rollout; see the module docstring for the rules."""
    if status.phase in FINISHED:
        return _decision(spec, names.Action.HOLD, f"rollout is {status.phase}", status,
                         status.last_analysis)
    if status.canary_version is None:
        return _decision(spec, names.Action.HOLD, "no canary version to roll out", status)
    if status.paused or status.phase == names.Phase.PAUSED:
        # The reason it paused (why, and what to do) stays the message.
        return _decision(spec, names.Action.HOLD,
                         status.message or "paused: resume, promote or abort to go on",
                         dataclasses.replace(status, phase=names.Phase.PAUSED, paused=True),
                         status.last_analysis)

    stages = spec.rollout.stages
    index, stage = _current_stage(spec, status)
    elapsed = now - status.stage_started_at
    timed_out = elapsed >= stage.max_duration_s
    where = f"stage {index + 1}/{len(stages)} {stage.name!r}"

    if measurements is None or measurements.stage != index:
        if timed_out:
            return _on_undecided(spec, status, where, stage, [
                f"no measurements of the stage in {elapsed:.0f} s"], status.last_analysis)
        return _decision(spec, names.Action.HOLD, f"{where}: no measurements yet "
                         f"({elapsed:.0f} s in)", status, status.last_analysis,
                         _requeue(stage, elapsed))

    last = status.last_analysis
    if last is not None and last.window == measurements.window:
        run, failures = last, status.consecutive_failures  # judged and counted already
    else:
        # Every test of every stage shares the rollout's false-rollback budget.
        run = analyze(spec.rollout.analysis, measurements,
                      rollout_tests(spec.rollout.analysis, stages, spec.kind), spec.kind)
        failures = status.consecutive_failures + 1 if run.verdict == names.Outcome.FAILED else 0
    status = dataclasses.replace(status, last_analysis=run, consecutive_failures=failures)

    if run.verdict == names.Outcome.FAILED:
        limit = spec.rollout.analysis.consecutive_failure_limit
        detail = "; ".join(f"{m.label}: {m.reason}" for m in run.with_outcome(names.Outcome.FAILED))
        if failures >= limit:
            return _on_failure(spec, status, f"{where} failed ({failures} of {limit} in a "
                               f"row): {detail}", run)
        return _decision(spec, names.Action.HOLD, f"{where}: analysis failed ({failures} of "
                         f"{limit} in a row): {detail}", status, run, _requeue(stage, elapsed))

    why = []
    requests = measurements.requests("canary")
    if timed_out and requests == 0:
        # Nothing was judged, so nothing failed: the traffic or the routes are
        # what to look at, not the version.
        return _paused(spec, status, f"{where}: no canary traffic in "
                       f"{stage.max_duration_s:g} s: pausing (the stage's weights send "
                       "no requests to the canary; check the traffic and the routes, "
                       "then resume)", run)
    if requests < stage.min_requests:
        why.append(f"too little data: {requests} of {stage.min_requests} canary requests "
                   f"({MIN_REQUESTS})")
    if elapsed < stage.min_duration_s:
        why.append(f"too short: {elapsed:.0f} of {stage.min_duration_s:g} s ({MIN_DURATION})")
    if run.verdict in (names.Outcome.INCONCLUSIVE, names.Outcome.ERROR):
        pending = (run.with_outcome(names.Outcome.INCONCLUSIVE)
                   + run.with_outcome(names.Outcome.ERROR))
        why.append(f"analysis {run.verdict.lower()}: " +
                   "; ".join(f"{m.label}: {m.reason}" for m in pending))
    if why:
        if timed_out:
            return _on_undecided(spec, status, where, stage, why, run)
        return _decision(spec, names.Action.HOLD, f"{where}: {'; '.join(why)}", status, run,
                         _requeue(stage, elapsed))

    assert run.verdict == names.Outcome.SUCCESSFUL
    if index == len(stages) - 1:
        return _promoted(spec, status, f"{where} passed, the last: promoting "
                         f"version {status.canary_version}", run)
    return _advanced(spec, status, index, now, f"{where} passed: on to stage {index + 2} "
                     f"{stages[index + 1].name!r}", run)


def _requeue(stage: Stage, elapsed: float) -> float:
    deadlines = [d - elapsed for d in (stage.min_duration_s, stage.max_duration_s)
                 if d > elapsed]
    return max(0.0, min([POLL_INTERVAL_S, *deadlines]))


def _on_failure(spec: TieredModel, status: RolloutStatus, reason: str,
                run: AnalysisRun | None) -> Decision:
    if spec.rollout.on_failure == names.OnFailure.PAUSE:
        return _paused(spec, status, f"{reason}; pausing ({ON_FAILURE}: pause)", run)
    return _rolled_back(spec, status, f"{reason}; rolling back to version "
                        f"{status.stable_version} ({ON_FAILURE}: rollback)", run)


def _on_undecided(spec: TieredModel, status: RolloutStatus, where: str, stage: Stage,
                  why: list[str], run: AnalysisRun | None) -> Decision:
    """A stage out of time with too little data to decide: nothing failed, so
    by default a person decides, told what is missing and what to do."""
    limit = f"{stage.max_duration_s:g}"
    reason = f"{where} undecided at {MAX_DURATION} ({limit} s): {'; '.join(why)}"
    if spec.rollout.on_undecided == names.OnUndecided.ROLLBACK:
        return _rolled_back(spec, status, f"{reason}; rolling back to version "
                            f"{status.stable_version} ({ON_UNDECIDED}: rollback)", run)
    return _paused(spec, status, f"{reason}; pausing ({ON_UNDECIDED}: pause): nothing "
                   "failed, but the data does not decide yet. Resume to give the stage another "
                   f"{limit} s (its samples so far count), send the canary more traffic, "
                   "promote to pass the stage as it is, or abort", run)


def _paused(spec: TieredModel, status: RolloutStatus, reason: str,
            run: AnalysisRun | None) -> Decision:
    return _decision(spec, names.Action.PAUSE, reason,
                     dataclasses.replace(status, phase=names.Phase.PAUSED, paused=True), run)


def _rolled_back(spec: TieredModel, status: RolloutStatus, reason: str,
                 run: AnalysisRun | None) -> Decision:
    return _decision(spec, names.Action.ROLLBACK, reason,
                     dataclasses.replace(status, phase=names.Phase.ROLLED_BACK, paused=False), run)


def _promoted(spec: TieredModel, status: RolloutStatus, reason: str,
              run: AnalysisRun | None) -> Decision:
    promoted = dataclasses.replace(status, stable_version=status.canary_version,
                                   canary_version=None, phase=names.Phase.PROMOTED, paused=False,
                                   consecutive_failures=0)
    return _decision(spec, names.Action.PROMOTE, reason, promoted, run)


def _advanced(spec: TieredModel, status: RolloutStatus, index: int, now: float, reason: str,
              run: AnalysisRun | None) -> Decision:
    advanced = dataclasses.replace(status, stage_index=index + 1, stage_started_at=now,
                                   phase=names.Phase.PROGRESSING, paused=False,
                                   consecutive_failures=0)
    return _decision(spec, names.Action.ADVANCE, reason, advanced, run, 0.0)


# --- manual verbs -----------------------------------------------------------
#
# One rule for every verb: asking for what is already in effect (pause a
# paused rollout, abort an aborted one, promote a promoted one, resume or
# retry one that is going) is a no-op that says so, a HOLD; asking for what
# cannot be (pause a finished rollout) is an InvalidArgument naming why.


def _require_live(status: RolloutStatus, verb: str) -> None:
    if status.phase in FINISHED:
        raise InvalidArgument(f"phase: the rollout is {status.phase}; nothing to {verb}")
    if status.canary_version is None:
        raise InvalidArgument(f"{wire_key('canary_version')}: no canary version; nothing to "
                              f"{verb}")


def _already(spec: TieredModel, status: RolloutStatus, reason: str) -> Decision:
    return _decision(spec, names.Action.HOLD, f"{reason}; nothing to do", status,
                     status.last_analysis)


def pause(spec: TieredModel, status: RolloutStatus, now: float) -> Decision:
    """Stop at the current stage; canary weights stay as they are."""
    if status.phase == names.Phase.PAUSED or (status.paused and status.phase not in FINISHED):
        return _already(spec, status, "already paused")
    _require_live(status, "pause")
    return _decision(spec, names.Action.PAUSE, "paused by hand",
                     dataclasses.replace(status, phase=names.Phase.PAUSED, paused=True),
                     status.last_analysis)


def resume(spec: TieredModel, status: RolloutStatus, now: float) -> Decision:
    """Go on from the current stage; its clock and the failure count restart."""
    _require_live(status, "resume")
    if not status.paused and status.phase != names.Phase.PAUSED:
        return _already(spec, status, "not paused: already progressing")
    resumed = dataclasses.replace(status, phase=names.Phase.PROGRESSING, paused=False,
                                  stage_started_at=now, consecutive_failures=0)
    return _decision(spec, names.Action.RESUME, "resumed by hand", resumed,
                     status.last_analysis, 0.0)


def promote(spec: TieredModel, status: RolloutStatus, now: float,
            full: bool = False) -> Decision:
    """Skip the analysis: on to the next stage, or (full, or from the last
    stage) make the canary the stable version."""
    if status.phase == names.Phase.PROMOTED:
        return _already(spec, status, f"already promoted: version {status.stable_version} "
                        "is stable")
    _require_live(status, "promote")
    index, _ = _current_stage(spec, status)
    stages = spec.rollout.stages
    if full or index == len(stages) - 1:
        return _promoted(spec, status, f"promoted version {status.canary_version} by hand"
                         f"{' (full)' if full else ''}", status.last_analysis)
    return _advanced(spec, status, index, now, f"promoted by hand to stage {index + 2} "
                     f"{stages[index + 1].name!r}", status.last_analysis)


def abort(spec: TieredModel, status: RolloutStatus, now: float) -> Decision:
    """Send all traffic back to stable and stop; the canary version stays on record."""
    if status.phase == names.Phase.ABORTED:
        return _already(spec, status, f"already aborted: all traffic on version "
                        f"{status.stable_version}")
    _require_live(status, "abort")
    return _decision(spec, names.Action.ABORT, f"aborted by hand; all traffic to version "
                     f"{status.stable_version}",
                     dataclasses.replace(status, phase=names.Phase.ABORTED, paused=False),
                     status.last_analysis)


def retry(spec: TieredModel, status: RolloutStatus, now: float, target: int) -> Decision:
    """Roll a rolled-back or aborted canary out again, from stage 1 (Argo
    Rollouts' `retry`). `target` is the version the spec names: only that
    version can be retried, or the next pass would abort it again.

    The canary is set aside (canary_version none, phase Progressing), so the
    next pass starts the rollout exactly as for a newly applied version: once
    its agents are up again on every tier (they may have been retired since),
    with fresh samples, a fresh failure count and the stage clock at zero."""
    if status.phase in (names.Phase.PROGRESSING, names.Phase.PAUSED) and (
            status.canary_version == target or status.canary_version is None):
        return _already(spec, status, f"version {target} is already being rolled out")
    if status.phase not in (names.Phase.ROLLED_BACK, names.Phase.ABORTED) \
            or status.canary_version is None:
        raise InvalidArgument(f"phase: the rollout is {status.phase}; only a rolled-back or "
                              "aborted rollout can be retried")
    if target != status.canary_version:
        raise InvalidArgument(
            f"artifact: the spec names version {target}, not the {status.phase.lower()} "
            f"canary version {status.canary_version}; apply its artifact (or `rollout undo "
            f"--to-version {status.canary_version}`) to roll it out again")
    again = RolloutStatus(stable_version=status.stable_version, canary_version=None,
                          phase=names.Phase.PROGRESSING, stage_started_at=now)
    return _decision(spec, names.Action.RETRY, f"retrying version {target} by hand: it "
                     "starts again at stage 1 once its agents are up", again, None, 0.0)
