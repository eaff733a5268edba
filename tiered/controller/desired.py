"""Desired state, pure: which versions exist, which each tier serves, how a
spec change moves the rollout, and the routing table the router should read.

Functions of (spec, status, artifacts, agents, now) only; the backends (local
processes, Kubernetes) turn their results into builds, loads and files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from tiered import names
from tiered.errors import InvalidArgument
from tiered.protocol import routing
from tiered.rollout import engine
from tiered.rollout.spec import Artifact, TieredModel
from tiered.rollout.status import ArtifactVersion, RolloutStatus, TieredModelStatus


def version_of(artifact: Artifact, known: Sequence[ArtifactVersion]
               ) -> tuple[int, tuple[ArtifactVersion, ...]]:
    """The version of the spec's (pinned) artifact, registering a new one when
    its digest has not been seen: the same bytes are always the same version."""
    if artifact.sha256 is None:
        raise ValueError("artifact.sha256: not pinned; `tiered apply` pins it")
    for entry in known:
        if entry.sha256 == artifact.sha256:
            return entry.version, tuple(known)
    version = max((entry.version for entry in known), default=0) + 1
    return version, (*known, ArtifactVersion(version, artifact.uri, artifact.sha256))


def build_args(spec: TieredModel, tier: str, artifact: ArtifactVersion,
               repository: str) -> list[str]:
    """The `tiered build` arguments that make one tier's build of one version:
    the artifact is checked against its sha256 first. Both backends run it."""
    tier_spec = spec.tiers[tier]
    args = ["build", artifact.uri, "--sha256", artifact.sha256, "--tier", tier,
            "--repository", repository, "--model", spec.name,
            "--version", str(artifact.version),
            "--max-batch-size", str(tier_spec.batching.max_batch_size),
            "--max-queue-delay-us", str(tier_spec.batching.max_queue_delay_us)]
    for flag, value in (("--backend", tier_spec.engine), ("--precision", tier_spec.precision),
                        ("--calibration", spec.artifact.calibration),
                        ("--calibration-sha256", spec.artifact.calibration_sha256),
                        ("--eval", spec.artifact.eval),
                        ("--eval-sha256", spec.artifact.eval_sha256)):
        if value:
            args += [flag, value]
    return args


@dataclass(frozen=True)
class Transition:
    """A rollout status change caused by the spec, and why."""

    action: str  # start | promote | abort
    reason: str
    status: RolloutStatus


def live(status: RolloutStatus | None) -> bool:
    return (status is not None and status.canary_version is not None
            and status.phase in (names.Phase.PROGRESSING, names.Phase.PAUSED))


def follow_spec(spec: TieredModel, status: RolloutStatus | None, target: int,
                now: float) -> Transition | None:
    """What the spec's version asks of the rollout, or None when nothing.

    The first version serves at once; a new version starts a rollout at stage
    0 (replacing a live canary); going back to the stable version aborts a
    live rollout. A version that already ran its rollout (promoted, rolled
    back, aborted) is not rolled out again by re-applying the same spec.
    """
    if status is None:
        first = RolloutStatus(stable_version=target, phase=names.Phase.PROMOTED,
                              stage_started_at=now, message=f"version {target} serving")
        return Transition("promote", f"first version {target}: serving on every tier", first)
    if target == status.stable_version:
        if live(status):
            reason = (f"spec is back at stable version {target}: canary version "
                      f"{status.canary_version} aborted, all traffic to version {target}")
            aborted = engine.abort(spec, status, now).status
            return Transition("abort", reason, dataclasses.replace(aborted, message=reason))
        return None
    if target == status.canary_version:
        return None
    replaced = (f" (replaces canary version {status.canary_version})" if live(status)
                else "")
    started = engine.start(spec, status.stable_version, target, now)
    reason = (f"rolling out version {target} over {status.stable_version}{replaced}: "
              f"stage 1/{len(spec.rollout.stages)} {spec.rollout.stages[0].name!r}")
    starved = starved_stage(spec, started, where=False)
    if starved is not None:  # said as the stage starts, not at its max_duration_s
        reason = f"{reason}: {starved}"
    return Transition("start", reason, dataclasses.replace(started, message=reason))


# The share of requests without a tier hint that a live stage's tiers get
# first (`routing.DEFAULT_STAGE_FLOOR` says why a third), written into every
# route of the table.
STAGE_FLOOR = routing.DEFAULT_STAGE_FLOOR


def unrouted_tiers(spec: TieredModel, status: RolloutStatus | None) -> tuple[str, ...]:
    """The tiers the live stage sends canary traffic to that no request
    without a tier hint reaches under the spec's routing policy: those a
    cascade does not list. Under slo-energy there are none: while a stage is
    live its floor (`STAGE_FLOOR`) sends un-hinted requests to its tiers."""
    if not live(status) or spec.routing.policy != names.Policy.CASCADE:
        return ()
    asked = spec.routing.cascade.tiers
    return tuple(tier for tier, weight in engine.canary_weights(spec, status).items()
                 if weight > 0 and tier not in asked)


def starved_stage(spec: TieredModel, status: RolloutStatus | None,
                  where: bool = True) -> str | None:
    """Why the live stage's canary gets no request without a tier hint on
    some of its tiers (`where`: led by the stage's name), said as the stage
    starts, so nobody waits out its max_duration_s to learn it; None when
    every staged tier gets some. The policy stands (a cascade's tiers are
    the spec's choice) and hinted requests still reach those tiers, so the
    stage is not stopped."""
    tiers = unrouted_tiers(spec, status)
    if not tiers:
        return None
    assert status is not None
    index = min(status.stage_index, len(spec.rollout.stages) - 1)
    stage = f"stage {index + 1}/{len(spec.rollout.stages)} {spec.rollout.stages[index].name!r}: "
    starved = ", ".join(tiers)
    asked = spec.routing.cascade.tiers
    policy = (f"the routing policy (a cascade of {asked[0]} alone) pins every request "
              f"without a tiered-tier hint to {asked[0]}, so {starved} "
              f"{'gets' if len(tiers) == 1 else 'get'} none"
              if len(asked) == 1 else
              f"the routing policy (a cascade over {', '.join(asked)}) sends no request "
              f"without a tiered-tier hint to {starved}")
    hinted = " or ".join(f"'tiered-tier: {tier}'" for tier in tiers)
    return (f"{stage if where else ''}{policy}; only requests hinted {hinted} reach the "
            f"canary there (list {starved} in routing.cascade.tiers, or send such requests)")


def explain_starvation(spec: TieredModel, decision: engine.Decision) -> engine.Decision:
    """`decision` with `starved_stage`'s reason added when the stage it
    leaves live starves on some tier: an advance to such a stage says so at
    once, and each hold of it keeps saying so."""
    starved = starved_stage(spec, decision.status)
    if starved is None or starved in decision.reason:
        return decision
    reason = f"{decision.reason}; {starved}"
    return dataclasses.replace(decision, reason=reason,
                               status=dataclasses.replace(decision.status, message=reason))


@dataclass(frozen=True)
class Undo:
    """Where `rollout undo` points the spec: an earlier version's artifact."""

    version: int
    artifact: ArtifactVersion
    reason: str
    unchanged: bool = False  # the spec names that version already: nothing to do


def undo(status: TieredModelStatus, target: int, to_version: int | None = None) -> Undo:
    """The version `rollout undo` goes back to, as Argo Rollouts' undo does, by
    making the spec name that version's artifact again, so `follow_spec` takes
    it from there like any applied spec:

    - a live rollout: back to its stable version, which aborts the canary at
      once (the spec back at stable is an abort; nothing is judged);
    - otherwise the stable version before the current one (from the status's
      history), or `to_version`: a version other than stable is rolled out in
      stages and judged like any new version; going back is a change like any
      other, and the old version's builds may have been removed since.

    `target` is the version the spec names now."""
    rollout = status.rollout
    known = {a.version: a for a in status.artifacts}
    if rollout is None:
        raise InvalidArgument("status: no version serves yet; nothing to undo")
    if to_version is not None:
        if to_version not in known:
            raise InvalidArgument(f"to_version: {to_version} is not a version of this model "
                                  f"(known: {', '.join(map(str, sorted(known)))})")
        version = to_version
    elif live(rollout):
        version = rollout.stable_version
    else:
        earlier = next((step.stable_version for step in reversed(status.history)
                        if step.stable_version != rollout.stable_version
                        and step.stable_version in known), None)
        if earlier is None:
            raise InvalidArgument(
                f"history: no stable version before {rollout.stable_version} on record; "
                f"pass --to-version (known: {', '.join(map(str, sorted(known)))})")
        version = earlier
    if version == target:
        return Undo(version, known[version], f"the spec names version {version} already",
                    unchanged=True)
    if version == rollout.stable_version:
        why = (f"the spec is back at stable version {version}: canary version "
               f"{rollout.canary_version} is aborted at once" if live(rollout) else
               f"the spec is back at stable version {version}, which serves already")
    else:
        why = (f"the spec names version {version} again: it is rolled out over version "
               f"{rollout.stable_version} in stages and judged like any new version")
    return Undo(version, known[version], why)


def stage_label(spec: TieredModel, status: RolloutStatus) -> str:
    """The status's stage as people read it: 'N/M name'."""
    index = min(status.stage_index, len(spec.rollout.stages) - 1)
    return f"{index + 1}/{len(spec.rollout.stages)} {spec.rollout.stages[index].name}"


def weights_summary(weights: Mapping[str, float]) -> str:
    """Canary percent of the tiers that have any, in one line: 'edge=20% regional=5%'."""
    return " ".join(f"{tier}={weight:g}%" for tier, weight in weights.items() if weight)


def served_versions(status: RolloutStatus | None) -> tuple[int, ...]:
    """Versions the agents must serve: stable, plus the canary while it is live."""
    if status is None:
        return ()
    if live(status):
        return (status.stable_version, status.canary_version)
    return (status.stable_version,)


AgentsOf = Callable[[TieredModel, str, int], Sequence[str]]  # (spec, tier, version) -> addresses


def same_agents(agents: Mapping[str, Sequence[str]]) -> AgentsOf:
    """Every version of a tier on the same agents (the host backend)."""
    return lambda spec, tier, version: tuple(agents.get(tier, ()))


def wanted_versions(status: RolloutStatus | None, target: int) -> tuple[int, ...]:
    """Versions whose agents must exist: those served, plus the spec's version
    while it is still to be rolled out (not once its rollout has ended)."""
    served = served_versions(status)
    ended = status is not None and target == status.canary_version and not live(status)
    if target in served or ended:
        return served
    return tuple(sorted({*served, target}))


def routing_table(version: int, models: Sequence[tuple[TieredModel, RolloutStatus]],
                  agents_of: AgentsOf) -> routing.RoutingTable:
    """The router's table for these models (`tiered.protocol.routing`, the
    schema the router reads with), each tier's canary weight from the
    rollout's current stage, and the stage floor that sends un-hinted
    requests to the staged tiers whatever the policy prefers (`STAGE_FLOOR`).
    Where the canary runs on other agents than
    stable (Kubernetes: a Deployment per version), the tier lists them as
    `canary_agents`. A tier that may scale to zero and has no agent is
    listed `asleep`: the router counts the demand for it and holds the
    requests only it may answer until it wakes."""
    table: dict[str, routing.ModelRoute] = {}
    for spec, status in models:
        weights = engine.canary_weights(spec, status)
        shadow = (spec.rollout.shadow_fraction
                  if live(status) and spec.rollout.analysis.agreement is not None else 0.0)
        tiers: dict[str, routing.TierRoute] = {}
        asleep = []
        for tier in names.TIERS:
            if tier not in spec.tiers:
                continue
            stable_agents = tuple(agents_of(spec, tier, status.stable_version))
            if not stable_agents:
                auto = spec.tiers[tier].autoscaling
                if auto is not None and auto.scale_to_zero:
                    asleep.append(tier)  # scaled to zero: its demand wakes it
                continue
            if not live(status):
                tiers[tier] = routing.TierRoute(stable_agents, status.stable_version)
                continue
            canary_agents = tuple(agents_of(spec, tier, status.canary_version))
            tiers[tier] = routing.TierRoute(
                stable_agents, status.stable_version, canary=status.canary_version,
                canary_weight=round(weights[tier] / 100.0, 6), shadow_fraction=shadow,
                canary_agents=canary_agents if canary_agents != stable_agents else ())
        if not tiers and not asleep:
            continue
        cascade = spec.routing.cascade
        cascade_tiers = tuple(t for t in cascade.tiers if t in tiers)
        # A cascade with none of its tiers up routes like slo-energy until one is.
        table[spec.name] = routing.ModelRoute(
            tiers, policy=spec.routing.policy if cascade_tiers else "slo-energy",
            slo_ms=spec.routing.slo_ms, stage_floor=STAGE_FLOOR,
            cascade=routing.CascadeSettings(cascade_tiers, cascade.threshold, cascade.output)
            if cascade_tiers else routing.CascadeSettings(), asleep=tuple(asleep),
            split=_split(spec, tiers, asleep))
    return routing.RoutingTable(version, table)


def _split(spec: TieredModel, tiers: Mapping[str, routing.TierRoute],
           asleep: Sequence[str]) -> routing.SplitRoute | None:
    """The spec's split, while both its tiers are in the route (up or asleep);
    else the model is served whole."""
    split = spec.routing.split
    if split is None or not all(t in tiers or t in asleep
                                for t in (split.vision, split.decoder)):
        return None
    return routing.SplitRoute(split.vision, split.decoder)


def next_table(previous: routing.RoutingTable | None,
               models: Sequence[tuple[TieredModel, RolloutStatus]],
               agents_of: AgentsOf, keep: Collection[str] = ()
               ) -> routing.RoutingTable | None:
    """The table to write after `previous`, numbered one on; None when its
    routes are the same (no write, no new version). The models in `keep`
    (unreadable now) keep the routes `previous` gave them."""
    version = previous.version if previous is not None else 0
    table = routing_table(version + 1, models, agents_of)
    if previous is not None:
        kept = {name: route for name, route in previous.models.items() if name in keep}
        table = dataclasses.replace(table, models={**table.models, **kept})
        if table.models == previous.models:
            return None
    return table
