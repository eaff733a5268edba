"""Trained sample models: a small CNN for scikit-learn's handwritten digits.

The zoo's models have random weights, which is enough to measure serving but
not to judge a build or a rollout by accuracy. These are trained for real, on
the one image data set that ships inside a package (`sklearn.datasets.
load_digits`: 1,797 grayscale 8x8 images, 10 classes), so INT8/FP16 builds can
be scored against true labels and a canary can be compared with the stable
version by agreement. Training takes seconds on one CPU core.

Variants (`VARIANTS`): `v1` the base model, `v2` v1's network retrained with another seed
(as costly, answering a little differently: a realistic "new version"), and `heavy`, a
deliberately costly network of the same accuracy for latency-regression demos.

`write_digits` writes, into one directory:
- `digits-<variant>.onnx`: input `input` FP32 [batch, 1, 8, 8] (pixels in
  [0, 1]), output `logits` FP32 [batch, 10]; opset 17, IR 8; only Conv, Relu,
  MaxPool, Flatten and Gemm, every weight an initializer, so simple engines
  can interpret it;
- `digits-calibration.npz`: `input`, training images for INT8 calibration;
- `digits-eval.npz`: `input` and `label` (int64), the held-out test split.

This module needs the `samples` extra (torch and scikit-learn); import
it only where training is asked for, never from the agent or the engines. It
never downloads anything.
"""

from __future__ import annotations

import contextlib
import io
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

__all__ = [
    "CALIBRATION_FILE",
    "EVAL_FILE",
    "VARIANTS",
    "DigitsModel",
    "DigitsSplit",
    "DigitsVariant",
    "TrainedDigits",
    "build_network",
    "digits_split",
    "export_digits",
    "save_digits",
    "train_digits",
    "with_identity_layers",
    "write_digits",
    "write_digits_data",
]

OPSET = 17
# As in tiered.models.zoo: IR 8 goes with opset 17 and keeps the files
# loadable by older ONNX Runtime builds.
IR_VERSION = 8
BATCH_DIM = "batch"
INPUT = "input"
OUTPUT = "logits"
LABEL = "label"
CLASSES = 10
IMAGE_SIZE = 8

CALIBRATION_FILE = "digits-calibration.npz"
EVAL_FILE = "digits-eval.npz"
CALIBRATION_SAMPLES = 256

# The held-out split is fixed for every variant, so all of them (and every
# build of them) are scored on the same images.
SPLIT_SEED = 0
TEST_FRACTION = 0.25

# One thread: these networks are too small for a second thread to pay (on
# the 2-core dev machines two threads were several times slower under load),
# and a fixed count keeps float reductions, hence weights, identical from run
# to run and machine to machine.
TRAIN_THREADS = 1

Progress = Callable[[str], None]


@dataclass(frozen=True)
class DigitsVariant:
    """One network shape and training recipe.

    `stem` convs (3x3, stride 1) run at 8x8, then a 2x2 max-pool, then `body`
    convs at 4x4, then Linear(`hidden`) + ReLU + Linear(10). `identity_layers`
    more 3x3 convs at 8x8, after the stem, pass their input on unchanged: put
    in once training ends, they cost inference time that training never pays.
    """

    name: str
    seed: int
    stem: tuple[int, ...]
    body: tuple[int, ...]
    hidden: int
    epochs: int
    max_lr: float = 5e-3
    batch_size: int = 64
    max_shift: int = 1  # training images move by up to this many pixels each way
    identity_layers: int = 0

    def __post_init__(self) -> None:
        if not self.stem or min(self.stem + self.body) < 1:
            raise ValueError(f"variant {self.name!r}: stem: needs at least one conv before the "
                             f"pool, and every conv at least one channel")
        if self.identity_layers < 0:
            raise ValueError(f"variant {self.name!r}: identity_layers: must be at least 0, "
                             f"got {self.identity_layers}")
        for name in ("hidden", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"variant {self.name!r}: {name}: must be at least 1, "
                                 f"got {getattr(self, name)}")
        if not 0 <= self.max_shift < IMAGE_SIZE:
            raise ValueError(f"variant {self.name!r}: max_shift: must be in [0, {IMAGE_SIZE}), "
                             f"got {self.max_shift}")
        if not self.max_lr > 0:
            raise ValueError(f"variant {self.name!r}: max_lr: must be positive, got {self.max_lr}")

    @property
    def macs(self) -> int:
        """Multiply-accumulates per image: the network's cost, independent of the machine."""
        total, channels = 0, 1
        for out in self.stem:
            total += IMAGE_SIZE * IMAGE_SIZE * channels * out * 9
            channels = out
        total += self.identity_layers * IMAGE_SIZE * IMAGE_SIZE * channels * channels * 9
        pooled = IMAGE_SIZE // 2
        for out in self.body:
            total += pooled * pooled * channels * out * 9
            channels = out
        features = channels * pooled * pooled
        return total + features * self.hidden + self.hidden * CLASSES


