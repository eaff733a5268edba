"""Generative engines: decode token sequences step by step.

`base` is the interface the agent's scheduler drives (start a sequence, one
`step` gives every running sequence its next token, `stop` frees a sequence at
once); `onnxruntime_genai_engine` runs a model made by onnxruntime-genai's
builder (INT4 or FP16 for the edge and regional tiers); `torch_engine` runs a
Llama checkpoint itself (the datacenter tier). `open_generative` opens a
built version on its backend. The heavy libraries are imported only by the
engine that needs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered.errors import ConfigError
from tiered.settings import load_dataclass

if TYPE_CHECKING:
    from tiered.engines.generative.base import GenerativeEngine

__all__ = ["CHECKPOINT_FILES", "GENERATIVE_BACKENDS", "GenAISettings", "is_checkpoint",
           "open_generative", "read_prompts"]

# A model built by onnxruntime-genai's builder, and a checkpoint run by our torch engine.
GENERATIVE_BACKENDS = ("onnxruntime-genai", "torch-generative")
CHECKPOINT_FILES = ("config.json", "tokenizer.json")  # beside one or more *.safetensors
GENERATIVE_EXTRA = "pip install 'tiered[generative]' (CPU), or 'tiered[generative-gpu]'"


def read_prompts(path: Path, where: str) -> list[str]:
    """A prompts file's prompts: a JSON object whose `prompts` is a list of
    non-empty strings (tinyllama-eval.json's form); `where` names it in errors."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{where}: {path}: cannot read: {error}") from error
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if (not isinstance(prompts, list) or not prompts
            or not all(isinstance(p, str) and p for p in prompts)):
        raise ConfigError(f'{where}: {path}: expected {{"prompts": [...]}}, a list of '
                          "non-empty strings")
    return prompts


def is_checkpoint(path: Path) -> bool:
    """A Hugging Face-style checkpoint directory: config.json, tokenizer.json
    and one or more *.safetensors."""
    path = Path(path)
    return (path.is_dir() and all((path / name).is_file() for name in CHECKPOINT_FILES)
            and any(path.glob("*.safetensors")))


@dataclass(frozen=True)
class GenAISettings:
    """The onnxruntime-genai engine's settings (config.yaml `engine:`)."""

    max_sequences: int = 8  # sequences in the running batch

    def __post_init__(self) -> None:
        if self.max_sequences < 1:
            raise ConfigError(f"max_sequences: must be >= 1, got {self.max_sequences}")


def open_generative(backend: str, path: Path, settings: Mapping[str, Any],
                    where: str = "engine") -> GenerativeEngine:
    """The generative engine for a built version: `path` is the version's
    directory (or a file in it); `settings` its config.yaml `engine:` mapping
    (`where` names them in errors)."""
    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    try:
        if backend == "onnxruntime-genai":
            from tiered.engines.generative.onnxruntime_genai_engine import OrtGenAIEngine

            chosen = load_dataclass(GenAISettings, settings, where)
            return OrtGenAIEngine(directory, chosen.max_sequences)
        if backend == "torch-generative":
            from tiered.engines.generative.torch_engine import (
                TorchGenerativeEngine,
                TorchGenerativeSettings,
            )

            return TorchGenerativeEngine(
                directory, load_dataclass(TorchGenerativeSettings, settings, where))
    except ModuleNotFoundError as error:
        raise ConfigError(f"backend: {backend} needs the generative extra "
                          f"({GENERATIVE_EXTRA}): {error}") from error
    raise ConfigError(f"backend: {backend!r} is not a generative backend "
                      f"(one of {', '.join(GENERATIVE_BACKENDS)})")
