"""The interface of a generative engine: sequences decoded one step at a time.

The scheduler (in the agent) owns the requests; the engine owns the sequences'
state (KV cache) and nothing of the wire. One `step` advances every running
sequence by one token, so sequences join (`start`) and leave (`stop`, or their
last token) between steps: in-flight batching. The first step of a sequence
reads its prompt (prefill) and gives its first token. Calls are blocking and
come from one thread at a time.

A vision-language model's decoder takes visual tokens with a prompt
(`visual`, FP32 [image tokens, hidden]): the embeddings at the prompt's image
tokens are replaced by these rows, in order (`visual.py`); a model version
built without them refuses them (InvalidArgument naming `visual`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tiered.errors import EngineError, InvalidArgument, ResourceExhausted

MAX_TOKENS_LIMIT = 4096  # the most tokens one request may ask for


@dataclass(frozen=True)
class Sampling:
    """How a sequence picks its tokens. temperature 0 is greedy (and `seed`
    unused); `top_p` keeps the smallest set of tokens whose probability
    reaches it."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise InvalidArgument(f"max_tokens: expected 1..{MAX_TOKENS_LIMIT}, "
                                  f"got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 10.0):
            raise InvalidArgument(f"temperature: expected 0..10, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p: expected a number in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Token:
    """One step's token of one sequence."""

    sequence: int  # the id `start` gave
    id: int
    logprob: float  # natural log of its probability under the model
    last: bool  # the sequence ended with it (end of sequence, max_tokens, full context)


class GenerativeEngine(ABC):
    """One loaded generative model version."""

    device: str = "cpu"
    max_sequences: int  # sequences that may run at once (KV cache slots)
    max_context: int  # prompt plus generated tokens of one sequence

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The prompt's token ids."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids."""

    @abstractmethod
    def start(self, prompt: Sequence[int], sampling: Sampling,
              visual: np.ndarray | None = None) -> int:
        """Admit a sequence, with the visual tokens of its image tokens, if
        any; its id. ResourceExhausted when every slot is taken,
        InvalidArgument when it cannot fit the context or `visual` does not
        fit its prompt."""

    @abstractmethod
    def step(self) -> list[Token]:
        """One token for every running sequence; sequences whose token is
        `last` are gone after it."""

    @abstractmethod
    def stop(self, sequence: int) -> None:
        """Drop a sequence now (its client went away); unknown ids are ignored."""

    @property
    @abstractmethod
    def running(self) -> int:
        """Sequences started and not yet ended."""

    def describe(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        """Release what the engine holds. Safe to call twice."""

    def prefix_logits(self, ids: Sequence[int], visual: np.ndarray | None = None
                      ) -> np.ndarray:
        """Teacher forcing: the logits after each prefix of `ids` (with
        `visual` at its image tokens), FP32 [len(ids), vocab], leaving
        running sequences as they were. What a build's accuracy gate scores
        a model with."""
        raise EngineError(f"{type(self).__name__} cannot score a token sequence")

    def check_fits(self, prompt: Sequence[int], sampling: Sampling) -> None:
        """The admission checks every engine makes."""
        if not prompt:
            raise InvalidArgument("text_input: the prompt has no tokens")
        if len(prompt) + sampling.max_tokens > self.max_context:
            raise InvalidArgument(
                f"text_input: {len(prompt)} prompt tokens + max_tokens {sampling.max_tokens} "
                f"exceed the model's context of {self.max_context}")
        if self.running >= self.max_sequences:
            raise ResourceExhausted(f"all {self.max_sequences} sequences are running")


def pick(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> tuple[int, float]:
    """A token from one row of logits, and its log-probability (under the
    model's distribution, before temperature): greedy, or sampled with
    temperature and top-p."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max()
    logprobs = shifted - math.log(np.exp(shifted).sum())
    if sampling.greedy:
        token = int(np.argmax(logits))
        return token, float(logprobs[token])
    scaled = shifted / sampling.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    kept = order[: int(np.searchsorted(np.cumsum(probs[order]), sampling.top_p) + 1)]
    weights = probs[kept] / probs[kept].sum()
    token = int(rng.choice(kept, p=weights))
    return token, float(logprobs[token])
