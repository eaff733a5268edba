"""Tiny Llama-shaped checkpoints made in code, for tests, the demo and
benchmarks: a BPE tokenizer trained on a few sentences and a causal language
model trained on them for a few seconds, saved as a Hugging Face-style
checkpoint directory (config.json, model.safetensors, tokenizer.json).
Nothing is downloaded. Needs torch, transformers and tokenizers (the
`generative` extra).

Why trained: random weights give near-uniform next-token distributions, whose
greedy choices are near ties that any quantization flips, so no accuracy gate
could judge a build of them. A model that has learnt `CORPUS` continues a
prefix of one of its sentences with the rest of it by a wide logit margin
("the quick brown" -> " fox jumps over the lazy dog"), which an INT4 build
keeps and a broken build does not.

Variants (`VARIANTS`): `v1` the base model; `v2` v1's shape retrained with
another seed and more steps (a new version with mostly the same greedy
output); `v3` deeper and wider, several times the compute per token (for
latency-regression demos). `write_tinyllama` writes `tinyllama-<variant>/`
and `tinyllama-eval.json` (the eval prompts, `{"prompts": [...]}`) into one
directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CORPUS = (
    "the quick brown fox jumps over the lazy dog",
    "edge gateways answer first and the datacenter answers the rest",
    "a regional server sits between the edge and the datacenter",
    "every version rolls out in stages and is judged on what it measures",
    "tokens stream one at a time until the end of the sequence",
    "a canary takes a few percent of the traffic before it is promoted",
    "when the latency regresses the rollout goes back to the stable version",
    "small models run on gateways while large ones need a graphics card",
)
SPECIAL = ("<unk>", "<s>", "</s>")
EOS_ID = 2  # SPECIAL's index of "</s>"
EVAL_FILE = "tinyllama-eval.json"


@dataclass(frozen=True)
class TinyLlama:
    """The shape of a tiny model and how it is trained; `layers` and `hidden`
    set its cost per token."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512  # at most; the tokenizer learns fewer from CORPUS
    # The model's vocabulary when larger than the tokenizer's (its embedding and
    # lm_head the size of a real model's; ids past the tokenizer decode to nothing)
    padded_vocab: int = 0
    context: int = 256
    seed: int = 0  # initial weights (and so the trained ones)
    train_steps: int = 80  # full-batch AdamW steps on CORPUS; 0 leaves the weights random
    learning_rate: float = 5e-3


VARIANTS: dict[str, TinyLlama] = {
    "v1": TinyLlama(),
    "v2": TinyLlama(seed=1, train_steps=100),
    "v3": TinyLlama(layers=6, hidden=192, heads=6, kv_heads=2, intermediate=384,
                    learning_rate=3e-3),
}


def eval_prompts() -> list[str]:
    """Prefixes of CORPUS's sentences (their first 2, 4 and 6 words) that
    belong to one sentence only, so each has one right continuation."""
    prompts = []
    for sentence in CORPUS:
        words = sentence.split()
        for count in (2, 4, 6):
            prefix = " ".join(words[:count])
            if sum(s.startswith(prefix + " ") for s in CORPUS) == 1:
                prompts.append(prefix)
    return prompts


def write_tinyllama(out: Path, variant: str, shape: TinyLlama | None = None) -> Path:
    """`out/tinyllama-<variant>/` (a checkpoint: the variant's shape, or `shape`)
    and `out/tinyllama-eval.json`."""
    if shape is None and variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r} is not one of {', '.join(VARIANTS)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / EVAL_FILE).write_text(json.dumps({"prompts": eval_prompts()}, indent=1) + "\n")
    return write_checkpoint(out / f"tinyllama-{variant}", shape or VARIANTS[variant])


def write_checkpoint(out: Path, shape: TinyLlama = TinyLlama()) -> Path:
    """A checkpoint directory at `out` (made, or overwritten)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=shape.vocab, special_tokens=list(SPECIAL), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=max(tokenizer.get_vocab_size(), shape.padded_vocab), hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context, bos_token_id=1, eos_token_id=EOS_ID,
        tie_word_embeddings=False)
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config)
    _train(model, [tokenizer.encode(s).ids for s in CORPUS], shape)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def _train(model, sentences: list[list[int]], shape: TinyLlama) -> None:
    """Full-batch AdamW on every sentence followed by end-of-sequence, no BOS
    (prompts are encoded without one). One thread: for matrices this small it
    is the fastest, and the result does not depend on the machine's cores."""
    import torch

    rows = [ids + [EOS_ID] for ids in sentences]
    width = max(map(len, rows))
    inputs = torch.full((len(rows), width), EOS_ID)
    labels = torch.full((len(rows), width), -100)  # -100: positions the loss ignores
    for index, row in enumerate(rows):
        inputs[index, :len(row)] = torch.tensor(row)
        labels[index, :len(row)] = torch.tensor(row)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=shape.learning_rate,
                                      weight_decay=0.0)
        for _ in range(shape.train_steps):
            loss = model(input_ids=inputs, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
        model.eval()
