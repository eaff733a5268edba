"""Tier builds: make a tier's version of one FP32 ONNX artifact, measure it
against that artifact, judge it, and place it into a model repository.

    tiered build ARTIFACT.onnx --tier edge --repository DIR --model NAME --version V
    tiered build SRC/ --tier edge --repository DIR --model ENSEMBLE --version V
    tiered build LLAVA/ --stage vision --tier edge --repository DIR --model NAME --version V

(the second: SRC is a Triton-style repository holding the ensemble ENSEMBLE
and its step models' FP32 ONNX files, built and judged as one model; the
third: the vision stage of a vision-language checkpoint, exported to ONNX
and built like an artifact).

edge: INT8 static QDQ on ONNX Runtime's CPU provider; regional: FP16 weights
and compute with FP32 inputs/outputs; datacenter: the FP32 artifact, which the
torch engine converts at load. The tier profile's `build:` mapping chooses the
defaults (`BuildSettings`), command-line flags override them.

The package, one job a module:
    spec      what to build and how (BuildRequest, BuildSettings, choose_settings)
    fetch     the artifact as a local file holding exactly the pinned bytes
    samples   calibration and eval data (an npz, or random inputs)
    gate      output comparison, the accuracy gate, latency summaries (pure)
    report    build.json: composed, written, read, and its key figures
    install   the repository layout and the all-or-nothing move into it
    pipeline  `build`, the adapter that runs engines and moves files
    chain     an ensemble's steps as the build sees them (pure)
    ensemble  the build of an ensemble: each step lowered, the chain judged as
              one model, the ensemble and its steps installed together
    generative  the build of a checkpoint artifact (per-tier generative
              engines, the greedy-generation gate), which `build` hands over to
    vision_language  the vision stage of a vision-language checkpoint: its
              ONNX export, its tier builds and their gate (visual-token
              agreement, answer match), which `build` hands `--stage vision` to

This `__init__` is only the public surface (the names its callers use); the
orchestration has a module of its own so that the surface is read in one
screen and the modules import one another, never this file's names.

Nothing here may import tiered.agent or tiered.protocol (engines sit below
them): the repository's on-disk layout is written as a file format, and the
caller's verdict reaches build.json through `build(verdict=...)`.
"""

from __future__ import annotations

from tiered.engines.build.chain import ChainStep, EnsembleChain
from tiered.engines.build.ensemble import is_model_repository
from tiered.engines.build.fetch import fetch_artifact
from tiered.engines.build.gate import GateDecision
from tiered.engines.build.pipeline import build
from tiered.engines.build.report import BuildOutcome, read_report, version_facts
from tiered.engines.build.spec import (
    BuildRequest,
    BuildSettings,
    GenerativeBuildSettings,
    VisionBuildSettings,
    choose_generative_settings,
    choose_settings,
    choose_vision_settings,
)
from tiered.engines.build.vision_language import export_vision_stage, is_vision_language
from tiered.engines.generative import is_checkpoint

__all__ = [
    "BuildOutcome",
    "BuildRequest",
    "BuildSettings",
    "ChainStep",
    "EnsembleChain",
    "GateDecision",
    "GenerativeBuildSettings",
    "VisionBuildSettings",
    "build",
    "choose_generative_settings",
    "choose_settings",
    "choose_vision_settings",
    "export_vision_stage",
    "fetch_artifact",
    "is_checkpoint",
    "is_model_repository",
    "is_vision_language",
    "read_report",
    "version_facts",
]
