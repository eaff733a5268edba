"""Tier builds: make a tier's version of one FP32 ONNX artifact, measure it
against that artifact, judge it, and place it into a model repository.

    tiered build ARTIFACT.onnx --tier edge --repository DIR --model NAME --version V

edge: INT8 static QDQ on ONNX Runtime's CPU provider; regional: FP16 weights
and compute with FP32 inputs/outputs; datacenter: the FP32 artifact, which the
torch engine converts at load. The tier profile's `build:` mapping chooses the
defaults (`BuildSettings`), command-line flags override them.

The pure parts (metrics, the accuracy gate, latency summaries, the choice of
settings, file digests) are plain functions; `build` is the adapter that runs
engines and moves files. A build happens in a temporary directory and moves
into the repository only when the gate accepts it, so a failed or interrupted
build never leaves a half-written version behind (at most, if killed while
copying, a hidden staging directory that the agent ignores).

This module must never import tiered.agent or tiered.protocol (engines sit
below them): it writes the repository's on-disk layout (DIR/<model>/config.yaml,
DIR/<model>/<version>/model.onnx) as a file format, not through agent code.
It must never pass a rejected build into the repository either.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tiered.engines import BACKENDS, Engine, TensorSpec, open_engine, quantize
from tiered.errors import ConfigError, EngineError, TieredError
from tiered.files import sha256_file, write_atomically
from tiered.profiles import TierProfile
from tiered.settings import load_dataclass, read_yaml

MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.yaml"
REPORT_FILE = "build.json"
LABEL_KEYS = ("label", "labels")  # optional keys of an eval npz holding integer class labels

# What each backend can be built as. ONNX Runtime versions carry their
# precision in the file; torch takes FP32 ONNX and converts at load.
PRECISIONS: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("int8", "fp16", "fp32"),
    "torch": ("fp32", "fp16", "bf16", "fp8"),
}


@dataclass(frozen=True)
class BuildSettings:
    """How a tier builds a version (profile `build:` mapping, overridden by flags)."""

    backend: str = "onnxruntime"
    precision: str = "fp32"
    calibration_method: str = "minmax"  # one of quantize.CALIBRATION_METHODS (INT8 only)
    calibration_samples: int = 256  # at most this many calibration samples are used
    per_channel: bool = True  # INT8 weight scales per output channel
    eval_samples: int = 2000  # at most this many eval samples are compared
    random_samples: int = 256  # eval/calibration samples drawn when no data is given
    min_eval_samples: int = 100  # fewer compared samples make the gate inconclusive
    min_agreement: float = 0.99  # top-1 agreement with FP32 the gate asks for
    max_accuracy_drop: float | None = None  # also gate on labelled accuracy (points / 100)
    latency_batch_sizes: tuple[int, ...] = (1, 32)
    latency_runs: int = 20  # timed runs per batch size, after two warm-up runs
    max_batch_size: int = 32  # written into a config.yaml the build creates
    engine: Mapping[str, Any] = field(default_factory=dict)  # over the profile's backend settings
    seed: int = 0  # for random data

    def __post_init__(self) -> None:
        if self.backend not in PRECISIONS:
            raise ConfigError(f"backend: {self.backend!r} is not one of {', '.join(PRECISIONS)}")
        if self.precision not in PRECISIONS[self.backend]:
            raise ConfigError(
                f"precision: {self.precision!r} cannot be built for backend {self.backend} "
                f"(one of {', '.join(PRECISIONS[self.backend])})"
            )
        if self.calibration_method not in quantize.CALIBRATION_METHODS:
            raise ConfigError(
                f"calibration_method: {self.calibration_method!r} is not one of "
                f"{', '.join(quantize.CALIBRATION_METHODS)}"
            )
        if not 0.0 <= self.min_agreement <= 1.0:
            raise ConfigError(f"min_agreement: must be within 0..1, got {self.min_agreement}")
        if self.max_accuracy_drop is not None and not 0.0 <= self.max_accuracy_drop <= 1.0:
            raise ConfigError(
                f"max_accuracy_drop: must be within 0..1, got {self.max_accuracy_drop}"
            )
        for name in ("calibration_samples", "eval_samples", "random_samples",
                     "min_eval_samples", "latency_runs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_batch_size < 0:
            raise ConfigError(f"max_batch_size: must be >= 0, got {self.max_batch_size}")
        if not self.latency_batch_sizes or any(b < 1 for b in self.latency_batch_sizes):
            raise ConfigError("latency_batch_sizes: give one or more sizes >= 1")


def choose_settings(
    profile: TierProfile, overrides: Mapping[str, Any], where: str = "build"
) -> BuildSettings:
    """The profile's `build:` mapping with the flags that were given laid over it.

    `overrides` holds BuildSettings keys; None means "flag not given".
    """
    given = {key: value for key, value in overrides.items() if value is not None}
    return load_dataclass(BuildSettings, {**profile.build, **given}, where)


# -- pure parts: digests, metrics, gate, latency ----------------------------------------------


MAX_ARTIFACT_BYTES = 4 << 30  # an artifact fetched over HTTP may be at most this large


def fetch_artifact(uri: str, sha256: str | None, work: Path, name: str = "artifact.onnx"
                   ) -> Path:
    """The artifact as a local file: a path as it is, an http(s) URI downloaded
    into `work`; checked against `sha256` when one is given, so that nothing
    but the pinned bytes is ever built."""
    import urllib.parse
    import urllib.request

    scheme = urllib.parse.urlparse(uri).scheme
    if scheme in ("http", "https"):
        path = work / name
        try:
            with urllib.request.urlopen(uri, timeout=60) as reply, path.open("wb") as out:
                copied = 0
                while block := reply.read(1 << 20):
                    copied += len(block)
                    if copied > MAX_ARTIFACT_BYTES:
                        raise ConfigError(f"artifact: {uri} is larger than "
                                          f"{MAX_ARTIFACT_BYTES >> 30} GiB")
                    out.write(block)
        except OSError as error:
            raise ConfigError(f"artifact: cannot fetch {uri}: {error}") from error
    elif scheme in ("", "file"):
        path = Path(urllib.parse.urlparse(uri).path if scheme else uri)
        if not path.is_file():
            raise ConfigError(f"artifact: {path} is not a file")
    else:
        raise ConfigError(f"artifact: unsupported URI scheme {scheme!r} in {uri} "
                          "(a path, file://, http:// or https://)")
    if sha256 is not None:
        digest = sha256_file(path)
        if digest != sha256:
            raise ConfigError(f"artifact: {uri} has sha256 {digest}, not the expected "
                              f"{sha256}; refusing to build it")
    return path


@dataclass(frozen=True)
class Agreement:
    """How a build's output compares with the FP32 artifact's on the same inputs."""

    output: str
    samples: int
    top1_agreement: float | None  # None where an output has one value per sample
    max_abs_error: float
    mean_abs_error: float
    nonfinite: int  # NaN/inf values in the build's output
    reference_accuracy: float | None = None  # with labels only
    build_accuracy: float | None = None

    @property
    def accuracy_drop(self) -> float | None:
        if self.reference_accuracy is None or self.build_accuracy is None:
            return None
        return self.reference_accuracy - self.build_accuracy


def compare_outputs(
    output: str,
    reference: np.ndarray,
    candidate: np.ndarray,
    labels: np.ndarray | None = None,
) -> Agreement:
    """Top-1 agreement, absolute errors and (with labels) accuracy of both.

    Samples run along axis 0; top-1 is the argmax over each sample's values.
    """
    if reference.shape != candidate.shape:
        raise EngineError(
            f"output {output!r}: the build answers shape {list(candidate.shape)}, "
            f"the FP32 artifact {list(reference.shape)}"
        )
    samples = reference.shape[0] if reference.ndim else 1
    ref = reference.reshape(samples, -1).astype(np.float64)
    got = candidate.reshape(samples, -1).astype(np.float64)
    finite = np.isfinite(got)
    error = np.abs(ref - got)[finite]
    top1 = None
    build_accuracy = reference_accuracy = None
    if ref.shape[1] > 1 and samples:
        ref_top = ref.argmax(axis=1)
        got_top = np.where(finite, got, -np.inf).argmax(axis=1)
        top1 = float(np.mean(ref_top == got_top))
        if labels is not None:
            labels = np.asarray(labels).reshape(-1)
            if labels.shape[0] != samples:
                raise ConfigError(f"labels: {labels.shape[0]} labels for {samples} eval samples")
            reference_accuracy = float(np.mean(ref_top == labels))
            build_accuracy = float(np.mean(got_top == labels))
    return Agreement(
        output=output,
        samples=int(samples),
        top1_agreement=top1,
        max_abs_error=float(error.max()) if error.size else 0.0,
        mean_abs_error=float(error.mean()) if error.size else 0.0,
        nonfinite=int(finite.size - finite.sum()),
        reference_accuracy=reference_accuracy,
        build_accuracy=build_accuracy,
    )


@dataclass(frozen=True)
class GateDecision:
    """The accuracy gate's verdict and the numbers it used.

    verdict: "pass", "fail" or "inconclusive" (too few samples, or no top-1 to
    compare: never a pass). `accepted` is whether the version may be written:
    a pass, or anything the user let through with --allow-accuracy-drop.
    """

    verdict: str
    accepted: bool
    reason: str


def judge(
    agreement: Agreement,
    *,
    min_agreement: float,
    min_samples: int,
    max_accuracy_drop: float | None = None,
    allow_accuracy_drop: bool = False,
) -> GateDecision:
    a = agreement
    numbers = (
        f"top-1 agreement {_fmt(a.top1_agreement)} (threshold {min_agreement:.4f}) over "
        f"{a.samples} samples of {a.output!r}; max abs error {a.max_abs_error:.4g}, "
        f"mean {a.mean_abs_error:.4g}"
    )
    if a.accuracy_drop is not None:
        numbers += (f"; accuracy FP32 {a.reference_accuracy:.4f}, build {a.build_accuracy:.4f}"
                    f" (drop {a.accuracy_drop:+.4f})")
    if a.samples < min_samples:
        verdict, why = "inconclusive", f"only {a.samples} samples (the gate needs {min_samples})"
    elif a.top1_agreement is None:
        verdict, why = "inconclusive", "the output has one value per sample, so no top-1 to compare"
    elif a.nonfinite:
        verdict, why = "fail", f"{a.nonfinite} NaN/inf values in the build's output"
    elif a.top1_agreement < min_agreement:
        verdict, why = "fail", "top-1 agreement below the threshold"
    elif (max_accuracy_drop is not None and a.accuracy_drop is not None
          and a.accuracy_drop > max_accuracy_drop):
        verdict, why = "fail", f"accuracy drops more than {max_accuracy_drop:.4f}"
    else:
        verdict, why = "pass", "within the threshold"
    accepted = verdict == "pass" or allow_accuracy_drop
    if verdict != "pass" and allow_accuracy_drop:
        why += "; accepted anyway (--allow-accuracy-drop)"
    return GateDecision(verdict, accepted, f"{verdict}: {why}: {numbers}")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


@dataclass(frozen=True)
class LatencySummary:
    """Wall time of `engine.run` for one batch size, in milliseconds."""

    batch_size: int
    runs: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float
    items_per_s: float  # batch_size / mean: sustained rate, outliers included


def summarize_latency(batch_size: int, seconds: Sequence[float]) -> LatencySummary:
    """Nearest-rank percentiles of the timed runs."""
    if not seconds:
        raise ValueError("summarize_latency: no timed runs")
    ordered = sorted(seconds)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1e3

    mean = sum(ordered) / len(ordered)
    return LatencySummary(
        batch_size=batch_size,
        runs=len(ordered),
        mean_ms=mean * 1e3,
        p50_ms=rank(0.50),
        p90_ms=rank(0.90),
        min_ms=ordered[0] * 1e3,
        max_ms=ordered[-1] * 1e3,
        items_per_s=batch_size / mean if mean > 0 else math.inf,
    )


def version_facts(report: Mapping[str, Any]) -> dict[str, str]:
    """A build report's key figures, as the agent shows them in ModelConfig parameters."""
    accuracy = report.get("accuracy") or {}
    facts = {
        "build_tier": report.get("tier"),
        "build_precision": report.get("precision"),
        "build_top1_agreement": _fact(accuracy.get("top1_agreement")),
        "build_max_abs_error": _fact(accuracy.get("max_abs_error")),
        "build_accuracy": _fact(accuracy.get("build_accuracy")),
        "build_eval_data": (report.get("eval") or {}).get("data"),
        "build_gate": (report.get("gate") or {}).get("verdict"),
        "build_source_sha256": (report.get("source") or {}).get("sha256"),
        "build_created": report.get("created"),
    }
    return {key: str(value) for key, value in facts.items() if value is not None}


