"""`tiered build`: make a tier's version of an ONNX artifact and say, as JSON,
whether the accuracy gate let it in. The build machinery (onnx, engines) is
imported only when it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tiered.cli import flags

if TYPE_CHECKING:
    from tiered.engines.build.chain import EnsembleChain
    from tiered.profiles import TierProfile


def register(commands: argparse._SubParsersAction) -> None:
    build = commands.add_parser(
        "build",
        help="build a tier's version of an ONNX model into a model repository",
        description="Make a tier's version of an FP32 ONNX artifact (edge: INT8 static QDQ; "
        "regional: FP16 with FP32 inputs/outputs; datacenter: FP32 ONNX for the torch engine), "
        "compare it with the artifact on eval data (top-1 agreement, errors, accuracy where "
        "the data has labels), time it, and write DIR/NAME/V/model.onnx, build.json and, when "
        "absent, DIR/NAME/config.yaml. A build below the tier's agreement threshold writes "
        "nothing. The report goes to stdout as JSON either way. Defaults come from the tier "
        "profile's build: mapping. A checkpoint directory (config.json, *.safetensors, "
        "tokenizer.json) builds a generative model instead (edge: onnxruntime-genai INT4; "
        "regional: onnxruntime-genai FP16 on CUDA; datacenter: the torch engine), judged by "
        "greedy generation against FP32 over --eval prompts (build.generative settings). "
        "A Triton-style repository directory holding the ensemble NAME (NAME/config.pbtxt or "
        "config.yaml) and its step models (STEP/<version>/model.onnx, FP32) builds each step "
        "for the tier (steps with integer tensors stay FP32; INT8 steps calibrate on the FP32 "
        "chain's tensors), judges the ensemble's outputs as one model, and installs the "
        "ensemble and every step as version V together, or nothing. A vision-language "
        "checkpoint (config.json model_type: llava) builds both its stages as one version: "
        "the vision stage (pixel_values FP32 [batch, 3, H, W] in, visual_tokens out) exported "
        "to ONNX and built like an ONNX artifact for the tier (datacenter: ONNX Runtime FP16, "
        "build.vision), judged by per-token cosine similarity and relative L2 error against "
        "the FP32 export and by the FP32 decoder's answers from its tokens; the decoder built "
        "as a checkpoint's is; and the two together judged on their greedy answers to --eval's "
        "questions against the FP32 model's. --stage vision builds the vision stage alone, as "
        "a model of its own.",
    )
    build.add_argument("artifact", metavar="ARTIFACT",
                       help="the FP32 ONNX model (a path, or an http(s) URI to fetch), a "
                       "checkpoint directory (a path), or a repository directory holding the "
                       "ensemble --model and its step models (a path)")
    build.add_argument("--stage", choices=("vision",),
                       help="build only the vision stage of a vision-language checkpoint, as a "
                       "predictive model of its own (refused for any other source; default: "
                       "both stages, one version)")
    build.add_argument("--sha256", metavar="HEX",
                       help="refuse to build unless the artifact has this SHA-256 (a "
                       "directory's: over its files, see tiered.files.sha256_tree)")
    build.add_argument("--tier", required=True, choices=flags.TIER_CHOICES,
                       help="the tier to build for")
    build.add_argument("--repository", required=True, type=Path, metavar="DIR",
                       help="model repository to write the version into")
    build.add_argument("--model", required=True, metavar="NAME", help="model name (directory)")
    build.add_argument("--version", required=True, type=int, metavar="V",
                       help="version to write (a positive integer)")
    build.add_argument("--calibration", metavar="DATA.npz",
                       help="INT8 calibration inputs (a path or http(s) URI): one array per model input, keyed by its "
                       "name (default: random inputs)")
    build.add_argument("--eval", metavar="DATA.npz",
                       help="eval inputs like --calibration, plus optional integer `labels` "
                       "(default: random inputs: agreement only, no accuracy); for a "
                       'checkpoint, required: JSON {"prompts": ["...", ...]}; for a vision '
                       "stage: an npz of `images` (uint8 [n, H, W, 3] or any form "
                       "tiered.engines.images takes) or `pixel_values`, and optional "
                       "`questions` (strings, one an image) for the answer match")
    build.add_argument("--calibration-sha256", metavar="HEX",
                       help="refuse to build unless the --calibration file has this SHA-256")
    build.add_argument("--eval-sha256", metavar="HEX",
                       help="refuse to build unless the --eval file has this SHA-256")
    build.add_argument("--calibration-method", metavar="METHOD",
                       help="INT8 calibration: minmax, entropy or percentile")
    build.add_argument("--calibration-samples", type=int, metavar="N",
                       help="use at most N calibration samples")
    build.add_argument("--precision", help="override the tier's precision (onnxruntime: int8, "
                       "fp16, fp32; torch: fp32, fp16, bf16, fp8; checkpoints: "
                       "onnxruntime-genai int4, fp16, fp32; torch-generative fp32, fp16, bf16, fp8)")
    build.add_argument("--backend", help="override the tier's backend (onnxruntime or torch; "
                       "checkpoints: onnxruntime-genai or torch-generative)")
    build.add_argument("--min-agreement", type=float, metavar="FRACTION",
                       help="top-1 agreement with FP32 the gate asks for (profile default 0.99; "
                       "checkpoints: the teacher-forced token agreement, default 0.98; a "
                       "vision stage: the mean visual-token cosine, default 0.99)")
    build.add_argument("--max-batch-size", type=int, metavar="N",
                       help="max_batch_size of a config.yaml the build creates")
    build.add_argument("--max-queue-delay-us", type=int, metavar="US",
                       help="dynamic_batching.max_queue_delay_us of a config.yaml the build "
                       "creates (default: the tier profile's)")
    build.add_argument("--allow-accuracy-drop", action="store_true",
                       help="write the version even when the accuracy gate rejects it")
    build.add_argument("--force", action="store_true", help="replace an existing version")
    build.add_argument("--profile", type=Path, metavar="FILE",
                       help="tier profile YAML (default: tiered/profiles/<tier>.yaml)")
    build.add_argument("--termination-log", type=Path, metavar="PATH",
                       help="also write the verdict (one JSON line) to PATH; on Kubernetes the "
                       "container's terminationMessagePath, /dev/termination-log (default: none)")
    build.set_defaults(handler=_run_build)


def _read_ensemble(source: Path, model: str, profile: TierProfile) -> EnsembleChain:
    """The ensemble `model` of the source repository, read by the agent's own
    parser, as the build's chain description."""
    from tiered.agent.repository import config_file, read_model_config
    from tiered.engines.build.chain import ChainStep, EnsembleChain
    from tiered.errors import ConfigError

    config = read_model_config(source, model, profile)
    if config.ensemble is None:
        raise ConfigError(f"artifact: {source / model} is model {model!r} of backend "
                          f"{config.backend!r}, not an ensemble; build a single model from "
                          "its ONNX file")
    found = config_file(source / model)
    assert found is not None  # read_model_config read it
    return EnsembleChain(
        name=model, config_file=found.name,
        inputs=tuple(t.name for t in config.inputs),
        outputs=tuple(t.name for t in config.outputs),
        max_batch_size=config.max_batch_size,
        steps=tuple(ChainStep(step.model, step.version, dict(step.inputs), dict(step.outputs))
                    for step in config.ensemble.steps))


