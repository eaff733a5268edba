"""The ONNX Runtime engine.

Providers are requested in the tier profile's order but only those the
installed onnxruntime offers are asked for, and the session's own
`get_providers()` is the truth afterwards: onnxruntime-gpu imports on machines
without a GPU and silently falls back to the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from tiered.engines.base import (
    Engine,
    TensorSpec,
    bucket_eligibility,
    choose_bucket,
    concatenate_into,
)
from tiered.errors import ConfigError, EngineError, InvalidArgument

log = logging.getLogger(__name__)

_ORT_TYPES: dict[str, np.dtype] = {
    "tensor(bool)": np.dtype(np.bool_),
    "tensor(uint8)": np.dtype(np.uint8),
    "tensor(uint16)": np.dtype(np.uint16),
    "tensor(uint32)": np.dtype(np.uint32),
    "tensor(uint64)": np.dtype(np.uint64),
    "tensor(int8)": np.dtype(np.int8),
    "tensor(int16)": np.dtype(np.int16),
    "tensor(int32)": np.dtype(np.int32),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(float)": np.dtype(np.float32),
    "tensor(double)": np.dtype(np.float64),
    "tensor(string)": np.dtype(object),
}

_OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

_EXECUTION_MODES = {
    "sequential": ort.ExecutionMode.ORT_SEQUENTIAL,
    "parallel": ort.ExecutionMode.ORT_PARALLEL,
}


@dataclass(frozen=True)
class OrtSettings:
    """Session settings; the tier profile supplies them, a model may override.

    Zero threads lets onnxruntime choose (one per physical core).

    `batch_buckets`: on a GPU provider, a batch is padded up to the smallest
    of these sizes that holds it and runs in a session of that bucket's own,
    opened and run once at load (larger batches run as they are in the first
    session). A session's CUDA convolutions plan themselves again (cuDNN's
    heuristics, for every layer) whenever its input shape differs from its
    previous run's: on an H200 a regional agent whose batcher formed sizes
    from 1 to 64 spent about 180 ms a batch planning. A session per bucket
    sees one shape. Each holds its own copy of the weights on the device.
    Ignored on the CPU, where a new shape costs nothing and padding would.
    """

    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    provider_options: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    graph_optimization_level: str = "all"
    execution_mode: str = "sequential"
    # Whether idle intra-op threads spin before sleeping. Spinning buys a
    # little latency in a tight loop of runs, but beside the server's own
    # threads it steals their CPU: three digits agents at 60 requests/s on
    # two cores used 116% of a core spinning and 15% without, and answered
    # faster without (p50 2.7 against 3.8 ms through the router).
    allow_spinning: bool = False
    batch_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.graph_optimization_level not in _OPTIMIZATION_LEVELS:
            raise ConfigError(
                f"graph_optimization_level: {self.graph_optimization_level!r} is not one of "
                f"{', '.join(_OPTIMIZATION_LEVELS)}"
            )
        if self.execution_mode not in _EXECUTION_MODES:
            raise ConfigError(
                f"execution_mode: {self.execution_mode!r} is not one of "
                f"{', '.join(_EXECUTION_MODES)}"
            )
        for name in ("intra_op_threads", "inter_op_threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not self.providers:
            raise ConfigError("providers: at least one execution provider is needed")
        if any(size < 1 for size in self.batch_buckets):
            raise ConfigError(f"batch_buckets: sizes must be >= 1, got {list(self.batch_buckets)}")

    def session_options(self) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.intra_op_threads
        options.inter_op_num_threads = self.inter_op_threads
        options.graph_optimization_level = _OPTIMIZATION_LEVELS[self.graph_optimization_level]
        options.execution_mode = _EXECUTION_MODES[self.execution_mode]
        spin = "1" if self.allow_spinning else "0"
        options.add_session_config_entry("session.intra_op.allow_spinning", spin)
        options.add_session_config_entry("session.inter_op.allow_spinning", spin)
        return options


def _spec(node) -> TensorSpec:
    dtype = _ORT_TYPES.get(node.type)
    if dtype is None:
        raise ConfigError(f"tensor {node.name!r}: onnxruntime type {node.type} is not supported")
    shape = tuple(dim if isinstance(dim, int) else -1 for dim in node.shape)
    return TensorSpec(node.name, dtype, shape)


class _Padded(dict):
    """A batch in a bucket's input buffers: its first `rows` are the batch."""

    def __init__(self, buffers: Mapping[str, np.ndarray], rows: int, bucket: int) -> None:
        super().__init__(buffers)
        self.rows, self.bucket = rows, bucket


