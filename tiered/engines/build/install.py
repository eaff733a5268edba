"""Placing finished versions into a model repository: the repository's
on-disk layout (DIR/<model>/config.yaml, DIR/<model>/<version>/model.onnx)
written as a file format, the config.yaml of a model the build creates, and
the all-or-nothing move into place (of one version, or of an ensemble's and
its steps' versions together).

It must never import tiered.agent (engines sit below it), never let an agent
see a half-written version, and never leave the repository changed when a
move fails.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tiered.engines.build import spec
from tiered.errors import ConfigError
from tiered.files import write_atomically
from tiered.profiles import TierProfile

MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.yaml"
MODEL_CONFIGS = (CONFIG_FILE, "config.pbtxt")  # a model with either has its config


def check_layout_names(model: str, version: int) -> None:
    # The agent checks model names fully; here the name only must not leave
    # the repository or hide from it.
    if not model or Path(model).name != model or model.startswith("."):
        raise ConfigError(f"model: {model!r} must be one plain directory name")
    if version < 1:
        raise ConfigError(f"version: must be a positive integer, got {version}")


def check_destination(request: spec.BuildRequest, model: str | None = None) -> None:
    """What refuses a build before it starts, wherever it installs: a model
    name that is not a plain directory, a repository that is not a directory,
    and a version already there (unless --force). `model`: another model
    the build installs beside the request's (an ensemble's step)."""
    model = request.model if model is None else model
    check_layout_names(model, request.version)
    if request.repository.exists() and not request.repository.is_dir():
        raise ConfigError(f"repository: {request.repository} is not a directory")
    target = request.repository / model / str(request.version)
    if target.exists() and not request.force:
        raise ConfigError(f"version: {target} already exists; pass --force to replace it")


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


@dataclass(frozen=True)
class Placement:
    """One finished version directory and where it goes: DIR/<model>/<version>,
    with `config_text` written as DIR/<model>/<config_name> when the model has
    no config yet (an existing one is left alone)."""

    built: Path
    model: str
    config_name: str
    config_text: str


def install_version(
    built: Path, repository: Path, model: str, version: int,
    config: Mapping[str, Any], *, force: bool,
) -> Path:
    """Move a finished version directory into DIR/<model>/<version>, with a
    config.yaml from `config` where the model has no config (`install_versions`)."""
    text = yaml.safe_dump(dict(config), sort_keys=False)
    return install_versions([Placement(built, model, CONFIG_FILE, text)], repository,
                            version, force=force)[0]


def install_versions(placements: Sequence[Placement], repository: Path, version: int, *,
                     force: bool) -> list[Path]:
    """Move finished version directories (an ensemble's and its steps') into
    DIR/<model>/<version>, all or none.

    The files are first copied next to their places under hidden names the
    agent ignores, then renamed into place one after another, so an agent
    never sees a half-written version; configs are written (the same way)
    only for models that have none. On any failure every version placed so
    far is taken back and the repository is left as it was; the staging
    directory of a build killed while copying goes with the next build of
    that version.
    """
    for placement in placements:
        check_layout_names(placement.model, version)
    if repository.exists() and not repository.is_dir():
        raise ConfigError(f"repository: {repository} is not a directory")
    repository.mkdir(parents=True, exist_ok=True)  # a new repository starts with its first build
    pid = os.getpid()
    created: list[Path] = []  # model directories this install made
    staged: list[Path] = []
    retired: list[tuple[Path, Path]] = []  # (version moved aside, its place)
    placed: list[Path] = []
    configs: list[Path] = []
    target = repository
    try:
        for placement in placements:
            model_dir = repository / placement.model
            if not model_dir.exists():
                model_dir.mkdir()
                created.append(model_dir)
            _remove_stale_staging(model_dir, version)
            staging = model_dir / f".{version}.partial-{pid}"
            shutil.copytree(placement.built, staging)
            staged.append(staging)
        for placement in placements:
            target = repository / placement.model / str(version)
            if target.exists() and not force:
                raise ConfigError(f"version: {target} already exists; pass --force to replace it")
        for placement, staging in zip(placements, staged, strict=True):
            model_dir = staging.parent
            target = model_dir / str(version)
            if target.exists():
                aside = model_dir / f".{version}.replaced-{pid}"
                os.rename(target, aside)
                retired.append((aside, target))
            os.rename(staging, target)
            placed.append(target)
            if not any((model_dir / name).exists() for name in MODEL_CONFIGS):
                config_path = model_dir / placement.config_name
                write_atomically(config_path, placement.config_text)
                configs.append(config_path)
    except BaseException as error:
        for path in (*placed, *staged):
            shutil.rmtree(path, ignore_errors=True)
        for path in configs:
            path.unlink(missing_ok=True)
        for aside, place in retired:
            os.rename(aside, place)
        for model_dir in created:
            shutil.rmtree(model_dir, ignore_errors=True)
        if isinstance(error, OSError):
            raise ConfigError(f"repository: cannot write {target}: {error}") from error
        raise
    for aside, _ in retired:
        shutil.rmtree(aside, ignore_errors=True)
    return placed
