"""The user's verbs against the local store: apply, get, rollout status and
the manual rollout verbs. The CLI prints what these return.

`apply` pins each artifact: a relative path is made absolute (relative to
the applied file) and a missing sha256 is filled in from the file, or from
a checkpoint directory's files (`tiered.files.sha256_tree`, as the build
checks it), so the stored spec names exactly the bytes that will be built.
A given sha256 that does not match is refused at once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from tiered import names
from tiered.controller import desired
from tiered.controller.plan import HISTORY_LIMIT, make_snapshot
from tiered.controller.reconciler import decode_status
from tiered.controller.store import Record, StateStore
from tiered.errors import ConfigError, Conflict
from tiered.files import sha256_file, sha256_tree
from tiered.rollout import engine, snapshot
from tiered.rollout.spec import TieredModel, as_resource, load_tiered_model
from tiered.rollout.status import ArtifactVersion, HistoryEntry, RolloutStatus, TieredModelStatus
from tiered.rollout.wire import API_GROUP, API_VERSION, to_plain, wire_key

CONFLICT_RETRIES = 5
MAX_PATH = 4096  # longest artifact path accepted
VERBS: dict[str, Callable[..., engine.Decision]] = {
    "pause": engine.pause, "resume": engine.resume, "promote": engine.promote,
    "abort": engine.abort, "retry": engine.retry,
}


def read_documents(path: Path) -> list[Mapping[str, Any]]:
    """Every YAML document in `path` (`---` separated), each a mapping."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read: {error}") from error
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except (yaml.YAMLError, ValueError, RecursionError) as error:  # bad dates, huge ints too
        raise ConfigError(f"{path}: invalid YAML: {str(error)[:300]}") from error
    for index, document in enumerate(documents):
        if not isinstance(document, Mapping):
            raise ConfigError(f"{path}: document {index + 1}: expected a mapping, got "
                              f"{type(document).__name__}")
    return documents


def checked(document: Mapping[str, Any], base: Path, where: str
            ) -> tuple[TieredModel, dict[str, Any]]:
    """A document's TieredModel and the resource to store: the document with its
    artifact pinned, in the current API version (an older version's document
    and a flat one are converted; see `as_resource`). The schema is
    checked first, so a mistyped field is named as such, not taken for a
    missing digest."""
    load_tiered_model(_with_digest(document, UNPINNED), where)
    pinned = pin_artifact(document, base, where)
    return load_tiered_model(pinned, where), as_resource(pinned)


UNPINNED = "0" * 64  # a digest that stands in while only the schema is checked


def _with_digest(document: Mapping[str, Any], digest: str) -> Mapping[str, Any]:
    """The document with `digest` where its artifact has no sha256 (else as it is)."""
    nested = isinstance(document.get("spec"), Mapping)
    holder = document["spec"] if nested else document
    artifact = holder.get("artifact")
    if not isinstance(artifact, Mapping) or "sha256" in artifact:
        return document
    holder = {**holder, "artifact": {**artifact, "sha256": digest}}
    return {**document, "spec": holder} if nested else holder


