"""Tokenizers without their engine: text to token ids and back.

An engine encodes and decodes with its model's tokenizer; where the engine
runs in a process of its own (`agent/engine_core.py`), the agent's side
turns text into ids and ids into text with the same tokenizer, opened here
from the version's directory without loading the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from tiered.errors import ConfigError


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CheckpointTokenizer:
    """A checkpoint's tokenizer.json, as the torch engine reads it."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(directory) / "tokenizer.json"
        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as error:  # noqa: BLE001 -- its errors are plain exceptions
            raise ConfigError(f"{path}: not a tokenizer: {error}") from error

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)


class GenAITokenizer:
    """The tokenizer of a model made by onnxruntime-genai's builder: from
    its model (the engine's) or from its directory alone."""

    def __init__(self, source) -> None:
        import onnxruntime_genai as og

        try:
            self._tokenizer = og.Tokenizer(str(source) if isinstance(source, Path) else source)
        except Exception as error:  # noqa: BLE001 -- its errors are plain RuntimeErrors
            raise ConfigError(f"{source}: no onnxruntime-genai tokenizer: {error}") from error

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(np.asarray(ids, dtype=np.int32))


def open_tokenizer(backend: str, directory: Path) -> Tokenizer:
    """The tokenizer of a built version of `backend` in `directory` (or of
    the version whose file it is)."""
    directory = Path(directory) if Path(directory).is_dir() else Path(directory).parent
    if backend == "onnxruntime-genai":
        return GenAITokenizer(Path(directory))
    if backend == "torch-generative":
        return CheckpointTokenizer(Path(directory))
    raise ConfigError(f"backend: {backend!r} is not a generative backend")
