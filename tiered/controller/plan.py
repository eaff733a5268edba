"""The reconcile core, pure: (spec, stored status, what was observed, now) -> Plan.

Both backends run this one function and only observe and apply, as
controller-runtime keeps one Reconciler and swaps its clients. From the
spec's artifact and the stored status it decides

- which version the spec names (a new digest is a new version) and which
  versions must have agents (`keep`): those served, the spec's version while
  it is still to be rolled out, and versions on their way out until their
  grace has passed;
- whether the spec's version is ready to start (its agents up on every
  tier), is still coming, or was refused by its build;
- how the spec moves the rollout (start, abort) and, while it is live, what
  the rollout engine decides from the stage's measurements;
- which versions leave now (`retire`): those no longer wanted whose grace,
  kept in the status so that a restarted controller keeps counting, has
  passed;
- the status to write: the rollout, the artifact versions, the summary
  fields, the `Ready`/`Progressing`/`Degraded` conditions and a bounded
  history of the rollout's steps with their numbers;
- how many agents each tier runs (`replicas`): an autoscaled tier's from
  its load (`tiered.controller.scaling`), with the reason in the status,
  shared between a live rollout's versions by its traffic weights.

Pure: no clock (`now` is passed in), no I/O. The backends' observations
arrive as `Observation`; the telemetry behind the measurements is read by
`tiered.controller.judge` before the plan is made.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from tiered import names
from tiered.controller import desired, scaling
from tiered.errors import ConfigError
from tiered.rollout import engine
from tiered.rollout.analysis import Measurements
from tiered.rollout.snapshot import Snapshot, StageFigures, to_step_numbers
from tiered.rollout.spec import TieredModel
from tiered.rollout.status import (
    ArtifactVersion,
    Condition,
    HistoryEntry,
    Retirement,
    RolloutStatus,
    TieredModelStatus,
    TierScale,
)

READY, PENDING, REFUSED = "Ready", "Pending", "Refused"
HISTORY_LIMIT = 50  # steps kept in the status; the oldest go first
RETIRE_GRACE_S = 120.0  # Kubernetes refreshes a mounted ConfigMap within about a minute
WAIT_S = 5.0  # how soon a version still coming up is looked at again
SCALE_INTERVAL_S = 5.0  # how soon an autoscaled model's load is looked at again


@dataclass(frozen=True)
class VersionState:
    """One version's agents on one tier, as the backend sees them."""

    state: str  # Ready | Pending | Refused
    why: str = ""  # Refused: the build's verdict; Pending: what it waits for, if told
    ready: int | None = None  # its agents ready now; None: not sized per version (local)


@dataclass(frozen=True)
class Versions:
    """The spec's version and the versions whose agents must exist for it."""

    target: int
    artifacts: tuple[ArtifactVersion, ...]
    wanted: tuple[int, ...]


@dataclass(frozen=True)
class StageReading:
    """What the judge read for one stage of a live rollout."""

    canary_version: int
    stage_index: int
    measurements: Measurements | None
    figures: StageFigures | None = None  # the headline figures, as far as read
    unreadable: tuple[str, ...] = ()  # agents whose telemetry could not be read
    state: Mapping[str, Any] | None = None  # the stage's samples, kept in the status
    # engine processes down, as "<agent> <device>: <why>" (a GPU gone, say)
    devices_down: tuple[str, ...] = ()


# Each router asked, and whether the routing table it uses routes the model
# (None: it could not be asked).
Routed = tuple[tuple[str, bool | None], ...]


@dataclass(frozen=True)
class Observation:
    """What a backend saw before planning."""

    generation: int
    states: Mapping[tuple[str, int], VersionState]  # (tier, version) of the wanted versions
    present: frozenset[int] = frozenset()  # versions with agents in place now
    reading: StageReading | None = None  # the live stage's, when it was judged
    routed: Routed | None = None  # None: not asked (see `asks_routers`)
    loads: Mapping[str, scaling.TierLoad] | None = None  # autoscaled tiers' (None: not read)