def pin_artifact(document: Mapping[str, Any], base: Path, where: str) -> dict[str, Any]:
    """The document with its artifact's local paths made absolute and its digest pinned."""
    document = dict(document)
    if "spec" in document and not isinstance(document["spec"], Mapping):
        return document  # validation names the malformed spec
    holder = dict(document["spec"]) if "spec" in document else document
    where = f"{where}.spec" if "spec" in document else where
    artifact = holder.get("artifact")
    if not isinstance(artifact, Mapping):
        return document  # validation names the missing or malformed field
    artifact = dict(artifact)
    for key in ("uri", "calibration", "eval"):
        value = artifact.get(key)
        if isinstance(value, str) and value and not urlparse(value).scheme:
            if "\0" in value or len(value) > MAX_PATH:
                raise ConfigError(f"{where}.artifact.{key}: not a usable path")
            artifact[key] = str((base / value).resolve())
    # The digests' keys as the document spells its fields.
    camel = "spec" in document and document.get("apiVersion") == f"{API_GROUP}/{API_VERSION}"
    for data in ("calibration", "eval"):
        pin = f"{data}_sha256"
        _pin_data(artifact, data, wire_key(pin) if camel else pin, where)
    uri = artifact.get("uri")
    if isinstance(uri, str) and (Path(uri).is_file() or Path(uri).is_dir()):
        digest = sha256_file(Path(uri)) if Path(uri).is_file() else sha256_tree(Path(uri))
        given = artifact.get("sha256")
        if given is None:
            artifact["sha256"] = digest
        elif given != digest:
            raise ConfigError(f"{where}.artifact.sha256: {uri} has sha256 {digest}, "
                              f"not {given}")
    elif isinstance(uri, str) and artifact.get("sha256") is None:
        if not urlparse(uri).scheme:
            raise ConfigError(f"{where}.artifact.uri: no such file: {uri}")
        raise ConfigError(f"{where}.artifact.uri: {uri} is not on this machine, so its "
                          "sha256 cannot be computed here; give artifact.sha256")
    holder["artifact"] = artifact
    if "spec" in document:
        document["spec"] = holder
    return document


def _pin_data(artifact: dict[str, Any], key: str, pin: str, where: str) -> None:
    """artifact.<pin>, the digest of a local calibration or eval file, pinned
    (or checked, when given); a URI must come with its digest."""
    value = artifact.get(key)
    if not isinstance(value, str) or not value:
        return
    if Path(value).is_file():
        digest = sha256_file(Path(value))
        given = artifact.get(pin)
        if given is None:
            artifact[pin] = digest
        elif given != digest:
            raise ConfigError(f"{where}.artifact.{pin}: {value} has sha256 {digest}, "
                              f"not {given}")
    elif artifact.get(pin) is None:
        if not urlparse(value).scheme:
            raise ConfigError(f"{where}.artifact.{key}: no such file: {value}")
        raise ConfigError(f"{where}.artifact.{key}: {value} is not on this machine, so its "
                          f"sha256 cannot be computed here; give artifact.{pin}")


def apply_file(store: StateStore, path: Path) -> list[tuple[str, str]]:
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


def _find(store: StateStore, name: str) -> Record | None:
    return next((r for r in store.list() if r.name == name), None)


def analysis_lines(status: RolloutStatus | None) -> list[str]:
    """The last analysis of a rollout, a line per metric and tier: what the
    stage is being judged on, with the numbers."""
    run = status.last_analysis if status is not None else None
    if run is None:
        return []
    return [f"last analysis: {run.verdict}",
            *(f"  {m.label}: {m.outcome}: {m.reason}" for m in run.metrics)]


