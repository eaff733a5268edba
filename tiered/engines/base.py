"""The Engine interface: run one model version on arrays.

Engines know numpy arrays and nothing of the wire, the batcher or the agent.
`run` is blocking and may be called from several threads at once when a model
has more than one instance; each engine documents whether that is safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    """An engine's view of one input or output: -1 marks a dynamic dimension."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


class Engine(ABC):
    """One loaded model version, ready to run batches."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    device: str = "cpu"  # where it computes: "cpu" or "cuda"

    def accept(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """Turn one request's checked inputs into what `run` takes, or raise
        InvalidArgument. Called per request, before batching, so a request
        the engine cannot take fails alone instead of failing its batch."""
        return inputs

    @abstractmethod
    def run(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run the model; return the named outputs (all when `outputs` is None)."""

    def describe(self) -> dict[str, str]:
        """Facts worth showing users (engine, providers, precision)."""
        return {}

    def close(self) -> None:
        """Release what the engine holds. Safe to call twice."""


WARM_UP_RUNS = 3


def warm_up(engine: Engine, runs: int = WARM_UP_RUNS) -> bool:
    """Run the engine on zeros (batch 1 for dynamic dimensions) a few times, so
    its first real requests do not pay for lazy allocation and kernel choice.
    False, and nothing run, when an input has no numeric dtype to fill."""
    feeds = {}
    for spec in engine.inputs:
        if spec.dtype.kind not in "biuf":
            return False
        feeds[spec.name] = np.zeros([1 if d < 0 else d for d in spec.shape], spec.dtype)
    for _ in range(runs):
        engine.run(engine.accept(feeds))
    return True
