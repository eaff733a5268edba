"""The rollout report: one self-contained HTML page and its JSON twin.

Renders the snapshots the controller recorded during rollouts (each with its
time, in time order) as summary tables, SVG charts with a marker at every
decision, and a table of decisions. Latency and energy are judged per tier,
so where the snapshots carry per-tier figures each tier gets its own p95
and J/inference charts with the canary's limit drawn (the
spec's max_ratio times stable's figure, and max_ms), and a table of p95 and
J/inference per tier and version; energy always names its source (nvml,
rapl, or model: an estimate). A generative model's rollouts show what it is
judged on instead: TTFT and TPOT p95 and J per output token, in charts and
tables of their own. The builds' accuracy reports, where the caller
has them, get a table of their own. A pure renderer: it never reads a clock or
talks to a backend, and the page never loads anything — CSS and SVG are inline,
there is no JavaScript and no external URL, so it opens offline from disk.
Every string from the history or `extra` is escaped.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tiered import names, tables
from tiered.files import write_atomically
from tiered.rollout import engine, snapshot
from tiered.rollout.progress import energy_sources
from tiered.rollout.snapshot import Figures, Snapshot, StageFigures

W, H = 760, 250
LEFT, RIGHT, TOP, BOTTOM = 60, 32, 34, 40  # plot margins inside the SVG
CENTER_X, CENTER_Y = (LEFT + W - RIGHT) / 2, (TOP + H - BOTTOM) / 2
MIDDLE = ' text-anchor="middle"'
STABLE, CANARY, LIMIT = "#64748b", "#ea580c", "#dc2626"
TIER_COLORS = {"edge": "#0891b2", "regional": "#7c3aed", "datacenter": "#16a34a"}
MARK_COLORS = {"promote": "#16a34a", "rollback": "#dc2626", "abort": "#dc2626"}
FINAL_METRICS = ("p95_stable_ms", "p95_canary_ms", "jpi_stable", "jpi_canary",
                 "agreement", "agreement_compared", "verdict", "energy_source_stable",
                 "energy_source_canary")
# A generative model's: what its rollouts are judged on instead of p95 and J/inference.
FINAL_GENERATIVE = ("ttft_p95_stable_ms", "ttft_p95_canary_ms", "tpot_p95_stable_ms",
                    "tpot_p95_canary_ms", "jpt_stable", "jpt_canary")

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;color:#1e293b;
 max-width:980px;margin:2em auto;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.3em}h2{font-size:1.15em;margin-top:1.8em}
table{border-collapse:collapse;margin:.6em 0;width:100%}
th,td{text-align:left;padding:.3em .6em;border-bottom:1px solid #e2e8f0;vertical-align:top}
th{background:#f8fafc;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.badge{padding:.1em .5em;border-radius:.6em;background:#e2e8f0;font-size:.9em}
.Promoted{background:#dcfce7}.RolledBack,.Aborted{background:#fee2e2}.Paused{background:#fef9c3}
svg{width:100%;height:auto;margin:.4em 0;font:11px system-ui,sans-serif}
svg .t{font-weight:600;font-size:13px}
svg .mark text{paint-order:stroke;stroke:#fff;stroke-width:3px}
"""

Timed = tuple[float, Snapshot]  # a snapshot and its time (s)
Getter = Callable[[Snapshot], Any]
Line = tuple[str, str, Getter]  # legend label, color, value of a snapshot
Mark = tuple[Timed, str]  # a decision's snapshot and its label


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any) -> float | None:
    """value as a finite float, or None (unknown, NaN or not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _plain(value: Any) -> Any:
    """value as JSON data: mappings to dicts, sequences to lists, NaN to None, others to str."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return _num(value)
    return value if value is None or isinstance(value, (bool, int, str)) else str(value)


def _canary(group: Sequence[Timed]) -> int | None:
    return next((s.canary_version for _, s in group if s.canary_version is not None), None)


