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


def answering_differently(source: Path, out: Path, images: np.ndarray,
                          share: float = 0.12) -> float:
    """The same network with one class's logit raised so that about `share` of
    `images` get another answer: as fast and as cheap. Returns the share."""
    logits = logits_of(source, images)
    top = logits.argmax(1)
    for label in range(logits.shape[1]):
        gaps = np.sort((logits.max(1) - logits[:, label])[top != label])
        count = int(share * len(images))
        if 0 < count <= len(gaps):
            raise_by = float(gaps[count - 1]) + 1e-4
            break
    model = onnx.load(source)
    final = _renamed_output(model)
    bias = np.zeros(logits.shape[1], np.float32)
    bias[label] = raise_by
    model.graph.initializer.append(numpy_helper.from_array(bias, "class_bias"))
    model.graph.node.append(helper.make_node("Add", [f"{final}_base", "class_bias"], [final]))
    onnx.save(model, out)
    return float((logits_of(out, images).argmax(1) != top).mean())


def slower_in_its_tail(source: Path, out: Path, images: np.ndarray, share: float = 0.10,
                       width: int = 1024, layers: int = 48) -> None:
    """The same network with the same answers, but the brightest `share` of
    `images` first take a detour through `layers` dense layers (about 1.5 ms
    on a 2-core machine): a slower tail, the median unchanged."""
    model = onnx.load(source)
    source_input = model.graph.input[0].name
    final = _renamed_output(model)
    threshold = float(np.quantile(images.reshape(len(images), -1).sum(1), 1 - share))
    rng = np.random.default_rng(0)
    model.graph.initializer.extend([
        numpy_helper.from_array(np.array(threshold, np.float32), "tail_threshold"),
        numpy_helper.from_array(
            rng.normal(0, 0.1, (images[0].size, width)).astype(np.float32), "tail_in"),
        numpy_helper.from_array(rng.normal(0, 0.03, (width, width)).astype(np.float32),
                                "tail_w"),
        numpy_helper.from_array(np.array(0.0, np.float32), "tail_zero")])
    detour = [helper.make_node("Flatten", [source_input], ["t_x"], axis=1),
              helper.make_node("MatMul", ["t_x", "tail_in"], ["t_h0"])]
    for k in range(layers):
        detour += [helper.make_node("MatMul", [f"t_h{k}", "tail_w"], [f"t_m{k}"]),
                   helper.make_node("Relu", [f"t_m{k}"], [f"t_h{k + 1}"])]
    detour += [helper.make_node("ReduceSum", [f"t_h{layers}"], ["t_sum"], keepdims=0),
               helper.make_node("Mul", ["t_sum", "tail_zero"], ["t_bump"])]
    scalar = TensorProto.FLOAT
    then = helper.make_graph(detour, "detour", [],
                             [helper.make_tensor_value_info("t_bump", scalar, [])])
    direct = helper.make_graph([helper.make_node("Identity", ["tail_zero"], ["d_bump"])],
                               "direct", [], [helper.make_tensor_value_info("d_bump", scalar, [])])
    model.graph.node.extend([
        helper.make_node("ReduceSum", [source_input], ["brightness"], keepdims=0),
        helper.make_node("Greater", ["brightness", "tail_threshold"], ["bright"]),
        helper.make_node("If", ["bright"], ["bump"], then_branch=then, else_branch=direct),
        helper.make_node("Add", [f"{final}_base", "bump"], [final])])
    onnx.save(model, out)


def the_same(source: Path, out: Path) -> None:
    """The same network as other bytes: a new version with nothing changed."""
    model = onnx.load(source)
    model.doc_string = "the same network, as another artifact"
    onnx.save(model, out)
