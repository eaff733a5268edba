"""Run an ONNX graph with torch: a small converter from ONNX nodes to torch ops.

`convert` turns a loaded `onnx.ModelProto` into an `OnnxModule` (a
`torch.nn.Module`): initializers become buffers, and `forward` executes the
graph's nodes in topological order, each through one torch op chosen and
configured at conversion time. All attribute handling and every decision that
depends on constants (pads, transposes, reshape targets, clip bounds) happens
once, here; `forward` only calls torch ops on tensors, so it has no control
flow that depends on tensor values and a CUDA graph can capture it for a fixed
input shape.

The op set covers the models of `tiered.models.zoo` and what torch exports for
small CNNs. An op, attribute or attribute value outside it is a ConfigError
naming the node and op, raised at conversion, never a wrong answer at run time.

This module must never import anything of tiered above `tiered.errors`: it
knows ONNX and torch, not engines, settings or the wire.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper

from tiered.errors import ConfigError

__all__ = ["SUPPORTED_OPS", "OnnxModule", "convert", "onnx_dtype_to_torch"]

# ONNX element types the converter can hold as tensors.
_ONNX_TO_TORCH: dict[int, torch.dtype] = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.BOOL: torch.bool,
}

# Floating types that follow the compute precision; float64 stays as declared,
# since a model computing in double means it.
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)

# The largest finite float8 e4m3 value: weights are scaled so their largest
# magnitude per output channel lands on it.
_FP8_MAX = 448.0

Tensor = torch.Tensor
OpFn = Callable[[Sequence[Tensor | None]], Tensor]


def onnx_dtype_to_torch(elem_type: int, where: str) -> torch.dtype:
    dtype = _ONNX_TO_TORCH.get(elem_type)
    if dtype is None:
        name = onnx.TensorProto.DataType.Name(elem_type)
        raise ConfigError(f"{where}: element type {name} is not supported by the torch engine")
    return dtype


@dataclass(frozen=True)
class _Step:
    """One node, ready to run: `fn` takes the node's input tensors in order."""

    fn: OpFn
    inputs: tuple[str, ...]  # "" marks an omitted optional input
    output: str
    release: tuple[str, ...]  # values no later step reads: dropped after this one