def _rollouts(history: Sequence[Timed]) -> list[list[Timed]]:
    """Snapshots grouped per rollout: one begins at 'start', at 'retry' (a
    rolled-back or aborted canary rolled out again is a rollout of its own)
    or at a model's new canary version, and ends at its outcome (promoted,
    rolled back, aborted): what comes after a finished rollout belongs to none
    until the next one begins. A retry's own 'start', once its agents are up,
    stays in the retry's rollout."""
    groups: list[list[Timed]] = []
    current: dict[str, list[Timed]] = {}
    retried: dict[str, int | None] = {}  # per model, the canary version its last retry rolls out
    for timed in history:
        s = timed[1]
        model, canary, group = s.model, s.canary_version, current.get(s.model)
        if s.action == names.Action.RETRY:
            retried[model] = _canary(group) if group else None
            group = current[model] = []
            groups.append(group)
        elif (s.action == names.Action.START and group and group[-1][1].action
              == names.Action.RETRY and canary == retried.get(model)):
            pass  # the retry's rollout starting, its agents up again
        elif s.action == names.Action.START or (
                canary is not None and (group is None or canary != _canary(group))):
            group = current[model] = []
            groups.append(group)
        elif group is None or group[-1][1].phase in engine.FINISHED:
            continue
        group.append(timed)
    return groups


def _decisions(history: Sequence[Timed], canary: Mapping[str, int] | None = None
               ) -> list[Mark]:
    """Every non-hold snapshot with a short label: 'advance to stage 2', 'rollback v3'.
    `canary`: each model's canary version as known before the first snapshot (a
    retry names the version it rolls out again before its start does)."""
    found, canary = [], dict(canary or {})
    for timed in history:
        s = timed[1]
        if s.canary_version is not None:
            canary[s.model] = s.canary_version
        if s.action == names.Action.HOLD:
            continue
        if s.action == names.Action.ADVANCE:
            label = f"advance to stage {s.stage_index + 1}"
        elif s.action in (names.Action.START, names.Action.PROMOTE, names.Action.ROLLBACK,
                          names.Action.ABORT, names.Action.RETRY) and s.model in canary:
            label = f"{s.action} v{canary[s.model]}"
        else:
            label = s.action
        found.append((timed, label))
    return found


def _known_canary(group: Sequence[Timed]) -> dict[str, int]:
    """The rollout's canary version, known from its first snapshot on."""
    version = _canary(group)
    return {} if version is None else {group[0][1].model: version}


def _last_known(values: Iterable[Any]) -> Any:
    """The last of `values` that is not None (None when none is)."""
    return next((v for v in reversed(list(values)) if v is not None), None)


def _last_figures(versions: Sequence[Figures]) -> Figures:
    """Each figure as last known."""
    return Figures(**{field.name: _last_known(getattr(v, field.name) for v in versions)
                      for field in dataclasses.fields(Figures)})


def _final(group: Sequence[Timed]) -> Snapshot:
    """The rollout's last snapshot with its verdict and each pooled figure as last known."""
    snaps = [s for _, s in group]
    figures = [s.figures for s in snaps]
    known = StageFigures(stable=_last_figures([f.stable for f in figures]),
                         canary=_last_figures([f.canary for f in figures]),
                         agreement=_last_known(f.agreement for f in figures),
                         agreement_compared=_last_known(f.agreement_compared for f in figures))
    return dataclasses.replace(snaps[-1], verdict=_last_known(s.verdict for s in snaps),
                               figures=known)


def _summary(group: Sequence[Timed]) -> dict[str, Any]:
    (t0, first), (t1, last) = group[0], group[-1]
    t0, t1 = _num(t0), _num(t1)
    kind = names.ModelKind.GENERATIVE if last.generative else names.ModelKind.PREDICTIVE
    keys = FINAL_METRICS + (FINAL_GENERATIVE if last.generative else ())
    final = snapshot.to_record(_final(group))
    return {"model": first.model, "kind": kind, "stable_version": first.stable_version,
            "canary_version": _canary(group), "outcome": last.phase, "started_s": t0,
            "duration_s": None if t0 is None or t1 is None else t1 - t0,
            "stages_reached": max(s.stage_index for _, s in group) + 1,
            "stages": last.stages,
            "decisions": [{"t": t, "action": s.action, "label": label, "reason": s.reason}
                          for (t, s), label in _decisions(group, _known_canary(group))],
            "final": {key: final.get(key) for key in keys}}


