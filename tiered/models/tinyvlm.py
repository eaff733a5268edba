"""Tiny LLaVA-shaped vision-language checkpoints made in code, for tests, the
demo and benchmarks: a CLIP-style vision tower, LLaVA's projector and a Llama
decoder (`LlavaForConditionalGeneration`), trained for seconds to answer
questions in words about scikit-learn's bundled 8x8 handwritten digits
("what digit is this?" -> "seven"). Nothing is downloaded. Needs torch,
transformers, tokenizers and scikit-learn; import it only where a model is
made or scored, never from the agent or the engines.

Why trained: as with `tiered.models.tinyllama`, random weights answer with
near ties that any quantization flips, so no gate could judge a build of
them; a trained model answers a held-out image by a wide margin, which a
sound INT8 vision stage keeps and a broken one does not.

The checkpoint directory (`tinyvlm-<variant>/`) is what
`LlavaForConditionalGeneration.save_pretrained` and the tokenizer's
`save_pretrained` write, plus `preprocessor_config.json` (a CLIP image
processor's fields). The tokenizer's `<image>` token has id
`config.image_token_index`. A prompt is `<image>` repeated `n_visual` times
(`config.image_seq_length`: 4 for v1 and v2, 8x8 pixels in 4x4 patches, the
CLS token dropped by the "default" feature selection), then a question, with
no BOS; the model continues with a space, the answer and `</s>`
(" seven</s>"). `answer` returns the words, stripped. Why 4x4 patches and a
128-wide tower: with 2x2 patches (16 visual tokens; about 1.7x the time per
step) or a 64-wide tower, the digit question ended at 93-97% held out within
the same budget, too near the 95% a gate is to judge against.

Images and pixels. A stored image is the data set's own: uint8 [8, 8],
integers 0..16 (16 = full ink). `pixel_values` for the vision tower are FP32
[batch, 3, 8, 8]: each image as float, times `rescale_factor` (1/16, exact in
binary), minus `image_mean` (0.5) over `image_std` (0.5), the grey plane
repeated on all three channels; no resize, no crop. So 0 -> -1.0 and
16 -> +1.0. preprocessor_config.json says exactly that, and it is what the
models were trained on.

Data files, written beside the checkpoints:
- `tinyvlm-eval.npz`: the held-out split (20%, stratified, seed 0, the same
  for every variant): `image` uint8 [n, 8, 8], `label` int64 [n], `question`
  str [k] (the question kinds' texts), `answer` str [n, k] (the right answer
  to each question about each image), `pixel_values` FP32 [n, 3, 8, 8];
- `tinyvlm-calibration.npz`: `image` and `pixel_values` of 256 training
  images, for INT8 calibration of the vision stage.

Variants (`VARIANTS`): `v1` the base; `v2` v1's shape retrained with another
seed (a new version with mostly the same answers); `bench` random weights at
a realistic size for benchmarks (a CLIP-B/16-like tower at 224 px, 196
visual tokens, and a decoder of TinyLlama-1.1B's shape), written in FP16 so
that writing it takes seconds, not minutes.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "CALIBRATION_FILE",
    "EVAL_FILE",
    "IMAGE_TOKEN",
    "NUMBER_WORDS",
    "PREPROCESSOR_FILE",
    "QUESTIONS",
    "VARIANTS",
    "DigitsSplit",
    "TinyVlm",
    "TinyVlmModel",
    "accuracy",
    "answer",
    "digits_split",
    "pixel_values",
    "prompt",
    "write_checkpoint",
    "write_tinyvlm",
]

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# Question kinds and how each answers for a digit. Every answer is one word.
QUESTIONS: dict[str, Callable[[int], str]] = {
    "what digit is this?": lambda digit: NUMBER_WORDS[digit],
    "is it odd or even?": lambda digit: "odd" if digit % 2 else "even",
    "is it more than four?": lambda digit: "yes" if digit > 4 else "no",
}
IMAGE_TOKEN = "<image>"
SPECIAL = ("<unk>", "<s>", "</s>", IMAGE_TOKEN)
BOS_ID, EOS_ID, IMAGE_ID = 1, 2, 3  # SPECIAL's indices

EVAL_FILE = "tinyvlm-eval.npz"
CALIBRATION_FILE = "tinyvlm-calibration.npz"
PREPROCESSOR_FILE = "preprocessor_config.json"
CALIBRATION_SAMPLES = 256
SPLIT_SEED = 0
TEST_FRACTION = 0.2
DIGIT_SIZE = 8
DIGIT_MAX = 16  # the data set's full-ink value
# Preprocessing of a stored image (see the module docstring).
RESCALE = 1.0 / DIGIT_MAX
MEAN = 0.5
STD = 0.5
# Answers are one word: a token or two, then end of sequence.
MAX_ANSWER_TOKENS = 4
# One thread: these matrices are too small for a second thread to pay on the
# 2-core dev machines, and a fixed count keeps weights identical run to run.
TRAIN_THREADS = 1

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TinyVlm:
    """The shape of a model and how it is trained. The vision tower sees
    `image_size` pixels in `patch_size` patches ((image_size / patch_size)^2
    visual tokens); images larger than the digits' 8x8 are upsampled
    (nearest) in `pixel_values`, for benchmark shapes only."""

    image_size: int = DIGIT_SIZE
    patch_size: int = 4
    vision_layers: int = 2
    vision_hidden: int = 128
    vision_heads: int = 4
    vision_intermediate: int = 512
    # Which hidden state LLaVA takes from the tower: the last one here (with
    # two layers, LLaVA's usual -2 would leave the second one unused).
    vision_feature_layer: int = -1
    text_layers: int = 2
    text_hidden: int = 128
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate: int = 256
    vocab: int = 512  # at most; the tokenizer learns fewer from the questions and answers
    # The decoder's vocabulary when larger than the tokenizer's (a real
    # model's embedding and lm_head size; ids past the tokenizer decode to nothing)
    padded_vocab: int = 0
    context: int = 256
    seed: int = 0  # initial weights and the order of training examples
    train_steps: int = 400  # AdamW steps; 0 leaves the weights random
    batch_size: int = 64
    # Higher peak rates (3e-3 and up) left every answer at the prior (the
    # likeliest word whatever the image) within these few steps.
    learning_rate: float = 1e-3
    dtype: str = "float32"  # of the saved weights

    def __post_init__(self) -> None:
        if self.image_size < self.patch_size or self.image_size % self.patch_size:
            raise ValueError(f"image_size: {self.image_size} is not a multiple of "
                             f"patch_size {self.patch_size}")
        if self.image_size % DIGIT_SIZE:
            raise ValueError(f"image_size: {self.image_size} is not a multiple of the "
                             f"digits' {DIGIT_SIZE} pixels")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype: {self.dtype!r} is not float32, float16 or bfloat16")
        if self.train_steps < 0:
            raise ValueError(f"train_steps: must be at least 0, got {self.train_steps}")

    @property
    def n_visual(self) -> int:
        """Visual tokens per image."""
        return (self.image_size // self.patch_size) ** 2


VARIANTS: dict[str, TinyVlm] = {
    "v1": TinyVlm(),
    "v2": TinyVlm(seed=1),
    # Random weights, a realistic cost: a CLIP-B/16-like tower at 224 px (196
    # visual tokens, LLaVA's penultimate layer) and TinyLlama-1.1B's decoder.
    "bench": TinyVlm(image_size=224, patch_size=16, vision_layers=12, vision_hidden=768,
                     vision_heads=12, vision_intermediate=3072, vision_feature_layer=-2,
                     text_layers=22, text_hidden=2048, text_heads=32, text_kv_heads=4,
                     text_intermediate=5632, padded_vocab=32000, context=2048,
                     train_steps=0, dtype="float16"),
}


@dataclass(frozen=True)
class DigitsSplit:
    """The data set as stored: images uint8 [n, 8, 8] in 0..16, labels int64 [n]."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