def history_lines(status: TieredModelStatus, last: int = 10) -> list[str]:
    """The rollout's latest steps as the status keeps them (both backends),
    each with the numbers it was taken on."""
    lines = []
    for step in status.history[-last:]:
        when = datetime.fromtimestamp(step.t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        versions = f"v{step.stable_version}" + (
            f"->v{step.canary_version}" if step.canary_version else "")
        numbers = " ".join(f"{k}={v:.4g}" + (f" ({step.sources[k]})" if k in step.sources
                                              else "") for k, v in step.numbers.items())
        lines.append(f"{when} {versions} {step.action}: {step.reason}"
                     + (f" [{numbers}]" if numbers else ""))
    return lines


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
    if spec.kind == names.ModelKind.GENERATIVE:
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


def snapshots_of(spec: TieredModel, status: TieredModelStatus
                 ) -> list[tuple[float, snapshot.Snapshot]]:
    """The status's history steps as report snapshots, each with its time
    (what the local store records every pass, Kubernetes keeps for each step
    in the status)."""
    stages = spec.rollout.stages
    snapshots = []
    for step in status.history:
        label = step.stage.split(" ", 1)
        index = next((i for i, stage in enumerate(stages)
                      if len(label) == 2 and stage.name == label[1]), 0)
        live = step.canary_version is not None and step.phase in (
            names.Phase.PROGRESSING, names.Phase.PAUSED)
        snapshots.append((step.t, snapshot.Snapshot(
            model=spec.name, kind=spec.kind, stable_version=step.stable_version,
            canary_version=step.canary_version, phase=step.phase, stage_index=index,
            stage_name=stages[index].name, stages=len(stages),
            weights={tier: float(stages[index].weights.get(tier, 0.0)) if live else 0.0
                     for tier in names.TIERS if tier in spec.tiers},
            action=step.action, reason=step.reason,
            figures=snapshot.from_step_numbers(step.numbers, step.sources))))
    return snapshots


def spec_of(record: Record) -> TieredModel:
    return load_tiered_model(record.spec, record.name)


def summary_row(record: Record) -> dict[str, str]:
    """One line of `tiered get`: name, readiness, phase, stage, versions, weights."""
    return row_of(record.name, spec_of(record), decode_status(record.name, record.status))


def row_of(name: str, spec: TieredModel, status: TieredModelStatus) -> dict[str, str]:
    """The `tiered get` line of one model, whichever backend keeps it. READY is
    the Ready condition (routable: a version serves and the routers route it);
    while it is not True, MESSAGE says why."""
    ready = next((c for c in status.conditions if c.type == "Ready"), None)
    rollout, message = status.rollout, status.message
    if ready is not None and ready.status != "True" and rollout is not None:
        message = ready.message
    if rollout is None:
        return {"NAME": name, "READY": ready.status if ready else "-", "PHASE": "Pending",
                "STAGE": "-", "STABLE": "-", "CANARY": "-", "WEIGHTS": "-",
                "MESSAGE": message}
    stage = (desired.stage_label(spec, rollout) if rollout.canary_version is not None
             and rollout.phase != names.Phase.PROMOTED else "-")
    return {
        "NAME": name, "READY": ready.status if ready else "-", "PHASE": rollout.phase,
        "STAGE": stage, "STABLE": f"v{rollout.stable_version}",
        "CANARY": f"v{rollout.canary_version}" if rollout.canary_version else "-",
        "WEIGHTS": desired.weights_summary(engine.canary_weights(spec, rollout)) or "-",
        "MESSAGE": message or rollout.message,
    }


def describe(record: Record) -> dict[str, Any]:
    """Everything `tiered get NAME -o yaml` shows: spec and status."""
    return {"name": record.name, "generation": record.generation,
            "revision": record.revision, "spec": dict(record.spec),
            "status": record.status}


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


def rollout_verb(store: StateStore, name: str, verb: str, *, full: bool = False,
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
        store.record(name, snapshot.to_record(make_snapshot(
            spec, decision.status, decision.action, decision.reason)), when)
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


def with_artifact(document: Mapping[str, Any], artifact: ArtifactVersion) -> dict[str, Any]:
    """The stored document with its artifact's uri and sha256 set to `artifact`'s
    (the rest, calibration and eval data included, as it was)."""
    document = dict(document)
    nested = isinstance(document.get("spec"), Mapping)
    holder = dict(document["spec"]) if nested else document
    holder["artifact"] = {**holder["artifact"], "uri": artifact.uri, "sha256": artifact.sha256}
    if nested:
        document["spec"] = holder
    return document


def rollout_undo(store: StateStore, name: str, to_version: int | None = None) -> desired.Undo:
    """Point the stored spec at an earlier version's artifact (a new generation,
    as `apply` of that artifact would make); the controller takes it from there."""
    record = store.get(name)
    found = undo_of(name, spec_of(record), decode_status(name, record.status), to_version)
    if not found.unchanged:
        store.apply(name, with_artifact(record.spec, found.artifact))
    return found
