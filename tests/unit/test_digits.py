"""The trained digits models: accurate, exported faithfully, deterministic, written by the CLI.

Each variant is trained at most once per session (module fixtures); `heavy`
is checked by its shape and cost, not trained, to keep the suite fast.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch", reason="the digits models need the torch extra")
pytest.importorskip("sklearn", reason="the digits data set ships in scikit-learn")

from tiered.cli import models as model_commands  # noqa: E402
from tiered.models import digits  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
MIN_ACCURACY = 0.97
TRAIN_BUDGET_S = 60.0
# Ops a simple ONNX interpreter (the torch engine's) is expected to cover.
PLAIN_OPS = {"Conv", "Relu", "MaxPool", "Flatten", "Reshape", "Gemm", "MatMul", "Add"}


@pytest.fixture(scope="module")
def split() -> digits.DigitsSplit:
    return digits.digits_split()


@pytest.fixture(scope="module")
def trained_v1(split) -> digits.TrainedDigits:
    return digits.train_digits("v1", split)


@pytest.fixture(scope="module")
def trained_v2(split) -> digits.TrainedDigits:
    return digits.train_digits("v2", split)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("digits")


@pytest.fixture(scope="module")
def written_v1(trained_v1, out_dir, split) -> digits.DigitsModel:
    return digits.save_digits(trained_v1, out_dir, split)


@pytest.fixture(scope="module")
def written_v2(trained_v2, out_dir, split) -> digits.DigitsModel:
    return digits.save_digits(trained_v2, out_dir, split)


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _onnx_logits(path: Path, images: np.ndarray) -> np.ndarray:
    (logits,) = _session(path).run(["logits"], {"input": images})
    return logits


def _torch_logits(module: torch.nn.Module, images: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return module(torch.from_numpy(images)).numpy()


def _dims(value_info: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _eval_data(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path) as archive:
        return archive["input"], archive["label"]


def test_v1_reaches_97_percent_on_held_out_digits_within_the_time_budget(
    trained_v1, written_v1
) -> None:
    print(f"v1 trained in {trained_v1.train_seconds:.1f} s, test accuracy "
          f"{trained_v1.test_accuracy:.2%}")
    assert trained_v1.train_seconds < TRAIN_BUDGET_S
    assert trained_v1.test_accuracy >= MIN_ACCURACY
    images, labels = _eval_data(written_v1.eval_path)
    onnx_accuracy = float(np.mean(_onnx_logits(written_v1.onnx_path, images).argmax(1) == labels))
    assert onnx_accuracy >= MIN_ACCURACY
    assert written_v1.onnx_accuracy == pytest.approx(onnx_accuracy)
    assert written_v1.torch_accuracy == pytest.approx(trained_v1.test_accuracy)


def test_onnx_file_computes_what_the_torch_model_computes(trained_v1, written_v1) -> None:
    images, _ = _eval_data(written_v1.eval_path)
    expected = _torch_logits(trained_v1.module, images)
    actual = _onnx_logits(written_v1.onnx_path, images)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4)
    assert written_v1.max_abs_diff <= 1e-4


def test_onnx_file_is_valid_opset_17_ir_8_with_plain_ops_and_a_batch_dimension(
    written_v1,
) -> None:
    model = onnx.load(written_v1.onnx_path)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert {node.op_type for node in model.graph.node} <= PLAIN_OPS
    assert not model.functions
    assert [i.name for i in model.graph.input] == ["input"]
    assert [o.name for o in model.graph.output] == ["logits"]
    assert _dims(model.graph.input[0]) == ["batch", 1, 8, 8]
    assert _dims(model.graph.output[0]) == ["batch", 10]
    session = _session(written_v1.onnx_path)
    for batch in (1, 7):
        x = np.random.default_rng(batch).random((batch, 1, 8, 8), dtype=np.float32)
        (logits,) = session.run(["logits"], {"input": x})
        assert logits.shape == (batch, 10) and logits.dtype == np.float32
    assert written_v1.file_bytes == written_v1.onnx_path.stat().st_size


def test_npz_files_hold_the_documented_keys_shapes_and_dtypes(written_v1, split) -> None:
    with np.load(written_v1.calibration_path) as calibration:
        assert calibration.files == ["input"]
        images = calibration["input"]
    assert images.dtype == np.float32
    assert images.ndim == 4 and images.shape[1:] == (1, 8, 8)
    assert 100 <= images.shape[0] <= len(split.train_images)
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert len(np.unique(split.train_labels[: images.shape[0]])) == 10

    with np.load(written_v1.eval_path) as evaluation:
        assert sorted(evaluation.files) == ["input", "label"]
        eval_images, labels = evaluation["input"], evaluation["label"]
    assert eval_images.dtype == np.float32 and labels.dtype == np.int64
    assert eval_images.shape == (len(labels), 1, 8, 8)
    # The held-out quarter of the 1,797 images, every class present.
    assert len(labels) == 450
    assert set(labels.tolist()) == set(range(10))
    np.testing.assert_array_equal(eval_images, split.test_images)
    np.testing.assert_array_equal(labels, split.test_labels)


def test_v2_is_a_different_model_of_the_same_accuracy(
    trained_v1, trained_v2, written_v1, written_v2
) -> None:
    assert written_v2.onnx_path.name == "digits-v2.onnx"
    assert trained_v2.test_accuracy >= MIN_ACCURACY
    assert written_v2.onnx_accuracy >= MIN_ACCURACY
    assert trained_v2.variant.macs == trained_v1.variant.macs  # as costly: a retrained v1
    images, _ = _eval_data(written_v1.eval_path)
    noise = np.random.default_rng(0).random((200, 1, 8, 8), dtype=np.float32)
    inputs = np.concatenate([images, noise])
    v1 = _onnx_logits(written_v1.onnx_path, inputs)
    v2 = _onnx_logits(written_v2.onnx_path, inputs)
    assert np.any(v1.argmax(1) != v2.argmax(1))
    assert np.max(np.abs(v1 - v2)) > 1.0
    # Both versions must mostly agree on real digits: a canary is compared with it.
    agreement = float(np.mean(v1[: len(images)].argmax(1) == v2[: len(images)].argmax(1)))
    assert agreement >= 0.95


def test_training_is_deterministic_for_a_seed_and_leaves_torch_state_alone(split) -> None:
    short = dataclasses.replace(digits.VARIANTS["v1"], epochs=1)
    torch.manual_seed(1234)
    expected_draw = torch.rand(3)
    torch.manual_seed(1234)
    threads = torch.get_num_threads()

    first = digits.train_digits(short, split)
    assert torch.equal(torch.rand(3), expected_draw)  # the caller's RNG stream is untouched
    assert torch.get_num_threads() == threads
    second = digits.train_digits(short, split)
    other_seed = digits.train_digits(dataclasses.replace(short, seed=99), split)

    for name, value in first.module.state_dict().items():
        assert torch.equal(value, second.module.state_dict()[name]), name
    assert not torch.equal(
        first.module.state_dict()["conv1.weight"], other_seed.module.state_dict()["conv1.weight"]
    )


def test_heavy_costs_many_times_v1_in_plain_ops(tmp_path: Path) -> None:
    v1, heavy = digits.VARIANTS["v1"], digits.VARIANTS["heavy"]
    assert heavy.macs >= 10 * v1.macs
    # Exported untrained: its graph and cost are what matter here, not its answers
    # (training it takes ~15 s on one core: `tiered models digits --variant heavy`).
    trained = digits.build_network(heavy).eval()
    module = digits.with_identity_layers(trained, heavy).eval()
    parameters = sum(p.numel() for p in module.parameters())
    untrained = digits.TrainedDigits(heavy, module, 0.0, 0.0, parameters)
    path = digits.export_digits(untrained, tmp_path / "digits-heavy.onnx")
    model = onnx.load(path)
    assert {node.op_type for node in model.graph.node} <= PLAIN_OPS
    convs = sum(node.op_type == "Conv" for node in model.graph.node)
    assert convs == len(heavy.stem) + len(heavy.body) + heavy.identity_layers == 16
    weights = {tensor.name for tensor in model.graph.initializer}  # as the torch engine reads
    assert all(node.input[1] in weights for node in model.graph.node if node.op_type == "Conv")
    x = np.random.default_rng(0).random((3, 1, 8, 8), dtype=np.float32)
    np.testing.assert_allclose(_onnx_logits(path, x), _torch_logits(module, x), atol=1e-4)
    # The identity convs change no answer: the served network is the trained one.
    np.testing.assert_allclose(_torch_logits(module, x), _torch_logits(trained, x), atol=1e-5)


def test_unknown_variant_is_rejected_by_name(split) -> None:
    with pytest.raises(ValueError, match="variant: unknown digits variant 'v3'"):
        digits.train_digits("v3", split)


def test_cli_variant_choices_are_the_trainers_variants() -> None:
    assert model_commands.DIGITS_VARIANTS == tuple(digits.VARIANTS)


def test_cli_writes_the_digits_files_and_the_same_model_as_the_library(
    tmp_path: Path, written_v1
) -> None:
    out = tmp_path / "models"
    result = subprocess.run(
        [sys.executable, "-m", "tiered", "models", "digits", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "digits-calibration.npz", "digits-eval.npz", "digits-v1.onnx",
    ]
    assert "epoch 20/20" in result.stderr  # progress while training
    assert "digits v1:" in result.stdout and "onnxruntime" in result.stdout
    images, labels = _eval_data(out / "digits-eval.npz")
    accuracy = float(np.mean(_onnx_logits(out / "digits-v1.onnx", images).argmax(1) == labels))
    assert accuracy >= MIN_ACCURACY
    # Same seed, same thread count: another process writes the very same file.
    assert (out / "digits-v1.onnx").read_bytes() == written_v1.onnx_path.read_bytes()


def test_cli_writes_resnet18_without_importing_torch(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from tiered import cli\n"
        f"code = cli.main(['models', 'resnet18', '--out', {str(tmp_path)!r}, "
        "'--image-size', '32', '--seed', '3'])\n"
        "assert 'torch' not in sys.modules, 'tiered models resnet18 imported torch'\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    path = tmp_path / "resnet18.onnx"
    assert str(path) in result.stdout
    model = onnx.load(path)
    assert _dims(model.graph.input[0]) == ["batch", 3, 32, 32]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"stem": ()}, "stem"),
        ({"epochs": 0}, "epochs"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_shift": -1}, "max_shift"),
        ({"max_lr": 0.0}, "max_lr"),
    ],
)
def test_a_malformed_variant_is_rejected_naming_the_field(change, field) -> None:
    with pytest.raises(ValueError, match=f"variant 'v1': {field}: "):
        dataclasses.replace(digits.VARIANTS["v1"], **change)
