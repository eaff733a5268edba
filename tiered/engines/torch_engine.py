"""The torch engine: an FP32 ONNX artifact run by torch, FP16/BF16 and CUDA graphs.

The datacenter tier keeps one artifact format (model.onnx); this engine
converts it at load (`tiered.engines.onnx_to_torch`) and runs it with torch in
the precision its settings ask for. Inputs and outputs keep the types the
model declares (FP32), so clients do not change when the precision does.

On CUDA, each batch-size bucket in `cuda_graph_batch_sizes` gets a captured
CUDA graph, and a batch is padded up to the next bucket, run by replaying that
graph, and cut back to its own rows. Host arrays go to the GPU through pinned
staging buffers. Padding is only sound for models whose rows are independent,
which is what the agent's dynamic batcher assumes too when it merges requests.

Thread safety: `run` may be called from several threads at once. On CUDA each
call takes one of `streams` lanes (a CUDA stream with its own staging buffers,
static tensors and graphs) and waits when all are busy, so the copies of one
batch overlap the compute of another; the converted module itself is shared
and read-only. On the CPU torch's own kernels are thread-safe for inference.

This module must never import the agent, the batcher or the wire protocol: it
knows arrays, torch and the engine interface.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from tiered import names
from tiered.engines.base import (
    DeviceRows,
    Engine,
    TensorSpec,
    bucket_eligibility,
    choose_bucket,
    concatenate_into,
)
from tiered.engines.onnx_to_torch import OnnxModule, convert
from tiered.errors import ConfigError, EngineError, InvalidArgument

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = (names.Precision.FP32, names.Precision.FP16, names.Precision.BF16,
              names.Precision.FP8)

# fp8 weights are widened to this type for the arithmetic.
_COMPUTE_DTYPES = {
    names.Precision.FP32: torch.float32,
    names.Precision.FP16: torch.float16,
    names.Precision.BF16: torch.bfloat16,
    names.Precision.FP8: torch.float16,
}

# Ada (8.9) and Hopper (9.0) are the first GPUs with fp8 tensor cores.
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class TorchSettings:
    """How the torch engine runs a model; the tier profile's `torch:` mapping,
    laid under a model's config.yaml `engine:`.

    - device: `auto` (cuda when torch sees a GPU), `cpu` or `cuda`.
    - precision: weights and arithmetic in fp32, fp16 or bf16. `fp8` stores
      Conv/Gemm/MatMul weights as float8 e4m3 (a scale per output channel) and
      computes in fp16: weight-only, it halves weight memory but does not use
      fp8 tensor cores, since torch has no fp8 convolution. CUDA with compute
      capability >= 8.9 only.
    - cuda_graph_batch_sizes: batch buckets captured as CUDA graphs (CUDA only;
      ignored on the CPU); a batch runs in the smallest bucket that holds it,
      larger ones run eagerly. Empty: always eager.
    - capture_at_load: capture every bucket while loading (slower load, no
      slow first requests); otherwise each bucket is captured on first use.
    - pinned_memory: stage host<->GPU copies through page-locked buffers.
    - streams: concurrent runs on CUDA (match the model's instance_count).
    - channels_last: hold 4-d tensors NHWC on CUDA, faster for fp16/bf16 convs.
    - threads: torch's CPU intra-op threads, process-wide; 0 leaves torch's choice.
    """

    device: str = "auto"
    precision: str = "fp32"
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    capture_at_load: bool = True
    pinned_memory: bool = True
    streams: int = 2
    channels_last: bool = True
    threads: int = 0

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device: {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision: {self.precision!r} is not one of {', '.join(PRECISIONS)}"
            )
        if any(size < 1 for size in self.cuda_graph_batch_sizes):
            raise ConfigError(
                "cuda_graph_batch_sizes: sizes must be >= 1, got "
                f"{list(self.cuda_graph_batch_sizes)}"
            )
        if self.streams < 1:
            raise ConfigError(f"streams: must be >= 1, got {self.streams}")
        if self.threads < 0:
            raise ConfigError(f"threads: must be >= 0, got {self.threads}")


# -- pure policies ---------------------------------------------------------------


def resolve_device(requested: str, cuda_available: bool) -> str:
    """`auto` -> cuda when a GPU is usable, else cpu; `cuda` without one is an error."""
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    if requested == "cuda" and not cuda_available:
        raise ConfigError("device: cuda was asked for, but torch sees no usable CUDA GPU")
    return requested


def fp8_refusal(device: str, capability: tuple[int, int] | None) -> str | None:
    """Why fp8 cannot run here, or None when it can."""
    if device != "cuda" or capability is None:
        return "precision: fp8 needs a CUDA GPU (compute capability >= 8.9); the device is cpu"
    if capability < FP8_MIN_CAPABILITY:
        major, minor = capability
        return (
            f"precision: fp8 needs compute capability >= 8.9; this GPU has {major}.{minor} "
            "(use fp16 or bf16)"
        )
    if not hasattr(torch, "float8_e4m3fn"):
        return f"precision: fp8 needs torch with float8_e4m3fn; torch {torch.__version__} lacks it"
    return None


# -- the engine --------------------------------------------------------------------


def _spec(value: onnx.ValueInfoProto, where: str) -> TensorSpec:
    tensor = value.type.tensor_type
    if not value.type.HasField("tensor_type"):
        raise ConfigError(f"{where} {value.name!r}: only tensors are supported")
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    except (KeyError, TypeError) as error:
        raise ConfigError(f"{where} {value.name!r}: unsupported element type") from error
    if dtype == np.dtype(object) or dtype.kind not in "biuf":
        raise ConfigError(f"{where} {value.name!r}: type {dtype} is not supported by torch")
    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim)
    return TensorSpec(value.name, dtype, shape)


class _Staging:
    """Page-locked host buffers, one per tensor name, grown on demand."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def view(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < nbytes:
            # Page-locking is slow (ms), so buffers only grow, by doubling.
            size = max(nbytes, 2 * (buffer.numel() if buffer is not None else 0))
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._buffers[name] = buffer
        return buffer[:nbytes].view(dtype).view(tuple(shape))


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static, [bucket, ...], the model's input types
    outputs: dict[str, torch.Tensor]  # static, [bucket, ...], the model's output types


class _Lane:
    """One concurrent run on CUDA: a stream and everything it writes."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.staging = _Staging()
        self.graphs: dict[int, _Captured] = {}
        # One memory pool for the lane's graphs: a lane replays one graph at a
        # time and its outputs are copied out before the next replay, so the
        # buckets may share intermediate memory.
        self.pool = None


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _page_locked(array: np.ndarray) -> torch.Tensor | None:
    """`array` as a tensor when it lies in page-locked memory (a front end's
    arena, pinned where it was mapped), so the GPU can copy it from there."""
    if not array.flags.writeable or not array.flags.c_contiguous:
        return None
    tensor = torch.from_numpy(array)
    return tensor if tensor.is_pinned() else None


def _on_device_or_host(array, device: str) -> np.ndarray | DeviceRows:
    """An input as the run takes it: rows already on a GPU stay there when
    this engine runs on one; anything else is a host array."""
    return array if device == "cuda" and isinstance(array, DeviceRows) else np.asarray(array)


def _copy_sources(part: np.ndarray | DeviceRows) -> list[torch.Tensor]:
    """A part of a batch that holds rows on the device, as tensors to copy from."""
    if isinstance(part, DeviceRows):
        return part.parts  # device to device
    locked = _page_locked(part)
    return [locked if locked is not None else torch.from_numpy(np.array(part))]


def _copy_rows(target: torch.Tensor, host: torch.Tensor | list[torch.Tensor],
               non_blocking: bool) -> None:
    """Rows (in host memory, or already on a device) into the first rows of a
    device tensor: one copy, or one grouped copy of its parts (a single
    kernel for parts on the device, rather than a call per request)."""
    parts = host if isinstance(host, list) else [host]
    targets, at = [], 0
    for part in parts:
        targets.append(target[at:at + part.shape[0]])
        at += part.shape[0]
    torch._foreach_copy_(targets, parts, non_blocking=non_blocking)


@dataclass
class _Staged:
    """A batch already in a lane's pinned staging buffers (`TorchEngine.stage`);
    the lane is held until `run` has used it."""

    lane: _Lane
    hosts: list[torch.Tensor | list[torch.Tensor]]  # in the order of the engine's inputs


class TorchEngine(Engine):
    """An ONNX model converted to torch; see the module docstring for threads."""

    def __init__(self, model_path: Path | str, settings: TorchSettings = TorchSettings()) -> None:
        self.settings = settings
        try:
            model = onnx.load(str(model_path))
        except Exception as error:  # onnx raises DecodeError, OSError, ...
            raise ConfigError(f"{model_path}: cannot read the ONNX model: {error}") from error
        initializers = {init.name for init in model.graph.initializer}
        self.inputs = tuple(
            _spec(v, "input") for v in model.graph.input if v.name not in initializers
        )
        self.outputs = tuple(_spec(v, "output") for v in model.graph.output)
        self.device = resolve_device(settings.device, torch.cuda.is_available())
        capability = torch.cuda.get_device_capability() if self.device == "cuda" else None
        if settings.precision == names.Precision.FP8:
            refusal = fp8_refusal(self.device, capability)
            if refusal:
                raise ConfigError(refusal)
        self._dtype = _COMPUTE_DTYPES[settings.precision]
        module = convert(model, self._dtype, fp8_weights=settings.precision == names.Precision.FP8)
        if self.device == "cpu" and settings.threads:
            torch.set_num_threads(settings.threads)
        if self.device == "cpu" and settings.precision == names.Precision.FP16:
            log.warning(
                "%s: fp16 on the CPU runs far slower than fp32 (few CPUs compute in it); "
                "prefer fp32 or bf16 there", model_path,
            )
        self._torch_device = torch.device(self.device)
        self._graph_note = "off (cpu)" if self.device == "cpu" else "off"
        self._buckets: tuple[int, ...] = ()
        if self.device == "cuda":
            # Let cuDNN time its algorithms per shape once; buckets keep shapes few.
            torch.backends.cudnn.benchmark = True
            if settings.channels_last:
                module.use_channels_last()
            module = module.to(self._torch_device)
            torch.cuda.synchronize(self._torch_device)
            self._buckets = tuple(sorted(set(settings.cuda_graph_batch_sizes)))
            reason = bucket_eligibility(self.inputs) if self._buckets else None
            if reason:
                log.warning("%s: no CUDA graphs: %s; running eagerly", model_path, reason)
                self._graph_note, self._buckets = f"off ({reason})", ()
            elif self._buckets:
                self._graph_note = ",".join(str(b) for b in self._buckets)
        self._module: OnnxModule | None = module.eval()
        self._capture_lock = threading.Lock()
        self._lanes: queue.SimpleQueue[_Lane] = queue.SimpleQueue()
        self._all_lanes: list[_Lane] = []
        if self.device == "cuda":
            for _ in range(settings.streams):
                lane = _Lane(self._torch_device)
                self._all_lanes.append(lane)
                self._lanes.put(lane)
            if settings.capture_at_load and self._buckets:
                for lane in self._all_lanes:
                    # Largest first, so the shared pool is sized once.
                    for bucket in sorted(self._buckets, reverse=True):
                        self._capture(lane, bucket)
        self._output_names = [spec.name for spec in self.outputs]

    # -- running ---------------------------------------------------------------

    def run(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        if isinstance(inputs, _Staged):  # the lane `stage` took goes back, whatever happens
            try:
                return self._on_cuda(inputs.lane, inputs.hosts, self._names(outputs))
            finally:
                self._lanes.put(inputs.lane)
        names = self._names(outputs)
        missing = [spec.name for spec in self.inputs if spec.name not in inputs]
        if missing:
            raise InvalidArgument(f"inputs: missing input {missing[0]!r}")
        arrays = [_on_device_or_host(inputs[spec.name], self.device) for spec in self.inputs]
        if self.device == "cpu":
            return self._on_cpu(arrays, names)
        lane = self._lanes.get()
        try:
            hosts = [self._to_host_tensor(lane, spec.name, array)
                     for spec, array in zip(self.inputs, arrays)]
            return self._on_cuda(lane, hosts, names)
        finally:
            self._lanes.put(lane)

    def _names(self, outputs: Sequence[str] | None) -> list[str]:
        names = list(outputs) if outputs else self._output_names
        unknown = [n for n in names if n not in self._output_names]
        if unknown:
            raise InvalidArgument(f"outputs: unknown output {unknown[0]!r}")
        return names

    def stage(self, requests: Sequence[Mapping[str, np.ndarray]]) -> Mapping[str, np.ndarray]:
        """On CUDA with pinned memory, the requests' inputs where the GPU copies
        them from: left where they are when already page-locked (a front end's
        arena) or on the GPU (`DeviceRows`, copied device to device), else concatenated straight into a lane's staging buffers (one
        host copy fewer than merging, then staging)."""
        if self.device == "cpu" or not self.settings.pinned_memory:
            return super().stage(requests)
        if len(requests) == 1:
            return dict(requests[0])  # `run` copies it to the GPU from where it lies
        lane = self._lanes.get()
        try:
            hosts = []
            for spec in self.inputs:
                parts = [_on_device_or_host(request[spec.name], self.device)
                         for request in requests]
                if any(isinstance(part, DeviceRows) for part in parts):
                    hosts.append([t for part in parts for t in _copy_sources(part)])
                    continue
                locked = [_page_locked(part) for part in parts]
                if all(tensor is not None for tensor in locked):
                    hosts.append(locked)  # each part goes to the GPU from where it lies
                    continue
                shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
                host = lane.staging.view(f"in:{spec.name}", shape, _torch_dtype(parts[0].dtype))
                concatenate_into(parts, host.numpy())
                hosts.append(host)
        except BaseException:
            self._lanes.put(lane)
            raise
        return _Staged(lane, hosts)

    def _module_or_refuse(self) -> OnnxModule:
        if self._module is None:
            raise EngineError("the torch engine is closed")
        return self._module

    def _on_cpu(self, arrays: list[np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        try:
            with torch.inference_mode():
                return self._run_cpu(self._module_or_refuse(), arrays, names)
        except RuntimeError as error:  # torch's errors: shapes, memory, kernels
            raise EngineError(f"torch: {error}") from error

    def _on_cuda(self, lane: _Lane, hosts: list[torch.Tensor],
                 names: list[str]) -> dict[str, np.ndarray]:
        try:
            with torch.inference_mode():
                return self._run_cuda(self._module_or_refuse(), lane, hosts, names)
        except RuntimeError as error:
            raise EngineError(f"torch: {error}") from error

    def _run_cpu(
        self, module: OnnxModule, arrays: list[np.ndarray], names: list[str]
    ) -> dict[str, np.ndarray]:
        # torch warns on read-only arrays (gRPC buffers are); a copy is cheap
        # next to CPU compute and keeps torch from ever aliasing them.
        tensors = [
            torch.from_numpy(a if a.flags.writeable else a.copy()) for a in arrays
        ]
        results = dict(zip(module.output_names, module(*tensors)))
        return {name: results[name].numpy() for name in names}

    def _run_cuda(
        self, module: OnnxModule, lane: _Lane, hosts: list[torch.Tensor | list[torch.Tensor]],
        names: list[str],
    ) -> dict[str, np.ndarray]:
        """`hosts`: the inputs in host memory (in the lane's pinned staging when
        pinned), each one tensor or the page-locked parts of its batch."""
        first = hosts[0] if hosts else None
        rows = (sum(part.shape[0] for part in first) if isinstance(first, list)
                else first.shape[0] if first is not None and first.ndim else 1)
        bucket = choose_bucket(rows, self._buckets) if self._buckets else None
        pinned = self.settings.pinned_memory
        with torch.cuda.stream(lane.stream):
            if bucket is not None:
                captured = lane.graphs.get(bucket) or self._capture(lane, bucket)
                for spec, host in zip(self.inputs, hosts):
                    _copy_rows(captured.inputs[spec.name], host, pinned)
                captured.graph.replay()
                produced = {name: captured.outputs[name][:rows] for name in names}
            else:
                device_inputs = []
                for host in hosts:
                    parts = host if isinstance(host, list) else [host]
                    device = torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype,
                                         device=self._torch_device)
                    _copy_rows(device, host, pinned)
                    device_inputs.append(device)
                results = dict(zip(module.output_names, module(*device_inputs)))
                produced = {name: results[name] for name in names}
            if not pinned:
                return {name: tensor.cpu().numpy() for name, tensor in produced.items()}
            staged = {}
            for name, tensor in produced.items():
                host = lane.staging.view(f"out:{name}", tensor.shape, tensor.dtype)
                host.copy_(tensor, non_blocking=True)
                staged[name] = host
            # Spins a core while the GPU runs (CUDA's choice with fewer contexts
            # than CPUs). A blocking event freed those cores but, with front
            # ends and clients keeping the host's cores busy, its thread woke
            # late: 3,532 img/s on the wire at c=64 against 4,232 spinning
            # (bench/results/gpu-blocking-sync.json).
            lane.stream.synchronize()
        # The staging buffers are reused by the lane's next run: hand out copies.
        return {name: host.numpy().copy() for name, host in staged.items()}

    def _to_host_tensor(self, lane: _Lane, name: str, array: np.ndarray) -> torch.Tensor:
        if isinstance(array, DeviceRows):
            return array.parts  # copied device to device
        if not self.settings.pinned_memory:
            return torch.from_numpy(array if array.flags.writeable else array.copy())
        locked = _page_locked(array)
        if locked is not None:
            return locked
        host = lane.staging.view(f"in:{name}", array.shape, _torch_dtype(array.dtype))
        np.copyto(host.numpy(), array)
        return host

    def _capture(self, lane: _Lane, bucket: int) -> _Captured:
        module = self._module
        assert module is not None
        with self._capture_lock, torch.inference_mode(), torch.cuda.stream(lane.stream):
            static = {
                spec.name: torch.zeros(
                    (bucket, *spec.shape[1:]),
                    dtype=torch.from_numpy(np.empty(0, spec.dtype)).dtype,
                    device=self._torch_device,
                )
                for spec in self.inputs
            }
            feeds = [static[spec.name] for spec in self.inputs]
            # Warm-up runs outside capture: cuDNN picks its algorithms and the
            # allocator settles, neither of which may happen while capturing.
            for _ in range(2):
                warm = module(*feeds)
            lane.stream.synchronize()
            for name, tensor in zip(module.output_names, warm):
                if tensor.dim() == 0 or tensor.shape[0] != bucket:
                    raise ConfigError(
                        f"cuda_graph_batch_sizes: output {name!r} has shape {list(tensor.shape)} "
                        f"for a batch of {bucket}; padded buckets need outputs that lead with "
                        "the batch dimension (set cuda_graph_batch_sizes: [])"
                    )
            graph = torch.cuda.CUDAGraph()
            # thread_local: another lane may be replaying on its own stream.
            with torch.cuda.graph(
                graph, pool=lane.pool, stream=lane.stream, capture_error_mode="thread_local"
            ):
                produced = module(*feeds)
            lane.pool = graph.pool()
            lane.stream.synchronize()
        captured = _Captured(graph, static, dict(zip(module.output_names, produced)))
        lane.graphs[bucket] = captured
        return captured

    # -- facts ------------------------------------------------------------------

    def describe(self) -> dict[str, str]:
        facts = {
            "engine": "torch",
            "device": self.device,
            "precision": self.settings.precision,
            "cuda_graphs": self._graph_note,
            "torch": torch.__version__,
        }
        if self.device == "cuda":
            facts["gpu"] = torch.cuda.get_device_name(self._torch_device)
            facts["streams"] = str(self.settings.streams)
        return facts

    def close(self) -> None:
        self._module = None
        for lane in self._all_lanes:
            lane.graphs.clear()
        self._all_lanes.clear()
        self._lanes = queue.SimpleQueue()
