"""Tiny Llama-shaped checkpoints made in code, for tests, the demo and
benchmarks: a BPE tokenizer trained on a few sentences and a causal language
model with seeded random weights, saved as a Hugging Face-style checkpoint
directory (config.json, model.safetensors, tokenizer.json). Nothing is
downloaded. Needs transformers and tokenizers (the `generative` extra)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CORPUS = (
    "the quick brown fox jumps over the lazy dog",
    "edge gateways answer first and the datacenter answers the rest",
    "a regional server sits between the edge and the datacenter",
    "every version rolls out in stages and is judged on what it measures",
    "tokens stream one at a time until the end of the sequence",
)
SPECIAL = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class TinyLlama:
    """The shape of a tiny model; `layers` and `hidden` set its cost per token."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    context: int = 256
    seed: int = 0


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
        vocab_size=tokenizer.get_vocab_size(), hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out
