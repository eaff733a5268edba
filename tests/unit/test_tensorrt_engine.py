"""The TensorRT engine: its pure parts everywhere, the engine where tensorrt imports."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tiered.engines import open_engine
from tiered.engines.base import TensorSpec
from tiered.engines.tensorrt_engine import (
    TensorRTSettings,
    cache_key,
    file_sha256,
    precision_refusal,
    profile_shapes,
)
from tiered.errors import ConfigError
from tiered.models import zoo
from tiered.settings import load_dataclass

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None
needs_tensorrt = pytest.mark.skipif(not HAVE_TENSORRT, reason="tensorrt is not installed")

SHA = "ab" * 32
BASE = TensorRTSettings()


def test_the_cache_key_is_stable_for_the_same_build():
    assert cache_key(SHA, "NVIDIA H200", "10.9.0", BASE) == cache_key(
        SHA, "NVIDIA H200", "10.9.0", TensorRTSettings()
    )


@pytest.mark.parametrize(
    ("artifact", "gpu", "version", "settings"),
    [
        ("cd" * 32, "NVIDIA H200", "10.9.0", BASE),
        (SHA, "NVIDIA L4", "10.9.0", BASE),
        (SHA, "NVIDIA H200", "10.10.0", BASE),
        (SHA, "NVIDIA H200", "10.9.0", replace(BASE, precision="fp32")),
        (SHA, "NVIDIA H200", "10.9.0", replace(BASE, max_batch_size=256)),
        (SHA, "NVIDIA H200", "10.9.0", replace(BASE, opt_batch_size=8)),
        (SHA, "NVIDIA H200", "10.9.0", replace(BASE, workspace_mib=1024)),
        (SHA, "NVIDIA H200", "10.9.0", replace(BASE, builder_optimization_level=5)),
    ],
)
def test_anything_that_changes_the_built_engine_changes_the_cache_key(
    artifact, gpu, version, settings
):
    assert cache_key(artifact, gpu, version, settings) != cache_key(
        SHA, "NVIDIA H200", "10.9.0", BASE
    )


@pytest.mark.parametrize("run_time_only", [{"streams": 7}, {"cache_dir": "/elsewhere"}])
def test_run_time_settings_reuse_the_cached_engine(run_time_only):
    changed = replace(BASE, **run_time_only)
    assert cache_key(SHA, "g", "v", changed) == cache_key(SHA, "g", "v", BASE)


def test_file_sha256_is_the_artifacts_content_hash(tmp_path):
    path = zoo.add_sub(tmp_path / "a.onnx")
    import hashlib

    assert file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("shape", "batches", "expected"),
    [
        ((-1, 3, 224, 224), (1, 32, 64), ((1, 3, 224, 224), (32, 3, 224, 224), (64, 3, 224, 224))),
        ((-1, 16), (2, 8, 8), ((2, 16), (8, 16), (8, 16))),
    ],
)
def test_profile_shapes_span_the_batch_dimension_only(shape, batches, expected):
    low, opt, high = batches
    settings = replace(BASE, min_batch_size=low, opt_batch_size=opt, max_batch_size=high)
    assert profile_shapes(TensorSpec("x", np.dtype(np.float32), shape), settings) == expected


@pytest.mark.parametrize(
    ("shape", "message"),
    [((1, 3, 8, 8), "no variable batch dimension"), ((-1, -1), "variable dimensions past")],
)
def test_profile_shapes_refuse_inputs_tensorrt_cannot_profile(shape, message):
    with pytest.raises(ConfigError, match=message):
        profile_shapes(TensorSpec("x", np.dtype(np.float32), shape), BASE)


@pytest.mark.parametrize(
    ("precision", "ops", "refused"),
    [
        ("fp16", {"Conv", "Relu"}, False),
        ("fp32", {"Conv"}, False),
        ("int8", {"Conv", "Relu"}, True),
        ("fp8", {"Gemm"}, True),
        ("int8", {"QuantizeLinear", "DequantizeLinear", "Conv"}, False),
        ("fp8", {"DequantizeLinear", "Gemm"}, False),
    ],
)
def test_fp8_and_int8_need_an_explicitly_quantized_model(precision, ops, refused):
    assert (precision_refusal(precision, ops) is not None) == refused


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"precision": "int4"}, "precision"),
        ({"min_batch_size": 8, "opt_batch_size": 4}, "min_batch_size"),
        ({"workspace_mib": 0}, "workspace_mib"),
        ({"builder_optimization_level": 6}, "builder_optimization_level"),
        ({"streams": 0}, "streams"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_field(settings, field):
    with pytest.raises(ConfigError, match=field):
        load_dataclass(TensorRTSettings, settings, "datacenter.tensorrt")


def test_the_datacenter_profile_tensorrt_section_loads():
    from tiered.profiles import load_profile

    settings = load_dataclass(
        TensorRTSettings, load_profile("datacenter").tensorrt, "datacenter.tensorrt"
    )
    assert settings.precision == "fp16"


@pytest.mark.skipif(HAVE_TENSORRT, reason="checks the message where tensorrt is absent")
def test_without_tensorrt_the_backend_says_it_is_not_installed(tmp_path):
    path = zoo.add_sub(tmp_path / "a.onnx")
    with pytest.raises(ConfigError, match="tensorrt is not installed"):
        open_engine("tensorrt", path, {}, "test.engine")


@needs_tensorrt
def test_a_built_engine_matches_onnxruntime_and_is_cached(tmp_path):
    path: Path = zoo.resnet18(tmp_path / "r.onnx", image_size=32, num_classes=10)
    settings = {"precision": "fp32", "min_batch_size": 1, "opt_batch_size": 4,
                "max_batch_size": 8, "cache_dir": str(tmp_path / "cache")}
    built = open_engine("tensorrt", path, settings, "test.engine")
    feeds = {"input": np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)}
    expected = ort.InferenceSession(str(path)).run(None, feeds)[0]
    got = built.run(feeds)["logits"]
    assert got.shape == (3, 10)
    assert np.max(np.abs(got - expected)) / np.max(np.abs(expected)) < 5e-3
    assert len(list((tmp_path / "cache").glob("*.plan"))) == 1
    again = open_engine("tensorrt", path, settings, "test.engine")
    assert again.plan_path == built.plan_path
