"""The rollout report: well-formed inline SVG, escaped text, gaps for unknown
values, rollout summaries, atomic files, and the edge cases (no or one snapshot)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import xml.etree.ElementTree as ET

import pytest

from tiered.demo import report
from tiered.rollout import snapshot
from tiered.rollout.snapshot import from_history

STAGES = (("edge-5", {"edge": 5, "regional": 0, "datacenter": 0}),
          ("region-50", {"edge": 50, "regional": 50, "datacenter": 0}),
          ("all-100", {"edge": 100, "regional": 100, "datacenter": 100}))
NONE = {"edge": 0, "regional": 0, "datacenter": 0}
EVIL = "p95 <script>alert(1)</script> & \"worse\""


def snap(t, action="hold", reason="waiting for samples", *, stable=1, canary=2, stage=0,
         phase="Progressing", p95=(20.0, 21.0), jpi=(0.5, 0.45), agreement=0.99, verdict=None):
    return {"t": t, "model": "digits", "stable_version": stable, "canary_version": canary,
            "phase": phase, "stage_index": stage, "stage_name": STAGES[stage][0], "stages": 3,
            "weights": dict(STAGES[stage][1] if canary is not None else NONE),
            "action": action, "reason": reason, "canary_requests": int(t) * 10,
            "stable_requests": int(t) * 100, "p95_stable_ms": p95[0], "p95_canary_ms": p95[1],
            "jpi_stable": jpi[0], "jpi_canary": jpi[1], "agreement": agreement,
            "agreement_compared": int(t) * 5, "verdict": verdict}


def timed(records):
    """Records with their time, as the report takes them: (t, snapshot)."""
    return [(r["t"], snapshot.from_record(r)) for r in records]


def history():
    return timed(records())


def records():
    """v2 promoted through three stages, then v3 rolled back in its first stage."""
    return [
        snap(0, "start", "rollout of v2 started", p95=(None, None), jpi=(None, None),
             agreement=None),
        snap(30, p95=(20.0, None), jpi=(0.5, None), agreement=None),
        snap(60, verdict="Successful"),
        snap(90, "advance", "stage edge-5 passed: p95 and energy within bounds", stage=1,
             verdict="Successful"),
        snap(120, stage=1, p95=(20.5, 21.5)),
        snap(150, "advance", "stage region-50 passed", stage=2, verdict="Successful"),
        snap(180, stage=2),
        snap(210, "promote", "all stages passed", stable=2, canary=None, stage=2,
             phase="Promoted", p95=(21.0, None), jpi=(0.45, None), agreement=None),
        snap(240, stable=2, canary=None, phase="Promoted", p95=(21.0, None), jpi=(0.45, None),
             agreement=None),
        snap(270, "start", "rollout of v3 started", stable=2, canary=3, p95=(21.0, None),
             jpi=(0.45, None), agreement=None),
        snap(300, stable=2, canary=3, p95=(21.0, 35.0), jpi=(0.45, 0.7), agreement=0.9,
             verdict="Failed"),
        snap(330, "rollback", EVIL, stable=2, canary=3, phase="RolledBack", p95=(21.0, 36.0),
             jpi=(0.45, 0.71), agreement=0.89, verdict="Failed"),
    ]


def svgs(page):
    return [ET.fromstring(s) for s in re.findall(r"<svg\b.*?</svg>", page, re.DOTALL)]


def assert_finite_geometry(page):
    """Every coordinate is a finite number and no 'None' reached the SVG."""
    for svg in svgs(page):
        for el in svg.iter():
            for name in ("x", "y", "x1", "y1", "x2", "y2"):
                if name in el.attrib:
                    assert math.isfinite(float(el.get(name))), (el.tag, el.attrib)
            if el.tag == "path":
                assert re.fullmatch(r"([ML][\d.]+,[\d.]+(h0)?|H[\d.]+V[\d.]+)*", el.get("d"))
            assert "None" not in (el.text or "")


def test_every_chart_is_well_formed_svg_with_axes_legend_and_markers():
    page = report.render_html(history(), "Rollout digits", {"machine": "h200"})
    charts = svgs(page)
    assert len(charts) == 4
    for svg in charts:
        texts = ["".join(t.itertext()) for t in svg.iter("text")]
        assert "time (s)" in texts
        assert "advance to stage 2" in texts and "advance to stage 3" in texts
        assert "promote v2" in texts and "rollback v3" in texts and "start v3" in texts
        assert any(p.get("d") for p in svg.iter("path"))
    legend = ["".join(t.itertext()) for t in charts[2].iter("text")]
    assert {"edge", "regional", "datacenter"} <= set(legend)


def test_page_is_self_contained():
    page = report.render_html(history(), "Rollout digits", {})
    assert "<script" not in page
    assert "http://" not in page and "https://" not in page
    assert "<style>" in page


def test_reasons_and_labels_are_escaped():
    extra = {"command": "tiered rollout <b>digits</b>"}
    page = report.render_html(history(), "digits <v3>", extra)
    assert "<script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &quot;worse&quot;" in page
    assert "tiered rollout &lt;b&gt;digits&lt;/b&gt;" in page
    assert "digits &lt;v3&gt;" in page
    assert "stage edge-5 passed: p95 and energy within bounds" in page


def test_unknown_values_leave_gaps_not_zeros_or_nan():
    page = report.render_html(history(), "r", {})
    assert_finite_geometry(page)
    canary_p95 = list(svgs(page)[0].iter("path"))[1].get("d")
    # Canary p95 is unknown at 0-30 s and from the promotion of v2 until v3 has
    # samples: two separate runs, each begun by a move.
    assert canary_p95.count("M") == 2
    assert f",{report.H - report.BOTTOM:.1f}" not in canary_p95  # never drawn at zero
    assert canary_p95.startswith("M")


def test_rollouts_summarise_outcomes_decisions_and_final_numbers():
    out = report.report_json(history(), "r", {"machine": "h200"})
    promoted, rolled_back = out["rollouts"]
    assert (promoted["stable_version"], promoted["canary_version"]) == (1, 2)
    assert promoted["outcome"] == "Promoted"
    assert promoted["duration_s"] == 210
    assert promoted["stages_reached"] == 3
    assert [d["action"] for d in promoted["decisions"]] == ["start", "advance", "advance",
                                                            "promote"]
    assert promoted["final"]["p95_canary_ms"] == 21.0
    assert (rolled_back["stable_version"], rolled_back["canary_version"]) == (2, 3)
    assert rolled_back["outcome"] == "RolledBack"
    assert rolled_back["stages_reached"] == 1
    assert rolled_back["decisions"][-1] == {"t": 330, "action": "rollback",
                                            "label": "rollback v3", "reason": EVIL}
    assert rolled_back["final"]["agreement"] == 0.89
    assert rolled_back["final"]["verdict"] == "Failed"
    assert out["extra"] == {"machine": "h200"} and len(out["history"]) == 12


def test_write_report_writes_both_files_and_json_round_trips(tmp_path):
    out_dir = tmp_path / "runs" / "r1"
    extra = {"machine": "h200", "out": tmp_path, "nan": float("nan")}
    html_path, json_path = report.write_report(history(), out_dir, "r", extra)
    assert (html_path, json_path) == (out_dir / "report.html", out_dir / "report.json")
    assert html_path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    loaded = json.loads(json_path.read_text(encoding="utf-8"))
    assert loaded == report.report_json(history(), "r", extra)
    assert loaded["extra"] == {"machine": "h200", "out": str(tmp_path), "nan": None}
    assert sorted(p.name for p in out_dir.iterdir()) == ["report.html", "report.json"]


@pytest.mark.parametrize("points", [[], timed([snap(0, "start", "go")])],
                         ids=["empty", "single"])
def test_empty_and_single_snapshot_histories_render(points, tmp_path):
    page = report.render_html(points, "r", {})
    assert_finite_geometry(page)
    charts = svgs(page)
    assert len(charts) == (4 if points else 0)
    if points:  # one point is a dot: a move and a zero-length segment
        assert re.fullmatch(r"M[\d.]+,[\d.]+h0", next(charts[0].iter("path")).get("d"))
    out = report.report_json(points, "r", {})
    assert len(out["rollouts"]) == len(points)
    report.write_report(points, tmp_path, "r", {})
    assert json.loads((tmp_path / "report.json").read_text())["history"] == out["history"]


def test_all_unknown_and_constant_series_render_without_division_by_zero():
    points = timed([snap(t, p95=(None, None), jpi=(0.5, 0.5), agreement=1.0)
                    for t in (0, 10, 20)])
    page = report.render_html(points, "r", {})
    p95, _, _, agreement = svgs(page)
    assert "no data" in ["".join(t.itertext()) for t in p95.iter("text")]
    assert all(not p.get("d") for p in p95.iter("path"))
    assert_finite_geometry(page)
    assert agreement.find(".//path").get("d").count("M") == 1


def test_energy_figures_name_their_source():
    modeled = timed([{**s, "energy_source_stable": "model", "energy_source_canary": "model"}
                     for s in records()])
    page = report.render_html(modeled, "t", {})
    assert "Energy per inference (model, estimate)" in page
    assert "<td>model, estimate</td>" in page
    final = report.report_json(modeled, "t", {})["rollouts"][0]["final"]
    assert (final["energy_source_stable"], final["energy_source_canary"]) == ("model", "model")
    plain = report.render_html(history(), "t", {})  # a history that names no source
    assert "Energy per inference</text>" in plain and "estimate" not in plain


def test_a_retried_rollout_is_a_rollout_of_its_own():
    """v2 rolled back, retried and aborted, retried and promoted: three rollouts,
    each with its own outcome and duration; nothing runs on to the retry."""
    points = timed([snap(0, "start", "rollout of v2"), snap(30),
                    snap(60, "rollback", "failed", phase="RolledBack"),
                    snap(100, "retry", "retrying version 2 by hand", canary=None),
                    snap(110, "start", "rollout of v2"), snap(130),
                    snap(150, "abort", "aborted by hand", phase="Aborted"),
                    snap(200, "retry", "retrying version 2 by hand", canary=None),
                    snap(210, "start", "rollout of v2"),
                    snap(240, "advance", "on to stage 2", stage=1),
                    snap(300, "promote", "promoted", stable=2, canary=None, stage=1,
                         phase="Promoted")])
    rollouts = report.report_json(points, "r", {})["rollouts"]
    assert [(r["stable_version"], r["canary_version"], r["outcome"], r["started_s"],
             r["duration_s"]) for r in rollouts] == [(1, 2, "RolledBack", 0, 60),
                                                      (1, 2, "Aborted", 100, 50),
                                                      (1, 2, "Promoted", 200, 100)]
    assert [[d["label"] for d in r["decisions"]] for r in rollouts] == [
        ["start v2", "rollback v2"], ["retry v2", "start v2", "abort v2"],
        ["retry v2", "start v2", "advance to stage 2", "promote v2"]]
    page = report.render_html(points, "r", {})
    assert page.count('class="badge Progressing"') == 0


def test_a_new_version_applied_after_a_retry_starts_its_own_rollout():
    points = timed([snap(0, "start", "rollout of v2"),
                    snap(60, "rollback", "failed", phase="RolledBack"),
                    snap(100, "retry", "retrying version 2 by hand", canary=None),
                    snap(110, "start", "rollout of v3", canary=3),
                    snap(200, "promote", "promoted", stable=3, canary=None, phase="Promoted")])
    rollouts = report.report_json(points, "r", {})["rollouts"]
    assert [(r["canary_version"], r["outcome"]) for r in rollouts] == [
        (2, "RolledBack"), (None, "Progressing"), (3, "Promoted")]


# --- what feeds the report, on either backend ----------------------------------

SHAS = {v: f"{v:x}" * 64 for v in (1, 2)}
DOCUMENT = {"name": "digits", "artifact": {"uri": "/m/v2.onnx", "sha256": SHAS[2]},
            "tiers": {"edge": {}},
            "rollout": {"stages": [{"name": "edge", "weights": {"edge": 10}}]}}


def retried_twice(controller, verb):
    """v2 over v1: rolled back by the controller, retried by hand, aborted by
    hand, retried, promoted; `controller(rollout, action, reason, t)` records
    what a controller pass would, `verb(name, t)` runs a manual verb."""
    from tiered.rollout import engine
    from tiered.rollout.spec import load_tiered_model

    spec = load_tiered_model(DOCUMENT)
    started = engine.start(spec, 1, 2, 10.0)
    controller(started, "start", "rolling out version 2", 10.0)
    controller(dataclasses.replace(started, phase="RolledBack"), "rollback", "failed", 70.0)
    verb("retry", 100.0)
    controller(engine.start(spec, 1, 2, 110.0), "start", "rolling out version 2", 110.0)
    verb("abort", 150.0)
    verb("retry", 200.0)
    again = engine.start(spec, 1, 2, 210.0)
    controller(again, "start", "rolling out version 2", 210.0)
    controller(engine.promote(spec, again, 310.0, full=True).status, "promote", "passed", 310.0)


EXPECTED = [(1, 2, "RolledBack", 0.0, 60.0), (1, 2, "Aborted", 90.0, 50.0),
            (1, 2, "Promoted", 190.0, 110.0)]


def outcomes(data):
    return [(r["stable_version"], r["canary_version"], r["outcome"], r["started_s"],
             r["duration_s"]) for r in data["rollouts"]]


def test_the_local_report_of_retried_rollouts(tmp_path):
    """`tiered rollout report` on a local store written as the controller and
    the verbs write it."""
    from tiered.cli import main
    from tiered.controller import verbs
    from tiered.controller.plan import make_snapshot
    from tiered.controller.reconciler import decode_status
    from tiered.controller.store import StateStore
    from tiered.rollout.status import ArtifactVersion, TieredModelStatus
    from tiered.rollout.wire import to_plain

    artifacts = tuple(ArtifactVersion(v, f"/m/v{v}.onnx", SHAS[v]) for v in (1, 2))
    with StateStore(tmp_path / "state" / "state.db") as store:
        record = store.apply("digits", DOCUMENT)
        spec = verbs.spec_of(record)

        def controller(rollout, action, reason, t):
            record = store.get("digits")
            status = TieredModelStatus(rollout=dataclasses.replace(rollout, message=reason),
                                       artifacts=artifacts,
                                       observed_generation=record.generation)
            store.write_status("digits", record.revision, status=to_plain(status))
            store.record("digits", snapshot.to_record(make_snapshot(
                spec, status.rollout, action, reason)), t)

        retried_twice(controller, lambda name, t: verbs.rollout_verb(
            store, "digits", name, now=lambda: t))
        assert decode_status("digits", store.get("digits").status).rollout.phase == "Promoted"
    assert main(["rollout", "report", "digits", "--state", str(tmp_path / "state"),
                 "--out", str(tmp_path / "report")]) == 0
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert outcomes(data) == EXPECTED


def test_the_kubernetes_report_of_retried_rollouts_reads_the_same():
    """On Kubernetes the report reads the status's steps: the verbs record
    theirs there too, so the same rollouts come out."""
    from tiered.controller import verbs
    from tiered.controller.plan import _step
    from tiered.rollout import engine
    from tiered.rollout.spec import load_tiered_model
    from tiered.rollout.status import TieredModelStatus

    spec = load_tiered_model(DOCUMENT)
    status = TieredModelStatus()

    def controller(rollout, action, reason, t):
        nonlocal status
        rollout = dataclasses.replace(rollout, message=reason)
        status = dataclasses.replace(status, rollout=rollout,
                                     history=(*status.history, _step(spec, rollout, action,
                                                                     reason, t)))

    def verb(name, t):
        nonlocal status
        extra = {"target": 2} if name == "retry" else {}
        decision = getattr(engine, name)(spec, status.rollout, t, **extra)
        status = verbs.with_decision(status, decision, spec, t)

    retried_twice(controller, verb)
    history = from_history(spec, status)
    t0 = history[0][0]
    data = report.report_json([(t - t0, snap) for t, snap in history], "r", {})
    assert outcomes(data) == EXPECTED
