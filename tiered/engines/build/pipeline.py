"""One tier build from start to end: refuse early what cannot be built, lower
the artifact to the tier's precision, run both on the same data, judge, time,
report, and install only what the gate accepts.

This is the adapter around the pure parts (`gate`, `samples`, `spec`): it runs
engines and moves files. A build happens in a temporary directory and moves
into the repository only when the gate accepts it, so a failed or interrupted
build never leaves a half-written version behind (at most, if killed while
copying, a hidden staging directory that the agent ignores). It must never
pass a rejected build into the repository.
"""

from __future__ import annotations

import datetime
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tiered import names
from tiered.engines import Engine, TensorSpec, open_engine, quantize
from tiered.engines.build import gate, generative, install, report, samples, spec
from tiered.engines.generative import is_checkpoint
from tiered.errors import ConfigError, EngineError
from tiered.profiles import TierProfile
from tiered.settings import load_dataclass, read_yaml

EVAL_BATCH = 64  # rows per engine run while comparing outputs
CALIBRATION_BATCH = 16  # rows per calibration run of the quantizer
LATENCY_WARMUP_RUNS = 2
LATENCY_MIN_RUNS = 5  # timed runs per batch size, whatever the budget


def build(
    request: spec.BuildRequest,
    profile: TierProfile,
    settings: spec.BuildSettings | spec.GenerativeBuildSettings,
    *,
    now: datetime.datetime,
    clock: Callable[[], float] = time.perf_counter,
    verdict: report.VerdictOf | None = None,
) -> report.BuildOutcome:
    """Build for `profile`'s tier, measure, judge; install only when the gate accepts.

    A checkpoint directory is built by `generative.build_checkpoint`, with
    `settings` itself where it is a GenerativeBuildSettings, else with its
    `generative` mapping; an ensemble (`request.ensemble`) by
    `ensemble.build_ensemble`; the vision stage of a vision-language
    checkpoint (`request.stage` "vision") by `vision_language.build_vision_stage`,
    which reads `settings.vision` (spec.choose_vision_settings)."""
    from tiered.engines.build import vision_language  # it builds on this module's steps

    if request.stage is not None and request.stage not in vision_language.STAGES:
        raise ConfigError(f"stage: {request.stage!r} is not one of "
                          f"{', '.join(vision_language.STAGES)}")
    if vision_language.is_vision_language(request.source):
        if request.stage is None:  # both stages, one version
            from tiered.engines.build import two_stage

            decoder = settings if isinstance(settings, spec.GenerativeBuildSettings) else \
                load_dataclass(spec.GenerativeBuildSettings, settings.generative,
                               f"{profile.tier} build.generative")
            return two_stage.build_whole(
                request, profile, spec.choose_vision_settings(profile, {}, f"{profile.tier} "
                                                              "build"),
                decoder, now=now, clock=clock, verdict=verdict)
        if request.stage == vision_language.VISION_STAGE:
            if isinstance(settings, spec.GenerativeBuildSettings):
                raise ConfigError("stage: the vision stage is built with a tier's build "
                                  "settings (spec.choose_vision_settings), not a checkpoint's")
            return vision_language.build_vision_stage(request, profile, settings, now=now,
                                                      clock=clock, verdict=verdict)
    elif request.stage is not None:
        raise ConfigError(f"stage: {request.source} is not a vision-language checkpoint; "
                          "--stage is for those only")
    if is_checkpoint(request.source):
        chosen = settings if isinstance(settings, spec.GenerativeBuildSettings) else \
            load_dataclass(spec.GenerativeBuildSettings, settings.generative,
                           f"{profile.tier} build.generative")
        return generative.build_checkpoint(request, profile, chosen, now=now, clock=clock,
                                           verdict=verdict)
    if isinstance(settings, spec.GenerativeBuildSettings):
        raise ConfigError(f"artifact: {request.source} is not a checkpoint directory, but "
                          "the settings are a checkpoint build's")
    if request.ensemble is not None:
        from tiered.engines.build import ensemble  # it builds on this module's steps

        return ensemble.build_ensemble(request, profile, settings, now=now, clock=clock,
                                       verdict=verdict)
    _preflight(request, profile, settings)
    engine_settings = engine_settings_of(profile, settings)
    with tempfile.TemporaryDirectory(prefix="tiered-build-") as work_name:
        work = Path(work_name)
        artifact = work / "version" / install.MODEL_FILE
        artifact.parent.mkdir()
        # The FP32 reference runs on the tier's ONNX Runtime settings, so its
        # latency is what serving the unlowered artifact here would cost.
        reference = open_engine(names.Backend.ONNXRUNTIME, request.source,
                                dict(profile.onnxruntime), f"{profile.tier} profile onnxruntime")
        built: Engine | None = None
        try:
            step = samples.batch_step(reference.inputs)
            rng = np.random.default_rng(settings.seed)
            evaluation = samples.load_or_draw(request.evaluation, reference.inputs,
                                              settings.eval_samples, settings.random_samples,
                                              rng, "eval")
            calibration, calibrator = _lower(request, settings, reference.inputs, step, rng,
                                             artifact, work)
            built = open_engine(settings.backend, artifact, engine_settings,
                                f"{profile.tier} profile {settings.backend} + build.engine")
            check_same_interface(reference, built)
            output = reference.outputs[0].name
            agreement = gate.compare_outputs(output,
                                             _run_all(reference, evaluation, step, output),
                                             _run_all(built, evaluation, step, output),
                                             evaluation.labels)
            decision = gate.judge(
                agreement,
                min_agreement=settings.min_agreement,
                min_samples=settings.min_eval_samples,
                max_accuracy_drop=settings.max_accuracy_drop,
                allow_accuracy_drop=request.allow_accuracy_drop,
            )
            sizes = [b for b in settings.latency_batch_sizes if step is None or b == step] or [1]
            latency = measure_latency(reference, built, evaluation, sizes,
                                      settings.latency_runs, settings.latency_budget_s, clock)
            record = report.compose(request, profile.tier, settings, engine_settings, artifact,
                                    built, evaluation, calibration, calibrator, agreement,
                                    decision, latency, now)
        finally:
            reference.close()
            if built is not None:
                built.close()
        installed = None
        if decision.accepted:
            if verdict is not None:
                target = request.repository / request.model / str(request.version)
                record["verdict"] = dict(verdict(decision, target))
            report.write_report(artifact.parent, record)
            config = install.new_config(settings, engine_settings, profile, step)
            installed = install.install_version(artifact.parent, request.repository,
                                                request.model, request.version, config,
                                                force=request.force)
    return report.BuildOutcome(record, decision, installed)