def report_json(history: Sequence[Timed], title: str, extra: Mapping,
                builds: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The report as JSON data: title, extra, one summary per rollout, the
    history (each snapshot's record, keys sorted as the store keeps them, with
    its time t), and the build reports when there are any."""
    data = {"title": title, "extra": extra,
            "rollouts": [_summary(g) for g in _rollouts(history)],
            "history": [dict(sorted(snapshot.to_record(s).items()), t=t) for t, s in history]}
    return _plain({**data, "builds": list(builds)} if builds else data)


def _scale(lo: float, hi: float, a: float, b: float) -> Callable[[float], float]:
    """Linear map of [lo, hi] onto [a, b]; a one-value domain maps to the middle."""
    if hi <= lo:
        return lambda v: (a + b) / 2
    return lambda v: a + (v - lo) * (b - a) / (hi - lo)


def _ticks(lo: float, hi: float, cover: bool = False, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 times a power of ten apart) within [lo, hi]; with
    `cover`, from the last one at or below lo to the first one at or above hi."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    eps = 1e-9  # so that 1.0 / 0.02 = 50.000000000000004 still counts as 50
    if cover:
        first, last = math.floor(lo / step + eps), math.ceil(hi / step - eps)
    else:
        first, last = math.ceil(lo / step - eps), math.floor(hi / step + eps)
    return [round(i * step, 12) for i in range(first, last + 1)]


def _path(points: Sequence[tuple[float | None, float | None]], sx, sy, step: bool) -> str:
    """SVG path data through the points, lifting the pen at every unknown value; with `step`,
    each value holds until the next point (for settings such as weights)."""
    data, pen = [], "M"
    for x, y in points:
        if x is None or y is None:
            pen = "M"
        elif pen == "M":
            # 'h0' after each move: a lone point then shows as a round-capped dot.
            data.append(f"M{sx(x):.1f},{sy(y):.1f}h0")
            pen = "L"
        else:
            data.append(f"H{sx(x):.1f}V{sy(y):.1f}" if step else f"L{sx(x):.1f},{sy(y):.1f}")
    return "".join(data)


def _text(x: float, y: float, text: str, attrs: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}"{attrs}>{_e(text)}</text>'


def _hline(y: float, color: str) -> str:
    return f'<line x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" stroke="{color}"/>'


def _axes(xs: Sequence[float], ys: Sequence[float], sx, sy, unit: str) -> list[str]:
    """Grid lines and tick labels on both axes, plus the axis titles."""
    return [*(_hline(sy(v), "#eef2f6") + _text(LEFT - 6, sy(v) + 4, f"{v:g}", ' text-anchor="end"')
              for v in ys),
            _hline(H - BOTTOM, "#94a3b8"),
            *(_text(sx(v), H - BOTTOM + 15, f"{v:g}", MIDDLE) for v in xs),
            _text(CENTER_X, H - 6, "time (s)", MIDDLE),
            _text(0, 0, unit, f'{MIDDLE} transform="translate(14,{CENTER_Y}) rotate(-90)"')]


def _legend(lines: Sequence[Line]) -> str:
    """Swatches and labels, right-aligned above the plot."""
    out, x = [], W - RIGHT
    for label, color, _ in reversed(lines):
        x -= 6.5 * len(label) + 30
        out.append(f'<rect x="{x}" y="{TOP - 20}" width="14" height="4" fill="{color}"/>'
                   + _text(x + 18, TOP - 15, label))
    return "".join(out)


def _marker(x: float, label: str, color: str) -> str:
    """A dashed vertical line at x with its label running down beside it."""
    return (f'<g class="mark"><line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{H - BOTTOM}" '
            f'stroke="{color}" stroke-dasharray="4 3"/>'
            + _text(0, 0, label, f' fill="{color}" transform="translate({x + 4:.1f},{TOP + 4}) '
                    'rotate(90)"') + "</g>")


def _chart(title: str, unit: str, history: Sequence[Timed], lines: Sequence[Line],
           include: Sequence[float], marks: Sequence[Mark], step: bool = False) -> str:
    """One SVG line chart over time: a line per (label, color, getter), a marker per decision.

    The y range spans the known values and `include` (e.g. 0, so that a ratio is not magnified).
    """
    ts = [_num(t) for t, _ in history]
    series = [(color, [_num(get(s)) for _, s in history]) for _, color, get in lines]
    known_t = [t for t in ts if t is not None]
    values = [v for _, ys in series for v in ys if v is not None]
    x0, x1 = (min(known_t), max(known_t)) if known_t else (0.0, 1.0)
    y_ticks = _ticks(min([*values, *include]), max([*values, *include]), cover=True)
    sx, sy = _scale(x0, x1, LEFT, W - RIGHT), _scale(y_ticks[0], y_ticks[-1], H - BOTTOM, TOP)
    parts = [f"<title>{_e(title)}</title>", _text(LEFT, 16, title, ' class="t"'),
             *_axes(_ticks(x0, x1), y_ticks, sx, sy, unit), _legend(lines)]
    if not values:
        parts.append(_text(CENTER_X, CENTER_Y, "no data", f'{MIDDLE} fill="#94a3b8"'))
    parts += ['<g fill="none" stroke-width="2" stroke-linecap="round" stroke-linejoin="round">',
              *(f'<path d="{_path(list(zip(ts, ys)), sx, sy, step)}" stroke="{color}"'
                + (' stroke-dasharray="6 4"' if color == LIMIT else "") + "/>"
                for color, ys in series), "</g>"]
    parts += [_marker(sx(t), label, MARK_COLORS.get(s.action, "#475569"))
              for (t, s), label in marks]
    return (f'<svg viewBox="0 0 {W} {H}" role="img" aria-label="{_e(title)}">'
            + "".join(parts) + "</svg>")


def _weight(tier: str) -> Getter:
    return lambda s: s.weights.get(tier)


def _figure(tier: str | None, who: str, figure: Callable[[Figures], Any]) -> Getter:
    """A version's figure at each snapshot: on `tier`, or pooled (None)."""
    def get(s: Snapshot) -> Any:
        compared = s.figures if tier is None else s.figures.tiers.get(tier)
        return None if compared is None else figure(getattr(compared, who))
    return get


def _tiers_in(history: Sequence[Timed]) -> list[str]:
    """The tiers the snapshots carry figures of their own for, cheapest first."""
    return [tier for tier in names.TIERS if any(tier in s.figures.tiers for _, s in history)]


def _limit(stable: Getter, ratio: float | None) -> Getter:
    """The canary's limit at each snapshot: `ratio` times stable's figure."""
    def get(s: Snapshot) -> float | None:
        value = _num(stable(s))
        return None if value is None or ratio is None else value * ratio
    return get


# Each tier's charts, per kind of model: title, unit, the figure and the
# `thresholds` keys of its limits (max_ratio x stable's figure, and an
# absolute max in ms).
_TIER_CHARTS: dict[str, tuple[tuple[str, str, Callable[[Figures], Any], str, str | None], ...]] = {
    names.ModelKind.PREDICTIVE: (
        ("p95 latency", "ms", lambda f: f.p95_ms, "latency_p95_max_ratio",
         "latency_p95_max_ms"),
        ("Energy per inference", "J / inference", lambda f: f.jpi, "energy_max_ratio", None)),
    names.ModelKind.GENERATIVE: (
        ("TTFT p95", "ms", lambda f: f.ttft_p95_ms, "ttft_p95_max_ratio", "ttft_p95_max_ms"),
        ("TPOT p95", "ms", lambda f: f.tpot_p95_ms, "tpot_p95_max_ratio", "tpot_p95_max_ms"),
        ("Energy per output token", "J / token", lambda f: f.jpt,
         "energy_per_token_max_ratio", None)),
}


def _charts(history: Sequence[Timed], marks: Sequence[Mark],
            thresholds: Mapping[str, Any]) -> str:
    """One model's charts: p95 and J/inference (a generative model's TTFT and
    TPOT p95 and J/token) per tier where the snapshots have per-tier figures
    (pooled otherwise), each with the canary's limit; canary weight per tier;
    agreement. Energy's title names its sources."""
    sources = next((label for _, s in reversed(history) if (label := energy_sources(s))), "")
    kind = (names.ModelKind.GENERATIVE if history and history[-1][1].generative
            else names.ModelKind.PREDICTIVE)
    charts = []
    for tier in _tiers_in(history) or [None]:
        where = f" on {tier}" if tier else ""
        for title, unit, figure, ratio_key, max_key in _TIER_CHARTS[kind]:
            stable = _figure(tier, "stable", figure)
            lines = [("stable", STABLE, stable), ("canary", CANARY, _figure(tier, "canary", figure))]
            ratio, most = thresholds.get(ratio_key), thresholds.get(max_key) if max_key else None
            if ratio is not None:
                lines.append((f"limit ({ratio:g} x stable)", LIMIT, _limit(stable, ratio)))
            if most is not None:
                lines.append((f"max {most:g} ms", LIMIT, lambda s, v=most: v))
            if title.startswith("Energy") and sources:
                title = f"{title} ({sources})"
            charts.append(_chart(title + where, unit, history, lines, [0], marks))
    return "".join([
        *charts,
        _chart("Canary weight per tier", "%", history,
               [(tier, TIER_COLORS[tier], _weight(tier)) for tier in names.TIERS], [0, 100], marks,
               step=True),
        _chart("Agreement with stable", "fraction", history,
               [("agreement", CANARY, lambda s: s.figures.agreement)], [1], marks)])


def _per_tier_rows(summaries_groups: Sequence[Sequence[Timed]],
                   kind: str = names.ModelKind.PREDICTIVE) -> list[tuple]:
    """Per rollout, tier and version: the latest p95 and J/inference (a
    generative model's TTFT and TPOT p95 and J/token), the way operators
    publish edge/regional/datacenter figures; rollouts of models of `kind`."""
    rows = []
    for group in summaries_groups:
        if group[-1][1].generative != (kind == names.ModelKind.GENERATIVE):
            continue
        first = group[0][1]
        canary = _canary(group)
        source = next((label for _, s in reversed(group) if (label := energy_sources(s))), "-")
        for tier in _tiers_in(group):
            for who, version in (("stable", first.stable_version), ("canary", canary)):
                latest = _last_figures([getattr(s.figures.tiers[tier], who) for _, s in group
                                        if tier in s.figures.tiers])
                if kind == names.ModelKind.GENERATIVE:
                    figures = (latest.ttft_p95_ms, latest.tpot_p95_ms, _mj(latest.jpt))
                else:
                    figures = (latest.p95_ms, _mj(latest.jpi))
                rows.append((first.model, tier, f"v{version} ({who})", latest.requests,
                             *figures, source))
    return rows


def _mj(joules: Any) -> float | None:
    value = _num(joules)
    return None if value is None else value * 1000


BUILD_COLUMNS = ("tier", "version", "backend", "precision", "eval data", "samples",
                 "top-1 agreement", "accuracy", "accuracy drop", "gate")


def build_row(report: Mapping[str, Any]) -> tuple:
    """One build report (`build.json`) as a row of the builds table."""
    accuracy = report.get("accuracy") or {}
    evaluation = report.get("eval") or {}
    return (report.get("tier"), report.get("version"), report.get("backend"),
            report.get("precision"), evaluation.get("data"), evaluation.get("samples"),
            accuracy.get("top1_agreement"), accuracy.get("build_accuracy"),
            accuracy.get("accuracy_drop"), (report.get("gate") or {}).get("verdict"))


class _Html(str):
    """A table cell that is HTML already (escaped by whoever built it)."""


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An HTML table: numbers right-aligned, '-' for unknown, text escaped unless _Html."""
    def td(v: Any) -> str:
        if isinstance(v, _Html):
            return f"<td>{v}</td>"
        numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
        return f'<td class="n">{_e(tables.cell(v))}</td>' if numeric else f"<td>{_e(v)}</td>"
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(td(v) for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _badge(phase: str | None) -> _Html:
    return _Html(f'<span class="badge {_e(phase)}">{_e(tables.cell(phase))}</span>')


def _versions(stable: Any, canary: Any) -> str:
    return f"v{stable}" if canary is None else f"v{stable} → v{canary}"


def render_html(history: Sequence[Timed], title: str, extra: Mapping,
                thresholds: Mapping[str, Any] | None = None,
                builds: Sequence[Mapping[str, Any]] = ()) -> str:
    """The report as one self-contained HTML page. `thresholds`: the limits the
    charts draw (latency_p95_max_ratio, latency_p95_max_ms, energy_max_ratio;
    ttft_p95_* and tpot_p95_* likewise, energy_per_token_max_ratio);
    `builds`: the tier builds' reports (build.json), for their accuracy."""
    facts = [(k, json.dumps(_plain(v)) if isinstance(v, (Mapping, list, tuple)) else v)
             for k, v in extra.items()]
    groups = _rollouts(history)

    def rollout_row(group: Sequence[Timed]) -> tuple:
        r, final = _summary(group), _final(group)
        stable, canary = final.figures.stable, final.figures.canary
        figures = ((stable.ttft_p95_ms, canary.ttft_p95_ms, stable.tpot_p95_ms,
                    canary.tpot_p95_ms, stable.jpt, canary.jpt) if final.generative
                   else (stable.p95_ms, canary.p95_ms, stable.jpi, canary.jpi))
        return (r["model"], _versions(r["stable_version"], r["canary_version"]),
                _badge(r["outcome"]),
                r["duration_s"], f'{r["stages_reached"]}/{tables.cell(r["stages"])}',
                *figures, energy_sources(final) or "-", final.figures.agreement)

    rollouts = [rollout_row(g) for g in groups if not g[-1][1].generative]
    generative_rollouts = [rollout_row(g) for g in groups if g[-1][1].generative]
    marks = _decisions(history)
    decisions = [(t, s.model, _versions(s.stable_version, s.canary_version),
                  f"{s.stage_index + 1} {s.stage_name or ''}".strip(),
                  label, s.reason) for (t, s), label in marks]
    sections = [f"<h1>{_e(title)}</h1>", _table(["fact", "value"], facts) if facts else ""]
    if not history:
        sections.append("<p>No snapshots were recorded.</p>")
    else:
        head = ["model", "versions", "outcome", "duration (s)", "stages"]
        if rollouts or not generative_rollouts:
            sections += ["<h2>Rollouts</h2>", _table(
                [*head, "p95 stable (ms)", "p95 canary (ms)", "J/inf stable", "J/inf canary",
                 "energy source", "agreement"], rollouts)]
        if generative_rollouts:
            sections += ["<h2>Rollouts of generative models</h2>", _table(
                [*head, "TTFT p95 stable (ms)", "TTFT p95 canary (ms)", "TPOT p95 stable (ms)",
                 "TPOT p95 canary (ms)", "J/token stable", "J/token canary", "energy source",
                 "greedy agreement"], generative_rollouts)]
        per_tier = _per_tier_rows(groups)
        if per_tier:
            sections += ["<h2>Per tier: p95 and energy per inference</h2>", _table(
                ["model", "tier", "version", "requests", "p95 (ms)", "J/inference (mJ)",
                 "energy source"], per_tier)]
        per_tier = _per_tier_rows(groups, names.ModelKind.GENERATIVE)
        if per_tier:
            sections += ["<h2>Per tier: TTFT, TPOT and energy per output token</h2>", _table(
                ["model", "tier", "version", "requests", "TTFT p95 (ms)", "TPOT p95 (ms)",
                 "J/token (mJ)", "energy source"], per_tier)]
        for model in dict.fromkeys(s.model for _, s in history):
            sections += [f"<h2>{_e(model)}</h2>", _charts(
                [timed for timed in history if timed[1].model == model],
                [m for m in marks if m[0][1].model == model], thresholds or {})]
        sections += ["<h2>Decisions</h2>", _table(
            ["t (s)", "model", "versions", "stage", "action", "reason"], decisions)]
    if builds:
        sections += ["<h2>Tier builds: accuracy against the FP32 artifact</h2>",
                     _table(BUILD_COLUMNS, [build_row(b) for b in builds])]
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(sections) + "\n</body></html>\n")


def write_report(history: Sequence[Timed], out_dir: Path, title: str,
                 extra: Mapping, thresholds: Mapping[str, Any] | None = None,
                 builds: Sequence[Mapping[str, Any]] = ()) -> tuple[Path, Path]:
    """Write report.html and report.json into out_dir (created if missing); return both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    html_path, json_path = out_dir / "report.html", out_dir / "report.json"
    write_atomically(html_path, render_html(history, title, extra, thresholds, builds))
    write_atomically(json_path, json.dumps(report_json(history, title, extra, builds),
                                           indent=2) + "\n")
    return html_path, json_path
