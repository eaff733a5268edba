"""A build's report (DIR/<model>/<version>/build.json): what was built from
what, how it compares with the FP32 artifact, the gate's verdict with its
numbers, timings, engine and library versions; and the key figures of a
report as the agent shows them.

Composing a report is pure apart from hashing the two files it names; it
never judges (that is the gate's job) and never writes into a repository.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tiered import names
from tiered.engines import Engine
from tiered.engines.build import gate, install, samples, spec
from tiered.errors import ConfigError
from tiered.files import sha256_file, sha256_tree

REPORT_FILE = "build.json"


@dataclass(frozen=True)
class BuildOutcome:
    report: dict[str, Any]  # also DIR/<model>/<version>/build.json when installed
    decision: gate.GateDecision
    installed: Path | None  # the version directory, when written


# What the caller records under an installed version's report key "verdict",
# given the gate's decision and the version directory it goes to. The caller
# owns the verdict's schema (tiered.protocol.verdict, which engines may not
# import); the build asks for it so that build.json holds it from the first
# moment an agent can see the version.
VerdictOf = Callable[[gate.GateDecision, Path], Mapping[str, Any]]


def _data_notes(evaluation: samples.Samples, calibration: samples.Samples | None,
                fp16_on_cpu: bool) -> list[str]:
    """What a reader of the report must know of the data and the device."""
    notes = []
    if evaluation.origin == "random":
        notes.append("eval on random inputs: top-1 agreement and errors only, no accuracy; "
                     "pass --eval with real data for a meaningful gate")
    if calibration is not None and calibration.origin == "random":
        notes.append("INT8 ranges calibrated on random inputs; pass --calibration with real data")
    if fp16_on_cpu:
        notes.append("FP16 measured on CPU: ONNX Runtime runs FP16 nodes it lacks CPU kernels "
                     "for through inserted casts, so this latency says nothing of GPU FP16")
    return notes


def compose(
    request: spec.BuildRequest, tier: str, settings: spec.BuildSettings,
    engine_settings: Mapping[str, Any], artifact: Path, built: Engine,
    evaluation: samples.Samples, calibration: samples.Samples | None,
    calibrator: Mapping[str, Any], agreement: gate.Agreement, decision: gate.GateDecision,
    latency: Mapping[str, Sequence[gate.LatencySummary]], now: datetime.datetime,
) -> dict[str, Any]:
    """The report of one build, whatever the gate decided."""
    source_bytes = request.source.stat().st_size
    artifact_bytes = artifact.stat().st_size
    notes = _data_notes(evaluation, calibration,
                        settings.precision == names.Precision.FP16 and built.device == "cpu")
    return {
        "model": request.model,
        "version": request.version,
        "tier": tier,
        "backend": settings.backend,
        "precision": settings.precision,
        "source": {"path": str(request.source), "sha256": sha256_file(request.source),
                   "size_bytes": source_bytes},
        "artifact": {"file": install.MODEL_FILE, "sha256": sha256_file(artifact),
                     "size_bytes": artifact_bytes,
                     "size_vs_source": round(artifact_bytes / source_bytes, 4)},
        "calibration": None if calibration is None else {
            **calibrator, "samples": calibration.count, "data": calibration.origin,
            "per_channel": settings.per_channel,
            "format": "QDQ", "activations": "int8", "weights": "int8",
        },
        "eval": {"data": evaluation.origin, "samples": evaluation.count,
                 "labels": evaluation.labels is not None},
        "accuracy": {**finite(asdict(agreement)),
                     "accuracy_drop": finite(agreement.accuracy_drop)},
        "gate": {"verdict": decision.verdict, "accepted": decision.accepted,
                 "reason": decision.reason, "min_agreement": settings.min_agreement,
                 "min_eval_samples": settings.min_eval_samples,
                 "max_accuracy_drop": settings.max_accuracy_drop,
                 "allow_accuracy_drop": request.allow_accuracy_drop},
        "latency": {name: [finite(asdict(s)) for s in rows] for name, rows in latency.items()},
        "engine": {**built.describe(), "device": built.device,
                   "settings": finite(dict(engine_settings))},
        "versions": library_versions(),
        "created": now.isoformat(),
        "notes": notes,
    }


def compose_step(
    source: Path, artifact: Path, settings: spec.BuildSettings,
    kept_fp32: str | None, calibrator: Mapping[str, Any], built: Engine,
    engine_settings: Mapping[str, Any],
) -> dict[str, Any]:
    """What one step of an ensemble was built as (its part of the ensemble's report)."""
    source_bytes, artifact_bytes = source.stat().st_size, artifact.stat().st_size
    return {
        "backend": settings.backend,
        "precision": settings.precision,
        "kept_fp32": kept_fp32,
        "source": {"path": str(source), "sha256": sha256_file(source),
                   "size_bytes": source_bytes},
        "artifact": {"file": install.MODEL_FILE, "sha256": sha256_file(artifact),
                     "size_bytes": artifact_bytes,
                     "size_vs_source": round(artifact_bytes / source_bytes, 4)},
        "calibration": {**calibrator, "per_channel": settings.per_channel, "format": "QDQ",
                        "activations": "int8", "weights": "int8"} if calibrator else None,
        "engine": {**built.describe(), "device": built.device,
                   "settings": finite(dict(engine_settings))},
    }


def compose_ensemble(
    request: spec.BuildRequest, tier: str, settings: spec.BuildSettings,
    steps: Mapping[str, Mapping[str, Any]], evaluation: samples.Samples,
    calibration: samples.Samples | None, agreements: Sequence[gate.Agreement],
    decision: gate.GateDecision, latency: Mapping[str, Sequence[gate.LatencySummary]],
    now: datetime.datetime,
) -> dict[str, Any]:
    """The report of one ensemble build, whatever the gate decided: `accuracy`
    holds the figures of the output that decided the verdict (the gated one
    of lowest agreement) and, under `outputs`, every output's."""
    assert request.ensemble is not None
    chain = request.ensemble
    gated = [a for a in agreements if a.top1_agreement is not None]
    deciding = min(gated, key=lambda a: a.top1_agreement or 0.0) if gated else agreements[0]
    notes = _data_notes(evaluation, calibration, any(
        s["precision"] == names.Precision.FP16 and s["engine"]["device"] == "cpu"
        for s in steps.values()))
    kept = [f"{model}: {s['kept_fp32']}" for model, s in steps.items() if s["kept_fp32"]]
    if kept:
        notes.append("steps not lowered: " + "; ".join(kept))
    return {
        "model": request.model,
        "version": request.version,
        "tier": tier,
        "backend": settings.backend,
        "precision": settings.precision,
        "kind": "ensemble",
        "source": {"path": str(request.source), "sha256": sha256_tree(request.source),
                   "config": chain.config_file},
        "steps": {model: {**step, "version": request.version} for model, step in steps.items()},
        "calibration": None if calibration is None else {
            "samples": calibration.count, "data": calibration.origin,
            "method": "the FP32 chain's tensors at each INT8 step's inputs",
        },
        "eval": {"data": evaluation.origin, "samples": evaluation.count,
                 "labels": evaluation.labels is not None, "outputs": list(chain.outputs)},
        "accuracy": {**finite(asdict(deciding)),
                     "accuracy_drop": finite(deciding.accuracy_drop),
                     "outputs": [{**finite(asdict(a)), "accuracy_drop": finite(a.accuracy_drop)}
                                 for a in agreements]},
        "gate": {"verdict": decision.verdict, "accepted": decision.accepted,
                 "reason": decision.reason, "min_agreement": settings.min_agreement,
                 "min_eval_samples": settings.min_eval_samples,
                 "max_accuracy_drop": settings.max_accuracy_drop,
                 "allow_accuracy_drop": request.allow_accuracy_drop,
                 "method": "the FP32 chain and the built chain on the same inputs; the "
                           "ensemble's outputs compared (argmax of floating-point outputs, "
                           "equality of integer ones)"},
        "latency": {name: [finite(asdict(s)) for s in rows] for name, rows in latency.items()},
        "versions": library_versions(),
        "created": now.isoformat(),
        "notes": notes,
    }


def compose_generative(
    request: spec.BuildRequest, tier: str, settings: spec.GenerativeBuildSettings,
    backend: str, precision: str, built_dir: Path, engine: Mapping[str, str],
    engine_settings: Mapping[str, Any], evaluation: Mapping[str, Any],
    agreement: gate.GenerationAgreement, decision: gate.GateDecision,
    latency: Mapping[str, Mapping[str, Any]], notes: Sequence[str], now: datetime.datetime,
) -> dict[str, Any]:
    """The report of one build of a checkpoint artifact, whatever the gate
    decided. sha256 of a directory is `tiered.files.sha256_tree`'s."""
    source_bytes = _tree_bytes(request.source)
    built_bytes = _tree_bytes(built_dir)
    return {
        "model": request.model,
        "version": request.version,
        "tier": tier,
        "backend": backend,
        "precision": precision,
        "requested_precision": settings.precision,
        "source": {"path": str(request.source), "kind": "checkpoint",
                   "sha256": sha256_tree(request.source), "size_bytes": source_bytes},
        "artifact": {"files": sorted(p.name for p in built_dir.iterdir()),
                     "sha256": sha256_tree(built_dir), "size_bytes": built_bytes,
                     "size_vs_source": round(built_bytes / source_bytes, 4)},
        "eval": {"data": "prompts", **evaluation},
        "accuracy": finite(asdict(agreement)),
        "gate": {"verdict": decision.verdict, "accepted": decision.accepted,
                 "reason": decision.reason,
                 "method": "greedy generation, FP32 reference (torch engine, CPU) vs build; "
                           "token agreement teacher-forced on the reference's tokens",
                 "first_tokens": settings.first_tokens,
                 "min_first_tokens_match": settings.min_first_tokens_match,
                 "min_token_agreement": settings.min_token_agreement,
                 "min_eval_prompts": settings.min_eval_prompts,
                 "allow_accuracy_drop": request.allow_accuracy_drop},
        "latency": finite(dict(latency)),
        "engine": {**engine, "settings": finite(dict(engine_settings))},
        "versions": library_versions(),
        "created": now.isoformat(),
        "notes": list(notes),
    }


def _tree_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def library_versions() -> dict[str, str | None]:
    found = {}
    for name, dists in (("onnxruntime", ("onnxruntime", "onnxruntime-gpu")),
                        ("onnx", ("onnx",)), ("numpy", ("numpy",)), ("torch", ("torch",)),
                        ("onnxruntime_genai", ("onnxruntime-genai", "onnxruntime-genai-cuda")),
                        ("tiered", ("tiered",))):
        found[name] = None
        for dist in dists:
            try:
                found[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def version_facts(report: Mapping[str, Any]) -> dict[str, str]:
    """A build report's key figures, as the agent shows them in ModelConfig parameters."""
    accuracy = report.get("accuracy") or {}
    facts = {
        "build_tier": report.get("tier"),
        "build_precision": report.get("precision"),
        "build_top1_agreement": _fact(accuracy.get("top1_agreement")),
        "build_token_agreement": _fact(accuracy.get("token_agreement")),
        "build_first_tokens_match": _fact(accuracy.get("first_tokens_match")),
        "build_max_abs_error": _fact(accuracy.get("max_abs_error")),
        "build_visual_cosine_mean": _fact(accuracy.get("cosine_mean")),
        "build_visual_cosine_p1": _fact(accuracy.get("cosine_p1")),
        "build_answer_match": _fact(accuracy.get("answer_match")),
        "build_accuracy": _fact(accuracy.get("build_accuracy")),
        "build_eval_data": (report.get("eval") or {}).get("data"),
        "build_gate": (report.get("gate") or {}).get("verdict"),
        "build_source_sha256": (report.get("source") or {}).get("sha256"),
        "build_created": report.get("created"),
    }
    return {key: str(value) for key, value in facts.items() if value is not None}


def _fact(value: Any) -> str | None:
    return None if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


def read_report(version_dir: Path) -> dict[str, Any] | None:
    """A version's build.json, or None where it has none."""
    path = version_dir / REPORT_FILE
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: unreadable build report: {error}") from error
    if not isinstance(report, dict):
        raise ConfigError(f"{path}: a build report is a JSON object")
    return report


def write_report(version_dir: Path, report: Mapping[str, Any]) -> None:
    """build.json into a version directory that is still being staged."""
    (version_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