def _fact(value: Any) -> str | None:
    return None if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


# -- data ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Samples:
    """Model inputs stacked along axis 0 (one sample per row), maybe with labels."""

    feeds: Mapping[str, np.ndarray]
    labels: np.ndarray | None
    origin: str  # the npz file, or "random"

    @property
    def count(self) -> int:
        return next(iter(self.feeds.values())).shape[0]

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {name: np.ascontiguousarray(array[index]) for name, array in self.feeds.items()}

    def batches(self, size: int) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, self.count, size):
            yield self.rows(np.arange(start, min(start + size, self.count)))


def _batch_step(inputs: Sequence[TensorSpec]) -> int | None:
    """Rows per run: None when every input has a variable leading (batch) dim, 1 when fixed at 1."""
    leading = {spec.shape[0] if spec.shape else 0 for spec in inputs}
    if leading == {-1}:
        return None
    if leading == {1}:
        return 1
    raise ConfigError(
        "inputs: a build feeds samples along the leading dimension, which must be a "
        f"variable batch dimension or 1; the model has {[list(s.shape) for s in inputs]}"
    )


def load_samples(path: Path, inputs: Sequence[TensorSpec], limit: int, where: str) -> Samples:
    """An npz with one array per model input (keyed by input name) and optional
    integer class labels (`label` or `labels`, one per sample).

    A model with a single input may name its array anything.
    """
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as error:
        raise ConfigError(f"{where}: cannot read {path} as an npz archive: {error}") from error
    found = [key for key in LABEL_KEYS if key in arrays]
    if len(found) > 1:
        raise ConfigError(f"{where}: {path} has both {' and '.join(found)}; keep one")
    label_key = found[0] if found else "label"
    labels = arrays.pop(label_key, None)
    if len(inputs) == 1 and inputs[0].name not in arrays and len(arrays) == 1:
        arrays = {inputs[0].name: next(iter(arrays.values()))}
    feeds = {}
    for spec in inputs:
        if spec.name not in arrays:
            raise ConfigError(
                f"{where}: {path} has no array {spec.name!r} for model input {spec.name!r} "
                f"(it has {', '.join(sorted(arrays)) or 'none'})"
            )
        array = arrays[spec.name]
        if array.dtype != spec.dtype:
            raise ConfigError(
                f"{where}.{spec.name}: dtype {array.dtype}, the model takes {spec.dtype}"
            )
        if array.ndim != len(spec.shape) or any(
            want not in (-1, got) for want, got in zip(spec.shape[1:], array.shape[1:])
        ):
            raise ConfigError(
                f"{where}.{spec.name}: shape {list(array.shape)} does not fit the model's "
                f"{list(spec.shape)} (samples along the first dimension)"
            )
        feeds[spec.name] = array[:limit]
    counts = {array.shape[0] for array in feeds.values()}
    if len(counts) != 1 or 0 in counts:
        raise ConfigError(f"{where}: arrays of {path} hold different or zero sample counts: "
                          f"{sorted(counts)}")
    if labels is not None:
        labels = labels[:limit]
        if labels.ndim != 1 or labels.shape[0] != counts.pop() or labels.dtype.kind not in "iu":
            raise ConfigError(
                f"{where}.{label_key}: expected one integer class label per sample, got "
                f"{labels.dtype} of shape {list(labels.shape)}"
            )
    return Samples(feeds, labels, str(path))


