"""The decoder stage of a vision-language model: a LLaVA checkpoint's Llama
decoder run by our torch engine, its prompts carrying visual tokens, against
transformers' LlavaForConditionalGeneration (FP32, CPU), alone, batched
with text-only sequences, through the sequence loop and an engine core; and
built by onnxruntime-genai's builder (FP32, and the edge's INT4) into a
pipeline that takes them.

The tiny LLaVA model is trained for a second to answer each of four images
with one sentence of tinyllama's corpus (from the image tokens alone), so its
greedy choices after an image lead by wide margins, which INT4 keeps. Logits
are compared with a tolerance; greedy tokens only over the steps where the
reference's best token leads the next by a clear margin (`MARGIN`, far above
FP32's rounding), so no near tie decides a comparison."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from tiered.agent.engine_core import CoreSpec, EngineCore  # noqa: E402
from tiered.agent.scheduler import Entry, SequenceLoop  # noqa: E402
from tiered.engines.generative.base import Sampling  # noqa: E402
from tiered.engines.generative.torch_engine import (  # noqa: E402
    TorchGenerativeEngine,
    TorchGenerativeSettings,
)
from tiered.engines.generative.visual import (  # noqa: E402
    VISUAL_FACTS,
    VisualFacts,
    decoder_checkpoint,
)
from tiered.errors import ConfigError, InvalidArgument  # noqa: E402
from tiered.models import tinyllama  # noqa: E402

IMAGE = "<image>"
TOKENS_PER_IMAGE = 16  # (8 / 2) ** 2 patches, the CLS row dropped
MARGIN = 1e-3  # a greedy choice this far ahead of the next is no tie
NEW_TOKENS = 8
SETTINGS = {"device": "cpu", "precision": "fp32"}


def _write_llava(out, images: torch.Tensor, train_steps: int = 60):
    """A LLaVA checkpoint: a 2-layer CLIP vision tower on 8x8 images, the
    projector, a tiny Llama decoder, and tinyllama's tokenizer with
    `<image>` as a special token; trained to answer `images` [n, 3, 8, 8]
    (an image alone in the prompt) with the first n sentences of tinyllama's
    corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        PreTrainedTokenizerFast,
    )

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(tinyllama.CORPUS * 20, trainers.BpeTrainer(
        vocab_size=512, special_tokens=[*tinyllama.SPECIAL, IMAGE], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(image_size=8, patch_size=2, hidden_size=64,
                                       intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4),
        text_config=LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=256,
                                vocab_size=tokenizer.get_vocab_size(),
                                max_position_embeddings=256, bos_token_id=1,
                                eos_token_id=tinyllama.EOS_ID),
        image_token_index=tokenizer.token_to_id(IMAGE),
        vision_feature_select_strategy="default", vision_feature_layer=-2)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    _train(model, images, [tokenizer.encode(s).ids for s in tinyllama.CORPUS[:len(images)]],
           config.image_token_index, train_steps)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def _train(model, images: torch.Tensor, sentences: list[list[int]], image_token: int,
           steps: int) -> None:
    """Full-batch AdamW: image i's tokens, then sentence i and end of sequence
    (the loss on the sentence's tokens only)."""
    rows = [[image_token] * TOKENS_PER_IMAGE + ids + [tinyllama.EOS_ID] for ids in sentences]
    width = max(map(len, rows))
    inputs = torch.full((len(rows), width), tinyllama.EOS_ID)
    labels = torch.full((len(rows), width), -100)
    for index, row in enumerate(rows):
        inputs[index, :len(row)] = torch.tensor(row)
        labels[index, TOKENS_PER_IMAGE:len(row)] = torch.tensor(row[TOKENS_PER_IMAGE:])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
        for _ in range(steps):
            loss = model(input_ids=inputs, pixel_values=images, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
        model.eval()


@pytest.fixture(scope="module")
def images():
    """Four images (pixel values), each answered with its own sentence."""
    return torch.randn((4, 3, 8, 8), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def llava(tmp_path_factory, images):
    return _write_llava(tmp_path_factory.mktemp("llava") / "llava", images)


@pytest.fixture(scope="module")
def reference(llava):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def decoder(llava, tmp_path_factory):
    return decoder_checkpoint(llava, tmp_path_factory.mktemp("decoder") / "decoder")


@pytest.fixture(scope="module")
def engine(decoder):
    return TorchGenerativeEngine(decoder, TorchGenerativeSettings(**SETTINGS))


def _visual(reference, pixels: torch.Tensor) -> np.ndarray:
    """The vision stage's output for `pixels` [images, 3, H, W], as
    transformers computes it: [images * tokens per image, hidden]."""
    with torch.no_grad():
        features = reference.get_image_features(pixel_values=pixels).pooler_output
    return torch.cat(list(features)).numpy()


def _prompt(engine, text: str, images: int = 1) -> list[int]:
    return engine.encode(IMAGE * (TOKENS_PER_IMAGE * images) + text)


def _greedy_reference(reference, ids: list[int], pixels: torch.Tensor | None
                      ) -> tuple[list[int], int]:
    """transformers' greedy tokens and how many of the first lead by MARGIN."""
    with torch.no_grad():
        images = {} if pixels is None else {"pixel_values": pixels}
        out = reference.generate(input_ids=torch.tensor([ids]), **images,
                                 max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=tinyllama.EOS_ID)
    clear = 0
    for logits in out.logits:
        top = torch.topk(logits[0].float(), 2).values
        if top[0] - top[1] < MARGIN:
            break
        clear += 1
    return out.sequences[0, len(ids):].tolist(), clear


def _alone(engine, prompt: list[int], visual: np.ndarray | None = None,
           tokens: int = NEW_TOKENS) -> list[tuple[int, float]]:
    sequence = engine.start(prompt, Sampling(max_tokens=tokens), visual)
    out = []
    while engine.running:
        (token,) = engine.step()
        assert token.sequence == sequence
        out.append((token.id, token.logprob))
    return out


def _ids(tokens: list[tuple[int, float]]) -> list[int]:
    return [token for token, _ in tokens]


def test_the_decoder_checkpoint_is_the_llava_language_model_as_llama(llava, decoder,
                                                                     reference, engine):
    from transformers import LlamaForCausalLM

    facts = VisualFacts.read(decoder)
    image_token = json.loads((llava / "config.json").read_text())["image_token_index"]
    assert facts == VisualFacts(image_token, TOKENS_PER_IMAGE, 128)
    assert json.loads((decoder / "config.json").read_text())["model_type"] == "llama"
    assert engine.encode(IMAGE) == [image_token]
    assert not any("vision" in name or "projector" in name for name in
                   _tensor_names(decoder))
    llama = LlamaForCausalLM.from_pretrained(decoder, dtype=torch.float32).eval()
    ids = engine.encode("the quick brown fox jumps")
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(llama(torch.tensor([ids])).logits[0].numpy(), theirs,
                                   atol=1e-5, rtol=0)
    np.testing.assert_allclose(engine.prefix_logits(ids), theirs, atol=1e-4, rtol=0)
    # Text the model was not trained on: the reference may end it early (at
    # its end of sequence, which the engine must end at too), so the clear
    # steps are counted over both prompts. Which prompt ends where depends on
    # the CPU's float rounding in training: one ended after 3 tokens on one host.
    compared = 0
    for text in ("the quick brown fox jumps", "a regional server sits between"):
        ids = engine.encode(text)
        expected, clear = _greedy_reference(reference, ids, None)
        assert _ids(_alone(engine, ids))[:clear] == expected[:clear], text
        compared += clear
    assert compared >= 4, f"only {compared} greedy steps lead by {MARGIN}"


def _tensor_names(directory) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "np") as f:
        return list(f.keys())


@pytest.mark.parametrize("image", [0, 1, 2, 3])
def test_visual_tokens_answer_as_transformers_llava(image, reference, engine, images):
    pixels = images[image:image + 1]
    visual = _visual(reference, pixels)
    assert visual.shape == (TOKENS_PER_IMAGE, 128) and visual.dtype == np.float32
    ids = _prompt(engine, "")
    answer = _alone(engine, ids, visual, tokens=20)
    assert engine.decode(_ids(answer)) == tinyllama.CORPUS[image]  # what it learnt
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    ours = engine.prefix_logits(ids, visual)
    np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-4, rtol=0)
    # the image counts: without its visual tokens the logits differ
    assert np.abs(engine.prefix_logits(ids, visual * 0.5) - ours).max() > 1e-2
    expected, clear = _greedy_reference(reference, ids, pixels)
    assert clear >= 4, f"image {image}: only {clear} greedy steps lead by {MARGIN}"
    assert _ids(_alone(engine, ids, visual))[:clear] == expected[:clear]


