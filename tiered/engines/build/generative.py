"""A tier build of a checkpoint artifact (config.json, *.safetensors,
tokenizer.json): lower it for the tier, generate from the eval prompts with
the FP32 reference and with the build, judge, report, and install only what
the gate accepts, as `pipeline.build` does for ONNX artifacts.

    onnxruntime-genai  its model builder makes INT4 / FP16 / FP32 ONNX for the
                       CPU, or for CUDA where onnxruntime-genai runs it
    torch-generative   the checkpoint itself, run by our torch engine in the
                       built precision (config.yaml `engine.precision`); fp8
                       where the GPU has FP8 tensor cores, and only if it
                       passes the gate: else fp16, the report says why

A vision-language decoder (a checkpoint with `visual.json`) is built by
onnxruntime-genai's builder with its embeddings as an input and completed
into a pipeline that takes visual tokens (`visual.genai_visual_inputs`).

The FP32 reference is our torch engine on the CPU (checked against
transformers' LlamaForCausalLM in the tests). What the gate measures is in
`spec.GenerativeBuildSettings`; the numbers in `gate.compare_generations`.
Like the ONNX build, it works in a temporary directory and never passes a
rejected build into the repository.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import runpy
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiered import names
from tiered.engines import generative as engines
from tiered.engines.build import gate, install, report, spec
from tiered.engines.generative.base import GenerativeEngine, Sampling
from tiered.engines.generative.visual import VISUAL_FACTS, genai_visual_inputs
from tiered.errors import ConfigError, EngineError
from tiered.profiles import TierProfile
from tiered.settings import read_yaml

MAX_EVAL_PROMPTS = 1000
MAX_GATE_SEQUENCES = 16  # eval prompts decoded at once


@dataclass(frozen=True)
class Target:
    """What is really built: the backend, precision and device, and why it
    differs from what was asked where it does."""

    backend: str
    precision: str
    device: str  # cpu | cuda
    note: str | None = None


def build_checkpoint(
    request: spec.BuildRequest, profile: TierProfile, settings: spec.GenerativeBuildSettings,
    *, now: datetime.datetime, clock: Callable[[], float] = time.perf_counter,
    verdict: report.VerdictOf | None = None,
) -> report.BuildOutcome:
    prompts = _preflight(request, settings)
    target = choose_target(settings)
    outcome = _build(request, profile, settings, target, prompts, now, clock, verdict)
    if outcome.decision.accepted or target.precision != names.Precision.FP8:
        return outcome
    # FP8 is a speed the gate must allow: refused, the version is FP16 (FP32
    # on the CPU, where FP8 only emulates).
    wide = str(names.Precision.FP16 if target.device == "cuda" else names.Precision.FP32)
    fallback = Target(target.backend, wide, target.device,
                      f"fp8 was built and rejected by the gate ({outcome.decision.reason}): "
                      f"built {wide} instead")
    return _build(request, profile, dataclasses.replace(settings, precision=fallback.precision),
                  fallback, prompts, now, clock, verdict)


def _build(request: spec.BuildRequest, profile: TierProfile,
           settings: spec.GenerativeBuildSettings, target: Target, prompts: list[str],
           now: datetime.datetime, clock: Callable[[], float],
           verdict: report.VerdictOf | None) -> report.BuildOutcome:
    with tempfile.TemporaryDirectory(prefix="tiered-build-") as work_name:
        work = Path(work_name)
        version = work / "version"
        lower(request.source, target, version, work)
        engine_settings = served_settings(target, settings)
        reference = built = None
        try:
            reference = _reference(request.source, prompts, settings)
            built = engines.open_generative(target.backend, version, engine_settings,
                                            f"{profile.tier} build.generative.engine")
            if target.device == "cuda" and built.device != "cuda":
                raise EngineError(f"the {target.backend} build for CUDA runs on "
                                  f"{built.device}: its CUDA provider does not run here")
            ref_ids = [reference.encode(p) for p in prompts]
            built_ids = [built.encode(p) for p in prompts]
            ref_run = generate(reference, ref_ids, settings.max_new_tokens, clock)
            built_run = generate(built, built_ids, settings.max_new_tokens, clock)
            forced, nonfinite = teacher_forced_top1(built, ref_ids, ref_run.tokens)
            agreement = gate.compare_generations(ref_run.tokens, built_run.tokens, forced,
                                                 settings.first_tokens, nonfinite)
            decision = gate.judge_generations(
                agreement, min_first_tokens_match=settings.min_first_tokens_match,
                min_token_agreement=settings.min_token_agreement,
                min_prompts=settings.min_eval_prompts,
                allow_accuracy_drop=request.allow_accuracy_drop)
            notes = [target.note] if target.note else []
            same_encoding = sum(a == b for a, b in zip(ref_ids, built_ids, strict=True))
            if same_encoding < len(prompts):
                notes.append(f"the build's tokenizer encodes {len(prompts) - same_encoding} of "
                             f"{len(prompts)} prompts differently from the checkpoint's")
            record = report.compose_generative(
                request, profile.tier, settings, target.backend, target.precision, version,
                built.describe() | {"device": built.device}, engine_settings,
                {"prompts": len(prompts), "max_new_tokens": settings.max_new_tokens,
                 "prompt_encoding_match": same_encoding / len(prompts)},
                agreement, decision,
                {"fp32_reference": ref_run.summary(), "build": built_run.summary()},
                notes, now)
        finally:
            for engine in (reference, built):
                if engine is not None:
                    engine.close()
        installed = None
        if decision.accepted:
            if verdict is not None:
                target_dir = request.repository / request.model / str(request.version)
                record["verdict"] = dict(verdict(decision, target_dir))
            report.write_report(version, record)
            config: dict[str, Any] = {"backend": target.backend}
            if engine_settings:
                config["engine"] = engine_settings
            installed = install.install_version(version, request.repository, request.model,
                                                request.version, config, force=request.force)
    return report.BuildOutcome(record, decision, installed)


def choose_target(settings: spec.GenerativeBuildSettings) -> Target:
    """The tier's precision where its device is here (fp8 where the GPU has
    FP8 tensor cores, else fp16); else `cpu_precision` for the CPU, said in a
    note; else a refusal naming the setting."""
    needs_cuda = settings.precision in (names.Precision.FP16, names.Precision.FP8)
    if not needs_cuda:
        return Target(settings.backend, settings.precision, "cpu")
    if _cuda_runs(settings.backend):
        if settings.precision == names.Precision.FP8 and not _fp8_runs():
            return Target(settings.backend, names.Precision.FP16, "cuda",
                          "fp8 asked for, but this GPU has no FP8 tensor cores "
                          "(compute capability 8.9 or newer): built fp16")
        return Target(settings.backend, settings.precision, "cuda")
    if settings.cpu_precision is None:
        raise ConfigError(f"precision: {settings.precision} is built for CUDA, which "
                          f"{settings.backend} cannot use here; set build.generative."
                          "cpu_precision or pass --precision for a CPU build")
    return Target(settings.backend, settings.cpu_precision, "cpu",
                  f"{settings.precision} asked for, but {settings.backend} cannot use CUDA "
                  f"here: built {settings.cpu_precision} for the CPU instead")


def _cuda_runs(backend: str) -> bool:
    if backend == "torch-generative":
        import torch

        return torch.cuda.is_available()
    import onnxruntime_genai as og

    return bool(getattr(og, "is_cuda_available", lambda: False)())


def _fp8_runs() -> bool:
    from tiered.engines.generative.torch_engine import has_fp8_tensor_cores

    return has_fp8_tensor_cores()


def lower(source: Path, target: Target, out: Path, work: Path) -> None:
    """Write the tier's model directory for `target` at `out`."""
    if target.backend == "torch-generative":
        shutil.copytree(source, out)
        return
    # A vision-language decoder: its embeddings an input, for the visual tokens.
    takes_visual = (source / VISUAL_FACTS).is_file()
    try:
        _run_builder(["-m", str(source), "-i", str(source), "-o", str(out),
                      "-p", target.precision, "-e", target.device,
                      "-c", str(work / "builder-cache"),
                      *(["--extra_options", "exclude_embeds=true"] if takes_visual else [])])
    except (Exception, SystemExit) as error:  # its argparse exits
        raise EngineError(f"onnxruntime-genai's builder failed: {error!r}") from error
    if not (out / "genai_config.json").is_file():
        raise EngineError("onnxruntime-genai's builder wrote no genai_config.json")
    if takes_visual:
        genai_visual_inputs(out, source)


