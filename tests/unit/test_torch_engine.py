"""The torch engine and its ONNX converter against real ONNX Runtime.

CPU tests run everywhere; CUDA tests (graphs, padding, fp16/fp8 on a GPU) run
only where torch sees a GPU and skip with the reason elsewhere.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch", reason="torch is not installed")

from tiered.agent.repository import model_file, write_config  # noqa: E402
from tiered.engines import open_engine  # noqa: E402
from tiered.engines.base import TensorSpec, bucket_eligibility, choose_bucket  # noqa: E402
from tiered.engines.onnx_to_torch import convert  # noqa: E402
from tiered.engines.torch_engine import (  # noqa: E402
    TorchEngine,
    TorchSettings,
    fp8_refusal,
    resolve_device,
)
from tiered.errors import ConfigError, InvalidArgument  # noqa: E402
from tiered.local.processes import AgentProcess  # noqa: E402
from tiered.models import zoo  # noqa: E402
from tiered.settings import load_dataclass  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU visible to torch")
rng = np.random.default_rng(7)


def reference(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    return float(np.max(np.abs(actual.astype(np.float64) - expected))) / scale


def engine(path: Path, **settings) -> TorchEngine:
    return open_engine("torch", path, settings, "test.engine")


# -- pure policies -------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "buckets", "expected"),
    [
        (1, (1, 2, 4, 8), 1),
        (3, (1, 2, 4, 8), 4),
        (4, (1, 2, 4, 8), 4),
        (8, (1, 2, 4, 8), 8),
        (9, (1, 2, 4, 8), None),  # above the largest: eager
        (5, (8, 1, 4), 8),  # order in the settings does not matter
        (1, (), None),  # no buckets: eager
        (64, (1, 2, 4, 8, 16, 32, 64), 64),
        (33, (1, 2, 4, 8, 16, 32, 64), 64),
    ],
)
def test_a_batch_runs_in_the_smallest_bucket_that_holds_it(rows, buckets, expected):
    assert choose_bucket(rows, buckets) == expected


@pytest.mark.parametrize(
    ("requested", "cuda", "expected"),
    [("auto", True, "cuda"), ("auto", False, "cpu"), ("cpu", True, "cpu"), ("cuda", True, "cuda")],
)
def test_auto_device_is_cuda_only_when_a_gpu_is_usable(requested, cuda, expected):
    assert resolve_device(requested, cuda) == expected


def test_asking_for_cuda_without_a_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match="device: cuda"):
        resolve_device("cuda", False)


@pytest.mark.parametrize(
    ("device", "capability", "refused_because"),
    [
        ("cpu", None, "device is cpu"),
        ("cuda", (8, 0), "this GPU has 8.0"),
        ("cuda", (7, 5), "this GPU has 7.5"),
        ("cuda", (8, 9), None),
        ("cuda", (9, 0), None),
    ],
)
def test_fp8_needs_compute_capability_8_9(device, capability, refused_because):
    refusal = fp8_refusal(device, capability)
    if refused_because is None:
        assert refusal is None
    else:
        assert refusal is not None and refused_because in refusal


@pytest.mark.parametrize(
    ("shapes", "reason"),
    [
        ([(-1, 3, 32, 32)], None),
        ([(-1, 16), (-1, 16)], None),
        ([(1, 3, 32, 32)], "no variable batch dimension"),
        ([(-1, -1)], "variable dimensions past the batch"),
        ([()], "no variable batch dimension"),
    ],
)
def test_cuda_graph_buckets_need_a_batch_dimension_and_static_rest(shapes, reason):
    specs = [TensorSpec(f"x{i}", np.dtype(np.float32), s) for i, s in enumerate(shapes)]
    found = bucket_eligibility(specs)
    assert (found is None) if reason is None else (reason in found)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"precision": "fp64"}, "precision"),
        ({"device": "tpu"}, "device"),
        ({"cuda_graph_batch_sizes": [0, 4]}, "cuda_graph_batch_sizes"),
        ({"streams": 0}, "streams"),
        ({"pinned_memory": "yes"}, "pinned_memory"),
        ({"warp_speed": 9}, "warp_speed"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_field(settings, field):
    with pytest.raises(ConfigError, match=field):
        load_dataclass(TorchSettings, settings, "datacenter.torch")


def test_the_datacenter_profile_torch_section_loads():
    from tiered.profiles import load_profile

    profile = load_profile("datacenter")
    settings = load_dataclass(TorchSettings, profile.torch, "datacenter.torch")
    assert settings.precision == "fp16" and 64 in settings.cuda_graph_batch_sizes


# -- the zoo and the digits CNN against onnxruntime ----------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("torch-models")
    return {
        "resnet18": zoo.resnet18(root / "resnet18.onnx", image_size=32, num_classes=10),
        "mlp": zoo.mlp(root / "mlp.onnx", seed=3),
        "add_sub": zoo.add_sub(root / "add_sub.onnx"),
    }


def feeds_for(name: str, batch: int) -> dict[str, np.ndarray]:
    if name == "resnet18":
        return {"input": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)}
    if name == "mlp":
        return {"input": rng.standard_normal((batch, 16)).astype(np.float32)}
    return {
        "INPUT0": rng.standard_normal((batch, 16)).astype(np.float32),
        "INPUT1": rng.standard_normal((batch, 16)).astype(np.float32),
    }


@pytest.mark.parametrize("name", ["resnet18", "mlp", "add_sub"])
def test_fp32_on_cpu_matches_onnxruntime(models, name):
    feeds = feeds_for(name, 3)
    expected = reference(models[name], feeds)
    torch_engine = engine(models[name], device="cpu", precision="fp32")
    got = torch_engine.run(feeds)
    assert set(got) == set(expected)
    for output, value in expected.items():
        assert got[output].dtype == value.dtype and got[output].shape == value.shape
        assert relative_error(got[output], value) < 1e-4, output


def test_bf16_on_cpu_is_close_and_keeps_fp32_inputs_and_outputs(models):
    feeds = feeds_for("resnet18", 8)
    expected = reference(models["resnet18"], feeds)["logits"]
    torch_engine = engine(models["resnet18"], device="cpu", precision="bf16")
    assert [s.dtype for s in torch_engine.inputs] == [np.dtype(np.float32)]
    got = torch_engine.run(feeds)["logits"]
    assert got.dtype == np.float32
    assert relative_error(got, expected) < 5e-2
    assert torch_engine.describe()["precision"] == "bf16"


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory) -> Path:
    if importlib.util.find_spec("tiered.models.digits") is None:
        pytest.skip("tiered.models.digits is not in this checkout")
    from tiered.models import digits

    # The graph is what torch's exporter makes of the digits network; its
    # weights need no training to check that two runtimes agree on it.
    variant = digits.VARIANTS["v1"]
    torch.manual_seed(0)
    network = digits.build_network(variant).eval()
    untrained = digits.TrainedDigits(variant, network, 0.0, 0.0, 0)
    return digits.export_digits(untrained, tmp_path_factory.mktemp("digits") / "digits.onnx")


def test_the_exported_digits_cnn_matches_onnxruntime(digits_model):
    feeds = {"input": rng.uniform(0, 1, (5, 1, 8, 8)).astype(np.float32)}
    expected = reference(digits_model, feeds)["logits"]
    got = engine(digits_model, device="cpu", precision="fp32").run(feeds)["logits"]
    assert relative_error(got, expected) < 1e-4


def test_fp8_weights_stay_close_to_fp32(models):
    # The fp8 path is weight-only storage; its conversion runs on any device.
    feeds = feeds_for("resnet18", 4)
    expected = reference(models["resnet18"], feeds)["logits"]
    module = convert(onnx.load(models["resnet18"]), torch.float32, fp8_weights=True)
    assert any(b.dtype == torch.float8_e4m3fn for b in module.buffers())
    with torch.inference_mode():
        (got,) = module(torch.from_numpy(feeds["input"]))
    assert relative_error(got.numpy(), expected) < 0.15


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without a GPU")
def test_fp8_on_the_cpu_is_refused_with_the_reason(models):
    with pytest.raises(ConfigError, match="fp8 needs a CUDA GPU"):
        engine(models["mlp"], precision="fp8")


@pytest.mark.parametrize("batch", [1, 3, 17, 200])
def test_every_batch_size_returns_exactly_its_rows(models, batch):
    feeds = feeds_for("add_sub", batch)
    got = engine(models["add_sub"], device="cpu").run(feeds, ["OUTPUT1"])
    assert list(got) == ["OUTPUT1"]
    np.testing.assert_array_equal(got["OUTPUT1"], feeds["INPUT0"] - feeds["INPUT1"])


def test_runs_from_several_threads_at_once_give_each_its_own_answer(models):
    torch_engine = engine(models["mlp"], device="cpu")
    batches = [feeds_for("mlp", 1 + i % 5) for i in range(16)]
    expected = [reference(models["mlp"], f)["probabilities"] for f in batches]
    got: list[np.ndarray | None] = [None] * len(batches)

    def work(index: int) -> None:
        got[index] = torch_engine.run(batches[index])["probabilities"]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for want, have in zip(expected, got):
        assert have is not None and relative_error(have, want) < 1e-4


# -- op coverage: one node at a time against onnxruntime ------------------------------


def one_node_model(
    op: str,
    inputs: dict[str, tuple[int, ...]],
    initializers: dict[str, np.ndarray] | None = None,
    extra_inputs: tuple[str, ...] = (),
    opset: int = 17,
    **attrs,
) -> onnx.ModelProto:
    initializers = initializers or {}
    node = helper.make_node(op, [*inputs, *initializers, *extra_inputs], ["y"], name="n0", **attrs)
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(v, n) for n, v in initializers.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def weights(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


OP_CASES = {
    "conv asymmetric pads, stride, dilation": (
        "Conv", {"x": (2, 4, 9, 9)}, {"w": weights(6, 4, 3, 3), "b": weights(6)},
        {"pads": [0, 1, 2, 1], "strides": [2, 1], "dilations": [1, 2]},
    ),
    "conv groups, no bias": (
        "Conv", {"x": (2, 4, 8, 8)}, {"w": weights(8, 2, 3, 3)}, {"group": 2, "pads": [1, 1, 1, 1]},
    ),
    "conv 1-d": ("Conv", {"x": (2, 3, 10)}, {"w": weights(5, 3, 3)}, {"pads": [1, 1]}),
    "max pool ceil mode": (
        "MaxPool", {"x": (2, 3, 10, 10)}, {}, {"kernel_shape": [3, 3], "strides": [2, 2],
                                               "ceil_mode": 1},
    ),
    "max pool asymmetric pads": (
        "MaxPool", {"x": (2, 3, 9, 9)}, {}, {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1]},
    ),
    "max pool dilated": (
        "MaxPool", {"x": (1, 2, 11, 11)}, {}, {"kernel_shape": [3, 3], "dilations": [2, 2]},
    ),
    "average pool excluding pads": (
        "AveragePool", {"x": (2, 3, 8, 8)}, {},
        {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]},
    ),
    "average pool including pads": (
        "AveragePool", {"x": (2, 3, 8, 8)}, {},
        {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
    ),
    "average pool asymmetric pads counted": (
        "AveragePool", {"x": (2, 3, 8, 8)}, {},
        {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1], "count_include_pad": 1},
    ),
    "average pool ceil mode": (
        "AveragePool", {"x": (2, 3, 9, 9)}, {},
        {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
    ),
    "global average pool": ("GlobalAveragePool", {"x": (2, 3, 5, 7)}, {}, {}),
    "gemm transA alpha beta": (
        "Gemm", {"a": (6, 3)}, {"b": weights(6, 5), "c": weights(3, 5)},
        {"transA": 1, "alpha": 0.5, "beta": 2.0},
    ),
    "gemm no C": ("Gemm", {"a": (3, 6)}, {"b": weights(4, 6)}, {"transB": 1}),
    "gemm broadcast C": (
        "Gemm", {"a": (3, 6)}, {"b": weights(6, 4), "c": weights(4)}, {"beta": 0.25},
    ),
    "matmul batched": ("MatMul", {"a": (2, 3, 4)}, {"b": weights(4, 5)}, {}),
    "flatten axis 2": ("Flatten", {"x": (2, 3, 4, 5)}, {}, {"axis": 2}),
    "flatten axis 0": ("Flatten", {"x": (2, 3, 4)}, {}, {"axis": 0}),
    "softmax axis 1": ("Softmax", {"x": (2, 3, 4)}, {}, {"axis": 1}),
    "reshape with 0 and -1": (
        "Reshape", {"x": (2, 3, 4)}, {"shape": np.array([0, -1], np.int64)}, {},
    ),
    "transpose": ("Transpose", {"x": (2, 3, 4)}, {}, {"perm": [2, 0, 1]}),
    "transpose default": ("Transpose", {"x": (2, 3, 4)}, {}, {}),
    "mul broadcast": ("Mul", {"x": (2, 3, 4)}, {"k": weights(4)}, {}),
    "div": ("Div", {"x": (2, 3)}, {"k": weights(2, 3) + 5.0}, {}),
    "sub": ("Sub", {"x": (2, 3)}, {"k": weights(1, 3)}, {}),
    "sigmoid": ("Sigmoid", {"x": (2, 5)}, {}, {}),
    "tanh": ("Tanh", {"x": (2, 5)}, {}, {}),
    "relu": ("Relu", {"x": (2, 5)}, {}, {}),
    "identity": ("Identity", {"x": (2, 5)}, {}, {}),
    "batch norm": (
        "BatchNormalization", {"x": (2, 3, 4, 4)},
        {"s": weights(3), "bias": weights(3), "m": weights(3), "v": np.abs(weights(3)) + 0.5},
        {"epsilon": 1e-3},
    ),
    "concat axis 1": ("Concat", {"x": (2, 3), "z": (2, 4)}, {"k": weights(2, 1)}, {"axis": 1}),
    "clip both bounds": (
        "Clip", {"x": (3, 4)}, {"lo": np.array(-0.5, np.float32), "hi": np.array(0.7, np.float32)},
        {},
    ),
}


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_each_supported_op_matches_onnxruntime(tmp_path, case):
    op, inputs, initializers, attrs = OP_CASES[case]
    path = tmp_path / "one.onnx"
    onnx.save(one_node_model(op, inputs, initializers, **attrs), path)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}
    expected = reference(path, feeds)["y"]
    module = convert(onnx.load(path))
    with torch.inference_mode():
        (got,) = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])
    assert got.shape == expected.shape
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_clip_with_only_a_max_and_a_constant_node(tmp_path):
    bound = helper.make_node(
        "Constant", [], ["hi"], value=numpy_helper.from_array(np.array(0.25, np.float32))
    )
    clip = helper.make_node("Clip", ["x", "", "hi"], ["y"])
    graph = helper.make_graph(
        [bound, clip], "clip",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 4])],
    )
    path = tmp_path / "clip.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                ir_version=8), path)
    feeds = {"x": rng.standard_normal((3, 4)).astype(np.float32)}
    got = engine(path, device="cpu").run(feeds)["y"]
    np.testing.assert_array_equal(got, reference(path, feeds)["y"])


def test_an_unsupported_op_is_a_config_error_naming_node_and_op(tmp_path):
    path = tmp_path / "erf.onnx"
    model = one_node_model("Erf", {"x": (2, 3)})
    model.graph.node[0].name = "gelu_part"
    onnx.save(model, path)
    with pytest.raises(ConfigError, match=r"node gelu_part \(Erf\): op Erf is not supported"):
        engine(path, device="cpu")


@pytest.mark.parametrize(
    ("op", "inputs", "initializers", "attrs", "message"),
    [
        ("Conv", {"x": (1, 2, 5, 5)}, {"w": weights(2, 2, 3, 3)}, {"auto_pad": "SAME_UPPER"},
         "auto_pad 'SAME_UPPER' is not supported"),
        ("MaxPool", {"x": (1, 2, 5, 5)}, {}, {"kernel_shape": [2, 2], "storage_order": 1},
         "storage_order 1"),
        ("Softmax", {"x": (2, 3)}, {}, {"axis": 1, "unknown_flag": 1},
         "attribute 'unknown_flag' is not supported"),
    ],
)
def test_an_unsupported_attribute_is_a_config_error_naming_it(
    tmp_path, op, inputs, initializers, attrs, message
):
    path = tmp_path / "bad.onnx"
    onnx.save(one_node_model(op, inputs, initializers, **attrs), path)
    with pytest.raises(ConfigError, match=rf"node n0 \({op}\): .*{message}"):
        engine(path, device="cpu")


def test_a_reshape_whose_shape_is_computed_at_run_time_is_refused(tmp_path):
    path = tmp_path / "reshape.onnx"
    node = helper.make_node("Reshape", ["x", "s"], ["y"], name="dynamic_reshape")
    graph = helper.make_graph(
        [node], "r",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
         helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                ir_version=8), path)
    with pytest.raises(ConfigError, match="dynamic_reshape.*must be a constant"):
        engine(path, device="cpu")


# -- served by a real datacenter agent --------------------------------------------------


def test_a_datacenter_agent_serves_a_torch_model_that_matches_onnxruntime(tmp_path):
    import tritonclient.grpc as grpcclient

    repo = tmp_path / "repository"
    resnet = zoo.resnet18(model_file(repo, "resnet", 1), image_size=32, num_classes=10)
    write_config(repo, "resnet", {
        "backend": "torch", "max_batch_size": 8,
        "dynamic_batching": {"max_queue_delay_us": 500},
        "engine": {"precision": "fp32"},
    })
    mlp = zoo.mlp(model_file(repo, "mlp", 1), seed=5)
    # No engine override: the datacenter profile's torch section (fp16).
    write_config(repo, "mlp", {"backend": "torch", "max_batch_size": 16})
    images = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
    rows = rng.standard_normal((4, 16)).astype(np.float32)
    with AgentProcess("datacenter", repo) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        def infer(model: str, name: str, array: np.ndarray, output: str) -> np.ndarray:
            item = grpcclient.InferInput(name, list(array.shape), "FP32")
            item.set_data_from_numpy(array)
            return client.infer(model, [item]).as_numpy(output)

        got = infer("resnet", "input", images, "logits")
        # fp32 on a GPU convolves in TF32 (torch's default), good to about 1e-3.
        tolerance = 5e-3 if CUDA else 1e-4
        assert relative_error(got, reference(resnet, {"input": images})["logits"]) < tolerance
        probabilities = infer("mlp", "input", rows, "probabilities")
        expected = reference(mlp, {"input": rows})["probabilities"]
        np.testing.assert_allclose(probabilities, expected, atol=2e-3)

        config = client.get_model_config("mlp", as_json=True)["config"]
        facts = {k: v["string_value"] for k, v in config["parameters"].items()}
        assert config["platform"] == "pytorch_libtorch"
        assert facts["engine"] == "torch" and facts["precision"] == "fp16"
        assert facts["device"] == ("cuda" if CUDA else "cpu")
    assert agent.stop() == 0 or not agent.alive()


# -- CUDA ----------------------------------------------------------------------------------


@needs_cuda
def test_cuda_graph_buckets_pad_and_return_exactly_the_rows_asked_for(models):
    buckets = [1, 2, 4, 8]
    graphed = engine(models["resnet18"], device="cuda", precision="fp32",
                     cuda_graph_batch_sizes=buckets, streams=2)
    assert graphed.describe()["cuda_graphs"] == "1,2,4,8"
    for batch in (1, 3, 5, 8, 11):  # 11 is above the largest bucket: eager
        feeds = feeds_for("resnet18", batch)
        got = graphed.run(feeds)["logits"]
        assert got.shape == (batch, 10)
        # TF32 convolutions on the GPU keep about 1e-3.
        assert relative_error(got, reference(models["resnet18"], feeds)["logits"]) < 5e-3


@needs_cuda
def test_cuda_fp16_keeps_fp32_io_and_agrees_with_onnxruntime(models):
    graphed = engine(models["resnet18"], device="cuda", precision="fp16",
                     cuda_graph_batch_sizes=[4, 16])
    feeds = feeds_for("resnet18", 16)
    expected = reference(models["resnet18"], feeds)["logits"]
    got = graphed.run(feeds)["logits"]
    assert got.dtype == np.float32
    assert relative_error(got, expected) < 2e-2
    assert np.mean(got.argmax(1) == expected.argmax(1)) >= 0.9


@needs_cuda
def test_cuda_lanes_run_concurrently_without_mixing_answers(models):
    graphed = engine(models["mlp"], device="cuda", precision="fp32",
                     cuda_graph_batch_sizes=[1, 2, 4, 8], streams=2)
    batches = [feeds_for("mlp", 1 + i % 8) for i in range(32)]
    expected = [reference(models["mlp"], f)["probabilities"] for f in batches]
    got: list[np.ndarray | None] = [None] * len(batches)

    def work(index: int) -> None:
        got[index] = graphed.run(batches[index])["probabilities"]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for want, have in zip(expected, got):
        assert have is not None and have.shape == want.shape
        assert relative_error(have, want) < 5e-3


@needs_cuda
def test_requests_staged_straight_into_pinned_buffers_match_a_merged_batch(models):
    graphed = engine(models["mlp"], device="cuda", precision="fp32",
                     cuda_graph_batch_sizes=[1, 2, 4, 8], streams=2)
    requests = [feeds_for("mlp", size) for size in (1, 3, 2)]
    merged = {name: np.concatenate([r[name] for r in requests]) for name in requests[0]}
    staged = graphed.stage(requests)
    assert not isinstance(staged, dict)  # written into a lane's pinned buffers
    np.testing.assert_array_equal(graphed.run(staged)["probabilities"],
                                  graphed.run(merged)["probabilities"])
    for _ in range(3):  # each run gave its lane back: staging never waits for one
        graphed.run(graphed.stage(requests))
    with pytest.raises(InvalidArgument):  # a refused run gives its lane back too
        graphed.run(graphed.stage(requests), outputs=["nope"])
    graphed.run(graphed.stage(requests))
    graphed.run(graphed.stage(requests))


@needs_cuda
@pytest.mark.parametrize("buckets", [[1, 2, 4, 8], []], ids=["graphs", "eager"])
def test_requests_in_pinned_shared_memory_go_to_the_gpu_from_where_they_lie(models, buckets):
    """A front end's arena, page-locked where the engine maps it: the batch's
    parts are copied to the GPU from there, one copy each, no staging."""
    import mmap

    from tiered.agent.shared_memory import pin_host_memory

    graphed = engine(models["mlp"], device="cuda", precision="fp32",
                     cuda_graph_batch_sizes=buckets, streams=2)
    arena = mmap.mmap(-1, 1 << 20)
    unpin = pin_host_memory(arena)
    assert unpin is not None
    requests, at = [], 0
    for size in (1, 3, 2):
        data = rng.standard_normal((size, 16)).astype(np.float32)
        view = np.frombuffer(arena, np.float32, data.size, at).reshape(data.shape)
        view[:] = data
        requests.append({"input": view})
        at += data.nbytes
    staged = graphed.stage(requests)
    assert isinstance(staged.hosts[0], list)  # the parts themselves, not a staging copy
    assert all(part.is_pinned() for part in staged.hosts[0])
    merged = {"input": np.concatenate([r["input"] for r in requests])}
    expected = reference(models["mlp"], merged)["probabilities"]
    assert relative_error(graphed.run(staged)["probabilities"], expected) < 5e-3
    assert relative_error(graphed.run(requests[1])["probabilities"],
                          reference(models["mlp"], requests[1])["probabilities"]) < 5e-3
    unpin()


@needs_cuda
def test_fp8_weight_only_runs_where_the_gpu_supports_it(models):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU has no fp8 (compute capability < 8.9)")
    fp8 = engine(models["resnet18"], device="cuda", precision="fp8",
                 cuda_graph_batch_sizes=[8])
    feeds = feeds_for("resnet18", 8)
    expected = reference(models["resnet18"], feeds)["logits"]
    assert relative_error(fp8.run(feeds)["logits"], expected) < 0.15