VARIANTS: dict[str, DigitsVariant] = {
    variant.name: variant
    for variant in (
        DigitsVariant("v1", seed=0, stem=(16, 32), body=(), hidden=64, epochs=20),
        # v1's network retrained (another seed, a longer schedule): the usual
        # new version, as costly as the old one, answering a little differently.
        DigitsVariant("v2", seed=1, stem=(16, 32), body=(), hidden=64, epochs=24),
        # Trained, about 17x the multiply-accumulates of v1 (two more convs
        # after the pool, three times the channels; a deeper network without
        # BatchNorm wants a lower peak learning rate). Served, 12 identity
        # convs make it about 205x: on a slow day of the 2-core VM, where a
        # Python loop of 3M additions takes 0.7 s of CPU, INT8 at batch 1
        # costs it about 4 ms of CPU against v1's 0.08 (0.9 ms without
        # them, which a busy demo once promoted), a cost a latency and an
        # energy test see through the serving path's noise. 40 of them
        # (14.5 ms) made its rollouts and builds (86 s of CPU against 25)
        # the suite's largest cost.
        DigitsVariant("heavy", seed=2, stem=(48, 96), body=(96, 96), hidden=192, epochs=12,
                      max_lr=4e-3, identity_layers=12),
    )
}


@dataclass(frozen=True)
class DigitsSplit:
    """The data set, preprocessed: images FP32 [n, 1, 8, 8] in [0, 1], labels int64 [n]."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def digits_split(test_fraction: float = TEST_FRACTION, seed: int = SPLIT_SEED) -> DigitsSplit:
    """The bundled digits, scaled to [0, 1], split stratified by class.

    The one place that decides preprocessing, so the training data, the npz
    files and anyone scoring a model agree on what an input is.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    # Pixel values are integers 0..16.
    images = (data.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = data.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=test_fraction, stratify=labels, random_state=seed
    )
    return DigitsSplit(
        np.ascontiguousarray(train_x),
        np.ascontiguousarray(train_y),
        np.ascontiguousarray(test_x),
        np.ascontiguousarray(test_y),
    )


@dataclass(frozen=True)
class TrainedDigits:
    """A trained network (eval mode) and how its training went."""

    variant: DigitsVariant
    module: nn.Module
    train_seconds: float
    test_accuracy: float
    parameters: int


@dataclass(frozen=True)
class DigitsModel:
    """What `write_digits` wrote and measured."""

    variant: str
    onnx_path: Path
    calibration_path: Path
    eval_path: Path
    torch_accuracy: float  # on the held-out split
    onnx_accuracy: float  # the written file in ONNX Runtime, same split
    max_abs_diff: float  # largest |torch logit - ONNX Runtime logit| over the split
    train_seconds: float
    parameters: int
    macs: int  # multiply-accumulates per image
    file_bytes: int

    def summary(self) -> str:
        return (
            f"digits {self.variant}: {self.onnx_path} ({self.file_bytes / 1024:.1f} KiB, "
            f"{self.parameters:,} parameters, {self.macs / 1e6:.2f} M MACs/image), "
            f"trained in {self.train_seconds:.1f} s; test accuracy torch "
            f"{self.torch_accuracy:.2%}, onnxruntime {self.onnx_accuracy:.2%} "
            f"(max |diff| {self.max_abs_diff:.1e})"
        )


def build_network(variant: DigitsVariant) -> nn.Module:
    """The untrained network: only layers that export to plain ONNX ops (no BatchNorm)."""
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    channels = 1
    for i, out in enumerate(variant.stem + variant.body, start=1):
        layers[f"conv{i}"] = nn.Conv2d(channels, out, kernel_size=3, padding=1)
        layers[f"relu{i}"] = nn.ReLU()
        if i == len(variant.stem):
            layers["pool"] = nn.MaxPool2d(2)
        channels = out
    pooled = IMAGE_SIZE // 2
    layers["flatten"] = nn.Flatten()
    layers["fc1"] = nn.Linear(channels * pooled * pooled, variant.hidden)
    layers["relu_fc1"] = nn.ReLU()
    layers["fc2"] = nn.Linear(variant.hidden, CLASSES)
    return nn.Sequential(layers)


