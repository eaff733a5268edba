"""`tiered models`: write sample ONNX models made on this machine. torch is
imported only when a model is trained."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Kept in step with tiered.models.digits.VARIANTS (a test compares them): the
# choices are spelled out so that `--help` does not have to import torch.
DIGITS_VARIANTS = ("v1", "v2", "heavy")
# Likewise tiered.models.tinyvlm.VARIANTS (torch, transformers).
TINYVLM_VARIANTS = ("v1", "v2", "bench")


def register(commands: argparse._SubParsersAction) -> None:
    models = commands.add_parser(
        "models",
        help="write sample models: trained digits classifiers, tiny LLMs and VLMs, a random-weight "
        "ResNet-18",
        description="Write sample ONNX models built on this machine (nothing is downloaded).",
    )
    model_kinds = models.add_subparsers(dest="model", required=True, metavar="MODEL")
    digits = model_kinds.add_parser(
        "digits",
        help="train small CNNs on scikit-learn's digits and export them (needs tiered[samples])",
        description="Train a small CNN on scikit-learn's bundled 8x8 handwritten digits "
        "(CPU, seconds) and write DIR/digits-<variant>.onnx (input `input` FP32 "
        "[batch, 1, 8, 8], pixels in [0, 1]; output `logits` FP32 [batch, 10]), "
        "DIR/digits-calibration.npz (`input`: training images for INT8 calibration) and "
        "DIR/digits-eval.npz (`input`, `label`: the held-out test split). Variants: v1 the "
        "base model; v2 v1's network retrained with another seed (a new version, as "
        "costly, that answers a little differently); heavy, many times the compute of v1 "
        "for latency-regression demos. "
        "Prints per-epoch progress to stderr and a summary per model.",
    )
    digits.add_argument("--variant", default="v1", choices=(*DIGITS_VARIANTS, "all"),
                        help="which model to train (default: v1)")
    digits.add_argument("--out", type=Path, default=Path("build/models"), metavar="DIR",
                        help="output directory (default: build/models)")
    digits.set_defaults(handler=_run_digits)
    tinyllama = model_kinds.add_parser(
        "tinyllama",
        help="train tiny Llama checkpoints (needs tiered[generative])",
        description="Train a tiny Llama-shaped causal LM on a few sentences (CPU, seconds) "
        "and write DIR/tinyllama-<variant>/ (a checkpoint directory: config.json, "
        "model.safetensors, tokenizer.json) and DIR/tinyllama-eval.json (the eval prompts). "
        "Variants: v1; v2, the same greedy output; v3, slower per token.")
    tinyllama.add_argument("--variant", default="v1", choices=("v1", "v2", "v3", "all"),
                           help="which checkpoint to write (default: v1)")
    tinyllama.add_argument("--out", type=Path, default=Path("build/models"), metavar="DIR",
                           help="output directory (default: build/models)")
    tinyllama.set_defaults(handler=_run_tinyllama)
    tinyvlm = model_kinds.add_parser(
        "tinyvlm",
        help="train tiny LLaVA-shaped vision-language checkpoints on the digits "
        "(needs tiered[generative,samples])",
        description="Train a tiny LLaVA-shaped model (CLIP-style vision tower, projector, "
        "Llama decoder) to answer questions about scikit-learn's 8x8 digits in words "
        "(CPU, seconds) and write DIR/tinyvlm-<variant>/ (a checkpoint directory: "
        "config.json, model.safetensors, tokenizer.json, preprocessor_config.json), "
        "DIR/tinyvlm-eval.npz (held-out images, labels, questions, answers) and "
        "DIR/tinyvlm-calibration.npz (training images for INT8 calibration of the vision "
        "stage). Variants: v1; v2, retrained with another seed (mostly the same answers); "
        "bench, random weights at a realistic size (a CLIP-B/16-like tower at 224 px and "
        "TinyLlama-1.1B's decoder, FP16, about 2.4 GB). Prints training progress to "
        "stderr and a summary per model with its held-out accuracy.")
    tinyvlm.add_argument("--variant", default="v1", choices=(*TINYVLM_VARIANTS, "all"),
                         help="which checkpoint to write (default: v1)")
    tinyvlm.add_argument("--out", type=Path, default=Path("build/models"), metavar="DIR",
                         help="output directory (default: build/models)")
    tinyvlm.set_defaults(handler=_run_tinyvlm)
    resnet18 = model_kinds.add_parser(
        "resnet18",
        help="write a ResNet-18-shaped classifier with random weights",
        description="Write DIR/resnet18.onnx: ResNet-18 with random (seeded) weights and "
        "BatchNorm folded into the convs; input `input` FP32 [batch, 3, N, N], output "
        "`logits` FP32 [batch, 1000]. For measuring serving, not for its answers.",
    )
    resnet18.add_argument("--out", type=Path, default=Path("build/models"), metavar="DIR",
                          help="output directory (default: build/models)")
    resnet18.add_argument("--image-size", type=int, default=224, metavar="N",
                          help="input height and width, at least 32 (default: 224)")
    resnet18.add_argument("--seed", type=int, default=0, metavar="S",
                          help="weight seed; the same seed writes the same file (default: 0)")
    resnet18.set_defaults(handler=_run_resnet18)


def _run_digits(args: argparse.Namespace) -> int:
    try:
        from tiered.models import digits  # torch: imported only when training is asked for
    except ImportError as error:
        print(f"tiered models digits: needs the samples extra "
              f"(pip install 'tiered[agent,samples]'): {error}", file=sys.stderr)
        return 2
    names = DIGITS_VARIANTS if args.variant == "all" else (args.variant,)
    for name in names:
        model = digits.write_digits(
            args.out, name, progress=lambda line: print(line, file=sys.stderr, flush=True)
        )
        print(model.summary(), flush=True)
    print(f"data: {model.calibration_path} (calibration inputs), {model.eval_path} "
          "(held-out inputs and labels)", flush=True)
    return 0


def _run_tinyllama(args: argparse.Namespace) -> int:
    try:
        from tiered.models import tinyllama  # torch, transformers: imported only here
    except ImportError as error:
        print(f"tiered models tinyllama: needs the generative extra: {error}", file=sys.stderr)
        return 2
    for name in tinyllama.VARIANTS if args.variant == "all" else (args.variant,):
        print(tinyllama.write_tinyllama(args.out, name), flush=True)
    print(f"eval prompts: {args.out / tinyllama.EVAL_FILE}", flush=True)
    return 0


def _run_tinyvlm(args: argparse.Namespace) -> int:
    try:
        from transformers.utils import logging as transformers_logging

        from tiered.models import tinyvlm  # torch, transformers, scikit-learn: only here
    except ImportError as error:
        print(f"tiered models tinyvlm: needs the generative and samples extras: {error}",
              file=sys.stderr)
        return 2
    # Its bars for every load and save would bury the training's progress lines.
    transformers_logging.disable_progress_bar()
    for name in TINYVLM_VARIANTS if args.variant == "all" else (args.variant,):
        model = tinyvlm.write_tinyvlm(
            args.out, name, progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(model.summary(), flush=True)
    print(f"data: {model.calibration_path} (calibration images), {model.eval_path} "
          "(held-out images, labels, questions and answers)", flush=True)
    return 0


def _run_resnet18(args: argparse.Namespace) -> int:
    from tiered.models import zoo

    try:
        path = zoo.resnet18(args.out / "resnet18.onnx", seed=args.seed, image_size=args.image_size)
    except ValueError as error:
        print(f"tiered models resnet18: --image-size: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}: ResNet-18, random weights (seed {args.seed}), input `input` FP32 "
          f"[batch, 3, {args.image_size}, {args.image_size}], output `logits` FP32 [batch, 1000]")
    return 0
