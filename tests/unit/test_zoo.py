"""The code-built sample models are valid ONNX and compute what they claim."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tiered.models import zoo


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _checked(path: Path) -> onnx.ModelProto:
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    return model


def _dims(value_info: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def test_resnet18_is_a_valid_dynamic_batch_classifier(tmp_path: Path) -> None:
    path = zoo.resnet18(tmp_path / "r18" / "model.onnx", num_classes=10, image_size=64)
    model = _checked(path)

    assert path.is_file()
    assert model.opset_import[0].version == 17
    ops = Counter(node.op_type for node in model.graph.node)
    assert set(ops) == {"Conv", "Relu", "Add", "MaxPool", "GlobalAveragePool", "Flatten", "Gemm"}
    # stem + 8 blocks x 2 convs + 3 downsample projections
    assert ops["Conv"] == 20
    assert ops["Add"] == 8
    assert _dims(model.graph.input[0]) == ["batch", 3, 64, 64]
    assert _dims(model.graph.output[0]) == ["batch", 10]

    session = _session(path)
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 64, 64), dtype=np.float32)
        (logits,) = session.run(["logits"], {"input": x})
        assert logits.shape == (batch, 10)
        assert logits.dtype == np.float32
        assert np.all(np.isfinite(logits))


def test_resnet18_has_resnet18_parameter_count(tmp_path: Path) -> None:
    model = onnx.load(zoo.resnet18(tmp_path / "model.onnx", image_size=64))
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    # torchvision's resnet18 has 11,689,512 parameters. Folding turns each BN
    # channel's gamma and beta into one conv bias: 4,800 channels fewer values.
    assert params == 11_689_512 - 4_800


def test_builders_are_deterministic_per_seed(tmp_path: Path) -> None:
    a = zoo.mlp(tmp_path / "a.onnx", seed=7).read_bytes()
    b = zoo.mlp(tmp_path / "b.onnx", seed=7).read_bytes()
    c = zoo.mlp(tmp_path / "c.onnx", seed=8).read_bytes()
    assert a == b
    assert a != c


def test_mlp_outputs_probabilities(tmp_path: Path) -> None:
    path = zoo.mlp(tmp_path / "model.onnx", in_features=8, hidden=12, out_features=5)
    model = _checked(path)
    assert [n.op_type for n in model.graph.node] == ["Gemm", "Relu", "Gemm", "Softmax"]
    assert _dims(model.graph.input[0]) == ["batch", 8]

    x = np.random.default_rng(0).standard_normal((7, 8), dtype=np.float32)
    (probabilities,) = _session(path).run(["probabilities"], {"input": x})
    assert probabilities.shape == (7, 5)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)


_ALL_DATATYPES = [
    "FP32", "FP16", "FP64", "INT8", "INT16", "INT32", "INT64",
    "UINT8", "UINT16", "UINT32", "UINT64", "BOOL", "BYTES",
]


def _sample(datatype: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    if datatype == "BYTES":
        return np.array(
            [[f"s{i}-{j}-\u00e9" for j in range(shape[1])] for i in range(shape[0])], dtype=object
        )
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(zoo.V2_TO_ONNX[datatype])
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def test_identity_round_trips_every_datatype(tmp_path: Path) -> None:
    assert set(_ALL_DATATYPES) == set(zoo.V2_TO_ONNX)
    path = zoo.identity(tmp_path / "model.onnx", _ALL_DATATYPES)
    model = _checked(path)
    assert [i.name for i in model.graph.input] == [f"in_{dt}" for dt in _ALL_DATATYPES]
    assert [o.name for o in model.graph.output] == [f"out_{dt}" for dt in _ALL_DATATYPES]
    for value_info in model.graph.input:
        dims = value_info.type.tensor_type.shape.dim
        assert dims[0].dim_param == "batch"
        assert not dims[1].HasField("dim_value")

    rng = np.random.default_rng(0)
    # Each datatype gets its own second-dim length: they must not be tied together.
    feeds = {f"in_{dt}": _sample(dt, (2, 3 + i), rng) for i, dt in enumerate(_ALL_DATATYPES)}
    outputs = _session(path).run([f"out_{dt}" for dt in _ALL_DATATYPES], feeds)
    for dt, got in zip(_ALL_DATATYPES, outputs):
        sent = feeds[f"in_{dt}"]
        assert got.shape == sent.shape, dt
        if dt == "BYTES":
            assert got.tolist() == sent.tolist()
        else:
            assert got.dtype == sent.dtype, dt
            np.testing.assert_array_equal(got, sent)


def test_identity_takes_a_subset_and_rejects_unknown_names(tmp_path: Path) -> None:
    model = onnx.load(zoo.identity(tmp_path / "model.onnx", ["INT32", "BYTES"]))
    assert [i.name for i in model.graph.input] == ["in_INT32", "in_BYTES"]
    with pytest.raises(ValueError, match="BF16"):
        zoo.identity(tmp_path / "bad.onnx", ["FP32", "BF16"])


def test_add_sub_adds_and_subtracts(tmp_path: Path) -> None:
    path = zoo.add_sub(tmp_path / "model.onnx")
    model = _checked(path)
    assert [i.name for i in model.graph.input] == ["INPUT0", "INPUT1"]
    assert _dims(model.graph.output[1]) == ["batch", 16]

    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 16), dtype=np.float32)
    b = rng.standard_normal((4, 16), dtype=np.float32)
    out0, out1 = _session(path).run(["OUTPUT0", "OUTPUT1"], {"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out0, a + b)
    np.testing.assert_array_equal(out1, a - b)