@dataclass(frozen=True)
class TinyVlmModel:
    """What `write_tinyvlm` wrote and measured."""

    variant: str
    checkpoint: Path
    eval_path: Path
    calibration_path: Path
    seconds: float  # to make, train and save the checkpoint
    parameters: int
    accuracy: dict[str, float]  # held-out share right per question; empty when untrained

    def summary(self) -> str:
        scores = ", ".join(f"{q!r} {share:.1%}" for q, share in self.accuracy.items())
        return (f"tinyvlm {self.variant}: {self.checkpoint} ({self.parameters:,} parameters, "
                f"written in {self.seconds:.1f} s); held-out accuracy "
                f"{scores or 'not measured (random weights)'}")


def digits_split(test_fraction: float = TEST_FRACTION, seed: int = SPLIT_SEED) -> DigitsSplit:
    """The bundled digits at their own scale, split stratified by class."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = data.images.astype(np.uint8)  # integers 0..16 stored as float64
    labels = data.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=test_fraction, stratify=labels, random_state=seed)
    return DigitsSplit(*(np.ascontiguousarray(a) for a in (train_x, train_y, test_x, test_y)))


def prompt(question: str, n_visual: int) -> str:
    """The text of a prompt: the image's placeholders, then the question."""
    return IMAGE_TOKEN * n_visual + question