def _lower(
    request: spec.BuildRequest, settings: spec.BuildSettings, inputs: Sequence[TensorSpec],
    step: int | None, rng: np.random.Generator, artifact: Path, work: Path,
) -> tuple[samples.Samples | None, dict[str, Any]]:
    """Write the tier's artifact; return the calibration data and calibrator facts (INT8)."""
    if settings.precision == names.Precision.INT8:
        calibration = samples.load_or_draw(request.calibration, inputs,
                                           settings.calibration_samples,
                                           settings.random_samples, rng, "calibration")
        calibrator = quantize.quantize_int8(
            request.source, artifact, list(calibration.batches(step or CALIBRATION_BATCH)),
            method=settings.calibration_method, per_channel=settings.per_channel, work_dir=work,
        )
        return calibration, calibrator
    convert(request.source, artifact, settings)
    return None, {}


def convert(source: Path, artifact: Path, settings: spec.BuildSettings) -> None:
    """Write the tier's artifact of a precision that needs no calibration data."""
    if (settings.precision == names.Precision.FP16
            and settings.backend == names.Backend.ONNXRUNTIME):
        quantize.convert_fp16(source, artifact)
    else:  # torch converts at load; ONNX Runtime fp32 is the artifact itself
        quantize.keep_fp32(source, artifact)


def _preflight(request: spec.BuildRequest, profile: TierProfile,
               settings: spec.BuildSettings) -> None:
    """Everything that can refuse a build before minutes are spent on it."""
    if not request.source.is_file():
        raise ConfigError(f"artifact: {request.source} is not a file")
    install.check_destination(request)
    if settings.backend not in tuple(names.Backend):
        raise ConfigError(
            f"backend: {settings.backend!r} has no engine in this installation of tiered "
            f"(engines: {', '.join(names.Backend)}); build for it once its engine is registered"
        )
    config_path = request.repository / request.model / install.CONFIG_FILE
    if config_path.is_file():
        config = read_yaml(config_path)
        served = config.get("backend", profile.engine)
        if served != settings.backend:
            raise ConfigError(
                f"backend: {config_path} serves this model on {served!r}, the build makes a "
                f"{settings.backend!r} version; build with --backend {served} or give the "
                "model another name"
            )


def engine_settings_of(profile: TierProfile, settings: spec.BuildSettings) -> dict[str, Any]:
    """The settings the version is measured (and, in a new config, served) with."""
    merged = {**profile.backends.get(settings.backend, {}), **settings.engine}
    if settings.backend == names.Backend.TORCH:
        merged["precision"] = settings.precision  # torch converts at load
    return merged


def check_same_interface(reference: Engine, built: Engine) -> None:
    def interface(engine: Engine) -> list[tuple[str, str]]:
        return [(s.name, str(s.dtype)) for s in (*engine.inputs, *engine.outputs)]

    if interface(reference) != interface(built):
        raise EngineError(
            f"the build changed the model's inputs/outputs: {interface(reference)} became "
            f"{interface(built)}; clients would have to change"
        )


def _run_all(engine: Engine, data: samples.Samples, step: int | None,
             output: str) -> np.ndarray:
    parts = [engine.run(feeds, [output])[output] for feeds in data.batches(step or EVAL_BATCH)]
    return np.concatenate(parts, axis=0)


class Runs(Protocol):
    """What is timed: an engine, or an ensemble's chain of them."""

    def run(self, inputs: Mapping[str, np.ndarray],
            outputs: Sequence[str] | None = None) -> Mapping[str, np.ndarray]: ...


def measure_latency(
    reference: Runs, built: Runs, data: samples.Samples, batch_sizes: Sequence[int],
    runs: int, budget_s: float, clock: Callable[[], float],
) -> dict[str, list[gate.LatencySummary]]:
    """Runs of the two engines alternate, so both see the same machine noise:
    `runs` of each per batch size, fewer (LATENCY_MIN_RUNS at least) where
    the timed runs take more than `budget_s`."""
    results: dict[str, list[gate.LatencySummary]] = {"build": [], "fp32_reference": []}
    for batch_size in batch_sizes:
        feeds = data.rows(np.arange(batch_size) % data.count)
        timings: dict[str, list[float]] = {"build": [], "fp32_reference": []}
        for index in range(LATENCY_WARMUP_RUNS + runs):
            for name, engine in (("fp32_reference", reference), ("build", built)):
                start = clock()
                engine.run(feeds)
                if index >= LATENCY_WARMUP_RUNS:
                    timings[name].append(clock() - start)
            timed = index + 1 - LATENCY_WARMUP_RUNS
            spent = sum(timings["build"]) + sum(timings["fp32_reference"])
            if timed >= min(LATENCY_MIN_RUNS, runs) and spent >= budget_s:
                break
        for name, seconds in timings.items():
            results[name].append(gate.summarize_latency(batch_size, seconds))
    return results