@dataclass(frozen=True)
class Event:
    """A step worth telling: a progress line, a Kubernetes Event."""

    reason: str  # CamelCase
    message: str
    warning: bool = False


@dataclass(frozen=True)
class Plan:
    """What to make so, for one model."""

    status: TieredModelStatus
    keep: tuple[int, ...]  # versions whose agents must exist
    retire: tuple[int, ...]  # versions whose agents go now
    events: tuple[Event, ...] = ()
    snapshot: Snapshot | None = None  # this pass's rollout snapshot, if judged or moved
    requeue_after_s: float | None = None
    # agents per (tier, version) of the versions still wanted (`workload_replicas`)
    replicas: Mapping[tuple[str, int], int] = dataclasses.field(default_factory=dict)


def versions(spec: TieredModel, status: TieredModelStatus) -> Versions:
    """The spec's version (numbering a new digest) and the versions it wants."""
    if spec.artifact.sha256 is None:
        raise ConfigError("artifact.sha256: required (`tiered apply` pins it when the "
                          "artifact is a local file)")
    for data in ("calibration", "eval"):
        if getattr(spec.artifact, data) and getattr(spec.artifact, f"{data}_sha256") is None:
            raise ConfigError(f"artifact.{data}Sha256: required with artifact.{data} "
                              "(`tiered apply` pins it when the file is local)")
    target, artifacts = desired.version_of(spec.artifact, status.artifacts)
    return Versions(target, artifacts, desired.wanted_versions(status.rollout, target))


def refusals(spec: TieredModel, wanted: Versions,
             states: Mapping[tuple[str, int], VersionState]) -> dict[str, str]:
    """Tier -> why the spec's version was refused there, for tiers where it was."""
    return {tier: states[(tier, wanted.target)].why for tier in _tiers(spec)
            if states.get((tier, wanted.target), VersionState(PENDING)).state == REFUSED}


def waiting(spec: TieredModel, rollout: RolloutStatus | None, wanted: Versions,
            states: Mapping[tuple[str, int], VersionState]) -> str | None:
    """Why the spec's version cannot start yet, or None when nothing waits:
    a version still to be rolled out starts once its agents are up on every tier.
    Each tier says what it waits for where the backend told ("edge (building,
    12 s)"), else "(building and starting)" covers them all."""
    if wanted.target not in wanted.wanted or wanted.target in desired.served_versions(rollout):
        return None
    refused = refusals(spec, wanted, states)
    if refused:
        return f"version {wanted.target} refused: " + "; ".join(
            f"{tier}: {why}" for tier, why in refused.items())
    pending = {tier: states.get((tier, wanted.target), VersionState(PENDING))
               for tier in _tiers(spec)}
    coming = {tier: state.why for tier, state in pending.items() if state.state != READY}
    if not coming:
        return None
    if not any(coming.values()):
        return (f"version {wanted.target}: waiting for its agents on {', '.join(coming)} "
                "(building and starting)")
    return f"version {wanted.target}: waiting for its agents on " + ", ".join(
        f"{tier} ({why})" if why else tier for tier, why in coming.items())


def judging(spec: TieredModel, status: TieredModelStatus, wanted: Versions,
            states: Mapping[tuple[str, int], VersionState]) -> bool:
    """Whether this pass judges the stored rollout (so its telemetry is read)."""
    return desired.live(status.rollout) and waiting(spec, status.rollout, wanted,
                                                    states) is None


def asks_routers(status: TieredModelStatus) -> bool:
    """Whether this pass asks the routers if they route the model: until they
    were seen routing it (a table once loaded keeps the model; a restarted
    router loads the table before it serves)."""
    ready = next((c for c in status.conditions if c.type == "Ready"), None)
    return not (ready is not None and ready.status == "True" and ready.reason == ROUTED)


