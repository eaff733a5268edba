"""The build of an ensemble: each step model lowered for the tier, the FP32
chain and the built chain run on the same inputs in the ensemble's input
space, one gate over the ensemble's outputs, and the ensemble's version and
its step models' versions installed together, or none of them.

    SRC/<ensemble>/config.pbtxt (or config.yaml)
    SRC/<step model>/<version>/model.onnx

This is an adapter like `pipeline.build`, whose lowering, timing and
interface check it reuses. It must never judge a step alone (a step's error
matters as far as it reaches the ensemble's outputs) and never install a
step version without the ensemble the gate accepted it with.
"""

from __future__ import annotations

import dataclasses
import datetime
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tiered import names
from tiered.engines import Engine, open_engine, quantize
from tiered.engines.build import chain as chains
from tiered.engines.build import gate, install, pipeline, report, samples, spec
from tiered.errors import ConfigError
from tiered.profiles import TierProfile
from tiered.settings import read_yaml


class ChainRunner:
    """Step engines run as one model: what the gate compares and the timer times."""

    def __init__(self, chain: chains.EnsembleChain, engines: Sequence[Engine]) -> None:
        self.chain, self.engines = chain, engines

    def tensors(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return chains.run_chain(self.chain, feeds, lambda index, inputs: self.engines[index].run(
            inputs, list(self.chain.steps[index].outputs)))

    def run(self, inputs: Mapping[str, np.ndarray],
            outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        tensors = self.tensors(inputs)
        return {name: tensors[name] for name in (outputs or self.chain.outputs)}


def is_model_repository(path: Path) -> bool:
    """A directory of model directories, one with a config at least (an ensemble's source)."""
    return path.is_dir() and any(
        (child / name).is_file() for child in path.iterdir() if child.is_dir()
        for name in install.MODEL_CONFIGS)


def step_source(source: Path, step: chains.ChainStep, where: str) -> Path:
    """SRC/<model>/<version>/model.onnx of a step: its pinned version, or the newest."""
    model_dir = source / step.model
    if step.version == chains.NEWEST:
        versions = sorted(int(c.name) for c in model_dir.glob("*")
                          if c.name.isdigit() and (c / install.MODEL_FILE).is_file())
        if not versions:
            raise ConfigError(f"{where}: {model_dir} has no <version>/{install.MODEL_FILE} for "
                              f"step model {step.model!r}")
        return model_dir / str(versions[-1]) / install.MODEL_FILE
    path = model_dir / str(step.version) / install.MODEL_FILE
    if not path.is_file():
        raise ConfigError(f"{where}: step model {step.model!r} version {step.version}: "
                          f"{path} is not a file")
    return path


def build_ensemble(
    request: spec.BuildRequest,
    profile: TierProfile,
    settings: spec.BuildSettings,
    *,
    now: datetime.datetime,
    clock: Callable[[], float],
    verdict: report.VerdictOf | None = None,
) -> report.BuildOutcome:
    """Build every step for `profile`'s tier, judge the chain as one model, and
    install the ensemble with its steps only when the gate accepts."""
    chain = request.ensemble
    assert chain is not None
    _preflight(request, chain, settings)
    sources = [step_source(request.source, step, f"ensemble.steps[{index}]")
               for index, step in enumerate(chain.steps)]
    references: list[Engine] = []
    built: list[Engine] = []
    with tempfile.TemporaryDirectory(prefix="tiered-build-") as work_name:
        work = Path(work_name)
        try:
            for index, source in enumerate(sources):
                references.append(open_engine(
                    names.Backend.ONNXRUNTIME, source, dict(profile.onnxruntime),
                    f"{profile.tier} profile onnxruntime (ensemble.steps[{index}])"))
            step_inputs = [engine.inputs for engine in references]
            rows = chains.rows_per_run(step_inputs)
            inputs = chains.input_specs(chain, step_inputs)
            lowerings = [chains.choose_step_lowering(settings.backend, settings.precision,
                                                     (*e.inputs, *e.outputs))
                         for e in references]
            step_settings = [_settings_of_step(settings, lowering, chain)
                             for lowering in lowerings]
            _check_served_backends(request, chain, step_settings)
            rng = np.random.default_rng(settings.seed)
            evaluation = samples.load_or_draw(request.evaluation, inputs, settings.eval_samples,
                                              settings.random_samples, rng, "eval")
            fp32 = ChainRunner(chain, references)
            calibration = None
            calibration_tensors: list[dict[str, np.ndarray]] = []
            if any(s.precision == names.Precision.INT8 for s in step_settings):
                calibration = samples.load_or_draw(
                    request.calibration, inputs, settings.calibration_samples,
                    settings.random_samples, rng, "calibration")
                calibration_tensors = [fp32.tensors(batch) for batch in
                                       calibration.batches(rows or pipeline.CALIBRATION_BATCH)]
            steps: dict[str, dict[str, Any]] = {}
            for index, step in enumerate(chain.steps):
                engine, steps[step.model] = _lower_step(
                    index, step, sources[index], step_settings[index], lowerings[index],
                    calibration_tensors, profile, work)
                built.append(engine)
                pipeline.check_same_interface(references[index], engine)
            candidate = ChainRunner(chain, built)
            expected = _run_all(fp32, evaluation, rows)
            answered = _run_all(candidate, evaluation, rows)
            agreements = [gate.compare_outputs(name, expected[name], answered[name],
                                               evaluation.labels) for name in chain.outputs]
            decision = gate.judge_outputs(
                agreements, min_agreement=settings.min_agreement,
                min_samples=settings.min_eval_samples,
                max_accuracy_drop=settings.max_accuracy_drop,
                allow_accuracy_drop=request.allow_accuracy_drop)
            sizes = [b for b in settings.latency_batch_sizes
                     if (rows is None or b == rows)
                     and (chain.max_batch_size == 0 or b <= chain.max_batch_size)]
            latency = pipeline.measure_latency(fp32, candidate, evaluation, sizes or [1],
                                               settings.latency_runs, settings.latency_budget_s,
                                               clock)
            record = report.compose_ensemble(request, profile.tier, settings, steps, evaluation,
                                             calibration, agreements, decision, latency, now)
            configs = [install.new_config(chosen, pipeline.engine_settings_of(profile, chosen),
                                          profile, samples.batch_step(engine.inputs))
                       for chosen, engine in zip(step_settings, references, strict=True)]
        finally:
            for engine in (*references, *built):
                engine.close()
        installed = None
        if decision.accepted:
            installed = _install(request, chain, record, steps, configs, work, verdict,
                                 decision)
    return report.BuildOutcome(record, decision, installed)


def _lower_step(
    index: int, step: chains.ChainStep, source: Path, chosen: spec.BuildSettings,
    lowering: chains.StepLowering, calibration_tensors: Sequence[Mapping[str, np.ndarray]],
    profile: TierProfile, work: Path,
) -> tuple[Engine, dict[str, Any]]:
    """Write the step's artifact into WORK/<model>/, open it, and say what it was built as."""
    artifact = work / step.model / install.MODEL_FILE
    artifact.parent.mkdir()
    calibrator: dict[str, Any] = {}
    if chosen.precision == names.Precision.INT8:
        # The step's ranges come from what the FP32 chain hands it.
        feeds = [{name: tensors[t] for name, t in step.inputs.items()}
                 for tensors in calibration_tensors]
        scratch = work / f".calibrate-{step.model}"
        scratch.mkdir()
        calibrator = quantize.quantize_int8(source, artifact, feeds,
                                            method=chosen.calibration_method,
                                            per_channel=chosen.per_channel, work_dir=scratch)
    else:
        pipeline.convert(source, artifact, chosen)
    engine_settings = pipeline.engine_settings_of(profile, chosen)
    engine = open_engine(chosen.backend, artifact, engine_settings,
                         f"{profile.tier} profile {chosen.backend} (ensemble.steps[{index}])")
    try:
        facts = report.compose_step(source, artifact, chosen, lowering.kept_fp32, calibrator,
                                    engine, engine_settings)
    except BaseException:
        engine.close()
        raise
    return engine, facts


def _settings_of_step(settings: spec.BuildSettings, lowering: chains.StepLowering,
                      chain: chains.EnsembleChain) -> spec.BuildSettings:
    """The build's settings for one step: its lowering, and a batch that holds
    the ensemble's (an ensemble's max_batch_size may not exceed its steps')."""
    same_backend = lowering.backend == settings.backend
    return dataclasses.replace(
        settings, backend=lowering.backend, precision=lowering.precision,
        engine=settings.engine if same_backend else {},
        max_batch_size=max(settings.max_batch_size, chain.max_batch_size))


def _run_all(runner: ChainRunner, data: samples.Samples,
             rows: int | None) -> dict[str, np.ndarray]:
    parts = [runner.run(feeds) for feeds in data.batches(rows or pipeline.EVAL_BATCH)]
    return {name: np.concatenate([part[name] for part in parts], axis=0)
            for name in runner.chain.outputs}


def _preflight(request: spec.BuildRequest, chain: chains.EnsembleChain,
               settings: spec.BuildSettings) -> None:
    """Everything that can refuse an ensemble's build before any step is lowered."""
    if request.model != chain.name:
        raise ConfigError(f"model: {request.model!r} is not the ensemble {chain.name!r} the "
                          f"build was given")
    if not (request.source / chain.name / chain.config_file).is_file():
        raise ConfigError(f"artifact: {request.source / chain.name / chain.config_file} is "
                          "not a file")
    if request.repository.exists() and not request.repository.is_dir():
        raise ConfigError(f"repository: {request.repository} is not a directory")
    if settings.backend not in tuple(names.Backend):
        raise ConfigError(f"backend: {settings.backend!r} has no engine in this installation "
                          f"of tiered (engines: {', '.join(names.Backend)})")
    version = request.version
    for index, step in enumerate(chain.steps):
        if step.version not in (chains.NEWEST, version):
            raise ConfigError(
                f"ensemble.steps[{index}].model_version: {step.version} of {step.model!r}; "
                f"the build installs every step as version {version} with the ensemble, so "
                f"give -1 (the newest) or {version}")
    for model in (chain.name, *(step.model for step in chain.steps)):
        install.check_destination(request, model)
    for step in chain.steps:
        model_dir = request.repository / step.model
        newer = sorted(int(c.name) for c in model_dir.glob("*")
                       if c.name.isdigit() and int(c.name) > version)
        if newer:
            raise ConfigError(
                f"version: step model {step.model!r} already has version {newer[-1]} in "
                f"{request.repository}, newer than {version}; the ensemble would serve that "
                "one, which this gate never judged: build a version above it")


def _check_served_backends(request: spec.BuildRequest, chain: chains.EnsembleChain,
                           step_settings: Sequence[spec.BuildSettings]) -> None:
    """A step model whose config.yaml serves another backend would not load the build."""
    for step, chosen in zip(chain.steps, step_settings, strict=True):
        config_path = request.repository / step.model / install.CONFIG_FILE
        if config_path.is_file():
            served = read_yaml(config_path).get("backend", chosen.backend)
            if served != chosen.backend:
                raise ConfigError(
                    f"backend: {config_path} serves step model {step.model!r} on {served!r}, "
                    f"the build makes a {chosen.backend!r} version of it")


def _install(request: spec.BuildRequest, chain: chains.EnsembleChain, record: dict[str, Any],
             steps: Mapping[str, Mapping[str, Any]], configs: Sequence[Mapping[str, Any]],
             work: Path,
             verdict: report.VerdictOf | None, decision: gate.GateDecision) -> Path:
    """The ensemble's version (build.json, the verdict) and each step's
    (model.onnx, a build.json pointing at the ensemble's), in one move."""
    target = request.repository / chain.name / str(request.version)
    if verdict is not None:
        record["verdict"] = dict(verdict(decision, target))
    ensemble_dir = work / chain.name / str(request.version)
    ensemble_dir.mkdir(parents=True)
    report.write_report(ensemble_dir, record)
    config_text = (request.source / chain.name / chain.config_file).read_text()
    placements = [install.Placement(ensemble_dir, chain.name, chain.config_file, config_text)]
    for step, config in zip(chain.steps, configs, strict=True):
        report.write_report(work / step.model, {
            "model": step.model, "version": request.version, "tier": record["tier"],
            **steps[step.model],
            "ensemble": {"model": chain.name, "version": request.version,
                         "report": f"../../{chain.name}/{request.version}/{report.REPORT_FILE}",
                         "gate": record["gate"]["verdict"]},
            "created": record["created"],
        })
        placements.append(install.Placement(work / step.model, step.model, install.CONFIG_FILE,
                                            yaml.safe_dump(dict(config), sort_keys=False)))
    return install.install_versions(placements, request.repository, request.version,
                                    force=request.force)[0]