def test_sequences_with_and_without_images_batch_in_one_step(reference, engine, images):
    visual = [_visual(reference, images[i:i + 1]) for i in (0, 1)]
    both = _visual(reference, images[:2])  # two images in one prompt
    assert np.abs(visual[0] - visual[1]).max() > 1e-2
    requests = [(engine.encode("the quick brown"), None),
                (_prompt(engine, ""), visual[0]),
                (_prompt(engine, ""), visual[1]),
                (_prompt(engine, "a regional"), visual[0]),
                (_prompt(engine, "edge gateways", images=2), both),
                (engine.encode("a regional server sits"), None)]
    alone = [_alone(engine, prompt, rows) for prompt, rows in requests]
    assert len({tuple(_ids(a)) for a in alone[1:3]}) == 2  # the two images answer apart
    # all but the last start together: one prefill of text and image prompts
    # of different lengths; the last joins while the others decode
    names = {engine.start(prompt, Sampling(max_tokens=NEW_TOKENS), rows): n
             for n, (prompt, rows) in enumerate(requests[:-1])}
    got: dict[int, list[tuple[int, float]]] = {n: [] for n in range(len(requests))}
    for turn in range(NEW_TOKENS):
        if turn == 2:
            names[engine.start(requests[-1][0], Sampling(max_tokens=NEW_TOKENS))] = 5
        for token in engine.step():
            got[names[token.sequence]].append((token.id, token.logprob))
    while engine.running:
        for token in engine.step():
            got[names[token.sequence]].append((token.id, token.logprob))
    for n, expected in enumerate(alone):
        assert _ids(got[n]) == _ids(expected), f"request {n}"
        np.testing.assert_allclose([lp for _, lp in got[n]], [lp for _, lp in expected],
                                   atol=1e-4)


