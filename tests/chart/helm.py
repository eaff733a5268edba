"""Run the real `helm` binary on the chart and read what it renders.

`make test` fetches helm into the venv (tests/chart/fetch_helm.py) before it
runs pytest, so a missing helm is a broken setup: the chart tests fail with a
message saying how to get it, they never skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tiered"
KUBE_VERSION = "1.30.0"
RELEASE = "prod"
NAMESPACE = "ml"


def helm_binary() -> Path:
    """The helm the tests run: $HELM, else the venv's, else one on PATH."""
    candidates = [os.environ.get("HELM", ""), str(Path(sys.prefix) / "bin" / "helm"),
                  shutil.which("helm") or ""]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    pytest.fail(
        "helm not found (looked at $HELM, the venv's bin/helm and PATH). `make test` fetches "
        "it; by hand: .venv/bin/python tests/chart/fetch_helm.py",
        pytrace=False,
    )


@dataclass(frozen=True)
class HelmResult:
    returncode: int
    stdout: str
    stderr: str


def run_helm(args: Iterable[str], values: Mapping[str, Any] | None = None,
             tmp_dir: Path | None = None, chart: Path = CHART) -> HelmResult:
    """`helm ARGS CHART`, with `values` passed as a values file when given."""
    command = [str(helm_binary()), *args, str(chart)]
    if values is not None:
        assert tmp_dir is not None, "values need a directory for their file"
        with tempfile.NamedTemporaryFile("w", dir=tmp_dir, suffix=".yaml", delete=False) as f:
            yaml.safe_dump(dict(values), f)
        command += ["--values", f.name]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HELM_CACHE_HOME": str(tmp_dir or "/tmp"),
                               "HELM_CONFIG_HOME": str(tmp_dir or "/tmp"),
                               "HELM_DATA_HOME": str(tmp_dir or "/tmp")})
    return HelmResult(done.returncode, done.stdout, done.stderr)


def template_args(*extra: str) -> list[str]:
    return ["template", RELEASE, "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
            "--include-crds", *extra]


def render(values: Mapping[str, Any] | None, tmp_dir: Path) -> list[dict[str, Any]]:
    """Every object `helm template` renders (CRDs included) for `values`."""
    result = run_helm(template_args(), values, tmp_dir)
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
