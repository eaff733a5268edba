"""The tiny Llama checkpoints are trained: their greedy continuations are the
corpus's sentences, by margins a quantized build can keep."""

from __future__ import annotations

import json

import pytest

from tiered.models import tinyllama

pytest.importorskip("transformers")


def _greedy(checkpoint, prompt: str, tokens: int = 16) -> tuple[str, float]:
    """The greedy continuation of `prompt` and the smallest top-1 minus top-2
    logit margin along it."""
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    model = LlamaForCausalLM.from_pretrained(checkpoint)
    ids = tokenizer.encode(prompt)
    out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True,
                         pad_token_id=tinyllama.EOS_ID)
    margins = [float(step[0].topk(2).values[0] - step[0].topk(2).values[1])
               for step in out.logits]
    return tokenizer.decode(out.sequences[0][len(ids):], skip_special_tokens=True), min(margins)


def test_trained_checkpoint_continues_a_sentence_of_its_corpus(tinyllama_models):
    text, margin = _greedy(tinyllama_models / "tinyllama-v1", "the quick brown")
    assert text == " fox jumps over the lazy dog"
    assert margin > 2.0  # logits, far from the ties of random weights


def test_variants_answer_alike_and_v3_is_larger(tinyllama_models):
    prompt = "a canary takes a"
    answers = {v: _greedy(tinyllama_models / f"tinyllama-{v}", prompt)[0]
               for v in tinyllama.VARIANTS}
    assert set(answers.values()) == {" few percent of the traffic before it is promoted"}
    sizes = {v: (tinyllama_models / f"tinyllama-{v}" / "model.safetensors").stat().st_size
             for v in tinyllama.VARIANTS}
    assert sizes["v3"] > 3 * sizes["v1"]


def test_eval_prompts_are_written_beside_the_checkpoints(tinyllama_models):
    prompts = json.loads((tinyllama_models / tinyllama.EVAL_FILE).read_text())["prompts"]
    assert prompts == tinyllama.eval_prompts()
    assert len(prompts) >= 20
    for prompt in prompts:  # each prefix belongs to one sentence
        assert sum(s.startswith(prompt + " ") for s in tinyllama.CORPUS) == 1


def test_untrained_checkpoint_stays_random(tmp_path):
    random = tinyllama.write_checkpoint(tmp_path / "random", tinyllama.TinyLlama(train_steps=0))
    text, margin = _greedy(random, "the quick brown")
    assert text != " fox jumps over the lazy dog"
    assert margin < 1.0


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(ValueError, match="variant"):
        tinyllama.write_tinyllama(tmp_path, "v9")