def test_visual_tokens_that_do_not_fit_the_prompt_are_invalid_argument_naming_them(
        reference, engine, decoder, images, tmp_path):
    visual = _visual(reference, images[:1])
    prompt = _prompt(engine, "the quick")
    sampling = Sampling(max_tokens=2)
    cases = [(prompt, visual[:-1], "15 visual tokens for the prompt's 16 image tokens"),
             (prompt, np.zeros((TOKENS_PER_IMAGE, 64), np.float32), "hidden size is 128"),
             (prompt, None, "16 image tokens and no visual tokens"),
             (engine.encode("the quick"), visual, "0 image tokens"),
             (prompt, visual.ravel(), "expected a floating-point array"),
             (prompt, np.full_like(visual, np.nan), "not finite")]
    for ids, rows, said in cases:
        with pytest.raises(InvalidArgument, match=said) as raised:
            engine.start(ids, sampling, rows)
        assert str(raised.value).startswith("visual: ")
        with pytest.raises(InvalidArgument, match=said):
            engine.prefix_logits(ids, rows)
    assert engine.running == 0
    text_only = tmp_path / "text-only"
    shutil.copytree(decoder, text_only)
    (text_only / VISUAL_FACTS).unlink()
    plain = TorchGenerativeEngine(text_only, TorchGenerativeSettings(**SETTINGS))
    with pytest.raises(InvalidArgument, match="visual: this model version takes no visual tokens"):
        plain.start(prompt, sampling, visual)
    # FP64 rows are taken as FP32
    assert _alone(engine, prompt, visual.astype(np.float64), 3) == \
        _alone(engine, prompt, visual, 3)


