"""The user's verbs on TieredModels, written once against the `ModelStore`
seam (`controller/store.py`: the local system's SQLite store, or a cluster's
resources): apply, the manual rollout verbs (pause, resume, promote, abort,
retry), undo, and when a followed rollout ends. The CLI says what they return.

A verb writes the status at the revision it read and tries again when the
controller wrote in between; the controller acts on it at its next pass.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiered import names
from tiered.controller import desired
from tiered.controller.pinning import checked, read_documents, with_artifact
from tiered.controller.plan import HISTORY_LIMIT, make_snapshot
from tiered.controller.reconciler import decode_status
from tiered.controller.store import ModelStore, Record
from tiered.errors import ConfigError, Conflict, NotFound
from tiered.rollout import engine
from tiered.rollout.snapshot import to_record
from tiered.rollout.spec import TieredModel, load_tiered_model
from tiered.rollout.status import HistoryEntry, TieredModelStatus
from tiered.rollout.wire import to_plain

CONFLICT_RETRIES = 5
VERBS: dict[str, Callable[..., engine.Decision]] = {
    "pause": engine.pause, "resume": engine.resume, "promote": engine.promote,
    "abort": engine.abort, "retry": engine.retry,
}


def apply_file(store: ModelStore, path: Path) -> list[tuple[str, str]]:
    """Apply every TieredModel in `path`; (name, created|configured|unchanged) each.
    All documents are checked before any is stored."""
    path = Path(path)
    checked_documents = []
    for index, document in enumerate(read_documents(path)):
        where = f"{path}[{index}]" if index else str(path)
        checked_documents.append(checked(document, path.parent, where))
    results = []
    for spec, pinned in checked_documents:
        before = _find(store, spec.name)
        after = store.apply(spec.name, pinned)
        results.append((spec.name, "created" if before is None else
                        "configured" if after.generation != before.generation else "unchanged"))
    return results


def _find(store: ModelStore, name: str) -> Record | None:
    try:
        return store.get(name)
    except NotFound:
        return None


def spec_of(record: Record) -> TieredModel:
    return load_tiered_model(record.spec, record.name)


def _target(spec: TieredModel, status: TieredModelStatus, generation: int) -> int | None:
    """The spec's version once the controller has seen the spec, else None."""
    if status.rollout is None or status.observed_generation < generation:
        return None
    if spec.artifact.sha256 is None:
        return None
    return next((a.version for a in status.artifacts if a.sha256 == spec.artifact.sha256),
                None)


def ended(spec: TieredModel, status: TieredModelStatus, generation: int) -> bool:
    """Whether the rollout of the spec's version is over (promoted, rolled back,
    aborted, or the spec's version simply serving): not while the controller
    has yet to see the spec, nor while a new version is built or rolled out."""
    rollout, target = status.rollout, _target(spec, status, generation)
    if target is None:
        return False
    if target == rollout.stable_version:
        return not desired.live(rollout)
    return target == rollout.canary_version and rollout.phase in engine.FINISHED


def paused(spec: TieredModel, status: TieredModelStatus, generation: int) -> bool:
    """Whether the rollout of the spec's version is paused, by hand or by the
    rollout itself (a stage undecided at its maxDurationSeconds under onUndecided:
    pause, a failed one under onFailure: pause): it
    waits for a person (resume, promote or abort)."""
    rollout, target = status.rollout, _target(spec, status, generation)
    return (target is not None and target == rollout.canary_version
            and desired.live(rollout)
            and (rollout.phase == names.Phase.PAUSED or rollout.paused))


def watch_end(spec: TieredModel, status: TieredModelStatus, generation: int) -> str | None:
    """The phase that ends `rollout status --watch` (Promoted, RolledBack,
    Aborted or Paused), None while the spec's version is still coming or
    going on; one rule for both backends."""
    if paused(spec, status, generation):
        return names.Phase.PAUSED
    if ended(spec, status, generation):
        return status.rollout.phase
    return None