def with_identity_layers(module: nn.Module, variant: DigitsVariant) -> nn.Module:
    """`module` (built by `build_network`) with the variant's identity convs
    before its pool: each kernel is 1 at the centre of the channel's own
    plane, so every layer hands on its (non-negative, post-ReLU) input as is."""
    layers = OrderedDict(module.named_children())
    channels = variant.stem[-1]
    identity = torch.zeros(channels, channels, 3, 3)
    identity[range(channels), range(channels), 1, 1] = 1.0
    served: OrderedDict[str, nn.Module] = OrderedDict()
    for name, layer in layers.items():
        if name == "pool":
            for i in range(1, variant.identity_layers + 1):
                conv = nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False)
                with torch.no_grad():
                    conv.weight.copy_(identity)
                served[f"identity{i}"] = conv
        served[name] = layer
    return nn.Sequential(served)


def train_digits(
    variant: DigitsVariant | str,
    split: DigitsSplit | None = None,
    *,
    progress: Progress | None = None,
) -> TrainedDigits:
    """Train `variant` on the training split; the same variant always gives the same weights.

    Adam with a one-cycle learning rate, fixed epochs (no early stopping on the
    test split, so the reported accuracy is an honest held-out figure). The
    caller's torch RNG state and thread count are left as they were.
    """
    variant = _variant(variant)
    split = split or digits_split()
    say = progress or (lambda _line: None)
    train_x = torch.from_numpy(split.train_images)
    train_y = torch.from_numpy(split.train_labels)
    steps_per_epoch = -(-len(train_x) // variant.batch_size)
    with _torch_threads(TRAIN_THREADS), torch.random.fork_rng(devices=[]):
        torch.manual_seed(variant.seed)
        module = build_network(variant)
        optimizer = torch.optim.Adam(module.parameters(), lr=variant.max_lr)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=variant.max_lr, total_steps=variant.epochs * steps_per_epoch
        )
        shuffle = torch.Generator().manual_seed(variant.seed)
        start = time.perf_counter()
        for epoch in range(1, variant.epochs + 1):
            module.train()
            order = torch.randperm(len(train_x), generator=shuffle)
            total_loss = 0.0
            for first in range(0, len(order), variant.batch_size):
                rows = order[first:first + variant.batch_size]
                images = _shifted(train_x[rows], variant.max_shift, shuffle)
                loss = nn.functional.cross_entropy(module(images), train_y[rows])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                total_loss += loss.item() * len(rows)
            accuracy = _accuracy(_torch_logits(module, split.test_images), split.test_labels)
            say(
                f"digits {variant.name}: epoch {epoch}/{variant.epochs} "
                f"loss {total_loss / len(order):.4f} test accuracy {accuracy:.2%} "
                f"({time.perf_counter() - start:.1f} s)"
            )
        seconds = time.perf_counter() - start
    module = with_identity_layers(module, variant).eval()
    return TrainedDigits(
        variant=variant,
        module=module,
        train_seconds=seconds,
        test_accuracy=accuracy,
        parameters=sum(p.numel() for p in module.parameters()),
    )


def export_digits(trained: TrainedDigits, path: str | Path) -> Path:
    """Write the trained network as ONNX (opset 17, IR 8, dynamic `batch`) and check it.

    Uses torch's TorchScript exporter (`dynamo=False`). Both of torch 2.13's
    exporters give a clean graph here; this one writes opset 17 and IR 8 as
    they are, with Flatten and the module's parameter names, and takes about
    0.1 s. The torch.export-based default gives Conv/Relu/MaxPool/Reshape/Gemm
    too, but at IR 10 with per-node metadata to strip, and it rebuilds its op
    registry from onnxscript sources on every call: 2.5-4 s per export on the
    2-core dev machines, paid by every variant and every test. The
    TorchScript exporter is deprecated but present in the pinned torch; if a
    later torch drops it, switch to `dynamo=True` and set `ir_version` after
    clearing `metadata_props` of nodes and values.
    """
    buffer = io.BytesIO()
    example = torch.zeros(2, 1, IMAGE_SIZE, IMAGE_SIZE)
    with warnings.catch_warnings(), _torch_threads(TRAIN_THREADS):
        # The exporter's own deprecation notices (it and its logging helper),
        # chosen knowingly above; nothing a user of these models can act on.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            trained.module,
            (example,),
            buffer,
            input_names=[INPUT],
            output_names=[OUTPUT],
            opset_version=OPSET,
            dynamic_axes={INPUT: {0: BATCH_DIM}, OUTPUT: {0: BATCH_DIM}},
            dynamo=False,
        )
    model = onnx.load_model_from_string(buffer.getvalue())
    _unshare_initializers(model.graph)
    model.ir_version = IR_VERSION  # already so today; pinned in case the exporter moves on
    model.graph.name = f"digits_{trained.variant.name}"
    model.producer_name = "tiered.models.digits"
    model.producer_version = torch.__version__
    onnx.checker.check_model(model, full_check=True)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, out)
    return out


