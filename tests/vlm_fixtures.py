"""Small LLaVA-style checkpoints with random weights, for the vision-language
tests: the layout `LlavaForConditionalGeneration.save_pretrained` writes, the
tokenizer (with its `<image>` token) and a `preprocessor_config.json`, as the
project's vision-language checkpoints hold them.

Random weights answer nothing sensible, but greedy answers are still a
deterministic function of the visual tokens, which is what a vision stage's
gate compares. Their margins are small: an INT8 vision stage whose tokens
keep a cosine of 0.998 still changes about a fifth of the answers.
"""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_TOKEN = "<image>"
SPECIAL = ("<unk>", "<s>", "</s>", IMAGE_TOKEN)
WORDS = ("what", "is", "in", "the", "picture", "a", "cat", "dog", "red", "blue", "green",
         "square", "circle", "colour", "shape", "how", "many", "?", "it", "yes", "no")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
QUESTIONS = ("what is in the picture ?", "what colour is it ?", "what shape is it ?",
             "is it a cat ?")


def write_tiny_llava(out: Path, *, seed: int = 0, image_size: int = 8, patch_size: int = 2,
                     vision_feature_layer: int = -2, projector_noise: float = 0.0, noise_seed: int = 1) -> Path:
    """A random-weight LLaVA checkpoint at `out` (made or overwritten).

    `projector_noise`: Gaussian noise of this standard deviation (relative to
    each projector weight's own) added to the projector's weights after the
    seeded initialisation, so that a checkpoint can differ from the seed's
    only in its projector."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        PreTrainedTokenizerFast,
    )

    vocab = {token: index for index, token in enumerate((*SPECIAL, *WORDS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=[IMAGE_TOKEN])
    image_token_index = vocab[IMAGE_TOKEN]
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            image_size=image_size, patch_size=patch_size, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            projection_dim=64),
        text_config=LlamaConfig(
            vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], tie_word_embeddings=False),
        image_token_index=image_token_index,
        vision_feature_select_strategy="default",
        vision_feature_layer=vision_feature_layer,
        projector_hidden_act="gelu",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    if projector_noise:
        generator = torch.Generator().manual_seed(noise_seed)
        with torch.no_grad():
            for parameter in model.model.multi_modal_projector.parameters():
                noise = torch.randn(parameter.shape, generator=generator)
                parameter.add_(noise * parameter.std() * projector_noise)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor",
        "size": {"height": image_size, "width": image_size},
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
    }, indent=1) + "\n")
    return out


def n_visual(image_size: int = 8, patch_size: int = 2) -> int:
    """Visual tokens per image with the "default" strategy (CLS dropped)."""
    return (image_size // patch_size) ** 2


def eval_images(count: int, size: int = 12, seed: int = 0):
    """uint8 RGB images [count, size, size, 3] of flat colours with a square of
    another colour: structured enough to have spread-out activations."""
    import numpy as np

    rng = np.random.default_rng(seed)
    images = np.empty((count, size, size, 3), np.uint8)
    for index in range(count):
        images[index] = rng.integers(0, 256, 3, dtype=np.uint8)
        top, left = rng.integers(0, size // 2, 2)
        images[index, top:top + size // 2, left:left + size // 2] = rng.integers(0, 256, 3)
    images = np.clip(images.astype(np.int16) + rng.integers(-12, 13, images.shape), 0, 255)
    return images.astype(np.uint8)


def write_eval_npz(path: Path, count: int, seed: int = 0) -> Path:
    """An eval npz of the vision stage's build: `images` and a `questions` each."""
    import numpy as np

    questions = np.array([QUESTIONS[i % len(QUESTIONS)] for i in range(count)])
    np.savez(path, images=eval_images(count, seed=seed), questions=questions)
    return path