class _Node:
    """A node's attributes with defaults and checks; errors name the node and op."""

    def __init__(
        self, node: onnx.NodeProto, index: int, opset: int, constants: Mapping[str, np.ndarray]
    ) -> None:
        self.proto = node
        self.opset = opset
        self.op = node.op_type
        self.label = f"node {node.name or f'#{index}'} ({node.op_type})"
        self.attrs = {a.name: a for a in node.attribute}
        self._constants = constants
        self._used: set[str] = set()

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.label}: {message}")

    def get(self, name: str, default=None):
        self._used.add(name)
        attr = self.attrs.get(name)
        return default if attr is None else onnx.helper.get_attribute_value(attr)

    def ints(self, name: str, default: Sequence[int]) -> tuple[int, ...]:
        return tuple(int(v) for v in self.get(name, default))

    def check_all_used(self) -> None:
        """Attributes the op handler never read are ones it does not understand."""
        unknown = sorted(set(self.attrs) - self._used)
        if unknown:
            raise self.error(f"attribute {unknown[0]!r} is not supported")

    def input(self, position: int) -> str:
        inputs = self.proto.input
        return inputs[position] if position < len(inputs) else ""

    def constant(self, position: int, what: str) -> np.ndarray | None:
        """The value of input `position` when it is a constant; None when omitted."""
        name = self.input(position)
        if not name:
            return None
        if name not in self._constants:
            raise self.error(f"input {position} ({what}) must be a constant initializer")
        return self._constants[name]

    def auto_pad_notset(self) -> None:
        auto_pad = self.get("auto_pad", b"NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        if auto_pad != "NOTSET":
            raise self.error(f"auto_pad {auto_pad!r} is not supported (only NOTSET)")


# -- op handlers ---------------------------------------------------------------
# Each takes the node and returns the function run at forward time, plus the
# positions of inputs that were folded into it as constants (those are not fed
# at run time).

Handler = Callable[[_Node], tuple[OpFn, tuple[int, ...]]]


def _spatial(node: _Node, rank: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """strides, dilations and begin/end pads for `rank` spatial dimensions."""
    strides = node.ints("strides", (1,) * rank)
    dilations = node.ints("dilations", (1,) * rank)
    pads = node.ints("pads", (0,) * (2 * rank))
    if len(strides) != rank or len(dilations) != rank or len(pads) != 2 * rank:
        raise node.error(
            f"strides/dilations/pads do not match {rank} spatial dimensions "
            f"(strides {list(strides)}, dilations {list(dilations)}, pads {list(pads)})"
        )
    if any(p < 0 for p in pads):
        raise node.error(f"negative pads {list(pads)} are not supported")
    return strides, dilations, pads


def _torch_pad(pads: Sequence[int], rank: int) -> list[int]:
    """ONNX [x1_begin, x2_begin, ..., x1_end, x2_end] -> F.pad's last-dim-first pairs."""
    out: list[int] = []
    for axis in reversed(range(rank)):
        out += [pads[axis], pads[axis + rank]]
    return out


def _conv(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    node.auto_pad_notset()
    weight = node.constant(1, "weight")
    if weight is None:
        raise node.error("input 1 (weight) is missing")
    rank = weight.ndim - 2
    if rank not in (1, 2, 3):
        raise node.error(f"{rank}-d convolution is not supported")
    kernel = node.ints("kernel_shape", weight.shape[2:])
    if tuple(kernel) != tuple(weight.shape[2:]):
        raise node.error(
            f"kernel_shape {list(kernel)} differs from the weight's {list(weight.shape[2:])}"
        )
    strides, dilations, pads = _spatial(node, rank)
    group = int(node.get("group", 1))
    conv = (F.conv1d, F.conv2d, F.conv3d)[rank - 1]
    has_bias = bool(node.input(2))
    begin, end = pads[:rank], pads[rank:]
    if begin == end:
        padding = tuple(begin)

        def run(xs: Sequence[Tensor | None]) -> Tensor:
            bias = xs[2] if has_bias else None
            return conv(xs[0], xs[1], bias, strides, padding, dilations, group)
    else:  # torch pads both sides equally: pad the input first
        explicit = _torch_pad(pads, rank)

        def run(xs: Sequence[Tensor | None]) -> Tensor:
            bias = xs[2] if has_bias else None
            return conv(F.pad(xs[0], explicit), xs[1], bias, strides, 0, dilations, group)

    return run, ()


def _pool_common(node: _Node) -> tuple:
    node.auto_pad_notset()
    kernel = node.ints("kernel_shape", ())
    if not kernel:
        raise node.error("kernel_shape is required")
    rank = len(kernel)
    if rank not in (1, 2, 3):
        raise node.error(f"{rank}-d pooling is not supported")
    strides, dilations, pads = _spatial(node, rank)
    ceil_mode = bool(node.get("ceil_mode", 0))
    return kernel, rank, strides, dilations, pads, ceil_mode


def _max_pool(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    if len(node.proto.output) > 1 and node.proto.output[1]:
        raise node.error("the Indices output is not supported")
    if node.get("storage_order", 0) != 0:
        raise node.error("storage_order 1 is not supported")
    kernel, rank, strides, dilations, pads, ceil_mode = _pool_common(node)
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[rank - 1]
    begin, end = pads[:rank], pads[rank:]
    # torch pads symmetrically and at most half a kernel; anything else is
    # padded explicitly with -inf, which max pooling never picks.
    if begin == end and all(p <= k // 2 for p, k in zip(begin, kernel)):
        padding = tuple(begin)

        def run(xs: Sequence[Tensor | None]) -> Tensor:
            return pool(xs[0], kernel, strides, padding, dilations, ceil_mode=ceil_mode)
    else:
        if ceil_mode:
            raise node.error("ceil_mode with asymmetric or wide pads is not supported")
        explicit = _torch_pad(pads, rank)

        def run(xs: Sequence[Tensor | None]) -> Tensor:
            padded = F.pad(xs[0], explicit, value=-math.inf)
            return pool(padded, kernel, strides, 0, dilations)

    return run, ()


def _average_pool(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    kernel, rank, strides, dilations, pads, ceil_mode = _pool_common(node)
    if any(d != 1 for d in dilations):
        raise node.error(f"dilations {list(dilations)} are not supported (only 1)")
    count_include_pad = bool(node.get("count_include_pad", 0))
    pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[rank - 1]
    begin, end = pads[:rank], pads[rank:]
    if begin == end and all(p <= k // 2 for p, k in zip(begin, kernel)):
        padding = tuple(begin)

        def run(xs: Sequence[Tensor | None]) -> Tensor:
            return pool(xs[0], kernel, strides, padding, ceil_mode, count_include_pad)
    elif count_include_pad and not ceil_mode:
        # Zero padding counted in the average is exactly an explicit zero pad.
        explicit = _torch_pad(pads, rank)

        def run(xs: Sequence[Tensor | None]) -> Tensor:
            return pool(F.pad(xs[0], explicit), kernel, strides, 0, False, True)
    else:
        raise node.error(
            f"pads {list(pads)} (asymmetric or wider than half the kernel) are supported "
            "only with count_include_pad 1 and ceil_mode 0"
        )
    return run, ()


def _global_average_pool(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    def run(xs: Sequence[Tensor | None]) -> Tensor:
        x = xs[0]
        return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)

    return run, ()


def _flatten(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    axis = int(node.get("axis", 1))

    def run(xs: Sequence[Tensor | None]) -> Tensor:
        x = xs[0]
        cut = axis if axis >= 0 else axis + x.dim()
        # Shapes are known on the host, so this is no data-dependent branch.
        return x.reshape(math.prod(x.shape[:cut]), math.prod(x.shape[cut:]))

    return run, ()


def _gemm(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    alpha = float(node.get("alpha", 1.0))
    beta = float(node.get("beta", 1.0))
    trans_a = bool(node.get("transA", 0))
    trans_b = bool(node.get("transB", 0))
    has_c = bool(node.input(2))

    def run(xs: Sequence[Tensor | None]) -> Tensor:
        a = xs[0].t() if trans_a else xs[0]
        b = xs[1].t() if trans_b else xs[1]
        if not has_c:
            product = a @ b
            return product * alpha if alpha != 1.0 else product
        if alpha == 1.0 and beta == 1.0 and trans_b and xs[2].dim() == 1:
            return F.linear(a, xs[1], xs[2])  # the common case, one fused kernel
        return torch.addmm(xs[2], a, b, beta=beta, alpha=alpha)

    return run, ()


def _softmax(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    if node.opset >= 13:
        axis = int(node.get("axis", -1))

        def run(xs: Sequence[Tensor | None]) -> Tensor:
            return torch.softmax(xs[0], dim=axis)
    else:
        # Before opset 13 the input is viewed as 2-d at `axis` and softmax
        # runs over everything from `axis` on.
        axis = int(node.get("axis", 1))

        def run(xs: Sequence[Tensor | None]) -> Tensor:
            x = xs[0]
            cut = axis if axis >= 0 else axis + x.dim()
            flat = x.reshape(math.prod(x.shape[:cut]), -1)
            return torch.softmax(flat, dim=1).reshape(x.shape)

    return run, ()


def _reshape(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    shape = node.constant(1, "shape")
    if shape is None:
        raise node.error("input 1 (shape) is missing")
    target = tuple(int(v) for v in shape.reshape(-1))
    allow_zero = bool(node.get("allowzero", 0))
    if target.count(-1) > 1:
        raise node.error(f"shape {list(target)} has more than one -1")
    copies = () if allow_zero else tuple(i for i, v in enumerate(target) if v == 0)

    def run(xs: Sequence[Tensor | None]) -> Tensor:
        x = xs[0]
        if not copies:
            return x.reshape(target)
        # 0 copies that dimension of the input (ONNX); shapes are host values.
        dims = list(target)
        for i in copies:
            dims[i] = x.shape[i]
        return x.reshape(dims)

    return run, (1,)


def _transpose(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    perm = node.get("perm")

    def run(xs: Sequence[Tensor | None]) -> Tensor:
        x = xs[0]
        return x.permute(tuple(perm) if perm is not None else tuple(reversed(range(x.dim()))))

    return run, ()


def _batch_norm(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    if len([o for o in node.proto.output if o]) > 1:
        raise node.error("running mean/var outputs (training) are not supported")
    if node.get("training_mode", 0):
        raise node.error("training_mode 1 is not supported")
    epsilon = float(node.get("epsilon", 1e-5))
    node.get("momentum")  # meaningful in training only
    node.get("spatial")  # opset < 9; 1 is the only value models use

    def run(xs: Sequence[Tensor | None]) -> Tensor:
        x, scale, bias, mean, var = xs
        return F.batch_norm(x, mean, var, scale, bias, False, 0.0, epsilon)

    return run, ()


def _concat(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    axis = node.get("axis")
    if axis is None:
        raise node.error("axis is required")

    def run(xs: Sequence[Tensor | None]) -> Tensor:
        return torch.cat(list(xs), dim=int(axis))

    return run, ()


def _clip(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    if node.opset < 11:
        low = node.get("min")
        high = node.get("max")
        folded: tuple[int, ...] = ()
    else:
        bounds = []
        for position, what in ((1, "min"), (2, "max")):
            value = node.constant(position, what)
            bounds.append(None if value is None else float(value.reshape(-1)[0]))
        low, high = bounds
        folded = (1, 2)
    low = None if low is None else float(low)
    high = None if high is None else float(high)
    if low is None and high is None:
        return (lambda xs: xs[0]), folded

    def run(xs: Sequence[Tensor | None]) -> Tensor:
        return torch.clamp(xs[0], low, high)

    return run, folded


def _div(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    def run(xs: Sequence[Tensor | None]) -> Tensor:
        a, b = xs[0], xs[1]
        # Dtypes are fixed for a given graph, so this branch never depends on data.
        if a.is_floating_point():
            return a / b
        return torch.div(a, b, rounding_mode="trunc")  # ONNX integer division truncates

    return run, ()


def _plain(fn: Callable[..., Tensor]) -> Handler:
    def handler(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
        return (lambda xs: fn(*xs)), ()

    return handler


def _identity(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    return (lambda xs: xs[0]), ()


def _dropout(node: _Node) -> tuple[OpFn, tuple[int, ...]]:
    if len([o for o in node.proto.output if o]) > 1:
        raise node.error("the mask output is not supported")
    node.get("seed")  # inference: dropout passes its input through
    return (lambda xs: xs[0]), (1, 2)


_HANDLERS: dict[str, Handler] = {
    "Add": _plain(torch.add),
    "Sub": _plain(torch.sub),
    "Mul": _plain(torch.mul),
    "Div": _div,
    "MatMul": _plain(torch.matmul),
    "Relu": _plain(torch.relu),
    "Sigmoid": _plain(torch.sigmoid),
    "Tanh": _plain(torch.tanh),
    "Identity": _identity,
    "Dropout": _dropout,
    "Conv": _conv,
    "MaxPool": _max_pool,
    "AveragePool": _average_pool,
    "GlobalAveragePool": _global_average_pool,
    "Flatten": _flatten,
    "Gemm": _gemm,
    "Softmax": _softmax,
    "Reshape": _reshape,
    "Transpose": _transpose,
    "BatchNormalization": _batch_norm,
    "Concat": _concat,
    "Clip": _clip,
}

SUPPORTED_OPS: tuple[str, ...] = tuple(sorted({*_HANDLERS, "Constant"}))

# Which input of these ops is a weight that fp8 storage may hold.
_WEIGHT_INPUTS = {"Conv": 1, "Gemm": 1, "MatMul": 1}


# -- the module -----------------------------------------------------------------


class OnnxModule(torch.nn.Module):
    """An ONNX graph as a torch module; call it with the graph inputs in order.

    Floating inputs are cast to `compute_dtype` on entry and outputs back to the
    graph's declared types on exit, so callers keep the model's own types
    whatever precision it computes in. `forward` mutates nothing: one module may
    serve several threads at once.
    """

    def __init__(
        self,
        steps: list[_Step],
        constants: Mapping[str, Tensor],
        fp8_weights: Mapping[str, tuple[Tensor, Tensor]],
        input_names: Sequence[str],
        output_names: Sequence[str],
        output_dtypes: Sequence[torch.dtype],
        compute_dtype: torch.dtype,
        early_release: Mapping[str, tuple[str, ...]],
    ) -> None:
        super().__init__()
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self.output_dtypes = tuple(output_dtypes)
        self.compute_dtype = compute_dtype
        self._steps = steps
        # ONNX names may hold any character; buffers are registered under
        # positional names and looked up through this table.
        self._constant_slots: dict[str, str] = {}
        for index, (name, tensor) in enumerate(constants.items()):
            slot = f"c{index}"
            self.register_buffer(slot, tensor, persistent=False)
            self._constant_slots[name] = slot
        self._fp8_slots: dict[str, tuple[str, str]] = {}
        for index, (name, (quantized, scale)) in enumerate(fp8_weights.items()):
            slots = (f"q{index}", f"s{index}")
            self.register_buffer(slots[0], quantized, persistent=False)
            self.register_buffer(slots[1], scale, persistent=False)
            self._fp8_slots[name] = slots
        self._early_release = dict(early_release)
        self.channels_last = False

    def use_channels_last(self) -> OnnxModule:
        """Hold 4-d tensors (conv weights, image inputs) channels-last (NHWC).

        Same answers; tensor-core convolutions in fp16/bf16 run faster on it.
        """
        for slot, tensor in list(self._buffers.items()):
            if tensor is not None and tensor.dim() == 4:
                self._buffers[slot] = tensor.contiguous(memory_format=torch.channels_last)
        self.channels_last = True
        return self

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        values: dict[str, Tensor | None] = {"": None}
        for name, slot in self._constant_slots.items():
            values[name] = self._buffers[slot]
        for name, (q_slot, s_slot) in self._fp8_slots.items():
            # Weight-only fp8: widen to the compute type before use.
            values[name] = self._buffers[q_slot].to(self.compute_dtype) * self._buffers[s_slot]
        for name, tensor in zip(self.input_names, inputs):
            if tensor.dtype in _CASTABLE:
                if self.channels_last and tensor.dim() == 4:
                    tensor = tensor.to(self.compute_dtype, memory_format=torch.channels_last)
                else:
                    tensor = tensor.to(self.compute_dtype)
            values[name] = tensor
        for name in self._early_release.get("", ()):
            values.pop(name, None)
        for step in self._steps:
            values[step.output] = step.fn([values[name] for name in step.inputs])
            for name in step.release:
                values.pop(name, None)
        results = []
        for name, dtype in zip(self.output_names, self.output_dtypes):
            value = values[name]
            assert value is not None
            results.append(value.to(dtype) if value.dtype != dtype else value)
        return tuple(results)


def _graph_constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    return {init.name: numpy_helper.to_array(init) for init in graph.initializer}


def _constant_value(node: _Node) -> np.ndarray:
    for key in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if key in node.attrs:
            value = node.get(key)
            node.check_all_used()
            if key == "value":
                return numpy_helper.to_array(value)
            dtype = np.float32 if "float" in key else np.int64
            return np.asarray(value, dtype=dtype)
    unknown = sorted(node.attrs)
    raise node.error(f"attribute {unknown[0] if unknown else 'value'!r} is not supported")


def _topological(nodes: Sequence[onnx.NodeProto], known: set[str]) -> list[int]:
    """Node indices in an order where every input is produced before use."""
    producers = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    order: list[int] = []
    state: dict[int, int] = {}  # 1: visiting, 2: done

    def visit(start: int) -> None:
        stack = [(start, iter(nodes[start].input))]
        state[start] = 1
        while stack:
            index, pending = stack[-1]
            for name in pending:
                if not name or name in known:
                    continue
                producer = producers.get(name)
                if producer is None:
                    node = nodes[index]
                    raise ConfigError(
                        f"node {node.name or f'#{index}'} ({node.op_type}): input {name!r} "
                        "is produced by no node, initializer or graph input"
                    )
                if state.get(producer) == 1:
                    raise ConfigError(f"the graph has a cycle through {name!r}")
                if producer not in state:
                    state[producer] = 1
                    stack.append((producer, iter(nodes[producer].input)))
                    break
            else:
                stack.pop()
                state[index] = 2
                order.append(index)

    for i in range(len(nodes)):
        if i not in state:
            visit(i)
    return order


def _quantize_fp8(weight: np.ndarray, compute_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-row (first-axis) scaled float8 e4m3 storage of `weight` and its scales."""
    w = torch.from_numpy(np.array(weight, dtype=np.float32))
    amax = w.abs().reshape(w.shape[0], -1).amax(dim=1).clamp(min=1e-12)
    scale = (amax / _FP8_MAX).reshape(-1, *([1] * (w.dim() - 1)))
    quantized = (w / scale).to(torch.float8_e4m3fn)
    return quantized, scale.to(compute_dtype)


def convert(
    model: onnx.ModelProto,
    compute_dtype: torch.dtype = torch.float32,
    fp8_weights: bool = False,
) -> OnnxModule:
    """Build an `OnnxModule` from `model`; ConfigError for anything unsupported.

    `compute_dtype` is the floating type of weights and arithmetic. With
    `fp8_weights`, Conv/Gemm/MatMul weights are stored as float8 e4m3 with a
    scale per output row and widened to `compute_dtype` inside `forward`.
    """
    graph = model.graph
    opset = next(
        (o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None
    )
    if opset is None:
        raise ConfigError("the model imports no default ONNX opset")
    constants = _graph_constants(graph)
    # Older IR versions list initializers among the inputs too.
    input_names = [i.name for i in graph.input if i.name not in constants]
    known = set(constants) | set(input_names)
    nodes = list(graph.node)
    order = _topological(nodes, known)

    steps: list[tuple[OpFn, tuple[str, ...], str]] = []
    weight_names: set[str] = set()
    other_uses: set[str] = set()
    for index in order:
        proto = nodes[index]
        if proto.domain not in ("", "ai.onnx"):
            raise ConfigError(
                f"node {proto.name or f'#{index}'} ({proto.op_type}): domain {proto.domain!r} "
                "is not supported"
            )
        node = _Node(proto, index, opset, constants)
        outputs = [o for o in proto.output if o]
        if proto.op_type == "Constant":
            constants[outputs[0]] = _constant_value(node)
            continue
        handler = _HANDLERS.get(proto.op_type)
        if handler is None:
            raise node.error(
                f"op {proto.op_type} is not supported by the torch engine "
                f"(supported: {', '.join(SUPPORTED_OPS)})"
            )
        fn, folded = handler(node)
        node.check_all_used()
        if len(outputs) != 1:
            raise node.error(f"{len(outputs)} outputs; only one is supported")
        fed = tuple("" if i in folded else name for i, name in enumerate(proto.input))
        steps.append((fn, fed, outputs[0]))
        weight_at = _WEIGHT_INPUTS.get(proto.op_type)
        for position, name in enumerate(fed):
            if position == weight_at and name in constants:
                weight_names.add(name)
            elif name:
                other_uses.add(name)

    output_names = [o.name for o in graph.output]
    output_dtypes = [
        onnx_dtype_to_torch(o.type.tensor_type.elem_type, f"output {o.name!r}")
        for o in graph.output
    ]
    produced = set(known) | {out for _, _, out in steps} | set(constants)
    for name in output_names:
        if name not in produced:
            raise ConfigError(f"output {name!r} is produced by no node")

    # Only constants some step reads become tensors; folded ones (reshape
    # targets, clip bounds) were consumed at conversion.
    read = {name for _, fed, _ in steps for name in fed if name} | set(output_names)
    quantize = (
        {n for n in weight_names - other_uses
         if constants[n].dtype.kind == "f" and constants[n].ndim >= 2}
        if fp8_weights else set()
    )
    tensors: dict[str, Tensor] = {}
    fp8: dict[str, tuple[Tensor, Tensor]] = {}
    for name, array in constants.items():
        if name not in read or name in input_names:
            continue
        if name in quantize:
            fp8[name] = _quantize_fp8(array, compute_dtype)
            continue
        tensor = torch.from_numpy(np.array(array))  # a writable copy torch may own
        if tensor.dtype in _CASTABLE:
            tensor = tensor.to(compute_dtype)
        tensors[name] = tensor

    # Free each intermediate after its last reader so eager runs hold only
    # live activations (a captured graph's pool gets the same benefit).
    last_use: dict[str, int] = {}
    for position, (_, fed, _) in enumerate(steps):
        for name in fed:
            if name:
                last_use[name] = position
    keep = set(tensors) | set(fp8) | set(output_names)
    releases: dict[int, list[str]] = {}
    for name, position in last_use.items():
        if name not in keep:
            releases.setdefault(position, []).append(name)
    unused_inputs = tuple(n for n in input_names if n not in last_use and n not in keep)
    final = [
        _Step(fn, fed, out, tuple(releases.get(i, ())))
        for i, (fn, fed, out) in enumerate(steps)
    ]
    return OnnxModule(
        final, tensors, fp8, input_names, output_names, output_dtypes, compute_dtype,
        {"": unused_inputs},
    )