def plan(spec: TieredModel, status: TieredModelStatus, observed: Observation, now: float,
         retire_grace_s: float = RETIRE_GRACE_S) -> Plan:
    """The one reconcile step both backends take; see the module docstring."""
    wanted = versions(spec, status)
    rollout = status.rollout
    events: list[Event] = []
    steps: list[HistoryEntry] = []
    snapshot: Snapshot | None = None
    requeue: float | None = None
    blocked = waiting(spec, rollout, wanted, observed.states)
    if blocked is not None:
        message, requeue = blocked, WAIT_S
    else:
        transition = desired.follow_spec(spec, rollout, wanted.target, now)
        if transition is not None:
            rollout = transition.status
            events.append(Event(_REASONS[transition.action], transition.reason))
            steps.append(_step(spec, rollout, transition.action, transition.reason, now))
            snapshot = make_snapshot(spec, rollout, transition.action, transition.reason)
            if desired.live(rollout):  # judged from the next pass on
                requeue = spec.rollout.analysis.interval_s
        elif desired.live(rollout):
            held = rollout.message  # the reason of the last decision
            decision, figures = _judge(spec, rollout, observed.reading, now)
            decision = desired.explain_starvation(spec, decision)
            decision = _promotion_waits(spec, rollout, decision, observed.states,
                                        replicas_of(spec, status.scaling))
            rollout = decision.status
            snapshot = make_snapshot(spec, rollout, decision.action, decision.reason, figures)
            if decision.action == names.Action.HOLD:
                if engine.reason_gist(decision.reason) != engine.reason_gist(held):
                    events.append(Event(_REASONS[decision.action],
                                        f"{decision.action}: {decision.reason}"))
            else:
                events.append(Event(_REASONS[decision.action],
                                    f"{decision.action}: {decision.reason}",
                                    warning=decision.action in (names.Action.ROLLBACK,
                                                                names.Action.PAUSE)))
                steps.append(_step(spec, rollout, decision.action, decision.reason, now,
                                   figures))
            requeue = decision.requeue_after_s
            if requeue is None or requeue > spec.rollout.analysis.interval_s:
                requeue = spec.rollout.analysis.interval_s
        message = rollout.message if rollout is not None else status.message

    still = desired.wanted_versions(rollout, wanted.target)
    retiring, due = _retirements(status.retiring, still, observed.present, now,
                                 retire_grace_s)
    waits = [r.after - now for r in retiring if r.after > now]
    requeue = min([v for v in (requeue, *waits) if v is not None], default=None)
    refused = refusals(spec, wanted, observed.states)
    scales = scale_tiers(spec, status.scaling, observed.loads, now)
    unreadable = observed.reading.unreadable if observed.reading is not None else ()
    down = observed.reading.devices_down if observed.reading is not None else ()
    written = TieredModelStatus(
        rollout=rollout, artifacts=wanted.artifacts, **status_fields(spec, rollout),
        observed_generation=observed.generation, message=message,
        conditions=conditions(status.conditions, rollout, blocked, refused, unreadable,
                              observed.generation, now, observed.routed, down),
        history=(*status.history, *steps)[-HISTORY_LIMIT:], retiring=retiring,
        stage_samples=_stage_samples(status, rollout, observed.reading), scaling=scales)
    keep = tuple(sorted({*still, *(r.version for r in retiring if r.version not in due)}))
    if rollout is not None and asks_routers(written):  # look again soon until routed
        requeue = min(v for v in (requeue, WAIT_S) if v is not None)
    if scales:
        requeue = min(v for v in (requeue, SCALE_INTERVAL_S) if v is not None)
    return Plan(written, keep, due, (*events, *_scale_events(status.scaling, scales)),
                snapshot, requeue, workload_replicas(spec, rollout, scales, still))


def scale_tiers(spec: TieredModel, previous: Mapping[str, TierScale],
                loads: Mapping[str, scaling.TierLoad] | None, now: float
                ) -> dict[str, TierScale]:
    """Each autoscaled tier's scale after this look (`tiered.controller.scaling`)."""
    return {tier: scaling.decide(tier_spec.autoscaling, previous.get(tier),
                                 loads.get(tier) if loads is not None else None,
                                 tier_spec.replicas, now)
            for tier in _tiers(spec)
            if (tier_spec := spec.tiers[tier]).autoscaling is not None}


