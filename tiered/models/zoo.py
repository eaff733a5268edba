"""Sample and test models, built in code.

Nothing here downloads weights: machines that run tiered's tests and
benchmarks have no internet, and torch is optional. Every builder writes one
ONNX file with `onnx.helper` and random weights from a seeded generator, so the
same arguments always give the same file, and returns its path.

- `resnet18`: a ResNet-18-shaped image classifier, the compute-bound workload.
- `mlp`: a tiny classifier where per-request overhead dominates.
- `identity`: one Identity per Open Inference Protocol datatype, for round-trip
  tests of every wire type.
- `add_sub`: Triton's classic "simple" model (OUTPUT0 = a+b, OUTPUT1 = a-b).
- `repeat`: Triton's decoupled "repeat_int32": a response per element of IN.

The models are for measuring and testing serving, never for their answers: the
weights are random. This module must never import anything of tiered's above
it (agent, engines, protocol); it knows ONNX and numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["V2_TO_ONNX", "add_sub", "identity", "mlp", "repeat", "resnet18"]

OPSET = 17
# IR 8 is the version that goes with opset 17; writing it explicitly (rather
# than whatever the installed onnx defaults to) keeps the files loadable by
# older ONNX Runtime builds, such as the one on the lent GPU machine.
IR_VERSION = 8
BATCH_DIM = "batch"

# Open Inference Protocol (v2) datatype name -> ONNX element type. BF16 is left
# out on purpose: numpy has no bfloat16, so no v2 client can round-trip it as
# an array of its own type.
V2_TO_ONNX: dict[str, int] = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}


def resnet18(
    path: str | Path,
    *,
    seed: int = 0,
    num_classes: int = 1000,
    image_size: int = 224,
) -> Path:
    """Write a ResNet-18-shaped classifier with random weights to `path`.

    Layout as in He et al. (2015): conv 7x7/2 + max-pool 3x3/2, four stages of
    two BasicBlocks (64, 128, 256, 512 channels; stages 2-4 start with stride 2
    and a 1x1 strided projection on the shortcut), global average pool, Gemm.
    Weights are He-initialised and each conv's BatchNorm (random statistics) is
    folded into the conv's weight and bias, as an exported inference graph has
    it, so the graph holds only Conv, Relu, Add, MaxPool, GlobalAveragePool,
    Flatten and Gemm. Input `input` FP32 [batch, 3, image_size, image_size];
    output `logits` FP32 [batch, num_classes].
    """
    if image_size < 32:
        raise ValueError(f"image_size must be at least 32 (five stride-2 steps), got {image_size}")
    g = _GraphBuilder(np.random.default_rng(seed))
    x = g.conv_bn("input", 3, 64, kernel=7, stride=2, name="conv1", relu=True)
    x = g.node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    in_ch = 64
    for stage, out_ch in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            stride = 2 if stage > 1 and block == 0 else 1
            x = g.basic_block(x, in_ch, out_ch, stride, name=f"layer{stage}.{block}")
            in_ch = out_ch
    x = g.node("GlobalAveragePool", [x])
    x = g.node("Flatten", [x], axis=1)
    fc_w = g.initializer("fc.weight", _uniform(g.rng, (num_classes, 512), fan_in=512))
    fc_b = g.initializer("fc.bias", _uniform(g.rng, (num_classes,), fan_in=512))
    g.node("Gemm", [x, fc_w, fc_b], outputs=["logits"], transB=1)
    return _save(
        g,
        path,
        "resnet18",
        inputs=[_value_info("input", TensorProto.FLOAT, [BATCH_DIM, 3, image_size, image_size])],
        outputs=[_value_info("logits", TensorProto.FLOAT, [BATCH_DIM, num_classes])],
    )


def mlp(
    path: str | Path,
    *,
    seed: int = 0,
    in_features: int = 16,
    hidden: int = 32,
    out_features: int = 4,
) -> Path:
    """Write a two-layer perceptron (Gemm, Relu, Gemm, Softmax) to `path`.

    So small that a request's cost is almost all protocol and scheduling,
    which is what it is for. Input `input` FP32 [batch, in_features]; output
    `probabilities` FP32 [batch, out_features].
    """
    g = _GraphBuilder(np.random.default_rng(seed))
    w1 = g.initializer("fc1.weight", _he_normal(g.rng, (hidden, in_features), fan_in=in_features))
    b1 = g.initializer("fc1.bias", np.zeros(hidden, np.float32))
    w2 = g.initializer("fc2.weight", _uniform(g.rng, (out_features, hidden), fan_in=hidden))
    b2 = g.initializer("fc2.bias", np.zeros(out_features, np.float32))
    x = g.node("Gemm", ["input", w1, b1], transB=1)
    x = g.node("Relu", [x])
    x = g.node("Gemm", [x, w2, b2], transB=1)
    g.node("Softmax", [x], outputs=["probabilities"], axis=-1)
    return _save(
        g,
        path,
        "mlp",
        inputs=[_value_info("input", TensorProto.FLOAT, [BATCH_DIM, in_features])],
        outputs=[_value_info("probabilities", TensorProto.FLOAT, [BATCH_DIM, out_features])],
    )


def identity(path: str | Path, datatype_names: Iterable[str] = tuple(V2_TO_ONNX)) -> Path:
    """Write one graph with an `in_<DT>` -> Identity -> `out_<DT>` pair per datatype.

    `datatype_names` are v2 names (keys of `V2_TO_ONNX`); BYTES is an ONNX
    string tensor. Every tensor is [batch, n] with n dynamic and independent
    per datatype.
    """
    names = list(dict.fromkeys(datatype_names))
    if not names:
        raise ValueError("datatype_names is empty")
    unknown = [n for n in names if n not in V2_TO_ONNX]
    if unknown:
        raise ValueError(f"unknown datatype(s) {unknown}; known: {sorted(V2_TO_ONNX)}")
    g = _GraphBuilder(np.random.default_rng(0))
    inputs, outputs = [], []
    for dt in names:
        elem = V2_TO_ONNX[dt]
        # None leaves the second dim anonymous, so no two inputs are tied together.
        inputs.append(_value_info(f"in_{dt}", elem, [BATCH_DIM, None]))
        outputs.append(_value_info(f"out_{dt}", elem, [BATCH_DIM, None]))
        g.node("Identity", [f"in_{dt}"], outputs=[f"out_{dt}"])
    return _save(g, path, "identity", inputs=inputs, outputs=outputs)


def add_sub(path: str | Path) -> Path:
    """Write Triton's "simple" model: INPUT0, INPUT1 FP32 [batch, 16] ->
    OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""
    g = _GraphBuilder(np.random.default_rng(0))
    g.node("Add", ["INPUT0", "INPUT1"], outputs=["OUTPUT0"])
    g.node("Sub", ["INPUT0", "INPUT1"], outputs=["OUTPUT1"])
    shape: list[str | int | None] = [BATCH_DIM, 16]
    return _save(
        g,
        path,
        "add_sub",
        inputs=[_value_info(n, TensorProto.FLOAT, shape) for n in ("INPUT0", "INPUT1")],
        outputs=[_value_info(n, TensorProto.FLOAT, shape) for n in ("OUTPUT0", "OUTPUT1")],
    )


