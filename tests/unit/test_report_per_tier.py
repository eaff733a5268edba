"""The rollout report's per-tier view: a p95 and a J/inference chart per
tier with the canary's limit drawn, energy with its source, the per-tier
table, the builds' accuracy; and the status history of either backend as
report snapshots."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from tiered.controller import verbs
from tiered.demo import report
from tiered.rollout import snapshot
from tiered.rollout.snapshot import from_history
from tiered.rollout.spec import load_tiered_model
from tiered.rollout.status import HistoryEntry, TieredModelStatus

SPEC = load_tiered_model({
    "name": "digits", "artifact": {"uri": "/m.onnx", "sha256": "ab" * 32},
    "tiers": {"edge": {}, "regional": {}},
    "rollout": {"stages": [{"name": "edge", "weights": {"edge": 10}},
                           {"name": "wide", "weights": {"edge": 50, "regional": 50}}],
                "analysis": {"latency_p95": {"max_ratio": 1.2, "max_ms": 40}}}})


def snap(t, action="hold", **numbers):
    return t, snapshot.from_record({
        "model": "digits", "stable_version": 1, "canary_version": 2,
        "phase": "Progressing", "stage_index": 1, "stage_name": "wide", "stages": 2,
        "weights": {"edge": 50, "regional": 50}, "action": action, "reason": "r",
        "energy_source_stable": "rapl", "energy_source_canary": "rapl",
        "jpi_stable": 0.002, "jpi_canary": 0.0021, **numbers})


PER_TIER = [snap(t, **{f"{tier}.{k}": v * (2 if tier == "regional" else 1) for tier in
                       ("edge", "regional") for k, v in (
                           ("stable_requests", 100 + t), ("canary_requests", 10 + t),
                           ("p95_stable_ms", 10.0), ("p95_canary_ms", 11.0),
                           ("jpi_stable", 0.002), ("jpi_canary", 0.0021))})
            for t in (0, 10, 20)]
BUILD = {"tier": "edge", "version": 2, "backend": "onnxruntime", "precision": "int8",
         "eval": {"data": "file", "samples": 360},
         "accuracy": {"top1_agreement": 0.994, "build_accuracy": 0.95, "accuracy_drop": 0.003},
         "gate": {"verdict": "accepted"}}
THRESHOLDS = verbs.report_thresholds(SPEC)


def titles(page):
    return [ET.fromstring(s).find("title").text
            for s in re.findall(r"<svg\b.*?</svg>", page, re.DOTALL)]


def test_each_tier_gets_its_own_latency_and_energy_chart_with_the_limit_drawn():
    page = report.render_html(PER_TIER, "t", {}, THRESHOLDS, [BUILD])
    assert titles(page) == ["p95 latency on edge", "Energy per inference (rapl) on edge",
                            "p95 latency on regional",
                            "Energy per inference (rapl) on regional",
                            "Canary weight per tier", "Agreement with stable"]
    assert THRESHOLDS == {"latency_p95_max_ratio": 1.2, "latency_p95_max_ms": 40.0,
                          "energy_max_ratio": 1.1}
    assert "limit (1.2 x stable)" in page and "max 40 ms" in page
    assert "limit (1.1 x stable)" in page and 'stroke-dasharray="6 4"' in page


def test_the_per_tier_table_and_the_builds_accuracy():
    page = report.render_html(PER_TIER, "t", {}, THRESHOLDS, [BUILD])
    assert "Per tier: p95 and energy per inference" in page
    # regional's canary: its latest p95 and J/inference (in mJ), with the source
    assert re.search(r"<td>regional</td><td>v2 \(canary\)</td><td class=\"n\">60</td>"
                     r"<td class=\"n\">22.00</td><td class=\"n\">4.20\d*</td><td>rapl</td>",
                     page), page
    assert "Tier builds: accuracy against the FP32 artifact" in page
    assert "<td>int8</td>" in page and "0.9940" in page and "<td>accepted</td>" in page
    assert report.report_json(PER_TIER, "t", {}, [BUILD])["builds"][0]["tier"] == "edge"


def test_the_status_history_reads_as_report_snapshots():
    status = TieredModelStatus(history=(
        HistoryEntry(t=5.0, action="start", reason="go", phase="Progressing",
                     stable_version=1, canary_version=2, stage="2/2 wide",
                     numbers={"edge.p95_canary_ms": 11.0, "jpi_stable": 0.002},
                     sources={"jpi_stable": "nvml"}),
        HistoryEntry(t=9.0, action="promote", reason="done", phase="Promoted",
                     stable_version=2)))
    (_, first), (_, last) = from_history(SPEC, status)
    assert (first.stage_index, first.stage_name, first.weights) == (
        1, "wide", {"edge": 50.0, "regional": 50.0})
    assert first.figures.tiers["edge"].canary.p95_ms == 11.0
    assert first.figures.stable.energy_source == "nvml"
    assert last.weights == {"edge": 0.0, "regional": 0.0} and last.action == "promote"
    page = report.render_html(from_history(SPEC, status), "t", {}, THRESHOLDS)
    assert "p95 latency on edge" in titles(page)