def _run_builder(argv: Sequence[str]) -> None:
    """onnxruntime-genai's model builder as its command line runs it, in this
    process: a build is a process of its own (`tiered build`, under its
    caller's timeout), and a second interpreter would import torch and
    transformers again, 4-6 s of CPU a build. What the builder prints goes to
    stderr, file descriptor and all: stdout carries the build's verdict."""
    sys.stdout.flush()
    saved_argv, saved_stdout = sys.argv, os.dup(1)
    os.dup2(2, 1)
    try:
        sys.argv = ["onnxruntime_genai.models.builder", *argv]
        runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
    finally:
        sys.stdout.flush()
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
        sys.argv = saved_argv


def served_settings(target: Target, settings: spec.GenerativeBuildSettings) -> dict[str, Any]:
    """What the version is measured and served with."""
    merged = dict(settings.engine)
    if target.backend == "torch-generative":
        merged.update(precision=target.precision, device=target.device)
    return merged


def _reference(source: Path, prompts: Sequence[str],
               settings: spec.GenerativeBuildSettings) -> GenerativeEngine:
    """FP32 on the CPU, its cache just large enough for the eval prompts."""
    from tiered.engines.generative.torch_engine import (
        TorchGenerativeEngine,
        TorchGenerativeSettings,
    )

    probe = TorchGenerativeEngine(source, TorchGenerativeSettings(
        device="cpu", precision="fp32", max_sequences=1, max_context=1))
    longest = max(len(probe.encode(p)) for p in prompts)
    context = longest + settings.max_new_tokens
    if context > probe.shape.max_positions:
        raise ConfigError(f"eval: a prompt of {longest} tokens plus max_new_tokens "
                          f"{settings.max_new_tokens} exceeds the model's context of "
                          f"{probe.shape.max_positions}")
    return TorchGenerativeEngine(source, TorchGenerativeSettings(
        device="cpu", precision="fp32", max_sequences=min(MAX_GATE_SEQUENCES, len(prompts)),
        max_context=context))