def _unshare_initializers(graph: onnx.GraphProto) -> None:
    """The exporter hands equal weights (the identity convs') on through
    Identity nodes; give each its own copy, so that every Conv's weight is an
    initializer, as simple engines (and the torch engine's reader) expect."""
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    for node in [n for n in graph.node if n.op_type == "Identity"
                 and n.input[0] in initializers]:
        copy = onnx.TensorProto()
        copy.CopyFrom(initializers[node.input[0]])
        copy.name = node.output[0]
        graph.initializer.append(copy)
        graph.node.remove(node)


def write_digits_data(out_dir: str | Path, split: DigitsSplit | None = None) -> tuple[Path, Path]:
    """Write the calibration and eval npz files; returns their paths."""
    split = split or digits_split()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    calibration = out / CALIBRATION_FILE
    evaluation = out / EVAL_FILE
    # The split is already shuffled, so its first images cover every class.
    np.savez(calibration, **{INPUT: split.train_images[:CALIBRATION_SAMPLES]})
    np.savez(evaluation, **{INPUT: split.test_images, LABEL: split.test_labels})
    return calibration, evaluation


def save_digits(
    trained: TrainedDigits, out_dir: str | Path, split: DigitsSplit | None = None
) -> DigitsModel:
    """Export `trained` and the data files into `out_dir`; score the file in ONNX Runtime."""
    split = split or digits_split()
    out = Path(out_dir)
    onnx_path = export_digits(trained, out / f"digits-{trained.variant.name}.onnx")
    calibration, evaluation = write_digits_data(out, split)
    torch_logits = _torch_logits(trained.module, split.test_images)
    onnx_logits = _onnxruntime_logits(onnx_path, split.test_images)
    return DigitsModel(
        variant=trained.variant.name,
        onnx_path=onnx_path,
        calibration_path=calibration,
        eval_path=evaluation,
        torch_accuracy=_accuracy(torch_logits, split.test_labels),
        onnx_accuracy=_accuracy(onnx_logits, split.test_labels),
        max_abs_diff=float(np.max(np.abs(torch_logits - onnx_logits))),
        train_seconds=trained.train_seconds,
        parameters=trained.parameters,
        macs=trained.variant.macs,
        file_bytes=onnx_path.stat().st_size,
    )


def write_digits(
    out_dir: str | Path, variant: str = "v1", *, progress: Progress | None = None
) -> DigitsModel:
    """Train `variant` and write its ONNX file and the npz files into `out_dir`."""
    split = digits_split()
    return save_digits(train_digits(variant, split, progress=progress), out_dir, split)


def _variant(variant: DigitsVariant | str) -> DigitsVariant:
    if isinstance(variant, DigitsVariant):
        return variant
    try:
        return VARIANTS[variant]
    except KeyError:
        raise ValueError(
            f"variant: unknown digits variant {variant!r}; known: {', '.join(VARIANTS)}"
        ) from None


def _shifted(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Each image moved by its own random offset, vacated pixels black.

    Handwriting sits a pixel or two off-centre from writer to writer; seeing
    that in training is what the held-out images reward.
    """
    if max_shift == 0:
        return images
    n, size = images.shape[0], images.shape[-1]
    padded = nn.functional.pad(images[:, 0], (max_shift,) * 4)
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, n), generator=generator)
    rows = (dy[:, None] + torch.arange(size))[:, :, None]
    cols = (dx[:, None] + torch.arange(size))[:, None, :]
    return padded[torch.arange(n)[:, None, None], rows, cols][:, None]


def _accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.argmax(logits, axis=1) == labels))


def _torch_logits(module: nn.Module, images: np.ndarray) -> np.ndarray:
    was_training = module.training
    module.eval()
    with torch.no_grad():
        logits = module(torch.from_numpy(images)).numpy()
    module.train(was_training)
    return logits


def _onnxruntime_logits(path: Path, images: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (logits,) = session.run([OUTPUT], {INPUT: images})
    return logits


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