def _run_build(args: argparse.Namespace) -> int:
    """Exit 0 built, 1 rejected by the gate, 2 refused, 3 failed; on every path
    the last stderr line is the verdict as JSON (tiered.protocol.verdict), which
    the controller reads, and --termination-log gets the same line."""
    import datetime
    import json
    import tempfile
    import traceback

    from tiered.agent.config import check_model_name
    from tiered.engines import build
    from tiered.errors import TieredError
    from tiered.profiles import load_profile
    from tiered.protocol import verdict as verdicts

    def verdict(code: int, reason: str, installed: Path | None = None) -> verdicts.BuildVerdict:
        return verdicts.BuildVerdict(
            built=code == verdicts.BUILT, model=args.model, version=args.version,
            tier=args.tier, reason=reason, exit_code=code,
            installed=None if installed is None else str(installed),
        )

    overrides = {
        "backend": args.backend, "precision": args.precision,
        "calibration_method": args.calibration_method,
        "calibration_samples": args.calibration_samples,
        "min_agreement": args.min_agreement, "max_batch_size": args.max_batch_size,
        "max_queue_delay_us": args.max_queue_delay_us,
    }
    try:
        check_model_name(args.model)
        profile = load_profile(args.tier, args.profile)
        with tempfile.TemporaryDirectory(prefix="tiered-fetch-") as work:
            def data(uri: str | None, sha256: str | None, name: str) -> Path | None:
                return build.fetch_artifact(uri, sha256, Path(work), name) if uri else None

            source = build.fetch_artifact(args.artifact, args.sha256, Path(work))
            ensemble = (_read_ensemble(source, args.model, profile)
                        if build.is_model_repository(source) else None)
            where = f"{args.tier} profile build (and flags)"
            if args.stage == "vision" and build.is_vision_language(source):
                settings = build.choose_vision_settings(profile, {
                    **overrides, "min_agreement": None,
                    "vision": {"min_cosine_mean": args.min_agreement}}, where)
            elif build.is_checkpoint(source):
                settings = build.choose_generative_settings(profile, {
                    "backend": args.backend, "precision": args.precision,
                    "min_token_agreement": args.min_agreement,
                }, f"{args.tier} profile build.generative (and flags)")
            else:
                settings = build.choose_settings(profile, overrides, where)
            request = build.BuildRequest(
                source=source,
                repository=args.repository, model=args.model, version=args.version,
                calibration=data(args.calibration, args.calibration_sha256, "calibration.npz"),
                evaluation=data(args.eval, args.eval_sha256, "eval.npz"), force=args.force,
                allow_accuracy_drop=args.allow_accuracy_drop, ensemble=ensemble,
                stage=args.stage,
            )
            outcome = build.build(
                request, profile, settings, now=datetime.datetime.now(datetime.timezone.utc),
                verdict=lambda decision, target: verdict(
                    verdicts.BUILT, decision.reason, target).to_dict(),
            )
    except TieredError as error:
        said, told = f"tiered build: {error}", verdict(verdicts.REFUSED, str(error))
    except Exception as error:  # a bug still owes the controller a verdict
        traceback.print_exc()
        why = f"{type(error).__name__}: {error}"
        said, told = f"tiered build: failed: {why}", verdict(verdicts.FAILED, why)
    else:
        if outcome.installed is None:
            said = (f"tiered build: rejected, nothing written. {outcome.decision.reason} "
                    "(--allow-accuracy-drop writes it anyway)")
            told = verdict(verdicts.REJECTED, outcome.decision.reason)
        else:
            said = f"tiered build: wrote {outcome.installed}. {outcome.decision.reason}"
            told = verdict(verdicts.BUILT, outcome.decision.reason, outcome.installed)
        # The numbers, whatever the gate decided; the verdict as build.json holds it.
        print(json.dumps({**outcome.report, "verdict": told.to_dict()}, indent=2))
    line = told.to_json()
    if args.termination_log is not None:
        try:
            args.termination_log.write_text(line + "\n")
        except OSError as error:
            print(f"tiered build: cannot write --termination-log: {error}", file=sys.stderr)
    print(said, file=sys.stderr)
    print(line, file=sys.stderr, flush=True)
    return told.exit_code
