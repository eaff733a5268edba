"""The decoder stage of a vision-language model: a LLaVA checkpoint's
language model as a plain Llama checkpoint, and the visual tokens its
prompts carry.

A LLaVA checkpoint (`LlavaForConditionalGeneration`'s directory) holds a
vision tower, a projector and a Llama decoder. The vision stage turns an
image into `tokens_per_image` visual tokens, rows of the decoder's hidden
size; the decoder reads a prompt in which each image is that many copies of
the image token (`image_token_index`), whose embeddings are replaced by the
visual tokens, in order. `decoder_checkpoint` writes the decoder alone
(config.json from `text_config`, the Llama tensors under Llama's names, the
tokenizer), so every generative build and engine opens it as any Llama
checkpoint, plus `visual.json`: the facts an engine (and the server that
feeds it images) needs to place visual tokens (`VisualFacts`).

`visual_rows` checks a sequence's visual tokens against its prompt; an engine
calls it before it admits the sequence.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiered.errors import ConfigError, InvalidArgument

VISUAL_FACTS = "visual.json"  # beside a decoder checkpoint's config.json
IMAGE_TOKEN = "<image>"
SELECT_STRATEGIES = ("default", "full")  # default: the vision tower's CLS row dropped
# The tokenizer's files, copied beside the decoder's weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")
# A LLaVA checkpoint's language-model tensors, by prefix, and Llama's names for
# them: the layout `save_pretrained` writes, and the one its modules hold.
_LANGUAGE_PREFIXES = (("language_model.model.", "model."),
                      ("language_model.lm_head.", "lm_head."),
                      ("model.language_model.", "model."),
                      ("lm_head.", "lm_head."))


@dataclass(frozen=True)
class VisualFacts:
    """What a decoder needs to take visual tokens into its prompt."""

    image_token_index: int  # the prompt's placeholder of one visual token
    tokens_per_image: int  # visual tokens one image gives
    hidden_size: int  # the width of a visual token: the decoder's hidden size

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0 \
                    or (value == 0 and name != "image_token_index"):
                raise ConfigError(f"{name}: expected a positive integer, got {value!r}")

    @classmethod
    def of_llava(cls, config: Mapping[str, Any], where: str) -> VisualFacts:
        """The facts of a LLaVA config.json (`where` names it in errors)."""
        if config.get("model_type") != "llava":
            raise ConfigError(f"{where}: model_type {config.get('model_type')!r}; expected "
                              "'llava'")
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, Mapping) or not isinstance(text, Mapping):
            raise ConfigError(f"{where}: vision_config and text_config: expected objects")
        strategy = config.get("vision_feature_select_strategy", "default")
        if strategy not in SELECT_STRATEGIES:
            raise ConfigError(f"{where}: vision_feature_select_strategy {strategy!r} is not "
                              f"one of {', '.join(SELECT_STRATEGIES)}")
        token = config.get("image_token_index", config.get("image_token_id"))
        try:
            image_size, patch_size = int(vision["image_size"]), int(vision["patch_size"])
            hidden = int(text["hidden_size"])
        except (KeyError, TypeError, ValueError) as error:
            raise ConfigError(f"{where}: {error!r} missing or malformed") from error
        if image_size % patch_size:
            raise ConfigError(f"{where}: vision_config.image_size {image_size} is not a "
                              f"multiple of its patch_size {patch_size}")
        patches = (image_size // patch_size) ** 2
        if not isinstance(token, int):
            raise ConfigError(f"{where}: image_token_index: expected an integer, got {token!r}")
        return cls(token, patches + (strategy == "full"), hidden)

    @classmethod
    def read(cls, directory: Path) -> VisualFacts | None:
        """A decoder checkpoint's facts; None where it has none (a text model)."""
        path = Path(directory) / VISUAL_FACTS
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError) as error:
            raise ConfigError(f"{path}: {error}") from error

    def write(self, directory: Path) -> Path:
        path = Path(directory) / VISUAL_FACTS
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path


