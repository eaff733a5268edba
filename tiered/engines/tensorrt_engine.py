"""The TensorRT engine: an ONNX artifact built into a native TensorRT engine.

Written to TensorRT's documented Python API (TensorRT 10 names): a builder
and a network from the ONNX parser, a builder config with the precision flags
(FP16; FP8 and INT8 need an explicitly quantized, Q/DQ model), one
optimization profile over the batch dimension, and a runtime that executes
with `execute_async_v3` on tensor addresses. Building takes minutes, so the
serialized engine is cached on disk under a key of the artifact's sha256, the
GPU's name, the TensorRT version and every setting that changes the build.

`tensorrt` cannot be installed from the registries our machines reach, so it
is imported only inside this engine's constructor: the module imports without
it, and the pure parts (cache key, profile shapes, precision checks) are
tested everywhere. CUDA memory and streams come from torch, which every GPU
machine that has TensorRT also has.

Thread safety: `run` may be called from several threads; each call takes one
of `streams` lanes (an execution context, a CUDA stream, device buffers for the
largest batch and pinned staging) and waits while all are busy.

This module must never import the agent, the batcher or the wire protocol.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiered import names
from tiered.engines.base import Engine, TensorSpec
from tiered.errors import ConfigError, EngineError, InvalidArgument
from tiered.files import write_atomically

log = logging.getLogger(__name__)

PRECISIONS = (names.Precision.FP32, names.Precision.FP16, names.Precision.FP8,
              names.Precision.INT8)
# Explicit quantization: TensorRT takes fp8/int8 scales from Q/DQ nodes.
_QUANTIZED_OPS = {"QuantizeLinear", "DequantizeLinear"}

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tiered" / "tensorrt"


@dataclass(frozen=True)
class TensorRTSettings:
    """How an artifact is built and run; the tier profile's `tensorrt:` mapping.

    - precision: fp32, fp16 (FP32 I/O kept), or fp8/int8 for a Q/DQ model.
    - min/opt/max_batch_size: the optimization profile over the batch
      dimension; TensorRT tunes kernels for `opt` and accepts min..max.
    - workspace_mib: scratch memory the builder may use per layer.
    - builder_optimization_level: 0-5; higher builds slower, may run faster.
    - cache_dir: where built engines are kept ("" = ~/.cache/tiered/tensorrt).
    - streams: concurrent runs (match the model's instance_count).
    """

    precision: str = "fp16"
    min_batch_size: int = 1
    opt_batch_size: int = 32
    max_batch_size: int = 64
    workspace_mib: int = 4096
    builder_optimization_level: int = 3
    cache_dir: str = ""
    streams: int = 2

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision: {self.precision!r} is not one of {', '.join(PRECISIONS)}"
            )
        if not 1 <= self.min_batch_size <= self.opt_batch_size <= self.max_batch_size:
            raise ConfigError(
                "min_batch_size, opt_batch_size, max_batch_size: need 1 <= min <= opt <= max, "
                f"got {self.min_batch_size}, {self.opt_batch_size}, {self.max_batch_size}"
            )
        if self.workspace_mib < 1:
            raise ConfigError(f"workspace_mib: must be >= 1, got {self.workspace_mib}")
        if not 0 <= self.builder_optimization_level <= 5:
            raise ConfigError(
                f"builder_optimization_level: must be 0..5, got {self.builder_optimization_level}"
            )
        if self.streams < 1:
            raise ConfigError(f"streams: must be >= 1, got {self.streams}")

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else DEFAULT_CACHE_DIR


# -- pure parts ------------------------------------------------------------------


def file_sha256(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_key(
    artifact_sha256: str, gpu_name: str, tensorrt_version: str, settings: TensorRTSettings
) -> str:
    """Names one built engine: a plan is valid only for the same artifact, GPU
    model, TensorRT version and build settings. Run-time-only settings
    (streams, cache_dir) are left out, so changing them reuses the plan."""
    build = {
        k: v for k, v in asdict(settings).items() if k not in ("streams", "cache_dir")
    }
    text = json.dumps(
        {"artifact": artifact_sha256, "gpu": gpu_name, "tensorrt": tensorrt_version,
         "build": build},
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def profile_shapes(
    spec: TensorSpec, settings: TensorRTSettings
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(min, opt, max) shapes for one input: the batch dimension spans the
    profile, every other dimension must be static."""
    if not spec.shape or spec.shape[0] != -1:
        raise ConfigError(
            f"input {spec.name!r}: shape {list(spec.shape)} has no variable batch dimension; "
            "the TensorRT engine needs one"
        )
    rest = spec.shape[1:]
    if any(d < 0 for d in rest):
        raise ConfigError(
            f"input {spec.name!r}: shape {list(spec.shape)} has variable dimensions past the "
            "batch; only the batch dimension may vary"
        )
    return (
        (settings.min_batch_size, *rest),
        (settings.opt_batch_size, *rest),
        (settings.max_batch_size, *rest),
    )


def precision_refusal(precision: str, op_types: Iterable[str]) -> str | None:
    """Why this precision cannot build this graph, or None when it can."""
    quantized = _QUANTIZED_OPS.intersection(op_types)
    if precision in (names.Precision.FP8, names.Precision.INT8) and not quantized:
        return (
            f"precision: {precision} needs an explicitly quantized model (QuantizeLinear/"
            "DequantizeLinear nodes); this artifact has none (use fp16, or quantize it first)"
        )
    return None


# -- the engine --------------------------------------------------------------------


def _import_tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError as error:
        raise ConfigError(f"backend: tensorrt is not installed ({error})") from error
    return tensorrt


def _input_specs(model_path: Path) -> tuple[list[TensorSpec], set[str]]:
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    initializers = {init.name for init in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
        shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim)
        specs.append(TensorSpec(value.name, dtype, shape))
    return specs, {node.op_type for node in model.graph.node}


class _Lane:
    def __init__(self, engine: Any, torch: Any, device: Any) -> None:
        self.context = engine.create_execution_context()
        self.stream = torch.cuda.Stream(device)
        self.device_buffers: dict[str, Any] = {}
        self.host_buffers: dict[str, Any] = {}


class TensorRTEngine(Engine):
    """A TensorRT engine built (or read from the cache) for this GPU."""

    device = "cuda"

    def __init__(self, model_path: Path | str, settings: TensorRTSettings = TensorRTSettings()):
        trt = _import_tensorrt()
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("backend: tensorrt needs a CUDA GPU; torch sees none")
        self._trt, self._torch = trt, torch
        self.settings = settings
        model_path = Path(model_path)
        specs, op_types = _input_specs(model_path)
        refusal = precision_refusal(settings.precision, op_types)
        if refusal:
            raise ConfigError(refusal)
        shapes = {spec.name: profile_shapes(spec, settings) for spec in specs}
        self._logger = trt.Logger(trt.Logger.WARNING)
        key = cache_key(
            file_sha256(model_path), torch.cuda.get_device_name(), trt.__version__, settings
        )
        plan_path = settings.cache_path / f"{key}.plan"
        if plan_path.is_file():
            plan = plan_path.read_bytes()
            log.info("%s: TensorRT engine from cache %s", model_path, plan_path)
        else:
            plan = self._build(model_path, shapes)
            plan_path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(plan_path, plan)
            log.info("%s: built a TensorRT engine, cached at %s", model_path, plan_path)
        self.plan_path = plan_path
        runtime = trt.Runtime(self._logger)
        self._engine = runtime.deserialize_cuda_engine(plan)
        if self._engine is None:
            raise ConfigError(f"{plan_path}: TensorRT could not deserialize the engine")
        self._runtime = runtime
        inputs, outputs = [], []
        for index in range(self._engine.num_io_tensors):
            name = self._engine.get_tensor_name(index)
            dtype = np.dtype(trt.nptype(self._engine.get_tensor_dtype(name)))
            shape = tuple(self._engine.get_tensor_shape(name))
            spec = TensorSpec(name, dtype, shape)
            if self._engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                inputs.append(spec)
            else:
                outputs.append(spec)
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self._device = torch.device("cuda")
        self._lanes: queue.SimpleQueue[_Lane] = queue.SimpleQueue()
        for _ in range(settings.streams):
            self._lanes.put(_Lane(self._engine, torch, self._device))

    def _build(self, model_path: Path, shapes: Mapping[str, tuple]) -> bytes:
        trt, settings = self._trt, self.settings
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse_from_file(str(model_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise ConfigError(f"{model_path}: TensorRT's ONNX parser refused the model: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, settings.workspace_mib << 20)
        config.builder_optimization_level = settings.builder_optimization_level
        if settings.precision == names.Precision.FP16:
            config.set_flag(trt.BuilderFlag.FP16)
        elif settings.precision == names.Precision.FP8:
            config.set_flag(trt.BuilderFlag.FP8)
            config.set_flag(trt.BuilderFlag.FP16)  # layers without Q/DQ fall back to fp16
        elif settings.precision == names.Precision.INT8:
            config.set_flag(trt.BuilderFlag.INT8)
            config.set_flag(trt.BuilderFlag.FP16)
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in shapes.items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise ConfigError(f"{model_path}: TensorRT failed to build an engine (see its log)")
        return bytes(serialized)

    def run(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        torch = self._torch
        names = list(outputs) if outputs else [spec.name for spec in self.outputs]
        known = {spec.name for spec in self.outputs}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise InvalidArgument(f"outputs: unknown output {unknown[0]!r}")
        lane = self._lanes.get()
        try:
            with torch.cuda.stream(lane.stream):
                for spec in self.inputs:
                    if spec.name not in inputs:
                        raise InvalidArgument(f"inputs: missing input {spec.name!r}")
                    array = np.ascontiguousarray(inputs[spec.name], dtype=spec.dtype)
                    if not lane.context.set_input_shape(spec.name, array.shape):
                        raise InvalidArgument(
                            f"input {spec.name!r}: shape {list(array.shape)} is outside the "
                            "engine's optimization profile"
                        )
                    host = self._staged(lane, f"in:{spec.name}", array.shape, array.dtype)
                    host.numpy()[...] = array
                    device = self._device_buffer(lane, spec.name, array.shape, array.dtype)
                    device.copy_(host, non_blocking=True)
                    lane.context.set_tensor_address(spec.name, device.data_ptr())
                produced = {}
                for spec in self.outputs:
                    shape = tuple(lane.context.get_tensor_shape(spec.name))
                    device = self._device_buffer(lane, spec.name, shape, spec.dtype)
                    lane.context.set_tensor_address(spec.name, device.data_ptr())
                    produced[spec.name] = device
                if not lane.context.execute_async_v3(lane.stream.cuda_stream):
                    raise EngineError("tensorrt: execute_async_v3 failed (see its log)")
                staged = {}
                for name in names:
                    device = produced[name]
                    host = self._staged(lane, f"out:{name}", device.shape, device.dtype)
                    host.copy_(device, non_blocking=True)
                    staged[name] = host
                lane.stream.synchronize()
            return {name: host.numpy().copy() for name, host in staged.items()}
        except RuntimeError as error:
            raise EngineError(f"tensorrt: {error}") from error
        finally:
            self._lanes.put(lane)

    def _device_buffer(self, lane: _Lane, name: str, shape: Sequence[int], dtype: Any) -> Any:
        return self._buffer(lane.device_buffers, name, shape, dtype, pinned=False)

    def _staged(self, lane: _Lane, name: str, shape: Sequence[int], dtype: Any) -> Any:
        return self._buffer(lane.host_buffers, name, shape, dtype, pinned=True)

    def _buffer(self, store: dict, name: str, shape: Sequence[int], dtype: Any, pinned: bool):
        torch = self._torch
        torch_dtype = dtype if isinstance(dtype, torch.dtype) else (
            torch.from_numpy(np.empty(0, dtype)).dtype
        )
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=torch_dtype).element_size()
        buffer = store.get(name)
        if buffer is None or buffer.numel() < nbytes:
            if pinned:
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            else:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
            store[name] = buffer
        return buffer[:nbytes].view(torch_dtype).view(tuple(shape))

    def describe(self) -> dict[str, str]:
        return {
            "engine": "tensorrt",
            "device": "cuda",
            "precision": self.settings.precision,
            "tensorrt": self._trt.__version__,
            "batch_profile": (
                f"{self.settings.min_batch_size}/{self.settings.opt_batch_size}/"
                f"{self.settings.max_batch_size}"
            ),
            "plan": self.plan_path.name,
        }

    def close(self) -> None:
        self._lanes = queue.SimpleQueue()
        self._engine = None


