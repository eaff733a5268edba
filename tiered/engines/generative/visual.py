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

onnxruntime-genai's decoders read token ids, and one built with
`exclude_embeds` (inputs_embeds in place of input_ids) cannot be run alone:
its generator still asks for input_ids. Its multimodal pipeline can: an
embedding model (input_ids and image_features to inputs_embeds) runs before
the decoder at every step, and a vision model, run once on the prompt's
extra inputs, writes the image_features. `genai_visual_inputs` completes a
builder's `exclude_embeds` output into that pipeline with two small ONNX
graphs of our own: the embedding (the checkpoint's table; image tokens take
the image_features rows, in order) and a pass-through vision model whose
"pixel_values" are the visual tokens themselves. So the edge's INT4 decoder
takes the vision stage's output as it comes (`GENAI_VISUAL_INPUTS`).
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
# What a generator of `genai_visual_inputs`' pipeline is given with a prompt:
# the visual tokens as one "image" [1, tokens, hidden], and their count.
GENAI_VISUAL_INPUTS = ("pixel_values", "num_image_tokens")
GENAI_PIPELINE_TYPE = "phi3v"  # onnxruntime-genai's plainest vision-embedding-decoder pipeline
GENAI_FILES = ("embedding.onnx", "visual_tokens.onnx")
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
            raise InvalidArgument("visual: this model version takes no visual tokens (it "
                                  "was built without visual.json)")
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


def genai_visual_inputs(model_dir: Path, checkpoint: Path) -> None:
    """Make the onnxruntime-genai model in `model_dir` (its builder's output
    for the decoder `checkpoint`, built with `exclude_embeds`) take visual
    tokens: write its embedding and pass-through vision models, point its
    genai_config.json at them, and copy `visual.json`."""
    import onnx
    import torch
    from onnx import TensorProto, helper, numpy_helper
    from safetensors.torch import load_file

    model_dir, checkpoint = Path(model_dir), Path(checkpoint)
    facts = VisualFacts.read(checkpoint)
    if facts is None:
        raise ConfigError(f"{checkpoint}: no {VISUAL_FACTS}; not a vision-language decoder")
    config_path = model_dir / "genai_config.json"
    try:
        config = json.loads(config_path.read_text())
        decoder = config["model"]["decoder"]
        graph = onnx.load(str(model_dir / decoder["filename"]), load_external_data=False).graph
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"{model_dir}: not an onnxruntime-genai model: {error!r}") from error
    embeds = decoder["inputs"].get("inputs_embeds")
    kinds = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    if embeds not in kinds:
        raise ConfigError(f"{model_dir}: its decoder takes no inputs_embeds; build it with "
                          "the builder's extra option exclude_embeds=true")
    dtype = helper.tensor_dtype_to_np_dtype(kinds[embeds])
    table = None
    for file in sorted(checkpoint.glob("*.safetensors")):
        table = load_file(str(file)).get("model.embed_tokens.weight", table)
    if table is None or tuple(table.shape)[1:] != (facts.hidden_size,):
        raise ConfigError(f"{checkpoint}: no model.embed_tokens.weight of width "
                          f"{facts.hidden_size}")
    hidden = facts.hidden_size
    constants = [
        numpy_helper.from_array(table.to(torch.float32).numpy().astype(dtype), "table"),
        numpy_helper.from_array(np.array(facts.image_token_index, np.int64), "image_token"),
        numpy_helper.from_array(np.array([-1], np.int64), "flat"),
        numpy_helper.from_array(np.array(0, np.int64), "axis0"),
        numpy_helper.from_array(np.zeros((1, hidden), dtype), "no_image"),
        numpy_helper.from_array(np.array([-1], np.int64), "last_axis")]
    # The k-th image token of the flattened ids reads row k of [no_image; image_features]
    # where there is one; every other token (and an image token past the rows, as one
    # generated is) keeps its row of the table.
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["text"], axis=0),
             helper.make_node("Equal", ["input_ids", "image_token"], ["is_image"]),
             helper.make_node("Reshape", ["is_image", "flat"], ["is_image_flat"]),
             helper.make_node("Cast", ["is_image_flat"], ["is_image_int"],
                              to=TensorProto.INT64),
             helper.make_node("CumSum", ["is_image_int", "axis0"], ["counted"]),
             helper.make_node("Shape", ["image_features"], ["rows_given"], end=1),
             helper.make_node("LessOrEqual", ["counted", "rows_given"], ["has_row"]),
             helper.make_node("And", ["is_image_flat", "has_row"], ["takes_row_flat"]),
             helper.make_node("Cast", ["takes_row_flat"], ["takes_row_int"],
                              to=TensorProto.INT64),
             helper.make_node("Mul", ["counted", "takes_row_int"], ["row_flat"]),
             helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
             helper.make_node("Reshape", ["row_flat", "ids_shape"], ["row"]),
             helper.make_node("Reshape", ["takes_row_flat", "ids_shape"], ["takes_row"]),
             helper.make_node("Concat", ["no_image", "image_features"], ["rows"], axis=0),
             helper.make_node("Gather", ["rows", "row"], ["visual"], axis=0),
             helper.make_node("Unsqueeze", ["takes_row", "last_axis"], ["at_image"]),
             helper.make_node("Where", ["at_image", "visual", "text"], ["inputs_embeds"])]
    elem = kinds[embeds]
    _save_onnx(helper.make_graph(
        nodes, "embedding",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("image_features", elem, ["image_tokens", hidden])],
        [helper.make_tensor_value_info("inputs_embeds", elem, ["batch", "sequence", hidden])],
        constants), model_dir / GENAI_FILES[0], external=table.numel() * 4 > 1 << 30)
    _save_onnx(helper.make_graph(
        [helper.make_node("Reshape", ["pixel_values", "rows_shape"], ["rows"]),
         helper.make_node("Cast", ["rows"], ["image_features"], to=elem)],
        "visual_tokens",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT,
                                       ["images", "tokens", hidden])],
        [helper.make_tensor_value_info("image_features", elem, ["image_tokens", hidden])],
        [numpy_helper.from_array(np.array([-1, hidden], np.int64), "rows_shape")]),
        model_dir / GENAI_FILES[1])
    model = config["model"]
    model["type"] = GENAI_PIPELINE_TYPE
    model["embedding"] = {"filename": GENAI_FILES[0],
                          "inputs": {"input_ids": "input_ids", "image_features": "image_features"},
                          "outputs": {"inputs_embeds": "inputs_embeds"}}
    model["vision"] = {"filename": GENAI_FILES[1], "inputs": {"pixel_values": "pixel_values"},
                       "outputs": {"image_features": "image_features"}}
    config_path.write_text(json.dumps(config, indent=4) + "\n")
    facts.write(model_dir)


def _save_onnx(graph: Any, path: Path, external: bool = False) -> None:
    """`graph` as a model at `path`; `external`: its weights in a file beside
    it (a protobuf holds 2 GB at most)."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if external:
        onnx.save(model, str(path), save_as_external_data=True,
                  location=path.name + ".data")
        onnx.checker.check_model(str(path))
    else:
        onnx.checker.check_model(model)
        onnx.save(model, str(path))