@dataclass(frozen=True)
class Generation:
    tokens: list[list[int]]  # each prompt's greedy tokens, its end-of-sequence token included
    seconds: float
    sequences_at_once: int

    def summary(self) -> dict[str, Any]:
        produced = sum(map(len, self.tokens))
        return {"tokens": produced, "seconds": round(self.seconds, 6),
                "tokens_per_s": round(produced / self.seconds, 2) if self.seconds > 0 else None,
                "sequences_at_once": self.sequences_at_once,
                "what": "greedy decode of the eval prompts, prefill included"}


def generate(engine: GenerativeEngine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             clock: Callable[[], float]) -> Generation:
    """Greedy tokens for every prompt, as many running at once as the engine
    takes (in-flight batching: a waiting prompt joins when one ends)."""
    sampling = Sampling(max_tokens=max_new_tokens)
    waiting = list(range(len(prompts)))
    out: list[list[int]] = [[] for _ in prompts]
    index_of: dict[int, int] = {}
    at_once = min(engine.max_sequences, MAX_GATE_SEQUENCES)
    if prompts:  # warm-up, untimed: first calls pay for lazy initialisation
        engine.start(prompts[0], Sampling(max_tokens=2))
        while engine.running:
            engine.step()
    started = clock()
    while waiting or engine.running:
        while waiting and engine.running < at_once:
            index = waiting.pop(0)
            index_of[engine.start(prompts[index], sampling)] = index
        for token in engine.step():
            out[index_of[token.sequence]].append(token.id)
    return Generation(out, clock() - started, at_once)


def teacher_forced_top1(engine: GenerativeEngine, prompts: Sequence[Sequence[int]],
                        continuations: Sequence[Sequence[int]]) -> tuple[list[list[int]], int]:
    """The engine's top-1 at each position of each continuation, fed the prompt
    and the continuation's tokens before it; and its non-finite logits there."""
    forced, nonfinite = [], 0
    for prompt, continuation in zip(prompts, continuations, strict=True):
        if not continuation:
            forced.append([])
            continue
        # The last token is never an input: nothing is predicted after it.
        ids = [*prompt, *continuation[:-1]]
        logits = engine.prefix_logits(ids)
        if logits.shape[0] != len(ids):
            raise EngineError(f"prefix_logits answered {logits.shape[0]} rows for "
                              f"{len(ids)} tokens")
        rows = logits[len(prompt) - 1:]
        finite = np.isfinite(rows)
        nonfinite += int(finite.size - finite.sum())
        forced.append([int(t) for t in np.where(finite, rows, -np.inf).argmax(axis=1)])
    return forced, nonfinite


def _preflight(request: spec.BuildRequest, settings: spec.GenerativeBuildSettings
               ) -> list[str]:
    """Refuse what cannot be built before the builder runs; the eval prompts."""
    if not engines.is_checkpoint(request.source):
        raise ConfigError(f"artifact: {request.source} is not a checkpoint directory")
    install.check_destination(request)
    config_path = request.repository / request.model / install.CONFIG_FILE
    if config_path.is_file():
        served = read_yaml(config_path).get("backend")
        if served != settings.backend:
            raise ConfigError(f"backend: {config_path} serves this model on {served!r}, the "
                              f"build makes a {settings.backend!r} version; build with "
                              f"--backend {served} or give the model another name")
    return read_prompts(request.evaluation)


def read_prompts(path: Path | None) -> list[str]:
    """Eval prompts: a JSON object whose `prompts` is a list of non-empty strings."""
    if path is None:
        raise ConfigError("eval: a checkpoint build needs eval prompts (--eval PROMPTS.json, "
                          'a JSON object {"prompts": ["...", ...]})')
    prompts = engines.read_prompts(path, "eval")
    if len(prompts) > MAX_EVAL_PROMPTS:
        raise ConfigError(f"eval: {path}: {len(prompts)} prompts, at most {MAX_EVAL_PROMPTS}")
    return prompts
