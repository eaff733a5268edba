"""Canaries for the end-to-end judge tests, made in code from a trained network.

Each keeps the network's speed, cost and answers except in the one way its
name says, so a test can check that the judge sees exactly that.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def logits_of(path: Path, images: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: images})[0]


def _renamed_output(model: onnx.ModelProto) -> str:
    """Rename the graph's output where it is made; the caller makes it anew."""
    final = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = [f"{name}_base" if name == final else name for name in node.output]
    return final


def answering_differently(source: Path, out: Path, images: np.ndarray) -> float:
    """The same network answering `b` wherever it answered `a` (one class of
    ten, about 10% of `images`), every other answer kept: as fast and as
    cheap. Returns the share of `images` answered differently.

    Column `b` takes the larger of the two logits and column `a` the smaller,
    with Gather, Max, Min and Sub only: operators the INT8 quantizer leaves
    exact, so each tier's build answers as its own FP32 does (the accuracy
    gate sees the stable network's agreement, whatever the training gave),
    which a raised logit, putting inputs at a new boundary, did not."""
    top = logits_of(source, images).argmax(1)
    counts = np.bincount(top, minlength=10)
    a = int(np.argmin(np.abs(counts / len(images) - 0.10)))
    b = (a + 1) % len(counts)
    model = onnx.load(source)
    final = _renamed_output(model)
    far = 1e4  # beyond any logit, and within FP16's range for the regional build
    only_b = np.full((1, len(counts)), far, np.float32)
    only_b[0, b] = 0.0
    only_a = np.full((1, len(counts)), -far, np.float32)
    only_a[0, a] = 0.0
    model.graph.initializer.extend([
        numpy_helper.from_array(np.array([a], np.int64), "swap_a"),
        numpy_helper.from_array(np.array([b], np.int64), "swap_b"),
        numpy_helper.from_array(only_b, "swap_only_b"),
        numpy_helper.from_array(only_a, "swap_only_a")])
    base = f"{final}_base"
    model.graph.node.extend([
        helper.make_node("Gather", [base, "swap_a"], ["swap_la"], axis=1),
        helper.make_node("Gather", [base, "swap_b"], ["swap_lb"], axis=1),
        helper.make_node("Max", ["swap_la", "swap_lb"], ["swap_high"]),
        helper.make_node("Min", ["swap_la", "swap_lb"], ["swap_low"]),
        # high at b, -far elsewhere; low at a, +far elsewhere
        helper.make_node("Sub", ["swap_high", "swap_only_b"], ["swap_at_b"]),
        helper.make_node("Sub", ["swap_low", "swap_only_a"], ["swap_at_a"]),
        helper.make_node("Max", [base, "swap_at_b"], ["swap_raised"]),
        helper.make_node("Min", ["swap_raised", "swap_at_a"], [final])])
    onnx.save(model, out)
    answers = logits_of(out, images).argmax(1)
    assert set(np.flatnonzero(answers != top)) == set(np.flatnonzero(top == a)), \
        "the canary must change exactly the answers that were a"
    return float((answers != top).mean())


def slower_in_its_tail(source: Path, out: Path, threshold: float, width: int = 512,
                       steps: int = 1200) -> None:
    """The same network with the same answers, but inputs brighter than
    `threshold` (summed pixels) first take a detour: `steps` dense layers of
    `width` in a Loop, about 40 ms on one core here. Requests with such inputs
    are the slower tail; the rest, the median, unchanged. `bright_inputs`
    makes them: with the threshold above every input of the build's data,
    the tier builds (calibration, accuracy gate, timing) never take the
    detour and cost what the stable network's do."""
    model = onnx.load(source)
    source_input = model.graph.input[0].name
    final = _renamed_output(model)
    size = int(np.prod([d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim
                        if d.dim_value > 0]))
    rng = np.random.default_rng(0)
    model.graph.initializer.extend([
        numpy_helper.from_array(np.array(threshold, np.float32), "tail_threshold"),
        numpy_helper.from_array(np.array([1], np.int64), "tail_axis"),
        numpy_helper.from_array(rng.normal(0, 0.1, (size, width)).astype(np.float32),
                                "tail_in"),
        numpy_helper.from_array(rng.normal(0, 0.05, (width, width)).astype(np.float32),
                                "tail_w"),
        numpy_helper.from_array(np.array(steps, np.int64), "tail_steps"),
        numpy_helper.from_array(np.array(True), "tail_go"),
        numpy_helper.from_array(np.array(0.0, np.float32), "tail_zero")])
    scalar = TensorProto.FLOAT
    # One step: h <- Relu(h W), carried from one iteration to the next.
    step = helper.make_graph(
        [helper.make_node("Identity", ["l_cond"], ["l_cond_out"]),
         helper.make_node("MatMul", ["l_h", "tail_w"], ["l_m"]),
         helper.make_node("Relu", ["l_m"], ["l_h_out"])],
        "tail_step",
        [helper.make_tensor_value_info("l_i", TensorProto.INT64, []),
         helper.make_tensor_value_info("l_cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("l_h", scalar, None)],
        [helper.make_tensor_value_info("l_cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("l_h_out", scalar, None)])
    detour = [helper.make_node("Flatten", [source_input], ["t_x"], axis=1),
              helper.make_node("MatMul", ["t_x", "tail_in"], ["t_h0"]),
              helper.make_node("Loop", ["tail_steps", "tail_go", "t_h0"], ["t_h"],
                               body=step),
              helper.make_node("ReduceSum", ["t_h"], ["t_sum"], keepdims=0),
              helper.make_node("Mul", ["t_sum", "tail_zero"], ["t_bump"])]
    then = helper.make_graph(detour, "detour", [],
                             [helper.make_tensor_value_info("t_bump", scalar, [])])
    direct = helper.make_graph([helper.make_node("Identity", ["tail_zero"], ["d_bump"])],
                               "direct", [], [helper.make_tensor_value_info("d_bump", scalar, [])])
    model.graph.node.extend([
        # The brightest input of the batch decides (the builds run batches).
        helper.make_node("Flatten", [source_input], ["rows"], axis=1),
        helper.make_node("ReduceSum", ["rows", "tail_axis"], ["brightness"], keepdims=0),
        helper.make_node("ReduceMax", ["brightness"], ["brightest"], keepdims=0),
        helper.make_node("Greater", ["brightest", "tail_threshold"], ["bright"]),
        helper.make_node("If", ["bright"], ["bump"], then_branch=then, else_branch=direct),
        helper.make_node("Add", [f"{final}_base", "bump"], [final])])
    onnx.save(model, out)


def brightness(images: np.ndarray) -> np.ndarray:
    return images.reshape(len(images), -1).sum(1)


def bright_inputs(images: np.ndarray, lift: float) -> np.ndarray:
    """`images` with every pixel raised by `lift` times the data's top value,
    kept within the data's range: an INT8 build's input scale, calibrated on
    that range, clips what lies beyond it (a brighter scale would not read
    brighter there)."""
    top = float(images.max())
    return np.clip(images + lift * top, images.min(), top).astype(images.dtype)


def the_same(source: Path, out: Path) -> None:
    """The same network as other bytes: a new version with nothing changed."""
    model = onnx.load(source)
    model.doc_string = "the same network, as another artifact"
    onnx.save(model, out)