def decoder_checkpoint(llava_dir: Path, out: Path) -> Path:
    """`out` (made, or written over): the language model of the LLaVA
    checkpoint in `llava_dir` as a Llama checkpoint, its tokenizer, and
    `visual.json`."""
    from safetensors.torch import load_file, save_file

    llava_dir, out = Path(llava_dir), Path(out)
    config_path = llava_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{config_path}: {error}") from error
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: expected a JSON object")
    facts = VisualFacts.of_llava(config, str(config_path))
    text = dict(config["text_config"])
    if text.get("model_type", "llama") != "llama":
        raise ConfigError(f"{config_path}: text_config.model_type {text.get('model_type')!r}; "
                          "the decoder stage runs Llama decoders")
    vocab = int(text.get("vocab_size", 0))
    if not 0 <= facts.image_token_index < vocab:
        raise ConfigError(f"{config_path}: image_token_index {facts.image_token_index} is "
                          f"outside text_config.vocab_size {vocab}")
    _check_image_token(llava_dir / "tokenizer.json", facts.image_token_index)
    files = sorted(llava_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{llava_dir}: no *.safetensors")
    tensors: dict[str, Any] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            renamed = _llama_name(name)
            if renamed is not None:
                tensors[renamed] = tensor
    if "model.embed_tokens.weight" not in tensors:
        raise ConfigError(f"{llava_dir}: no language model tensors (expected "
                          "language_model.model.embed_tokens.weight)")
    out.mkdir(parents=True, exist_ok=True)
    text.update(model_type="llama", architectures=["LlamaForCausalLM"])
    text.setdefault("tie_word_embeddings", "lm_head.weight" not in tensors)
    (out / "config.json").write_text(json.dumps(text, indent=1) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (llava_dir / name).is_file():
            shutil.copyfile(llava_dir / name, out / name)
    facts.write(out)
    return out


def visual_rows(prompt: Sequence[int], visual: np.ndarray | None,
                facts: VisualFacts | None) -> np.ndarray | None:
    """A sequence's visual tokens, FP32 [image tokens of `prompt`, hidden],
    checked against its prompt; None where it has none. InvalidArgument
    naming `visual` when their count or width is not the prompt's, or when
    the model takes none (`facts` None)."""
    if facts is None:
        if visual is not None:
            raise InvalidArgument("visual: this model takes no visual tokens (a text model)")
        return None
    expected = sum(1 for token in prompt if token == facts.image_token_index)
    if visual is None:
        if expected:
            raise InvalidArgument(
                f"visual: the prompt holds {expected} image tokens and no visual tokens "
                "came with it")
        return None
    if not isinstance(visual, np.ndarray) or visual.ndim != 2 \
            or not np.issubdtype(visual.dtype, np.floating):
        raise InvalidArgument(f"visual: expected a floating-point array [tokens, "
                              f"{facts.hidden_size}], got "
                              f"{getattr(visual, 'shape', type(visual).__name__)}")
    if visual.shape[1] != facts.hidden_size:
        raise InvalidArgument(f"visual: rows of {visual.shape[1]} values; the decoder's "
                              f"hidden size is {facts.hidden_size}")
    if visual.shape[0] != expected:
        raise InvalidArgument(f"visual: {visual.shape[0]} visual tokens for the prompt's "
                              f"{expected} image tokens")
    rows = np.ascontiguousarray(visual, dtype=np.float32)
    if not np.isfinite(rows).all():
        raise InvalidArgument("visual: holds values that are not finite")
    return rows


def _llama_name(name: str) -> str | None:
    """Llama's name of a LLaVA checkpoint's tensor; None for the vision
    tower's and the projector's."""
    for prefix, llama in _LANGUAGE_PREFIXES:
        if name.startswith(prefix):
            return llama + name[len(prefix):]
    return None


def _check_image_token(path: Path, index: int) -> None:
    """The tokenizer's `<image>` is config.json's image token."""
    try:
        added = json.loads(path.read_text()).get("added_tokens", [])
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: {error}") from error
    ids = [token.get("id") for token in added if token.get("content") == IMAGE_TOKEN]
    if ids != [index]:
        raise ConfigError(f"{path}: the tokenizer's {IMAGE_TOKEN} is "
                          f"{ids[0] if ids else 'missing'}; config.json's image_token_index "
                          f"is {index}")
