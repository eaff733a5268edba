"""The generative torch engine: transformers' Llama numerics, a static KV cache
of bounded slots, one batched decode step for every running sequence."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from tiered.engines.generative.base import Sampling  # noqa: E402
from tiered.engines.generative.torch_engine import (  # noqa: E402
    TorchGenerativeEngine,
    TorchGenerativeSettings,
    has_fp8_tensor_cores,
    prefill_length,
    prefill_shapes,
)
from tiered.errors import ConfigError, InvalidArgument, ResourceExhausted  # noqa: E402
from tiered.models import tinyllama  # noqa: E402

PROMPTS = ("the quick", "edge gateways answer first", "a canary takes a few percent",
           "small models run on gateways")


def _engine(checkpoint, **settings) -> TorchGenerativeEngine:
    return TorchGenerativeEngine(checkpoint, TorchGenerativeSettings(
        **{"device": "cpu", "precision": "fp32", **settings}))


def _alone(engine, prompt: list[int], sampling: Sampling) -> list[tuple[int, float]]:
    sequence = engine.start(prompt, sampling)
    out = []
    while engine.running:
        (token,) = engine.step()
        assert token.sequence == sequence
        out.append((token.id, token.logprob))
    return out


@pytest.fixture(scope="module")
def v1(tinyllama_models):
    return tinyllama_models / "tinyllama-v1"


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """Random weights, GQA of 3 query heads per key head, and a head_dim
    other than hidden / heads: the shapes the tiny variants do not cover."""
    shape = tinyllama.TinyLlama(layers=3, hidden=96, heads=6, kv_heads=2, intermediate=160,
                                train_steps=0, seed=3)
    checkpoint = tinyllama.write_checkpoint(tmp_path_factory.mktemp("untrained"), shape)
    import json

    config = json.loads((checkpoint / "config.json").read_text())
    assert config["num_attention_heads"] // config["num_key_value_heads"] == 3
    return checkpoint


@pytest.mark.parametrize("which", ["v1", "v3", "untrained"])
def test_logits_match_transformers_llama_in_fp32(which, tinyllama_models, untrained):
    from transformers import LlamaForCausalLM

    checkpoint = untrained if which == "untrained" else \
        tinyllama_models / f"tinyllama-{which}"
    engine = _engine(checkpoint)
    reference = LlamaForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    for text in PROMPTS:
        ids = engine.encode(text + " and then some more words")
        ours = engine.prefix_logits(ids)
        with torch.no_grad():
            theirs = reference(torch.tensor([ids])).logits[0].numpy()
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_greedy_decode_matches_transformers_generate(v1):
    from transformers import LlamaForCausalLM

    engine = _engine(v1)
    reference = LlamaForCausalLM.from_pretrained(v1).eval()
    for text in PROMPTS:
        ids = engine.encode(text)
        ours = [token for token, _ in _alone(engine, ids, Sampling(max_tokens=12))]
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                     pad_token_id=tinyllama.EOS_ID)
        assert ours == out[0, len(ids):].tolist()
    assert engine.decode(engine.encode("the quick brown")) == "the quick brown"


@pytest.mark.parametrize("which", ["v1", "untrained"])
def test_batched_decode_equals_each_sequence_decoded_alone(which, v1, untrained):
    engine = _engine(v1 if which == "v1" else untrained)
    sampling = Sampling(max_tokens=10)
    prompts = [engine.encode(text) for text in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths
    alone = [_alone(engine, p, sampling) for p in prompts]
    ids = [engine.start(p, sampling) for p in prompts]
    together: dict[int, list[tuple[int, float]]] = {i: [] for i in ids}
    while engine.running:
        tokens = engine.step()
        assert len({t.sequence for t in tokens}) == len(tokens)  # one token each
        for token in tokens:
            together[token.sequence].append((token.id, token.logprob))
    for sequence, expected in zip(ids, alone, strict=True):
        got = together[sequence]
        assert [t for t, _ in got] == [t for t, _ in expected]
        np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in expected],
                                   atol=1e-4)


def test_sequences_join_and_leave_between_steps(v1):
    engine = _engine(v1, max_sequences=2)
    sampling = Sampling(max_tokens=8)
    first, second, third = (engine.encode(t) for t in PROMPTS[:3])
    expected = {name: [t for t, _ in _alone(engine, p, sampling)]
                for name, p in (("first", first), ("second", second), ("third", third))}
    got: dict[str, list[int]] = {"first": [], "second": [], "third": []}
    names = {engine.start(first, sampling): "first"}
    for _ in range(3):
        for token in engine.step():
            got[names[token.sequence]].append(token.id)
    names[engine.start(second, sampling)] = "second"  # joins while the first decodes
    tokens = engine.step()
    assert sorted(names[t.sequence] for t in tokens) == ["first", "second"]
    for token in tokens:
        got[names[token.sequence]].append(token.id)
    leaving = next(i for i, n in names.items() if n == "first")
    engine.stop(leaving)  # its client went away: its slot is free at once
    engine.stop(leaving)  # and an unknown id is ignored
    names[engine.start(third, sampling)] = "third"
    while engine.running:
        for token in engine.step():
            got[names[token.sequence]].append(token.id)
    assert got["first"] == expected["first"][:4]
    assert got["second"] == expected["second"]
    assert got["third"] == expected["third"]  # in the slot the first one left


def test_slots_are_bounded(v1):
    engine = _engine(v1, max_sequences=2, max_context=32)
    prompt = engine.encode("the quick")
    a = engine.start(prompt, Sampling(max_tokens=4))
    engine.start(prompt, Sampling(max_tokens=4))
    with pytest.raises(ResourceExhausted, match="2 sequences"):
        engine.start(prompt, Sampling(max_tokens=4))
    engine.stop(a)
    engine.start(prompt, Sampling(max_tokens=4))
    with pytest.raises(InvalidArgument, match="context of 32"):
        engine.stop(engine.start(prompt, Sampling(max_tokens=31)))
    with pytest.raises(InvalidArgument, match="no tokens"):
        engine.start([], Sampling())
    assert engine.describe()["sequences"] == "2"


def test_a_sequence_ends_at_end_of_sequence_or_max_tokens(v1):
    engine = _engine(v1)
    tokens = _alone(engine, engine.encode("the quick brown fox jumps over"), Sampling(64))
    assert [t for t, _ in tokens][-1] == tinyllama.EOS_ID
    assert engine.decode([t for t, _ in tokens]) == " the lazy dog"
    assert len(_alone(engine, engine.encode("the quick"), Sampling(max_tokens=3))) == 3


def test_sampling_is_seeded(v1):
    engine = _engine(v1)
    prompt = engine.encode("when the")
    hot = Sampling(max_tokens=10, temperature=5.0, seed=7)
    first = _alone(engine, prompt, hot)
    assert _alone(engine, prompt, hot) == first
    assert _alone(engine, prompt, Sampling(max_tokens=10, temperature=5.0, seed=8)) != first


def test_settings_that_cannot_run_are_refused(v1, tmp_path):
    with pytest.raises(ConfigError, match="fp16 runs on CUDA only"):
        _engine(v1, precision="fp16")
    with pytest.raises(ConfigError, match="max_cache_mib"):
        _engine(v1, max_sequences=100000, max_cache_mib=1)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        _engine(v1, max_context=100000)
    with pytest.raises(ConfigError, match="precision"):
        TorchGenerativeSettings(precision="int4")
    with pytest.raises(ConfigError, match="not a checkpoint"):
        _engine(tmp_path)


def test_bf16_on_the_cpu_answers_like_fp32(v1):
    fp32, bf16 = _engine(v1), _engine(v1, precision="bf16")
    prompt = fp32.encode("tokens stream one")
    assert [t for t, _ in _alone(bf16, prompt, Sampling(12))] == \
        [t for t, _ in _alone(fp32, prompt, Sampling(12))]


def test_fp8_weights_answer_like_fp32(v1):
    """FP8 E4M3 linear weights with a scale per output channel (widened on
    the CPU): the trained model's greedy answers stay FP32's, its linear
    weights take a byte each."""
    fp32, fp8 = _engine(v1), _engine(v1, precision="fp8")
    assert fp8.describe()["precision"] == "fp8"
    layer = fp8._weights["layers"][0]
    assert layer["gate_up"].dtype == torch.float8_e4m3fn
    assert layer["gate_up_scale"].shape == (1, layer["gate_up"].shape[0])
    assert fp8.weight_bytes < fp32.weight_bytes / 2
    for text in PROMPTS:
        prompt = fp32.encode(text)
        assert [t for t, _ in _alone(fp8, prompt, Sampling(12))] == \
            [t for t, _ in _alone(fp32, prompt, Sampling(12))]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8"])
@pytest.mark.parametrize("compile", [True, False])
def test_cuda_graph_decode_equals_eager_and_fp32(precision, compile, v1):
    if precision == "fp8" and not has_fp8_tensor_cores():
        pytest.skip("needs FP8 tensor cores")
    graphs = _engine(v1, device="cuda", precision=precision, compile=compile)
    eager = _engine(v1, device="cuda", precision=precision, cuda_graphs=False)
    fp32 = _engine(v1)
    sampling = Sampling(max_tokens=10)
    for engine in (graphs, eager, fp32):
        ids = [engine.start(engine.encode(t), sampling) for t in PROMPTS]
        out: dict[int, list[int]] = {i: [] for i in ids}
        while engine.running:
            for token in engine.step():
                out[token.sequence].append(token.id)
        engine.result = [out[i] for i in ids]
    assert graphs.describe()["cuda_graphs"] == "true"
    assert graphs.describe()["compiled"] == str(compile).lower()
    assert graphs.result == eager.result == fp32.result


@cuda
def test_cuda_graph_windows_follow_sequences_past_their_edges(v1):
    # Prompts of 60 and 122 tokens answer 8 and 13 (FP32 on the CPU): their
    # decodes cross the windows' edges at 64 and 128 positions.
    graphs = _engine(v1, device="cuda", precision="fp16")
    eager = _engine(v1, device="cuda", precision="fp16", cuda_graphs=False)
    text = graphs.encode(" ".join(PROMPTS * 8))
    for length in (60, 122):
        alone = [_alone(engine, text[:length], Sampling(max_tokens=100))
                 for engine in (graphs, eager)]
        assert [t for t, _ in alone[0]] == [t for t, _ in alone[1]]
        assert len(alone[0]) > 2
    assert {window for _, window in graphs._graphs} == {64, 128, 256}


def _staggered(engine) -> list[list[int]]:
    """Sequences that end at different steps and join late, into freed slots
    below running ones: each one's tokens, in the order they started."""
    out: dict[int, list[int]] = {}

    def start(text: str, tokens: int) -> None:
        out[engine.start(engine.encode(text), Sampling(max_tokens=tokens))] = []

    def step() -> None:
        for token in engine.step():
            out[token.sequence].append(token.id)

    for text, tokens in zip(PROMPTS, (3, 12, 5), strict=False):
        start(text, tokens)
    for _ in range(6):  # the first and third end; the second runs on in a higher slot
        step()
    start(PROMPTS[0], 9)
    step()
    start(PROMPTS[-1], 4)
    while engine.running:
        step()
    return list(out.values())