def random_samples(inputs: Sequence[TensorSpec], count: int, rng: np.random.Generator) -> Samples:
    """Inputs drawn at random from the model's own shapes (agreement only; no labels)."""
    feeds = {}
    for spec in inputs:
        dims = spec.shape[1:]
        if any(d < 0 for d in dims):
            raise ConfigError(
                f"input {spec.name!r}: shape {list(spec.shape)} has variable dimensions past "
                "the batch; random data cannot guess them: pass --eval and --calibration"
            )
        shape = (count, *dims)
        if spec.dtype.kind == "f":
            feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif spec.dtype.kind in "iu":
            feeds[spec.name] = rng.integers(0, 10, shape).astype(spec.dtype)
        elif spec.dtype.kind == "b":
            feeds[spec.name] = rng.random(shape) < 0.5
        else:
            raise ConfigError(
                f"input {spec.name!r}: cannot draw random {spec.dtype} data: pass --eval "
                "and --calibration"
            )
    return Samples(feeds, None, "random")


# -- the build ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildRequest:
    source: Path  # the FP32 ONNX artifact
    repository: Path
    model: str
    version: int
    calibration: Path | None = None  # npz; random inputs when absent
    evaluation: Path | None = None  # npz, maybe with labels; random inputs when absent
    force: bool = False  # replace an existing version
    allow_accuracy_drop: bool = False  # write a version the gate rejects