class OnnxRuntimeEngine(Engine):
    """An `onnxruntime.InferenceSession` (one per batch bucket on a GPU);
    `run` is safe from several threads."""

    def __init__(self, model_path: Path | str, settings: OrtSettings = OrtSettings()) -> None:
        available = set(ort.get_available_providers())
        requested = [p for p in settings.providers if p in available]
        skipped = [p for p in settings.providers if p not in available]
        if skipped:
            log.info("onnxruntime here lacks %s; not requesting them", ", ".join(skipped))
        if "CPUExecutionProvider" not in requested:
            requested.append("CPUExecutionProvider")
        self._path, self._settings = model_path, settings
        self._session = self._open(requested)
        self.providers: tuple[str, ...] = tuple(self._session.get_providers())
        self.device = "cpu" if self.providers[0] == "CPUExecutionProvider" else "cuda"
        if self.providers[0] != requested[0]:
            log.warning(
                "%s: asked for %s first, but the session runs on %s",
                model_path, requested[0], ", ".join(self.providers),
            )
        self.inputs = tuple(_spec(node) for node in self._session.get_inputs())
        self.outputs = tuple(_spec(node) for node in self._session.get_outputs())
        self._output_names = [spec.name for spec in self.outputs]
        self._string_inputs = {s.name for s in self.inputs if s.dtype == np.dtype(object)}
        self._buckets: dict[int, ort.InferenceSession] = {}
        self._spare: dict[int, list[dict[str, np.ndarray]]] = {}  # padded inputs, by bucket
        if self.device == "cuda" and settings.batch_buckets:
            self._buckets = self._bucket_sessions(sorted(set(settings.batch_buckets)))

    def _open(self, providers: Sequence[str]) -> ort.InferenceSession:
        options = [dict(self._settings.provider_options.get(p, {})) for p in providers]
        try:
            return ort.InferenceSession(str(self._path),
                                        sess_options=self._settings.session_options(),
                                        providers=list(providers), provider_options=options)
        except Exception as error:  # onnxruntime raises its own untyped errors
            raise ConfigError(f"{self._path}: onnxruntime cannot load the model: {error}") \
                from error

    def accept(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        # onnxruntime's Python API takes string tensors as str only: BYTES
        # elements must be UTF-8, and anything else is refused here.
        if not self._string_inputs.intersection(inputs):
            return inputs
        converted = dict(inputs)
        for name in self._string_inputs.intersection(inputs):
            array = inputs[name]
            text = np.empty(array.shape, dtype=object)
            flat = text.reshape(-1)
            for index, item in enumerate(array.reshape(-1)):
                try:
                    flat[index] = item.decode("utf-8") if isinstance(item, bytes) else str(item)
                except UnicodeDecodeError as error:
                    raise InvalidArgument(
                        f"input {name!r}: element {index} is not UTF-8 ({error.reason}); "
                        "onnxruntime string tensors hold text"
                    ) from None
            converted[name] = text
        return converted

    def run(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        names = list(outputs) if outputs else self._output_names
        if isinstance(inputs, _Padded):  # staged straight into a bucket's buffers
            feeds, rows, bucket = inputs, inputs.rows, inputs.bucket
        else:
            rows = next(iter(inputs.values())).shape[0] if self._buckets and inputs else 0
            bucket = choose_bucket(rows, self._buckets) if rows else None
            feeds = self._pad(inputs, bucket, rows) if bucket not in (None, rows) \
                else dict(inputs)
        session = self._buckets[bucket] if bucket is not None else self._session
        try:
            results = session.run(names, dict(feeds))
        except Exception as error:
            raise EngineError(f"onnxruntime: {error}") from error
        finally:
            if isinstance(feeds, _Padded):
                self._spare[bucket].append(dict(feeds))
        if bucket not in (None, rows):
            results = [result[:rows] for result in results]
        return dict(zip(names, results))

    def stage(self, requests: Sequence[Mapping[str, np.ndarray]]) -> Mapping[str, np.ndarray]:
        """On a GPU with buckets, the requests concatenated straight into the
        first rows of a bucket's buffers: one host copy, not a merge and then
        a pad."""
        rows = sum(len(next(iter(r.values()))) for r in requests) if self._buckets else 0
        bucket = choose_bucket(rows, self._buckets) if rows else None
        if bucket in (None, rows) or len(requests) == 1:
            return super().stage(requests)
        feeds = self._pad({}, bucket, rows)
        for name, padded in feeds.items():
            concatenate_into([np.asarray(r[name]) for r in requests], padded[:rows])
        return feeds

    def _pad(self, inputs: Mapping[str, np.ndarray], bucket: int, rows: int) -> _Padded:
        """`inputs` copied into the first `rows` of a bucket's buffers, kept
        for reuse (a fresh batch-sized array costs page faults on every run).
        The rows past them hold earlier batches' data: rows are independent,
        as dynamic batching assumes, and their outputs are dropped."""
        spare = self._spare.setdefault(bucket, [])
        try:
            buffers = spare.pop()  # atomic: another thread's run never gets the same ones
        except IndexError:
            buffers = {s.name: np.zeros((bucket, *s.shape[1:]), s.dtype) for s in self.inputs}
        for name, array in inputs.items():
            buffers[name][:rows] = array
        return _Padded(buffers, rows, bucket)

    def _bucket_sessions(self, buckets: list[int]) -> dict[int, ort.InferenceSession]:
        """A session per bucket, each run once on zeros; {} (and why, logged)
        where batches of this model cannot be padded."""
        reason = bucket_eligibility(self.inputs)
        if reason is None and any(s.dtype.kind not in "biuf" for s in self.inputs):
            reason = "an input is not numeric"
        sessions: dict[int, ort.InferenceSession] = {}
        for bucket in buckets if reason is None else ():
            session = sessions[bucket] = self._open(self.providers)
            feeds = {s.name: np.zeros((bucket, *s.shape[1:]), s.dtype) for s in self.inputs}
            results = session.run(self._output_names, feeds)
            short = [name for name, out in zip(self._output_names, results, strict=True)
                     if out.ndim == 0 or out.shape[0] != bucket]
            if short:
                reason = f"outputs {short} do not lead with the batch dimension"
                break
        if reason is not None:
            log.info("%s: batch_buckets off: %s", self._path, reason)
            return {}
        return sessions

    def describe(self) -> dict[str, str]:
        described = {"engine": "onnxruntime", "providers": ",".join(self.providers)}
        if self._buckets:
            described["batch_buckets"] = ",".join(map(str, self._buckets))
        return described

    def close(self) -> None:
        self._session, self._buckets = None, {}