@cuda
def test_cuda_graph_decode_follows_sequences_into_freed_slots(v1):
    graphs = _engine(v1, device="cuda", precision="fp16")
    eager = _engine(v1, device="cuda", precision="fp16", cuda_graphs=False)
    assert _staggered(graphs) == _staggered(eager)
    assert _staggered(graphs) == _staggered(_engine(v1))  # and FP32 on the CPU
    # joining prompts were prefilled by graphs of few shapes: rows a bucket, length from 8
    assert graphs._prefill_graphs and not eager._prefill_graphs
    assert all(rows in graphs._buckets and length >= 8 and length & (length - 1) == 0
               for rows, length in graphs._prefill_graphs)


def test_staggered_sequences_answer_as_each_alone(v1):
    engine = _engine(v1)
    expected = [[t for t, _ in _alone(engine, engine.encode(text), Sampling(max_tokens=tokens))]
                for text, tokens in [*zip(PROMPTS, (3, 12, 5), strict=False),
                                     (PROMPTS[0], 9), (PROMPTS[-1], 4)]]
    assert _staggered(engine) == expected


@cuda
def test_cuda_graph_buckets_stop_at_the_cache_slots(v1):
    # 5 slots: the bucket of 8 would have rows beyond the cache; it is one of 5.
    graphs = _engine(v1, device="cuda", precision="fp16", max_sequences=5)
    eager = _engine(v1, device="cuda", precision="fp16", max_sequences=5, cuda_graphs=False)
    for engine in (graphs, eager):
        ids = [engine.start(engine.encode(t), Sampling(max_tokens=6))
               for t in (*PROMPTS, PROMPTS[0])]
        out: dict[int, list[int]] = {i: [] for i in ids}
        while engine.running:
            for token in engine.step():
                out[token.sequence].append(token.id)
        engine.result = [out[i] for i in ids]
    assert {bucket for bucket, _ in graphs._graphs} == {1, 2, 4, 5}
    assert graphs.result == eager.result