def replicas_of(spec: TieredModel, scales: Mapping[str, TierScale]) -> dict[str, int]:
    """Agents per tier: the autoscaled tiers' decision, the others' `replicas`."""
    return {tier: scales[tier].replicas
            if tier in scales and spec.tiers[tier].autoscaling is not None
            else spec.tiers[tier].replicas for tier in _tiers(spec)}


def workload_replicas(spec: TieredModel, rollout: RolloutStatus | None,
                      scales: Mapping[str, TierScale], versions: Sequence[int]
                      ) -> dict[tuple[str, int], int]:
    """Agents per (tier, version), where each version runs agents of its own
    (Kubernetes: a Deployment each). While a rollout is live the canary's
    follow its traffic weight, at least one, and stable's the rest, at least
    one; a canary about to be promoted (`promoting`) gets the tier's count
    while stable keeps serving its share. Otherwise the version serving (or
    the first, about to) gets the tier's count and one still to be rolled out
    one. A tier at zero runs none of either."""
    counts = replicas_of(spec, scales)
    weights = engine.canary_weights(spec, rollout) if desired.live(rollout) else {}
    sized = {}
    for tier in _tiers(spec):
        count = counts[tier]
        share = weights.get(tier, 0.0) / 100.0
        canary_share = 1.0 if rollout is not None and rollout.promoting else share
        for version in versions:
            if not count:
                sized[(tier, version)] = 0
            elif rollout is not None and version == rollout.stable_version:
                sized[(tier, version)] = max(1, math.ceil(count * (1.0 - share) - 1e-9)) \
                    if weights else count
            elif rollout is not None and weights and version == rollout.canary_version:
                sized[(tier, version)] = max(1, math.ceil(count * canary_share - 1e-9))
            else:  # the first version serves at once: all of them
                sized[(tier, version)] = 1 if rollout is not None else count
    return sized


def _promotion_waits(spec: TieredModel, rollout: RolloutStatus, decision: engine.Decision,
                     states: Mapping[tuple[str, int], VersionState],
                     counts: Mapping[str, int]) -> engine.Decision:
    """A promotion moves every tier's traffic to the canary: where the
    backend sizes each version's agents, it waits (holding, `promoting`: the
    canary sized to each tier's count, stable still serving) until the
    canary's agents are ready at that count, so no tier is short of agents
    while they start. A rollback moves traffic at once: the canary is what
    failed."""
    if decision.action != names.Action.PROMOTE:
        held = decision.action == names.Action.HOLD and rollout.promoting
        return dataclasses.replace(decision, status=dataclasses.replace(
            decision.status, promoting=held)) if decision.status.promoting != held \
            else decision
    short = [f"{tier} {state.ready} of {counts[tier]}" for tier in _tiers(spec)
             if (state := states.get((tier, rollout.canary_version))) is not None
             and state.ready is not None and state.ready < counts[tier]]
    if not short:
        return dataclasses.replace(decision, status=dataclasses.replace(
            decision.status, promoting=False))
    why = f"promoting once the canary's agents are ready ({', '.join(short)}): {decision.reason}"
    return engine.Decision(names.Action.HOLD, why, dataclasses.replace(
        rollout, message=why, promoting=True), requeue_after_s=WAIT_S)


def _scale_events(before: Mapping[str, TierScale], after: Mapping[str, TierScale]
                  ) -> list[Event]:
    events = []
    for tier, scale in after.items():
        old = before.get(tier)
        if old is not None and old.replicas != scale.replicas:
            up = scale.replicas > old.replicas
            events.append(Event("ScaledUp" if up else "ScaledDown",
                                f"{tier}: {old.replicas} -> {scale.replicas} agents: "
                                f"{scale.reason}"))
    return events


def _tiers(spec: TieredModel) -> list[str]:
    return [tier for tier in names.TIERS if tier in spec.tiers]