def pixel_values(images: np.ndarray, image_size: int = DIGIT_SIZE) -> np.ndarray:
    """FP32 [n, 3, S, S] from stored images [n, 8, 8] (0..16), as the module
    docstring says; upsampled by repetition when `image_size` > 8."""
    grey = (np.asarray(images, dtype=np.float32) * np.float32(RESCALE) - np.float32(MEAN)) \
        / np.float32(STD)
    factor = image_size // DIGIT_SIZE
    if factor > 1:
        grey = grey.repeat(factor, axis=1).repeat(factor, axis=2)
    return np.ascontiguousarray(np.repeat(grey[:, None], 3, axis=1))


def write_tinyvlm(out: Path, variant: str, shape: TinyVlm | None = None, *,
                  progress: Progress | None = None) -> TinyVlmModel:
    """`out/tinyvlm-<variant>/` (the variant's shape, or `shape`) and the eval
    and calibration files beside it; a trained model is scored on the
    held-out split."""
    if shape is None and variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r} is not one of {', '.join(VARIANTS)}")
    shape = shape or VARIANTS[variant]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    split = digits_split()
    eval_path, calibration_path = _write_data(out, split)
    start = time.perf_counter()
    checkpoint, parameters = write_checkpoint(out / f"tinyvlm-{variant}", shape, split,
                                              progress=progress)
    seconds = time.perf_counter() - start
    scores = accuracy(checkpoint, eval_path) if shape.train_steps else {}
    return TinyVlmModel(variant, checkpoint, eval_path, calibration_path, seconds,
                        parameters, scores)


def write_checkpoint(out: Path, shape: TinyVlm = TinyVlm(), split: DigitsSplit | None = None,
                     *, progress: Progress | None = None) -> tuple[Path, int]:
    """A checkpoint directory at `out` (made, or overwritten) and its parameter count."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    tokenizer, fast = _tokenizer(shape.vocab)
    vision = CLIPVisionConfig(
        image_size=shape.image_size, patch_size=shape.patch_size, num_channels=3,
        hidden_size=shape.vision_hidden, intermediate_size=shape.vision_intermediate,
        num_hidden_layers=shape.vision_layers, num_attention_heads=shape.vision_heads,
        hidden_act="quick_gelu")
    text = LlamaConfig(
        vocab_size=max(tokenizer.get_vocab_size(), shape.padded_vocab),
        hidden_size=shape.text_hidden, intermediate_size=shape.text_intermediate,
        num_hidden_layers=shape.text_layers, num_attention_heads=shape.text_heads,
        num_key_value_heads=shape.text_kv_heads, max_position_embeddings=shape.context,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
        tie_word_embeddings=False)
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_ID,
        image_seq_length=shape.n_visual, vision_feature_layer=shape.vision_feature_layer,
        vision_feature_select_strategy="default", projector_hidden_act="gelu")
    dtype = getattr(torch, shape.dtype)
    with _torch_threads(TRAIN_THREADS), torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        with _default_dtype(dtype):  # a large random model is made in its saved precision
            model = LlavaForConditionalGeneration(config)
        if shape.train_steps:
            say = progress or (lambda _line: None)
            _train(model, fast, shape, split or digits_split(),
                   lambda line: say(f"{out.name}: {line}"))
    model.eval()
    model.generation_config.pad_token_id = EOS_ID
    model.generation_config.eos_token_id = EOS_ID
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    (out / PREPROCESSOR_FILE).write_text(json.dumps(_preprocessor_config(shape), indent=2) + "\n")
    return out, sum(p.numel() for p in model.parameters())


def answer(checkpoint: Path, images: np.ndarray, question: str) -> list[str]:
    """The FP32 reference: transformers' model, greedy, one answer per stored
    image ([n, 8, 8], 0..16), the words stripped of spaces and specials."""
    import torch
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    config = json.loads((Path(checkpoint) / PREPROCESSOR_FILE).read_text())
    return _answer(model, tokenizer, images, question, config["size"]["height"])


def accuracy(checkpoint: Path, eval_path: Path) -> dict[str, float]:
    """The held-out share of right answers, per question."""
    import torch
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    size = json.loads((Path(checkpoint) / PREPROCESSOR_FILE).read_text())["size"]["height"]
    with np.load(eval_path) as data:
        images, questions, answers = data["image"], list(data["question"]), data["answer"]
    return {str(question): float(np.mean(
        np.array(_answer(model, tokenizer, images, str(question), size)) == answers[:, kind]))
        for kind, question in enumerate(questions)}


def _answer(model, tokenizer, images: np.ndarray, question: str, image_size: int) -> list[str]:
    import torch

    n_visual = model.config.image_seq_length
    ids = tokenizer(prompt(question, n_visual), add_special_tokens=False)["input_ids"]
    pixels = torch.from_numpy(pixel_values(images, image_size))
    inputs = torch.tensor([ids]).repeat(len(pixels), 1)
    with torch.no_grad():
        out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                             pixel_values=pixels, max_new_tokens=MAX_ANSWER_TOKENS,
                             do_sample=False, pad_token_id=EOS_ID, eos_token_id=EOS_ID)
    return [text.strip() for text in
            tokenizer.batch_decode(out[:, len(ids):], skip_special_tokens=True)]


def _tokenizer(vocab: int):
    """A byte-level BPE tokenizer trained on every question and answer, with
    `SPECIAL` at ids 0..3; and the same as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [f"{question} {reply(digit)}" for question, reply in QUESTIONS.items()
             for digit in range(10)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts * 10, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(SPECIAL), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>", pad_token="</s>",
                                   extra_special_tokens={"image_token": IMAGE_TOKEN})
    return tokenizer, fast


