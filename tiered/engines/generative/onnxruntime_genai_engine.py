"""A generative model made by onnxruntime-genai's builder (a directory with
`genai_config.json`, the ONNX model and the tokenizer), run with
onnxruntime-genai: INT4 on the edge's CPUs, FP16 where its CUDA provider runs.

onnxruntime-genai decodes one `Generator` per sequence, so a step advances
each running sequence in turn; sequences still join and leave between steps.
Its own search picks each token (greedy, or sampled with the sequence's
temperature, top-p and seed); the log-probability of the token comes from the
step's logits.

A vision-language decoder built for visual tokens (`visual.genai_visual_inputs`:
a `visual.json` beside its embedding and pass-through vision models) takes
them with a prompt: each generator is given them as its "image" before its
prompt, and its embedding model puts them at the prompt's image tokens.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime_genai as og

from tiered.engines.generative.base import GenerativeEngine, Sampling, Token
from tiered.engines.generative.text import GenAITokenizer
from tiered.engines.generative.visual import GENAI_VISUAL_INPUTS, VisualFacts, visual_rows
from tiered.errors import ConfigError


class OrtGenAIEngine(GenerativeEngine):
    def __init__(self, model_dir: Path, max_sequences: int = 16) -> None:
        try:
            self._model = og.Model(str(model_dir))
        except Exception as error:  # noqa: BLE001 -- its errors are plain RuntimeErrors
            raise ConfigError(f"{model_dir}: not an onnxruntime-genai model: {error}") from error
        self._tokenizer = GenAITokenizer(self._model)
        config = _config(model_dir)
        self.max_context = int(config["model"]["context_length"])
        self.max_sequences = max_sequences
        self.device = "cuda" if "cuda" in _providers(config) else "cpu"
        # a decoder built without its embedding model reads token ids only
        self.visual_facts = VisualFacts.read(model_dir) if "embedding" in config["model"] \
            else None
        self._generators: dict[int, og.Generator] = {}
        self._ids = itertools.count(1)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids)

    def start(self, prompt: Sequence[int], sampling: Sampling,
              visual: np.ndarray | None = None) -> int:
        self.check_fits(prompt, sampling)
        rows = visual_rows(prompt, visual, self.visual_facts)
        params = og.GeneratorParams(self._model)
        options = {"max_length": len(prompt) + sampling.max_tokens,
                   "do_sample": not sampling.greedy}
        if not sampling.greedy:
            options.update(temperature=sampling.temperature, top_p=sampling.top_p,
                           random_seed=sampling.seed)
        params.set_search_options(**options)
        generator = og.Generator(self._model, params)
        _give_visual(generator, rows)
        generator.append_tokens(np.asarray(prompt, dtype=np.int32))
        sequence = next(self._ids)
        self._generators[sequence] = generator
        return sequence

    def step(self) -> list[Token]:
        tokens = []
        for sequence, generator in list(self._generators.items()):
            generator.generate_next_token()
            token = int(generator.get_next_tokens()[0])
            logits = np.asarray(generator.get_output("logits"))
            row = logits.reshape(-1, logits.shape[-1])[-1].astype(np.float64)
            top = row.max()
            logprob = float(row[token] - top - math.log(np.exp(row - top).sum()))
            last = generator.is_done()
            if last:
                del self._generators[sequence]
            tokens.append(Token(sequence, token, logprob, last))
        return tokens

    def stop(self, sequence: int) -> None:
        self._generators.pop(sequence, None)

    @property
    def running(self) -> int:
        return len(self._generators)

    def describe(self) -> dict[str, str]:
        return {"engine": "onnxruntime-genai", "device": self.device,
                "context": str(self.max_context)}

    def close(self) -> None:
        self._generators.clear()

    def prefix_logits(self, ids: Sequence[int], visual: np.ndarray | None = None
                      ) -> np.ndarray:
        rows = visual_rows(ids, visual, self.visual_facts)
        # A generator of its own: appending tokens runs them in one forward,
        # whose logits output holds every position's row.
        params = og.GeneratorParams(self._model)
        params.set_search_options(max_length=len(ids) + 1)
        generator = og.Generator(self._model, params)
        _give_visual(generator, rows)
        generator.append_tokens(np.asarray(ids, dtype=np.int32))
        logits = np.asarray(generator.get_output("logits"), dtype=np.float32)
        return logits.reshape(-1, logits.shape[-1])[-len(ids):]


def _give_visual(generator: og.Generator, rows: np.ndarray | None) -> None:
    """A generator's visual tokens, as its one image, before its prompt."""
    if rows is not None and len(rows):
        inputs = og.NamedTensors()
        pixels, count = GENAI_VISUAL_INPUTS
        inputs[pixels] = rows[None]
        inputs[count] = np.array([len(rows)], dtype=np.int64)
        generator.set_inputs(inputs)


def _config(model_dir: Path) -> dict:
    import json

    try:
        return json.loads((Path(model_dir) / "genai_config.json").read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{model_dir}/genai_config.json: {error}") from error


def _providers(config: dict) -> list[str]:
    options = config["model"]["decoder"].get("session_options", {}).get("provider_options", [])
    return [name.lower() for entry in options for name in entry]