def repeat(path: str | Path) -> Path:
    """Write Triton's decoupled "repeat_int32" as a graph: IN INT32 [n] ->
    OUT INT32 [n, 1] (row i: IN[i]) and IDX UINT32 [n, 1] (row i: i), the
    rows a decoupled model's n responses. DELAY UINT32 [n] and WAIT UINT32 [1]
    are taken, as Triton's clients send them, and not read: a graph cannot sleep."""
    g = _GraphBuilder(np.random.default_rng(0))
    axis = g.initializer("axis", np.array([1], dtype=np.int64))
    count = g.node("Squeeze", [g.node("Shape", ["IN"])])
    zero = g.initializer("zero", np.array(0, dtype=np.int64))
    one = g.initializer("one", np.array(1, dtype=np.int64))
    index = g.node("Cast", [g.node("Range", [zero, count, one])], to=TensorProto.UINT32)
    g.node("Unsqueeze", ["IN", axis], outputs=["OUT"])
    g.node("Unsqueeze", [index, axis], outputs=["IDX"])
    n: list[str | int | None] = ["n"]
    return _save(
        g, path, "repeat_int32",
        inputs=[_value_info("IN", TensorProto.INT32, n),
                _value_info("DELAY", TensorProto.UINT32, n),
                _value_info("WAIT", TensorProto.UINT32, [1])],
        outputs=[_value_info("OUT", TensorProto.INT32, ["n", 1]),
                 _value_info("IDX", TensorProto.UINT32, ["n", 1])],
    )