def test_a_llava_checkpoint_that_cannot_make_a_decoder_is_refused(llava, tmp_path):
    config = json.loads((llava / "config.json").read_text())
    broken = tmp_path / "broken"
    shutil.copytree(llava, broken)
    for change, said in (({"image_token_index": 5}, "the tokenizer's <image> is 3"),
                         ({"model_type": "llama"}, "expected 'llava'"),
                         ({"vision_feature_select_strategy": "cls"}, "not one of default"),
                         ({"image_token_index": 10**6}, "outside text_config.vocab_size")):
        (broken / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=said):
            decoder_checkpoint(broken, tmp_path / "out")


def _entry(key: int, prompt: list[int], visual: np.ndarray | None) -> Entry:
    return Entry(key, prompt, Sampling(max_tokens=NEW_TOKENS), 0.0, math.inf, math.inf,
                 visual=visual)


def test_the_sequence_loop_carries_visual_tokens_to_the_engine(reference, engine, images):
    visual = [_visual(reference, images[i:i + 1]) for i in (0, 1)]
    prompt = _prompt(engine, "the quick brown")
    requests = {1: (prompt, visual[0]), 2: (engine.encode("the quick brown"), None),
                3: (prompt, visual[1])}
    expected = {key: _ids(_alone(engine, *request)) for key, request in requests.items()}
    loop = SequenceLoop(engine)
    for key, request in requests.items():
        loop.add(_entry(key, *request))
    loop.add(_entry(4, prompt, visual[0][:3]))  # too few: fails alone
    got: dict[int, list[int]] = {key: [] for key in requests}
    turn = loop.turn()
    [(key, error)] = turn.failed
    assert key == 4 and isinstance(error, InvalidArgument) and "visual" in str(error)
    while True:
        for key, token, _, _ in turn.tokens:
            got[key].append(token)
        if not loop.busy:
            break
        turn = loop.turn()
    assert got == expected


def test_an_engine_core_gets_visual_tokens_in_its_work_frame(reference, engine, decoder,
                                                            images):
    visual = _visual(reference, images[1:2])
    prompt = _prompt(engine, "a canary takes a few")
    expected = _ids(_alone(engine, prompt, visual))
    core = EngineCore(CoreSpec("llava-decoder v1", "torch-generative", decoder,
                               {**SETTINGS, "max_sequences": 2}))
    core.start()
    try:
        core.send([_entry(1, prompt, visual), _entry(2, prompt, None)], [])
        got, failed = [], []
        while not got or not got[-1][1]:
            turn = core.receive()
            assert turn is not None
            failed += turn.failed
            got += [(token, last) for key, token, _, last in turn.tokens if key == 1]
        assert [token for token, _ in got] == expected
        [(key, error)] = failed
        assert key == 2 and "16 image tokens and no visual tokens" in str(error)
    finally:
        core.close()


@pytest.fixture(scope="module")
def genai_builds(decoder, tmp_path_factory):
    """The decoder built as the edge and a CPU FP32 build would be
    (onnxruntime-genai's builder, then completed to take visual tokens)."""
    from tiered.engines.build.generative import Target, lower

    root = tmp_path_factory.mktemp("genai")
    for precision in ("fp32", "int4"):
        lower(decoder, Target("onnxruntime-genai", precision, "cpu"), root / precision, root)
    return root


