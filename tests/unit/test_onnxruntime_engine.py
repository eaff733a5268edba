"""The ONNX Runtime engine's batch buckets: a batch padded to a fixed size
answers exactly as the batch itself, on the CPU provider here and on CUDA
where onnxruntime-gpu runs it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnxruntime as ort
import pytest

from tiered.engines.onnxruntime_engine import OnnxRuntimeEngine, OrtSettings
from tiered.errors import ConfigError
from tiered.models import zoo

BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return zoo.resnet18(tmp_path_factory.mktemp("ort") / "model.onnx", image_size=32)


def images(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((rows, 3, 32, 32), dtype=np.float32)


def test_buckets_are_ignored_on_the_cpu(model):
    engine = OnnxRuntimeEngine(model, OrtSettings(batch_buckets=BUCKETS))
    assert engine.device == "cpu" and "batch_buckets" not in engine.describe()


def test_a_padded_batch_answers_as_the_batch_itself(model):
    plain = OnnxRuntimeEngine(model)
    padded = OnnxRuntimeEngine(model)
    # What the engine does on a GPU provider, run on the CPU's: a session per
    # bucket, and every batch padded to the next one.
    padded._buckets = padded._bucket_sessions(list(BUCKETS))
    assert tuple(padded._buckets) == BUCKETS
    for rows in (1, 3, 5, 8, 11, 3, 5):  # 11: past the largest bucket, as it is; 3, 5 again
        # in buffers that held larger batches
        x = images(rows)
        expected, got = plain.run({"input": x})["logits"], padded.run({"input": x})["logits"]
        assert got.shape == (rows, 1000)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # Requests staged as the batcher stages them: straight into a bucket's buffers.
    parts = [images(3), images(2)]
    staged = padded.stage([{"input": part} for part in parts])
    assert staged["input"].shape == (8, 3, 32, 32)
    np.testing.assert_allclose(padded.run(staged)["logits"],
                               plain.run({"input": np.concatenate(parts)})["logits"],
                               rtol=1e-5, atol=1e-5)


def test_buckets_must_be_positive():
    with pytest.raises(ConfigError, match="batch_buckets"):
        OrtSettings(batch_buckets=(0, 4))


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="onnxruntime here has no CUDA provider (onnxruntime-gpu)")
def test_on_cuda_batches_run_in_buckets_warmed_at_load(model):
    settings = OrtSettings(providers=("CUDAExecutionProvider",), batch_buckets=BUCKETS)
    engine = OnnxRuntimeEngine(model, settings)
    if engine.device != "cuda":
        pytest.skip(f"the CUDA provider did not load here: {engine.providers}")
    assert engine.describe()["batch_buckets"] == "1,2,4,8"
    plain = OnnxRuntimeEngine(model, replace(settings, batch_buckets=()))
    for rows in (1, 3, 6):
        x = images(rows)
        np.testing.assert_allclose(engine.run({"input": x})["logits"],
                                   plain.run({"input": x})["logits"], rtol=1e-3, atol=1e-3)
