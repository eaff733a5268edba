"""How a TieredModel's state is said on a terminal: `tiered get`'s row and
document, the last analysis, and `rollout status`'s still line. Formatting
of what the models say; it reads nothing itself."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tiered import names
from tiered.controller import desired
from tiered.controller.plan import make_snapshot
from tiered.controller.reconciler import decode_status
from tiered.controller.store import Record
from tiered.controller.verbs import spec_of
from tiered.rollout import engine
from tiered.rollout.progress import quiet_tail, still_line
from tiered.rollout.spec import TieredModel
from tiered.rollout.status import RolloutStatus, TieredModelStatus

if TYPE_CHECKING:
    from tiered.cli.tieredmodels import Look


def analysis_lines(status: RolloutStatus | None) -> list[str]:
    """The last analysis of a rollout, a line per metric and tier: what the
    stage is being judged on, with the numbers."""
    run = status.last_analysis if status is not None else None
    if run is None:
        return []
    return [f"last analysis: {run.verdict}",
            *(f"  {m.label}: {m.outcome}: {m.reason}" for m in run.metrics)]


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
    """Everything `tiered get NAME -o yaml` shows: the applied document and
    the status (a cluster's object holds the status too: shown once)."""
    return {"name": record.name, "generation": record.generation,
            "revision": record.revision,
            "spec": {k: v for k, v in record.spec.items() if k != "status"},
            "status": record.status}


def still(look: Look, now: float, quiet_s: float) -> str:
    """The line for a watch with nothing new for `quiet_s` seconds: what the
    rollout waits for (the controller, a version's agents, a stage's data)
    and, while a stage is judged, how long it has run against its
    maxDurationSeconds. From the status alone, so both backends say the same."""
    spec, status = look.spec, look.status
    rollout = status.rollout
    if status.observed_generation < look.generation:
        reason = (f"the controller has not seen the applied spec yet (generation "
                  f"{look.generation}; it has seen {status.observed_generation})")
    elif desired.live(rollout):
        reason = rollout.message
    else:
        reason = status.message or (rollout.message if rollout else "")
    if rollout is None:
        clock = time.strftime("%H:%M:%S", time.localtime(now))
        return f"{clock} {look.name} | {reason or 'no version serves yet'} | " \
            f"{quiet_tail(quiet_s)}"
    stage = None
    if desired.live(rollout) and status.observed_generation >= look.generation:
        index = min(rollout.stage_index, len(spec.rollout.stages) - 1)
        ran = (rollout.blind_since or now) - rollout.stage_started_at  # blind: clock stopped
        stage = (ran, spec.rollout.stages[index].max_duration_s)
    snap = make_snapshot(spec, rollout, names.Action.HOLD, reason)
    return still_line(now, snap, quiet_s, stage)


def summary_line(row: dict[str, str]) -> str:
    """A `tiered get` row as one line of `key: value`, empty fields left out."""
    return "  ".join(f"{k.lower()}: {v}" for k, v in row.items() if v not in ("", "-"))
