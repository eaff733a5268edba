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

from tiered.engines.base import Engine, TensorSpec
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


class OnnxRuntimeEngine(Engine):
    """An `onnxruntime.InferenceSession`; `run` is safe from several threads."""

    def __init__(self, model_path: Path | str, settings: OrtSettings = OrtSettings()) -> None:
        available = set(ort.get_available_providers())
        requested = [p for p in settings.providers if p in available]
        skipped = [p for p in settings.providers if p not in available]
        if skipped:
            log.info("onnxruntime here lacks %s; not requesting them", ", ".join(skipped))
        if "CPUExecutionProvider" not in requested:
            requested.append("CPUExecutionProvider")
        options = [dict(settings.provider_options.get(p, {})) for p in requested]
        try:
            self._session = ort.InferenceSession(
                str(model_path),
                sess_options=settings.session_options(),
                providers=requested,
                provider_options=options,
            )
        except Exception as error:  # onnxruntime raises its own untyped errors
            raise ConfigError(f"{model_path}: onnxruntime cannot load the model: {error}") from error
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
        try:
            results = self._session.run(names, dict(inputs))
        except Exception as error:
            raise EngineError(f"onnxruntime: {error}") from error
        return dict(zip(names, results))

    def describe(self) -> dict[str, str]:
        return {"engine": "onnxruntime", "providers": ",".join(self.providers)}

    def close(self) -> None:
        self._session = None