def report_thresholds(spec: TieredModel) -> dict[str, float | None]:
    """The canary limits the report draws, from the spec's analysis: those of
    the metrics the model's kind is judged on."""
    analysis = spec.rollout.analysis
    if names.ModelKind(spec.kind).streams_tokens:
        ttft, tpot, energy = analysis.ttft_p95, analysis.tpot_p95, analysis.energy_per_token
        return {"ttft_p95_max_ratio": ttft.max_ratio if ttft else None,
                "ttft_p95_max_ms": ttft.max_ms if ttft else None,
                "tpot_p95_max_ratio": tpot.max_ratio if tpot else None,
                "tpot_p95_max_ms": tpot.max_ms if tpot else None,
                "energy_per_token_max_ratio": energy.max_ratio if energy else None}
    latency, energy = analysis.latency_p95, analysis.energy_per_inference
    return {"latency_p95_max_ratio": latency.max_ratio if latency else None,
            "latency_p95_max_ms": latency.max_ms if latency else None,
            "energy_max_ratio": energy.max_ratio if energy else None}


def manual_decision(name: str, spec: TieredModel, status: TieredModelStatus, verb: str,
                    *, full: bool, now: float) -> engine.Decision:
    """A manual verb on a rollout, for either backend: pause, resume, promote
    (`full`: all the way), abort or retry (the spec's version again)."""
    if verb not in VERBS:
        raise ConfigError(f"verb: {verb!r} is not one of {', '.join(VERBS)}")
    if status.rollout is None:
        raise ConfigError(f"{name}: has no status yet; the controller has not served it")
    extra: dict[str, Any] = {"full": full} if verb == "promote" else {}
    if verb == "retry":
        extra["target"] = desired.version_of(spec.artifact, status.artifacts)[0]
    return VERBS[verb](spec, status.rollout, now, **extra)


def with_decision(status: TieredModelStatus, decision: engine.Decision,
                  spec: TieredModel | None = None, now: float | None = None
                  ) -> TieredModelStatus:
    """The status after a manual verb: the controller's next pass recomputes
    the rest (weights, conditions). Given the spec and the time, the status's
    history records the step too, as it records the controller's: the
    rollout's steps (a pause, an abort, a retry) then read the same on
    Kubernetes, whose report and watch have only the status."""
    history = status.history
    if spec is not None and now is not None:
        rollout = decision.status
        step = HistoryEntry(
            t=now, action=decision.action, reason=decision.reason, phase=rollout.phase,
            stable_version=rollout.stable_version, canary_version=rollout.canary_version,
            stage=desired.stage_label(spec, rollout) if rollout.canary_version else "")
        history = (*history, step)[-HISTORY_LIMIT:]
    return dataclasses.replace(status, rollout=decision.status, message=decision.reason,
                               history=history)


def rollout_verb(store: ModelStore, name: str, verb: str, *, full: bool = False,
                 now: Callable[[], float] = time.time) -> engine.Decision:
    """Apply a manual verb to the stored status (retrying when the controller
    wrote in between); the controller acts on it at its next pass. A verb
    already in effect (a HOLD) writes nothing."""
    for _ in range(CONFLICT_RETRIES):
        record = store.get(name)
        spec = spec_of(record)
        status = decode_status(name, record.status)
        when = now()
        decision = manual_decision(name, spec, status, verb, full=full, now=when)
        if decision.action == names.Action.HOLD:
            return decision
        try:
            store.write_status(name, record.revision,
                               status=to_plain(with_decision(status, decision, spec, when)))
        except Conflict:
            continue
        store.record(name, to_record(make_snapshot(spec, decision.status, decision.action,
                                                   decision.reason)), when)
        return decision
    raise Conflict(f"{name}: the controller kept writing; try again")


def undo_of(name: str, spec: TieredModel, status: TieredModelStatus,
            to_version: int | None) -> desired.Undo:
    """`rollout undo` for either backend: the version the spec goes back to."""
    if spec.artifact.sha256 is None:
        raise ConfigError(f"{name}: artifact.sha256: not pinned")
    target = next((a.version for a in status.artifacts if a.sha256 == spec.artifact.sha256),
                  None)
    if target is None:
        raise Conflict(f"{name}: the controller has not seen the applied artifact yet; "
                       "try again in a moment")
    return desired.undo(status, target, to_version)


def rollout_undo(store: ModelStore, name: str, to_version: int | None = None
                 ) -> desired.Undo:
    """Point the stored spec at an earlier version's artifact (a new generation,
    as `apply` of that artifact would make); the controller takes it from there."""
    record = store.get(name)
    found = undo_of(name, spec_of(record), decode_status(name, record.status), to_version)
    if not found.unchanged:
        store.apply(name, with_artifact(record.spec, found.artifact))
    return found