def _judge(spec: TieredModel, rollout: RolloutStatus, reading: StageReading | None,
           now: float) -> tuple[engine.Decision, StageFigures | None]:
    """The engine's decision on the live stage from what was read for it.
    Partial data is never judged: an unreadable agent holds the stage, and
    its clock stops while it is blind (judged at the moment it went blind),
    so an agent away for a while delays the stage instead of running out its
    maxDurationSeconds; the time held moves the stage's start on once it reads again."""
    if reading is None or (reading.canary_version, reading.stage_index) != (
            rollout.canary_version, rollout.stage_index):
        return engine.decide(spec, rollout, None, rollout.blind_since or now), None
    if reading.unreadable:
        blind = rollout.blind_since if rollout.blind_since is not None else now
        decision = engine.decide(spec, rollout, None, blind)
        why = f"telemetry unreadable from {', '.join(reading.unreadable)}: {decision.reason}"
        held = blind if decision.action == names.Action.HOLD else None
        return dataclasses.replace(decision, reason=why, status=dataclasses.replace(
            decision.status, message=why, blind_since=held)), reading.figures
    if rollout.blind_since is not None:  # sighted again: the time held does not count
        rollout = dataclasses.replace(
            rollout, blind_since=None,
            stage_started_at=rollout.stage_started_at + (now - rollout.blind_since))
    return engine.decide(spec, rollout, reading.measurements, now), reading.figures


def _stage_samples(status: TieredModelStatus, rollout: RolloutStatus | None,
                   reading: StageReading | None) -> Mapping[str, Any] | None:
    """The live stage's samples to keep: this pass's reading when it was of
    the stage the rollout is still in, else what was kept for it; none once
    the stage or the rollout has moved on."""
    if not desired.live(rollout):
        return None
    stage = (rollout.canary_version, rollout.stage_index)
    for kept in (reading.state if reading is not None else None, status.stage_samples):
        if kept is not None and (kept.get("canary_version"), kept.get("stage")) == stage:
            return kept
    return None


def _retirements(previous: Sequence[Retirement], wanted: Sequence[int],
                 present: frozenset[int], now: float, grace_s: float
                 ) -> tuple[tuple[Retirement, ...], tuple[int, ...]]:
    """Versions on their way out (each marked once, when it stopped being
    wanted) and those whose grace has passed."""
    marked = {r.version: r for r in previous if r.version in present and r.version not in wanted}
    for version in sorted(present - set(wanted)):
        marked.setdefault(version, Retirement(version, now + grace_s))
    retiring = tuple(marked[v] for v in sorted(marked))
    return retiring, tuple(r.version for r in retiring if now >= r.after)


_REASONS = {names.Action.START: "RolloutStarted", names.Action.PROMOTE: "Promoted",
            names.Action.ABORT: "Aborted", names.Action.ADVANCE: "StageAdvanced",
            names.Action.ROLLBACK: "RolledBack", names.Action.PAUSE: "Paused",
            names.Action.RESUME: "Resumed", names.Action.HOLD: "Holding"}


def status_fields(spec: TieredModel, rollout: RolloutStatus | None) -> Mapping[str, Any]:
    """The status's summary fields for printer columns: stage and weights."""
    if rollout is None:
        return {"stage": "", "weights": {}, "weights_summary": ""}
    weights = dict(engine.canary_weights(spec, rollout))
    return {"stage": desired.stage_label(spec, rollout) if desired.live(rollout) else "",
            "weights": weights, "weights_summary": desired.weights_summary(weights)}


