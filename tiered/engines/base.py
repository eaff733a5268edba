"""The Engine interface: run one model version on arrays.

Engines know numpy arrays and nothing of the wire, the batcher or the agent;
an input may also be `DeviceRows` (rows already in GPU memory), which reads
as a numpy array wherever it is not gathered on the device.
`run` is blocking and may be called from several threads at once when a model
has more than one instance; each engine documents whether that is safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


class DeviceRows:
    """An input's rows in GPU memory (ranges of clients' CUDA shared-memory
    regions, one part per request), with the shape and numpy dtype that
    checks read. An engine that runs on a GPU copies the parts into its batch
    device to device (`TorchEngine`); anywhere else they read as one host
    array (`np.asarray`, or any ndarray attribute), copied back from the
    device once, where it is first needed."""

    def __init__(self, parts: Sequence, dtype: np.dtype, keep: Sequence[object] = ()) -> None:
        self.parts = list(parts)  # torch tensors on a CUDA device, [rows, ...] each
        self.dtype = dtype
        self.shape = (sum(int(p.shape[0]) for p in self.parts), *self.parts[0].shape[1:])
        self.keep = tuple(keep)  # what holds that memory open while these rows live
        self._host: np.ndarray | None = None

    @classmethod
    def joined(cls, rows: Sequence[DeviceRows]) -> DeviceRows:
        """Several requests' rows as one input of them all."""
        return cls([p for r in rows for p in r.parts], rows[0].dtype,
                   [k for r in rows for k in r.keep])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def host(self) -> np.ndarray:
        if self._host is None:
            self._host = np.concatenate([p.cpu().numpy() for p in self.parts])
        return self._host

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        host = self.host()
        return host if dtype is None else host.astype(dtype, copy=False)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.host(), name)


@dataclass(frozen=True)
class TensorSpec:
    """An engine's view of one input or output: -1 marks a dynamic dimension."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


def choose_bucket(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest batch bucket that holds `rows`; None when none does."""
    fitting = [size for size in buckets if size >= rows]
    return min(fitting) if fitting else None


def bucket_eligibility(inputs: Sequence[TensorSpec]) -> str | None:
    """Why batches of these inputs cannot be padded to fixed buckets, or None
    when they can.

    A bucket fixes the whole shape: every input must lead with the variable
    batch dimension and have static sizes everywhere else.
    """
    for spec in inputs:
        if not spec.shape or spec.shape[0] != -1:
            return f"input {spec.name!r} has no variable batch dimension ({list(spec.shape)})"
        if any(d < 0 for d in spec.shape[1:]):
            return (
                f"input {spec.name!r} has variable dimensions past the batch ({list(spec.shape)})"
            )
    return None


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

    def stage(self, requests: Sequence[Mapping[str, np.ndarray]]) -> Mapping[str, np.ndarray]:
        """Several requests' accepted inputs as one batch for `run` (each
        request leads with the batch dimension). An engine with staging
        buffers of its own writes the batch straight into them."""
        return merge(requests)

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


def merge(requests: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate requests' inputs along the batch dimension (host arrays:
    rows on a device are read back here)."""
    if len(requests) == 1:
        return {name: np.asarray(a) if isinstance(a, DeviceRows) else a
                for name, a in requests[0].items()}
    merged = {}
    for name in requests[0]:
        parts = [np.asarray(r[name]) for r in requests]
        out = np.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), parts[0].dtype)
        merged[name] = concatenate_into(parts, out)
    return merged


def concatenate_into(parts: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
    """np.concatenate(parts, out=out), holding the GIL throughout. numpy lets
    the GIL go for each part's copy; while a busy event loop holds it, every
    take-back waits a switch interval, which made a batch of 15 images take
    10 ms to merge instead of 0.6. Plain byte copies never let it go."""
    if out.dtype.hasobject or not out.flags.c_contiguous or any(
            p.dtype != out.dtype or not p.flags.c_contiguous for p in parts):
        return np.concatenate(parts, out=out)
    target, at = memoryview(out).cast("B"), 0
    for part in parts:
        size = part.nbytes
        target[at:at + size] = memoryview(part).cast("B")
        at += size
    if at != out.nbytes:
        raise ValueError(f"parts of {at} bytes do not fill a batch of {out.nbytes}")
    return out


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