def _examples(fast, n_visual: int) -> tuple[np.ndarray, np.ndarray]:
    """Token rows for every (question, digit): input ids [k, 10, width] (the
    prompt, " answer", end of sequence, padded with end of sequence) and
    labels (the answer and end of sequence; -100, ignored, elsewhere)."""
    rows = []
    for question, reply in QUESTIONS.items():
        ids = fast(prompt(question, n_visual), add_special_tokens=False)["input_ids"]
        for digit in range(10):
            tail = fast(" " + reply(digit), add_special_tokens=False)["input_ids"] + [EOS_ID]
            rows.append((ids + tail, [-100] * len(ids) + tail))
    width = max(len(ids) for ids, _ in rows)
    inputs = np.full((len(rows), width), EOS_ID, dtype=np.int64)
    labels = np.full((len(rows), width), -100, dtype=np.int64)
    for index, (ids, targets) in enumerate(rows):
        inputs[index, :len(ids)] = ids
        labels[index, :len(targets)] = targets
    return inputs.reshape(len(QUESTIONS), 10, width), labels.reshape(len(QUESTIONS), 10, width)


def _train(model, fast, shape: TinyVlm, split: DigitsSplit, say: Progress) -> None:
    """AdamW with a one-cycle learning rate on random (training image,
    question) pairs, the loss on the answer's tokens only. Right padding needs
    no attention mask: causal attention never looks ahead. Images are not
    shifted as the digits CNN's are: shifting all or half of them kept the
    answers at the prior, or below 95% held out, within these few steps."""
    import torch

    inputs, labels = (torch.from_numpy(a) for a in _examples(fast, shape.n_visual))
    digits = torch.from_numpy(split.train_labels)
    rng = np.random.default_rng(shape.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=shape.learning_rate, total_steps=shape.train_steps, pct_start=0.2)
    model.train()
    start = time.perf_counter()
    for step in range(1, shape.train_steps + 1):
        rows = torch.from_numpy(rng.integers(0, len(digits), shape.batch_size))
        kinds = torch.from_numpy(rng.integers(0, len(QUESTIONS), shape.batch_size))
        pixels = torch.from_numpy(pixel_values(split.train_images[rows.numpy()],
                                               shape.image_size))
        loss = model(input_ids=inputs[kinds, digits[rows]], pixel_values=pixels,
                     labels=labels[kinds, digits[rows]]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == shape.train_steps:
            say(f"step {step}/{shape.train_steps} loss {loss.item():.4f} "
                f"({time.perf_counter() - start:.1f} s)")
    model.eval()


def _write_data(out: Path, split: DigitsSplit) -> tuple[Path, Path]:
    """The eval and calibration npz files; returns their paths."""
    answers = np.array([[reply(int(digit)) for reply in QUESTIONS.values()]
                        for digit in split.test_labels])
    eval_path, calibration_path = out / EVAL_FILE, out / CALIBRATION_FILE
    np.savez(eval_path, image=split.test_images, label=split.test_labels,
             question=np.array(list(QUESTIONS)), answer=answers,
             pixel_values=pixel_values(split.test_images))
    # The split is already shuffled, so its first images cover every class.
    calibration = split.train_images[:CALIBRATION_SAMPLES]
    np.savez(calibration_path, image=calibration, pixel_values=pixel_values(calibration))
    return eval_path, calibration_path


def _preprocessor_config(shape: TinyVlm) -> dict:
    """A CLIP image processor's fields that reproduce `pixel_values` from a
    stored 8x8 image (resized to `image_size` where it is larger)."""
    return {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": shape.image_size != DIGIT_SIZE,
        "size": {"height": shape.image_size, "width": shape.image_size},
        "resample": 0,  # nearest
        "do_center_crop": False,
        "do_convert_rgb": True,
        "do_rescale": True,
        "rescale_factor": RESCALE,
        "do_normalize": True,
        "image_mean": [MEAN] * 3,
        "image_std": [STD] * 3,
    }


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _default_dtype(dtype) -> Iterator[None]:
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)