class _GraphBuilder:
    """Collects nodes and initializers; hands out unique tensor names."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._counter = 0

    def initializer(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def node(
        self,
        op_type: str,
        inputs: list[str],
        *,
        outputs: list[str] | None = None,
        **attrs: object,
    ) -> str:
        self._counter += 1
        if outputs is None:
            outputs = [f"{op_type.lower()}_{self._counter}"]
        self.nodes.append(
            helper.make_node(op_type, inputs, outputs, name=f"{op_type}_{self._counter}", **attrs)
        )
        return outputs[0]

    def conv_bn(
        self,
        x: str,
        in_ch: int,
        out_ch: int,
        *,
        kernel: int,
        stride: int,
        name: str,
        relu: bool,
        bn_scale: float = 1.0,
    ) -> str:
        """Conv followed by a BatchNorm that is folded into the conv."""
        fan_in = in_ch * kernel * kernel
        weight = _he_normal(self.rng, (out_ch, in_ch, kernel, kernel), fan_in=fan_in)
        gamma = bn_scale * self.rng.uniform(0.8, 1.2, out_ch).astype(np.float32)
        beta = self.rng.normal(0.0, 0.05, out_ch).astype(np.float32)
        mean = self.rng.normal(0.0, 0.05, out_ch).astype(np.float32)
        var = self.rng.uniform(0.8, 1.2, out_ch).astype(np.float32)
        weight, bias = _fold_batch_norm(weight, gamma, beta, mean, var)
        w = self.initializer(f"{name}.weight", weight)
        b = self.initializer(f"{name}.bias", bias)
        pad = kernel // 2
        y = self.node(
            "Conv",
            [x, w, b],
            kernel_shape=[kernel, kernel],
            strides=[stride, stride],
            pads=[pad, pad, pad, pad],
        )
        return self.node("Relu", [y]) if relu else y

    def basic_block(self, x: str, in_ch: int, out_ch: int, stride: int, *, name: str) -> str:
        y = self.conv_bn(x, in_ch, out_ch, kernel=3, stride=stride, name=f"{name}.conv1", relu=True)
        # A small gamma on the block's last BN (as "zero-init residual" training
        # leaves it) keeps activations from doubling at every one of the eight
        # residual additions, so random-weight outputs stay in a sane range.
        y = self.conv_bn(
            y, out_ch, out_ch, kernel=3, stride=1, name=f"{name}.conv2", relu=False, bn_scale=0.3
        )
        shortcut = x
        if stride != 1 or in_ch != out_ch:
            shortcut = self.conv_bn(
                x, in_ch, out_ch, kernel=1, stride=stride, name=f"{name}.downsample", relu=False
            )
        return self.node("Relu", [self.node("Add", [y, shortcut])])


def _fold_batch_norm(
    weight: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    mean: np.ndarray,
    var: np.ndarray,
    eps: float = 1e-5,
) -> tuple[np.ndarray, np.ndarray]:
    """BN(conv(x, W)) == conv(x, W * s) + (beta - mean * s), s = gamma / sqrt(var + eps)."""
    scale = gamma / np.sqrt(var + eps)
    folded_w = weight * scale[:, None, None, None]
    folded_b = beta - mean * scale
    return folded_w.astype(np.float32), folded_b.astype(np.float32)


def _he_normal(rng: np.random.Generator, shape: tuple[int, ...], *, fan_in: int) -> np.ndarray:
    return rng.normal(0.0, np.sqrt(2.0 / fan_in), shape).astype(np.float32)


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], *, fan_in: int) -> np.ndarray:
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, shape).astype(np.float32)


def _value_info(
    name: str, elem_type: int, shape: list[str | int | None]
) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def _save(
    g: _GraphBuilder,
    path: str | Path,
    graph_name: str,
    *,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
) -> Path:
    graph = helper.make_graph(g.nodes, graph_name, inputs, outputs, initializer=g.initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="tiered.models.zoo",
    )
    onnx.checker.check_model(model)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out)
    return out