@cuda
def test_every_cuda_graph_is_captured_as_the_engine_loads(v1):
    # A capture compiles and tunes new shapes (seconds, which running
    # sequences would wait for) and writes the first slots' caches: none may
    # happen once sequences run.
    graphs = _engine(v1, device="cuda", precision="fp16", max_sequences=5)
    assert set(graphs._graphs) == {(b, w) for b in (1, 2, 4, 5) for w in graphs._windows}
    assert set(graphs._prefill_graphs) == set(prefill_shapes((1, 2, 4, 5), graphs.max_context))
    loaded = (dict(graphs._graphs), dict(graphs._prefill_graphs))
    assert _staggered(graphs) == _staggered(_engine(v1))
    assert (graphs._graphs, graphs._prefill_graphs) == loaded


def test_a_cuda_prefill_runs_at_few_lengths():
    lengths = {n: prefill_length(n, 4096) for n in range(1, 4097)}
    assert [lengths[n] for n in (1, 8, 9, 16, 17, 300, 512, 513, 1024, 1025, 4096)] == \
        [8, 8, 16, 16, 32, 512, 512, 1024, 1024, 1536, 4096]
    assert all(n <= length for n, length in lengths.items())  # room for every prompt
    assert len(set(lengths.values())) == 14  # 8 to 512 by doubling, 1024 to 4096 by 512
    assert prefill_length(100, 96) == 96  # never past the cache


def test_the_prefill_graphs_cover_each_bucket_and_length_up_to_their_positions():
    shapes = prefill_shapes((1, 2, 4, 8, 16, 32, 64), 512)
    assert len(shapes) == len(set(shapes)) == 39
    assert all(rows * length <= 2048 for rows, length in shapes)
    assert {length for rows, length in shapes if rows == 1} == \
        {prefill_length(n, 512) for n in range(1, 513)}  # one row: every length
    assert {length for rows, length in shapes if rows == 64} == {8, 16, 32}
