"""One terminal line per rollout snapshot: stage, weights, samples, p95s,
J/inference with its source, agreement and the decision, for `tiered
rollout status` and the demo's live progress. Formatting only: it reads no
store and no clock."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from tiered import names


def _number(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def energy_sources(snap: Mapping[str, Any]) -> str:
    """The J/inference figures' sources as the snapshot names them ('nvml',
    'model, estimate', or each version's when they differ); '' when it names
    none or has no figure."""
    stable, canary = snap.get("energy_source_stable"), snap.get("energy_source_canary")
    if not stable and not canary:
        return ""
    stable = stable if snap.get("jpi_stable") is not None else None
    canary = canary if snap.get("jpi_canary") is not None else None
    return "" if stable is None and canary is None else names.energy_sources_label(stable, canary)


def _energy(snap: Mapping[str, Any]) -> str:
    def mj(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.3f}"
    sources = energy_sources(snap)
    return (f"J/inf {mj(snap['jpi_stable'])}/{mj(snap['jpi_canary'])} mJ"
            + (f" ({sources})" if sources else ""))


def progress_line(t: float, snap: Mapping[str, Any]) -> str:
    weights = " ".join(f"{tier[:3]} {w:g}%" for tier, w in (snap.get("weights") or {}).items()
                       if w) or "no canary traffic"
    versions = f"v{snap['stable_version']}"
    if snap.get("canary_version") is not None:
        versions += f"->v{snap['canary_version']}"
    head = (f"{time.strftime('%H:%M:%S', time.localtime(t))} {snap['model']} {versions} "
            f"{snap['phase']:<11}")
    if snap.get("canary_version") is not None:
        head += (f" stage {snap['stage_index'] + 1}/{snap['stages']} "
                 f"{snap['stage_name']!s:<8} [{weights}]")
    if snap.get("canary_requests") is None:
        return f"{head} | {snap['action']}: {snap['reason']}"
    agreement = snap.get("agreement")
    numbers = (f"n {snap['stable_requests']}/{snap['canary_requests']}  "
               f"p95 {_number(snap['p95_stable_ms'])}/{_number(snap['p95_canary_ms'])} ms  "
               f"{_energy(snap)}  "
               f"agree {'-' if agreement is None else f'{agreement:.1%}'}"
               f" ({snap.get('agreement_compared', 0)})")
    pending = ", ".join(snap.get("pending") or ())
    decision = snap["action"] if snap["action"] != names.Action.HOLD else \
        f"hold ({snap.get('verdict')}{': ' + pending if pending else ''})"
    line = f"{head} | {numbers} | {decision}"
    if snap["action"] != names.Action.HOLD:
        line += f": {snap['reason']}"
    return line