def conditions(previous: Sequence[Condition], rollout: RolloutStatus | None,
               blocked: str | None, refused: Mapping[str, str], unreadable: Sequence[str],
               generation: int, now: float, routed: Routed | None = None,
               devices_down: Sequence[str] = ()) -> tuple[Condition, ...]:
    """Ready, Progressing and Degraded, each keeping its lastTransitionTime
    while its status stays the same. Ready means routable: a version serves
    and the routers' tables route the model."""
    before = {c.type: c for c in previous}
    if rollout is None:
        ready = ("False", "NoVersionServing", blocked or "no version serves yet")
    else:
        ready = _ready(rollout, routed, before.get("Ready"))
    if refused:
        progressing = ("False", "BuildRefused", blocked or "")
    elif blocked is not None:
        progressing = ("True", "WaitingForAgents", blocked)
    elif (rollout is not None and rollout.phase == names.Phase.PROGRESSING
          and desired.live(rollout)):
        progressing = ("True", "RollingOut", rollout.message)
    elif rollout is not None and rollout.phase == names.Phase.PAUSED:
        progressing = ("False", "Paused", rollout.message)
    else:
        progressing = ("False", rollout.phase if rollout is not None else "NoVersionServing",
                       rollout.message if rollout is not None else "")
    if refused:
        degraded = ("True", "BuildRefused", blocked or "")
    elif unreadable:
        degraded = ("True", "TelemetryUnreadable",
                    f"telemetry unreadable from {', '.join(unreadable)}")
    elif rollout is not None and rollout.phase == names.Phase.ROLLED_BACK:
        degraded = ("True", "RolledBack", rollout.message)
    elif devices_down:
        degraded = ("True", "DeviceDown",
                    f"engine processes down: {'; '.join(devices_down)}")
    else:
        degraded = ("False", "AsExpected", "")
    stamp = datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    result = []
    for kind, (state, reason, message) in (("Ready", ready), ("Progressing", progressing),
                                           ("Degraded", degraded)):
        old = before.get(kind)
        since = old.lastTransitionTime if old is not None and old.status == state else stamp
        result.append(Condition(type=kind, status=state, reason=reason, message=message,
                                observedGeneration=generation, lastTransitionTime=since))
    return tuple(result)


ROUTED = "Routed"  # Ready's reason once the routers route the model


def _ready(rollout: RolloutStatus, routed: Routed | None,
           before: Condition | None) -> tuple[str, str, str]:
    serving = f"version {rollout.stable_version} serves on every tier"
    if routed is None:  # not asked this pass: routed before, or no router to ask
        if before is not None and before.reason == ROUTED and before.status == "True":
            # Routed stays, but a promotion since changed which version serves.
            return "True", ROUTED, (before.message if before.message.startswith(serving)
                                    else f"{serving} and the routers route it")
        return "True", "Serving", f"{serving}; no router to ask"
    if not routed:
        return "True", "Serving", f"{serving}; no router to ask"
    unasked = [router for router, routes in routed if routes is None]
    waiting = [router for router, routes in routed if routes is False]
    if waiting:
        return "False", "NotRouted", (f"{serving}; routers not routing it yet: "
                                      f"{', '.join(waiting)}")
    if len(unasked) == len(routed):
        return "Unknown", "RoutersUnreachable", (f"{serving}; no router answered: "
                                                 f"{', '.join(unasked)}")
    return "True", ROUTED, f"{serving} and the routers route it" + (
        f" ({', '.join(unasked)} did not answer)" if unasked else "")


def _step(spec: TieredModel, rollout: RolloutStatus, action: str, reason: str, now: float,
          figures: StageFigures | None = None) -> HistoryEntry:
    numbers, sources = to_step_numbers(figures) if figures is not None else ({}, {})
    return HistoryEntry(
        t=now, action=action, reason=reason, phase=rollout.phase,
        stable_version=rollout.stable_version, canary_version=rollout.canary_version,
        stage=desired.stage_label(spec, rollout) if rollout.canary_version else "",
        numbers=numbers, sources=sources)


def make_snapshot(spec: TieredModel, status: RolloutStatus, action: str, reason: str,
                  figures: StageFigures | None = None) -> Snapshot:
    """One line of the local rollout history (progress lines, the report):
    where the rollout stands and the figures it used."""
    index = min(status.stage_index, len(spec.rollout.stages) - 1)
    run = status.last_analysis
    return Snapshot(
        model=spec.name, kind=spec.kind, stable_version=status.stable_version,
        canary_version=status.canary_version, phase=status.phase, stage_index=index,
        stage_name=spec.rollout.stages[index].name, stages=len(spec.rollout.stages),
        weights=dict(engine.canary_weights(spec, status)), action=action, reason=reason,
        verdict=run.verdict if run is not None else None,
        pending=tuple(m.label for m in run.metrics
                      if m.outcome not in (names.Outcome.SUCCESSFUL, names.Outcome.NOT_JUDGED))
        if run is not None else (),
        figures=figures or StageFigures())
