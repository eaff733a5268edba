"""One terminal line per rollout snapshot: stage, weights, stable's and the
canary's samples, p95s and J/inference (with its source; a generative
model's TTFT and TPOT p95s and J/token instead), agreement and the
decision with its reason, for `tiered rollout status` and the demo's live
progress; `ProgressLines` leaves out a hold whose reason has not changed, and
`still_line` says what a long hold waits for.
Formatting only: it reads no store and no clock."""

from __future__ import annotations

import time
from collections.abc import Mapping

from tiered import names
from tiered.rollout.engine import reason_gist
from tiered.rollout.snapshot import Snapshot


def _number(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def energy_sources(snap: Snapshot) -> str:
    """The energy figures' sources (J/inference, or a generative model's
    J/token) as the snapshot names them ('nvml', 'model, estimate', or each
    version's when they differ); '' when it names none or has no figure."""
    figures = snap.figures
    if not figures.stable.energy_source and not figures.canary.energy_source:
        return ""
    stable, canary = (version.energy_source if version.energy(snap.generative) is not None
                      else None for version in (figures.stable, figures.canary))
    return "" if stable is None and canary is None else names.energy_sources_label(stable, canary)


def _count(value: float | None) -> str:
    """A count as kept (a status step keeps it as a float); '-' unknown."""
    return "-" if value is None else f"{value:.0f}"


def _mj(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.3f}"


def weights_label(weights: Mapping[str, float]) -> str:
    """Canary percent per tier, cheapest tier first: 'all tiers 50%' when every
    tier has the same, else 'edge 20%, regional 5%' (tiers at 0 left out)."""
    ordered = [(tier, weights[tier]) for tier in names.TIERS if tier in weights]
    shown = [(tier, w) for tier, w in ordered if w]
    if not shown:
        return "no canary traffic"
    if len(ordered) > 1 and len(shown) == len(ordered) and len({w for _, w in shown}) == 1:
        return f"all tiers {shown[0][1]:g}%"
    return ", ".join(f"{tier} {w:g}%" for tier, w in shown)


REASON_CHARS = 160  # a short line's reason, at most; the whole is in the status


def short_reason(snap: Snapshot) -> str:
    """The decision's reason without the stage its line's head names, cut at
    REASON_CHARS: what a live view shows (`tiered rollout status` and the
    report keep it whole)."""
    reason = snap.reason
    named = f"stage {snap.stage_index + 1}/{snap.stages} '{snap.stage_name}': "
    reason = reason.removeprefix(named)
    return reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS - 1] + "…"


def progress_line(t: float, snap: Snapshot, short: bool = False) -> str:
    """The snapshot in one line; `short` cuts its reason (`short_reason`)."""
    versions = f"v{snap.stable_version}"
    if snap.canary_version is not None:
        versions += f"->v{snap.canary_version}"
    head = (f"{time.strftime('%H:%M:%S', time.localtime(t))} {snap.model} {versions} "
            f"{snap.phase:<11}")
    if snap.canary_version is not None:
        head += (f" stage {snap.stage_index + 1}/{snap.stages} "
                 f"{snap.stage_name!s} [{weights_label(snap.weights)}]")
    decision = f"{snap.action}: {short_reason(snap) if short else snap.reason}"
    figures = snap.figures
    if figures.canary.requests is None:
        return f"{head} | {decision}"
    sources = energy_sources(snap)
    if snap.generative:
        numbers = "  ".join(
            f"{who} n {_count(version.requests)} ttft p95 {_number(version.ttft_p95_ms)} ms tpot p95 "
            f"{_number(version.tpot_p95_ms)} ms {_mj(version.jpt)} mJ/tok"
            for who, version in figures.each())
    else:
        numbers = "  ".join(
            f"{who} n {_count(version.requests)} p95 {_number(version.p95_ms)} ms "
            f"{_mj(version.jpi)} mJ/inf" for who, version in figures.each())
    numbers += ((f" ({sources})" if sources else "") + "  agree "
                + ("-" if figures.agreement is None else f"{figures.agreement:.1%}")
                + f" ({_count(figures.agreement_compared)})")
    return f"{head} | {numbers} | {decision}"


def quiet_tail(quiet_s: float, stage: tuple[float, float] | None = None) -> str:
    """How long a watch has had nothing new, and, while a stage is judged,
    (seconds it has run, its maxDurationSeconds): how long it may still hold."""
    tail = f"nothing new for {quiet_s:.0f} s"
    if stage is not None:
        ran, most = stage
        tail += (f"; stage {ran:.0f} s in, maxDurationSeconds {most:g} "
                 f"({max(most - ran, 0.0):.0f} s left)")
    return tail


def still_line(t: float, snap: Snapshot, quiet_s: float,
               stage: tuple[float, float] | None = None) -> str:
    """The line a watch prints when nothing new was decided for a while: where
    the rollout stands and what it waits for (a hold snapshot's reason), then
    for how long (`quiet_tail`)."""
    return f"{progress_line(t, snap)} | {quiet_tail(quiet_s, stage)}"


def hold_key(snap: Snapshot) -> tuple:
    """What makes a hold worth another line: where the rollout stands and the
    reason, its running counts aside ('35 of 40 requests', '12 s in')."""
    return (snap.model, snap.phase, snap.canary_version, snap.stage_index,
            reason_gist(snap.reason))


class ProgressLines:
    """Progress lines of a stream of snapshots, a hold only when its reason
    changed since the last line of its model."""

    def __init__(self) -> None:
        self._last: dict[str, tuple] = {}

    def line(self, t: float, snap: Snapshot) -> str | None:
        key = hold_key(snap)
        if snap.action == names.Action.HOLD and self._last.get(snap.model) == key:
            return None
        self._last[snap.model] = key
        return progress_line(t, snap)