def test_the_edge_int4_decoder_takes_visual_tokens(genai_builds, reference, engine, images):
    from tiered.engines.generative.onnxruntime_genai_engine import OrtGenAIEngine

    fp32 = OrtGenAIEngine(genai_builds / "fp32")
    int4 = OrtGenAIEngine(genai_builds / "int4")
    assert int4.visual_facts == engine.visual_facts
    visual = [_visual(reference, images[i:i + 1]) for i in range(len(images))]
    both = np.concatenate(visual[:2])
    # FP32: the pipeline computes what the torch engine does, also for an
    # image pruned to fewer tokens than the stage makes (5 of 16 kept)
    pruned = visual[1][[0, 3, 7, 8, 15]]
    for ids, rows in ((_prompt(engine, "the quick"), visual[0]),
                      (_prompt(engine, "edge", images=2), both),
                      (engine.encode(IMAGE * len(pruned) + "edge"), pruned),
                      (engine.encode("the quick brown"), None)):
        np.testing.assert_allclose(fp32.prefix_logits(ids, rows), engine.prefix_logits(ids, rows),
                                   atol=1e-4, rtol=0)
    # INT4: each image's answer (wide margins) as FP32's, all in one running batch
    # with a two-image prompt, and a text-only one (no clear margins: it answers
    # as INT4 does alone)
    requests = [*((_prompt(engine, ""), rows) for rows in visual),
                (_prompt(engine, "", images=2), both),
                (engine.encode("the quick brown fox"), None)]
    expected = [_ids(_alone(engine, ids, rows, tokens=20)) for ids, rows in requests[:-1]]
    expected.append(_ids(_alone(int4, *requests[-1], tokens=20)))
    names = {int4.start(ids, Sampling(max_tokens=20), rows): n
             for n, (ids, rows) in enumerate(requests)}
    got: dict[int, list[int]] = {n: [] for n in names.values()}
    while int4.running:
        for token in int4.step():
            got[names[token.sequence]].append(token.id)
    assert [got[n] for n in range(len(requests))] == expected
    assert [int4.decode(got[n]) for n in range(4)] == list(tinyllama.CORPUS[:4])
    with pytest.raises(InvalidArgument, match="visual: 15 visual tokens"):
        int4.start(_prompt(engine, ""), Sampling(max_tokens=2), visual[0][:-1])
    assert int4.running == 0


def test_a_generation_request_carries_its_visual_tokens_to_the_engine(reference, engine,
                                                                      images):
    """The scheduler's text side: a request's visual tokens reach the engine
    beside its tokenized prompt, and the answer streams back as text."""
    import asyncio

    from tiered.agent.generation import GenerationRequest
    from tiered.agent.scheduler import Piece, Scheduler, SchedulerLimits

    async def answers() -> list[str | Exception]:
        scheduler = Scheduler(engine, SchedulerLimits(), asyncio.get_running_loop())
        try:
            queues = [asyncio.Queue() for _ in range(3)]
            for i, ready in zip((2, 3), queues):
                scheduler.submit(GenerationRequest(
                    IMAGE * TOKENS_PER_IMAGE, Sampling(max_tokens=20),
                    visual=_visual(reference, images[i:i + 1])), math.inf, ready.put_nowait)
            scheduler.submit(GenerationRequest(IMAGE * TOKENS_PER_IMAGE, Sampling(max_tokens=20)),
                             math.inf, queues[2].put_nowait)
            out: list[str | Exception] = []
            for ready in queues:
                text = ""
                while True:
                    event = await asyncio.wait_for(ready.get(), 30)
                    if not isinstance(event, Piece):
                        text = event
                        break
                    text += event.text
                    if event.last:
                        break
                out.append(text)
            return out
        finally:
            scheduler.close()

    first, second, missing = asyncio.run(answers())
    assert (first, second) == tinyllama.CORPUS[2:4]
    assert isinstance(missing, InvalidArgument)
    assert "visual: the prompt holds 16 image tokens and no visual tokens" in str(missing)
