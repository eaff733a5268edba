"""Decode throughput of the generative torch engine: trained tiny Llamas (v1,
and v3 with about 5x the compute per token) at several running sequences,
on the CPU (FP32) and, where torch sees a GPU, on CUDA (FP16, eager and with
CUDA graphs; their greedy tokens must agree). Writes JSON and prints a table.

    python bench/generative.py --out bench/results/generative.json [--smoke]

tokens/s counts every generated token while `sequences` prompts run together
(greedy, prefill included, 32 new tokens each, end of sequence ignored).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from tiered.engines.generative.base import Sampling
from tiered.engines.generative.torch_engine import TorchGenerativeEngine, TorchGenerativeSettings
from tiered.models import tinyllama


def endless_checkpoint(work: Path, variant: str | tinyllama.TinyLlama) -> Path:
    """A tiny Llama checkpoint (a named variant, or any shape) with no end of
    sequence, so that every sequence runs to its max_tokens (bench/generate.py
    too): no EOS id in its config, and EOS's row of the output layer zeroed.
    onnxruntime-genai's builder takes the tokenizer's `</s>` as EOS all the
    same, and a trained model picks it; with a logit of 0 against hundreds of
    others' greedy decoding does not (the edge build's sequences ended after
    about 8 of 64 tokens before)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    if isinstance(variant, str):
        checkpoint = tinyllama.write_tinyllama(work, variant)
    else:
        checkpoint = tinyllama.write_tinyllama(work, "v1", shape=variant)
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = []
    config_path.write_text(json.dumps(config))
    for shard in checkpoint.glob("*.safetensors"):
        with safe_open(shard, "pt") as weights:
            if "lm_head.weight" not in weights.keys():
                continue
        weights = load_file(shard)
        weights["lm_head.weight"][tinyllama.EOS_ID] = 0
        save_file(weights, shard, metadata={"format": "pt"})
    return checkpoint


def measure(engine: TorchGenerativeEngine, prompts: list[list[int]], sequences: int,
            tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    best, outputs = 0.0, []
    for _ in range(repeats):
        ids = {engine.start(prompts[i % len(prompts)], Sampling(max_tokens=tokens)): i
               for i in range(sequences)}
        out: dict[int, list[int]] = {i: [] for i in ids}
        produced, started = 0, time.perf_counter()
        while engine.running:
            for token in engine.step():
                out[token.sequence].append(token.id)
                produced += 1
        if engine.device == "cuda":
            torch.cuda.synchronize()
        best = max(best, produced / (time.perf_counter() - started))
        outputs = [out[i] for i in ids]
    return best, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/generative.json"))
    parser.add_argument("--smoke", action="store_true", help="v1 only, few repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = ("v1",) if args.smoke else ("v1", "v3")
    batches = (1, 8) if args.smoke else (1, 8, 32)
    repeats = 1 if args.smoke else 3
    configs = [("cpu", "fp32", False)]
    if torch.cuda.is_available():
        configs += [("cuda", "fp16", False), ("cuda", "fp16", True)]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for variant in variants:
            checkpoint = endless_checkpoint(Path(work), variant)
            greedy: dict[tuple[int, str], list[list[int]]] = {}
            for device, precision, graphs in configs:
                engine = TorchGenerativeEngine(checkpoint, TorchGenerativeSettings(
                    device=device, precision=precision, cuda_graphs=graphs,
                    max_sequences=max(batches), max_context=64))
                prompts = [engine.encode(p) for p in tinyllama.eval_prompts()]
                for sequences in batches:
                    rate, outputs = measure(engine, prompts, sequences, 32, repeats)
                    if device == "cuda":
                        greedy.setdefault((sequences, "cuda"), outputs)
                        if greedy[(sequences, "cuda")] != outputs:
                            print(f"graphs and eager disagree: {variant} {sequences}",
                                  file=sys.stderr)
                            return 1
                    rows.append({"variant": variant, "device": device, "precision": precision,
                                 "cuda_graphs": graphs, "sequences": sequences,
                                 "tokens_per_s": round(rate, 1)})
                engine.close()
    result = {"bench": "generative", "machine": platform.machine(),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "torch": torch.__version__, "threads": args.threads, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'variant':8}{'device':8}{'prec':6}{'graphs':8}{'seqs':>6}{'tokens/s':>12}")
    for r in rows:
        print(f"{r['variant']:8}{r['device']:8}{r['precision']:6}{str(r['cuda_graphs']):8}"
              f"{r['sequences']:>6}{r['tokens_per_s']:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
