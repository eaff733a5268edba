"""Engines run one model version on arrays; `open_engine` picks one by backend name.

Backends import their heavy libraries (torch, tensorrt) only when chosen, so an
agent that serves ONNX Runtime never needs them installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiered import names
from tiered.engines.base import Engine, TensorSpec
from tiered.errors import ConfigError
from tiered.settings import load_dataclass

__all__ = ["AGENT_EXTRA", "Engine", "TensorSpec", "open_engine"]

# What to install where an agent's packages (ONNX Runtime, OpenTelemetry) are missing.
AGENT_EXTRA = "pip install 'tiered[agent]' (CPU), or 'tiered[gpu]' (CUDA)"


def open_engine(backend: str, model_path: Path, settings: Mapping[str, Any], where: str) -> Engine:
    """Load `model_path` on `backend` with its settings (`where` names them in errors)."""
    if backend == names.Backend.ONNXRUNTIME:
        try:
            from tiered.engines.onnxruntime_engine import OnnxRuntimeEngine, OrtSettings
        except ModuleNotFoundError as error:
            raise ConfigError(f"backend: onnxruntime needs ONNX Runtime ({AGENT_EXTRA}): "
                              f"{error}") from error

        return OnnxRuntimeEngine(model_path, load_dataclass(OrtSettings, settings, where))
    if backend == names.Backend.TORCH:
        try:
            from tiered.engines.torch_engine import TorchEngine, TorchSettings
        except ImportError as error:
            raise ConfigError(
                f"backend: torch needs the torch package (pip install 'tiered[torch]'): {error}"
            ) from error
        return TorchEngine(model_path, load_dataclass(TorchSettings, settings, where))
    if backend == names.Backend.TENSORRT:
        from tiered.engines.tensorrt_engine import TensorRTEngine, TensorRTSettings

        return TensorRTEngine(model_path, load_dataclass(TensorRTSettings, settings, where))
    raise ConfigError(f"backend: {backend!r} is not one of {', '.join(names.Backend)}")
