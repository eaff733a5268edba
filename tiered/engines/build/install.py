"""Placing a finished version into a model repository: the repository's
on-disk layout (DIR/<model>/config.yaml, DIR/<model>/<version>/model.onnx)
written as a file format, the config.yaml of a model the build creates, and
the all-or-nothing move into place.

It must never import tiered.agent (engines sit below it), never let an agent
see a half-written version, and never leave the repository changed when a
move fails.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tiered.engines.build import spec
from tiered.errors import ConfigError, TieredError
from tiered.files import write_atomically
from tiered.profiles import TierProfile

MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.yaml"


def check_layout_names(model: str, version: int) -> None:
    # The agent checks model names fully; here the name only must not leave
    # the repository or hide from it.
    if not model or Path(model).name != model or model.startswith("."):
        raise ConfigError(f"model: {model!r} must be one plain directory name")
    if version < 1:
        raise ConfigError(f"version: must be a positive integer, got {version}")


def new_config(settings: spec.BuildSettings, engine_settings: Mapping[str, Any],
               profile: TierProfile, step: int | None) -> dict[str, Any]:
    """config.yaml for a model the build creates (an existing one is left alone)."""
    config: dict[str, Any] = {"backend": settings.backend}
    if step is None and settings.max_batch_size > 0:
        config["max_batch_size"] = settings.max_batch_size
        # The tier profile's batching defaults, but for what the build was given.
        config["dynamic_batching"] = ({} if settings.max_queue_delay_us is None else
                                      {"max_queue_delay_us": settings.max_queue_delay_us})
    else:
        config["max_batch_size"] = 0
    # Serve with what was measured where it differs from the tier's defaults.
    defaults = profile.backends.get(settings.backend, {})
    engine = {k: v for k, v in engine_settings.items() if defaults.get(k) != v}
    if engine:
        config["engine"] = _plain(engine)
    return config


def _plain(value: Any) -> Any:
    """Tuples and mappings as YAML's safe dumper takes them."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _remove_stale_staging(model_dir: Path, version: int) -> None:
    """The staging directories of this version that a killed build left (its
    process is gone); hidden, so no agent ever loaded them."""
    for staging in model_dir.glob(f".{version}.partial-*"):
        pid = staging.name.rpartition("-")[2]
        if pid.isdigit() and not _process_exists(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def install_version(
    built: Path, repository: Path, model: str, version: int,
    config: Mapping[str, Any], *, force: bool,
) -> Path:
    """Move a finished version directory into DIR/<model>/<version>.

    The files are first copied next to their place under a hidden name the
    agent ignores, then renamed into place in one step, so an agent never sees
    a half-written version. config.yaml is written (the same way) only when
    the model has none. On any failure the repository is left as it was; the
    staging directory of a build killed while copying goes with the next build
    of that version.
    """
    check_layout_names(model, version)
    if repository.exists() and not repository.is_dir():
        raise ConfigError(f"repository: {repository} is not a directory")
    repository.mkdir(parents=True, exist_ok=True)  # a new repository starts with its first build
    model_dir = repository / model
    created_model_dir = not model_dir.exists()
    target = model_dir / str(version)
    staging = model_dir / f".{version}.partial-{os.getpid()}"
    retired = model_dir / f".{version}.replaced-{os.getpid()}"
    config_path = model_dir / CONFIG_FILE
    try:
        model_dir.mkdir(exist_ok=True)
        _remove_stale_staging(model_dir, version)
        shutil.copytree(built, staging)
        replacing = target.exists()
        if replacing:
            if not force:
                raise ConfigError(f"version: {target} already exists; pass --force to replace it")
            os.rename(target, retired)
        placed = False
        try:
            os.rename(staging, target)
            placed = True
            if not config_path.exists():
                write_atomically(config_path, yaml.safe_dump(dict(config), sort_keys=False))
        except BaseException:
            if placed:
                shutil.rmtree(target, ignore_errors=True)
            if replacing:
                os.rename(retired, target)
            raise
    except (OSError, TieredError) as error:
        shutil.rmtree(staging, ignore_errors=True)
        if created_model_dir:
            shutil.rmtree(model_dir, ignore_errors=True)
        if isinstance(error, TieredError):
            raise
        raise ConfigError(f"repository: cannot write {target}: {error}") from error
    shutil.rmtree(retired, ignore_errors=True)
    return target