@dataclass(frozen=True)
class BuildOutcome:
    report: dict[str, Any]  # also DIR/<model>/<version>/build.json when installed
    decision: GateDecision
    installed: Path | None  # the version directory, when written


EVAL_BATCH = 64  # rows per engine run while comparing outputs
CALIBRATION_BATCH = 16  # rows per calibration run of the quantizer
LATENCY_WARMUP_RUNS = 2


def build(
    request: BuildRequest,
    profile: TierProfile,
    settings: BuildSettings,
    *,
    now: datetime.datetime,
    clock: Callable[[], float] = time.perf_counter,
) -> BuildOutcome:
    """Build for `profile`'s tier, measure, judge; install only when the gate accepts."""
    _preflight(request, profile, settings)
    engine_settings = _engine_settings(profile, settings)
    with tempfile.TemporaryDirectory(prefix="tiered-build-") as work_name:
        work = Path(work_name)
        artifact = work / "version" / MODEL_FILE
        artifact.parent.mkdir()
        # The FP32 reference runs on the tier's ONNX Runtime settings, so its
        # latency is what serving the unlowered artifact here would cost.
        reference = open_engine("onnxruntime", request.source, dict(profile.onnxruntime),
                                f"{profile.tier} profile onnxruntime")
        built: Engine | None = None
        try:
            step = _batch_step(reference.inputs)
            rng = np.random.default_rng(settings.seed)
            evaluation = _samples(request.evaluation, reference.inputs, settings.eval_samples,
                                  settings.random_samples, rng, "eval")
            calibration, calibrator = _lower(request, settings, reference.inputs, step, rng,
                                             artifact, work)
            built = open_engine(settings.backend, artifact, engine_settings,
                                f"{profile.tier} profile {settings.backend} + build.engine")
            _check_same_interface(reference, built)
            output = reference.outputs[0].name
            agreement = compare_outputs(output, _run_all(reference, evaluation, step, output),
                                        _run_all(built, evaluation, step, output),
                                        evaluation.labels)
            decision = judge(
                agreement,
                min_agreement=settings.min_agreement,
                min_samples=settings.min_eval_samples,
                max_accuracy_drop=settings.max_accuracy_drop,
                allow_accuracy_drop=request.allow_accuracy_drop,
            )
            sizes = [b for b in settings.latency_batch_sizes if step is None or b == step] or [1]
            latency = _measure_latency(reference, built, evaluation, sizes,
                                       settings.latency_runs, clock)
            report = _report(request, profile.tier, settings, engine_settings, artifact, built,
                             evaluation, calibration, calibrator, agreement, decision, latency,
                             now)
        finally:
            reference.close()
            if built is not None:
                built.close()
        (artifact.parent / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        installed = None
        if decision.accepted:
            config = _new_config(settings, engine_settings, profile, step)
            installed = install_version(artifact.parent, request.repository, request.model,
                                        request.version, config, force=request.force)
    return BuildOutcome(report, decision, installed)


def _lower(
    request: BuildRequest, settings: BuildSettings, inputs: Sequence[TensorSpec],
    step: int | None, rng: np.random.Generator, artifact: Path, work: Path,
) -> tuple[Samples | None, dict[str, Any]]:
    """Write the tier's artifact; return the calibration data and calibrator facts (INT8)."""
    if settings.precision == "int8":
        calibration = _samples(request.calibration, inputs, settings.calibration_samples,
                               settings.random_samples, rng, "calibration")
        calibrator = quantize.quantize_int8(
            request.source, artifact, list(calibration.batches(step or CALIBRATION_BATCH)),
            method=settings.calibration_method, per_channel=settings.per_channel, work_dir=work,
        )
        return calibration, calibrator
    if settings.precision == "fp16" and settings.backend == "onnxruntime":
        quantize.convert_fp16(request.source, artifact)
    else:  # torch converts at load; ONNX Runtime fp32 is the artifact itself
        quantize.keep_fp32(request.source, artifact)
    return None, {}


def _preflight(request: BuildRequest, profile: TierProfile, settings: BuildSettings) -> None:
    """Everything that can refuse a build before minutes are spent on it."""
    if not request.source.is_file():
        raise ConfigError(f"artifact: {request.source} is not a file")
    _check_layout_names(request.model, request.version)
    if request.repository.exists() and not request.repository.is_dir():
        raise ConfigError(f"repository: {request.repository} is not a directory")
    if settings.backend not in BACKENDS:
        raise ConfigError(
            f"backend: {settings.backend!r} has no engine in this installation of tiered "
            f"(engines: {', '.join(BACKENDS)}); build for it once its engine is registered"
        )
    model_dir = request.repository / request.model
    if (model_dir / str(request.version)).exists() and not request.force:
        raise ConfigError(
            f"version: {model_dir / str(request.version)} already exists; pass --force to "
            "replace it"
        )
    config_path = model_dir / CONFIG_FILE
    if config_path.is_file():
        config = read_yaml(config_path)
        served = config.get("backend", profile.engine)
        if served != settings.backend:
            raise ConfigError(
                f"backend: {config_path} serves this model on {served!r}, the build makes a "
                f"{settings.backend!r} version; build with --backend {served} or give the "
                "model another name"
            )


def _check_layout_names(model: str, version: int) -> None:
    # The agent checks model names fully; here the name only must not leave
    # the repository or hide from it.
    if not model or Path(model).name != model or model.startswith("."):
        raise ConfigError(f"model: {model!r} must be one plain directory name")
    if version < 1:
        raise ConfigError(f"version: must be a positive integer, got {version}")


def _engine_settings(profile: TierProfile, settings: BuildSettings) -> dict[str, Any]:
    """The settings the version is measured (and, in a new config, served) with."""
    merged = {**profile.backends.get(settings.backend, {}), **settings.engine}
    if settings.backend == "torch":
        merged["precision"] = settings.precision  # torch converts at load
    return merged


def _samples(path: Path | None, inputs: Sequence[TensorSpec], limit: int, random_count: int,
             rng: np.random.Generator, where: str) -> Samples:
    if path is not None:
        return load_samples(path, inputs, limit, where)
    return random_samples(inputs, min(limit, random_count), rng)


def _check_same_interface(reference: Engine, built: Engine) -> None:
    def interface(engine: Engine) -> list[tuple[str, str]]:
        return [(s.name, str(s.dtype)) for s in (*engine.inputs, *engine.outputs)]

    if interface(reference) != interface(built):
        raise EngineError(
            f"the build changed the model's inputs/outputs: {interface(reference)} became "
            f"{interface(built)}; clients would have to change"
        )


def _run_all(engine: Engine, samples: Samples, step: int | None, output: str) -> np.ndarray:
    parts = [engine.run(feeds, [output])[output] for feeds in samples.batches(step or EVAL_BATCH)]
    return np.concatenate(parts, axis=0)


def _measure_latency(
    reference: Engine, built: Engine, samples: Samples, batch_sizes: Sequence[int],
    runs: int, clock: Callable[[], float],
) -> dict[str, list[LatencySummary]]:
    """Runs of the two engines alternate, so both see the same machine noise."""
    results: dict[str, list[LatencySummary]] = {"build": [], "fp32_reference": []}
    for batch_size in batch_sizes:
        feeds = samples.rows(np.arange(batch_size) % samples.count)
        timings: dict[str, list[float]] = {"build": [], "fp32_reference": []}
        for index in range(LATENCY_WARMUP_RUNS + runs):
            for name, engine in (("fp32_reference", reference), ("build", built)):
                start = clock()
                engine.run(feeds)
                if index >= LATENCY_WARMUP_RUNS:
                    timings[name].append(clock() - start)
        for name, seconds in timings.items():
            results[name].append(summarize_latency(batch_size, seconds))
    return results


def _versions() -> dict[str, str | None]:
    found = {}
    for name, dists in (("onnxruntime", ("onnxruntime", "onnxruntime-gpu")),
                        ("onnx", ("onnx",)), ("numpy", ("numpy",)), ("torch", ("torch",)),
                        ("tiered", ("tiered",))):
        found[name] = None
        for dist in dists:
            try:
                found[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def _report(
    request: BuildRequest, tier: str, settings: BuildSettings, engine_settings: Mapping[str, Any],
    artifact: Path, built: Engine, evaluation: Samples, calibration: Samples | None,
    calibrator: Mapping[str, Any], agreement: Agreement, decision: GateDecision,
    latency: Mapping[str, Sequence[LatencySummary]], now: datetime.datetime,
) -> dict[str, Any]:
    source_bytes = request.source.stat().st_size
    artifact_bytes = artifact.stat().st_size
    notes = []
    if evaluation.origin == "random":
        notes.append("eval on random inputs: top-1 agreement and errors only, no accuracy; "
                     "pass --eval with real data for a meaningful gate")
    if calibration is not None and calibration.origin == "random":
        notes.append("INT8 ranges calibrated on random inputs; pass --calibration with real data")
    if settings.precision == "fp16" and built.device == "cpu":
        notes.append("FP16 measured on CPU: ONNX Runtime runs FP16 nodes it lacks CPU kernels "
                     "for through inserted casts, so this latency says nothing of GPU FP16")
    return {
        "model": request.model,
        "version": request.version,
        "tier": tier,
        "backend": settings.backend,
        "precision": settings.precision,
        "source": {"path": str(request.source), "sha256": sha256_file(request.source),
                   "size_bytes": source_bytes},
        "artifact": {"file": MODEL_FILE, "sha256": sha256_file(artifact),
                     "size_bytes": artifact_bytes,
                     "size_vs_source": round(artifact_bytes / source_bytes, 4)},
        "calibration": None if calibration is None else {
            **calibrator, "samples": calibration.count, "data": calibration.origin,
            "per_channel": settings.per_channel,
            "format": "QDQ", "activations": "int8", "weights": "int8",
        },
        "eval": {"data": evaluation.origin, "samples": evaluation.count,
                 "labels": evaluation.labels is not None},
        "accuracy": {**_finite(asdict(agreement)),
                     "accuracy_drop": _finite(agreement.accuracy_drop)},
        "gate": {"verdict": decision.verdict, "accepted": decision.accepted,
                 "reason": decision.reason, "min_agreement": settings.min_agreement,
                 "min_eval_samples": settings.min_eval_samples,
                 "max_accuracy_drop": settings.max_accuracy_drop,
                 "allow_accuracy_drop": request.allow_accuracy_drop},
        "latency": {name: [_finite(asdict(s)) for s in rows] for name, rows in latency.items()},
        "engine": {**built.describe(), "device": built.device,
                   "settings": _finite(dict(engine_settings))},
        "versions": _versions(),
        "created": now.isoformat(),
        "notes": notes,
    }


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# -- the repository -----------------------------------------------------------------------


def _new_config(settings: BuildSettings, engine_settings: Mapping[str, Any],
                profile: TierProfile, step: int | None) -> dict[str, Any]:
    """config.yaml for a model the build creates (an existing one is left alone)."""
    config: dict[str, Any] = {"backend": settings.backend}
    if step is None and settings.max_batch_size > 0:
        config["max_batch_size"] = settings.max_batch_size
        config["dynamic_batching"] = {}  # the tier profile's batching defaults
    else:
        config["max_batch_size"] = 0
    # Serve with what was measured where it differs from the tier's defaults.
    defaults = profile.backends.get(settings.backend, {})
    engine = {k: v for k, v in engine_settings.items() if defaults.get(k) != v}
    if engine:
        config["engine"] = _plain(engine)
    return config


def _plain(value: Any) -> Any:
    """Tuples and mappings as YAML's safe dumper takes them."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def install_version(
    built: Path, repository: Path, model: str, version: int,
    config: Mapping[str, Any], *, force: bool,
) -> Path:
    """Move a finished version directory into DIR/<model>/<version>.

    The files are first copied next to their place under a hidden name the
    agent ignores, then renamed into place in one step, so an agent never sees
    a half-written version. config.yaml is written (the same way) only when
    the model has none. On any failure the repository is left as it was.
    """
    _check_layout_names(model, version)
    if repository.exists() and not repository.is_dir():
        raise ConfigError(f"repository: {repository} is not a directory")
    repository.mkdir(parents=True, exist_ok=True)  # a new repository starts with its first build
    model_dir = repository / model
    created_model_dir = not model_dir.exists()
    target = model_dir / str(version)
    staging = model_dir / f".{version}.partial-{os.getpid()}"
    retired = model_dir / f".{version}.replaced-{os.getpid()}"
    config_path = model_dir / CONFIG_FILE
    try:
        model_dir.mkdir(exist_ok=True)
        shutil.copytree(built, staging)
        replacing = target.exists()
        if replacing:
            if not force:
                raise ConfigError(f"version: {target} already exists; pass --force to replace it")
            os.rename(target, retired)
        placed = False
        try:
            os.rename(staging, target)
            placed = True
            if not config_path.exists():
                write_atomically(config_path, yaml.safe_dump(dict(config), sort_keys=False))
        except BaseException:
            if placed:
                shutil.rmtree(target, ignore_errors=True)
            if replacing:
                os.rename(retired, target)
            raise
    except (OSError, TieredError) as error:
        shutil.rmtree(staging, ignore_errors=True)
        if created_model_dir:
            shutil.rmtree(model_dir, ignore_errors=True)
        if isinstance(error, TieredError):
            raise
        raise ConfigError(f"repository: cannot write {target}: {error}") from error
    shutil.rmtree(retired, ignore_errors=True)
    return target


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
