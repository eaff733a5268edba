"""The model repository: which model versions this agent serves.

    DIR/<model>/config.yaml   (or Triton's config.pbtxt)
    DIR/<model>/<version>/model.onnx
    DIR/<ensemble>/<version>/ (empty: an ensemble's steps are other models)

Loading builds engines off the event loop, then swaps the served versions in
one step, so a new version takes traffic while the old one keeps serving until
the swap; replaced and unloaded versions drain their in-flight requests before
their engines close. A failed load leaves what was serving untouched.
Ensembles load after the models their steps use and are checked against
them, again whenever one of those models loads.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tiered.agent import triton_config
from tiered.agent.config import (
    ModelConfig,
    check_model_name,
    complete_with_engine,
    parse_model_config,
)
from tiered.agent.devices import DeviceEngine, DevicePool, EngineSpec, in_thread, nvml_gpu_count
from tiered.agent.engine_core import CoreSpec, EngineCore, EngineCores, runs_in_a_process
from tiered.agent.ensemble import EnsembleVersion, check_steps, load_order, step_version
from tiered.agent.generative import GenerativeVersion, with_tensors
from tiered.agent.model import ModelVersion
from tiered.agent.vision_language import VisionStage
from tiered.engines import Engine, open_engine
from tiered.engines import build as build_report
from tiered.engines.base import warm_up
from tiered.engines.generative import is_checkpoint, open_generative
from tiered.engines.generative.base import GenerativeEngine
from tiered.engines.generative.chat import ChatTemplate
from tiered.engines.generative.text import open_tokenizer
from tiered.errors import ConfigError, InvalidArgument, NotFound, TieredError, Unavailable
from tiered.profiles import MiB, TierProfile
from tiered.protocol import error_text
from tiered.settings import read_yaml
from tiered.telemetry.recorder import VersionRecorder

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
CONFIG, TRITON_CONFIG = "config.yaml", "config.pbtxt"


class ModelState(str, enum.Enum):
    READY = "READY"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass
class ModelEntry:
    """What the agent knows of one model directory."""

    name: str
    state: ModelState = ModelState.UNAVAILABLE
    reason: str = ""
    versions: dict[int, Served] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    state: str
    reason: str


EngineFactory = Callable[[str, Path, dict, str], Engine]  # backend, file, settings, where
Served = ModelVersion | GenerativeVersion | EnsembleVersion


def versions_on_disk(model_dir: Path) -> dict[int, Path]:
    """Integer-named subdirectories that hold a model: its ONNX file, or the
    config.json of a checkpoint (a generative model the torch engine runs)."""
    found = {}
    for child in model_dir.iterdir():
        if child.is_dir() and child.name.isdigit() and int(child.name) > 0:
            if (child / MODEL_FILE).is_file():
                found[int(child.name)] = child / MODEL_FILE
            elif is_checkpoint(child):
                found[int(child.name)] = child / "config.json"
    return found


def ensemble_versions(model_dir: Path) -> list[int]:
    """An ensemble's versions: its integer-named directories, empty as Triton's
    layout has them; version 1 where it has none."""
    return sorted(int(c.name) for c in model_dir.iterdir()
                  if c.is_dir() and c.name.isdigit() and int(c.name) > 0) or [1]


def inside_repository(root: Path, path: Path, what: str) -> None:
    """Refuse a file that a symlink (of the model, version or file) takes out of
    the repository: what an agent runs must be what its repository holds."""
    if not path.resolve().is_relative_to(root.resolve()):
        raise InvalidArgument(f"model_name: {what} leads out of the repository "
                              f"({path} -> {path.resolve()}); refusing to load it")


class ModelRepository:
    """Lives on the agent's event loop; engines are built in worker threads."""

    def __init__(
        self,
        root: Path,
        profile: TierProfile,
        engine_factory: EngineFactory = open_engine,
        telemetry: bool = True,
        devices: DevicePool | None = None,
    ) -> None:
        if not root.is_dir():
            raise ConfigError(f"model repository {root} is not a directory")
        self.root = root
        self.profile = profile
        self.devices = devices or DevicePool()  # none: engines run in this process
        self._engine_factory = engine_factory
        self._telemetry = telemetry  # windowed per-version recorders (tiered.v1.Telemetry)
        self._models: dict[str, ModelEntry] = {}
        self._draining: set[asyncio.Task] = set()
        self.on_load: list[Callable[[], None]] = []  # told after each model (re)loads

    # -- lookups ---------------------------------------------------------------

    def get(self, name: str, version: str = "") -> Served:
        """The version to answer a request; the newest served one when unset."""
        entry = self._models.get(name)
        if entry is None or not entry.versions:
            if entry is not None and entry.state is not ModelState.UNAVAILABLE:
                raise Unavailable(error_text.no_available_versions(
                    name, f"it is {entry.state.value.lower()}"))
            raise NotFound(error_text.unknown_model(name))
        if not version:
            return entry.versions[max(entry.versions)]
        if not (version.isascii() and version.isdigit()) or int(version) not in entry.versions:
            raise NotFound(error_text.unknown_version(name, version, entry.versions))
        return entry.versions[int(version)]

    def served(self, name: str) -> ModelEntry:
        entry = self._models.get(name)
        if entry is None or not entry.versions:
            raise NotFound(error_text.unknown_model(name))
        return entry

    def is_ready(self, name: str, version: str = "") -> bool:
        try:
            return self.get(name, version).ready
        except TieredError:
            return False

    def all_versions(self) -> list[Served]:
        return [v for entry in self._models.values() for v in entry.versions.values()]

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model on disk or in memory, with the state of each version."""
        names = set(self._models)
        names.update(
            p.name for p in self.root.iterdir() if p.is_dir() and config_file(p) is not None
        )
        rows = []
        for name in sorted(names):
            entry = self._models.get(name)
            if entry is None:
                rows.append(IndexEntry(name, "", ModelState.UNAVAILABLE.value, "not loaded"))
                continue
            reason = self._relative(entry.reason)
            if not entry.versions:
                rows.append(IndexEntry(name, "", entry.state.value, reason))
            for version in sorted(entry.versions):
                rows.append(IndexEntry(name, str(version), entry.state.value, reason))
        return [r for r in rows if not ready_only or r.state == ModelState.READY.value]

    def _relative(self, text: str) -> str:
        """`text` with paths in the repository relative to it, as clients
        read the index: where the agent keeps its models is not theirs to know."""
        return text.replace(f"{self.root}{os.sep}", "").replace(str(self.root), ".")

    # -- load / unload -----------------------------------------------------------

    async def load_all(self) -> list[str]:
        """Load every model directory, ensembles after the models their steps
        use; return the names that failed (and why in logs)."""
        uses = {}
        for entry in sorted(self.root.iterdir()):
            if entry.is_dir() and config_file(entry) is not None:
                uses[entry.name] = self._step_models(entry.name)
        order, refused = load_order(uses)
        failed = []
        for name, why in sorted(refused.items()):
            log.error("model %s not loaded: %s", name, why)
            entry = self._models.setdefault(name, ModelEntry(name))
            entry.state, entry.reason = ModelState.UNAVAILABLE, why
            failed.append(name)
        for name in order:
            try:
                await self.load(name)
            except TieredError as error:
                log.error("model %s not loaded: %s", name, error)
                failed.append(name)
        return sorted(failed)

    def _step_models(self, name: str) -> set[str]:
        """The models an ensemble's steps use; none for another model, or for
        one whose config does not read (its load says why)."""
        try:
            config = self._config(name)
        except TieredError:
            return set()
        return {step.model for step in config.ensemble.steps} if config.ensemble else set()

    async def load(self, name: str) -> None:
        """(Re)load a model from disk: new versions start, changed ones rebuild,
        versions the policy no longer selects drain and close."""
        check_model_name(name)
        entry = self._models.setdefault(name, ModelEntry(name))
        async with entry.lock:
            previous_state = entry.state
            entry.state = ModelState.LOADING if not entry.versions else entry.state
            try:
                config, wanted = self._read(name)
                built = await self._build(config, wanted, entry.versions)
            except TieredError as error:
                entry.state = previous_state if entry.versions else ModelState.UNAVAILABLE
                entry.reason = str(error)
                raise
            retired = [v for n, v in entry.versions.items() if built.get(n) is not v]
            entry.versions = built
            entry.state, entry.reason = ModelState.READY, ""
            log.info("model %s serving versions %s", name, sorted(built))
        for listener in self.on_load:
            listener()
        for version in retired:
            self._drain_later(version)
        await self._recheck_ensembles_using(name)

    async def _recheck_ensembles_using(self, name: str) -> None:
        """Load again the ensembles whose steps use `name`, as Triton reloads
        a model's dependents: their steps are checked against it as it is now.
        One that no longer fits keeps its reason in the index."""
        for entry in list(self._models.values()):
            configs = [v.config for v in entry.versions.values()]
            if any(c.ensemble and any(s.model == name for s in c.ensemble.steps)
                   for c in configs):
                try:
                    await self.load(entry.name)
                except TieredError as error:
                    log.error("ensemble %s no longer fits model %s: %s", entry.name, name,
                              error)

    async def unload(self, name: str) -> None:
        """Stop serving a model once its in-flight requests finish."""
        check_model_name(name)
        entry = self._models.get(name)
        if entry is None or not entry.versions:
            raise NotFound(f"model_name: model {name!r} is not loaded")
        async with entry.lock:
            retired, entry.versions = list(entry.versions.values()), {}
            entry.state, entry.reason = ModelState.UNLOADING, ""
            await asyncio.gather(*(v.drain(self.profile.limits.drain_timeout_s) for v in retired))
            entry.state, entry.reason = ModelState.UNAVAILABLE, "unloaded"
        log.info("model %s unloaded", name)

    async def close(self) -> None:
        """Drain everything (shutdown)."""
        versions = self.all_versions()
        for entry in self._models.values():
            entry.versions = {}
            entry.state = ModelState.UNLOADING
        await asyncio.gather(
            *(v.drain(self.profile.limits.drain_timeout_s) for v in versions), *self._draining
        )

    # -- internals ----------------------------------------------------------------

    def _config(self, name: str) -> ModelConfig:
        return read_model_config(self.root, name, self.profile)

    def _read(self, name: str) -> tuple[ModelConfig, dict[int, Path]]:
        model_dir = self.root / name
        config = self._config(name)
        if config.ensemble is not None:
            chosen = config.version_policy.select(ensemble_versions(model_dir))
            return config, {version: model_dir / str(version) for version in chosen}
        on_disk = versions_on_disk(model_dir)
        wanted = {v: on_disk[v] for v in config.version_policy.select(on_disk)}
        for version, path in wanted.items():
            inside_repository(self.root, path, f"{name} version {version}")
        if not wanted:
            raise ConfigError(
                f"{name}: no version directory with {MODEL_FILE} matches the version policy "
                f"(found {sorted(on_disk) or 'none'})"
            )
        return config, wanted

    async def _build(
        self, config: ModelConfig, wanted: dict[int, Path], current: dict[int, Served]
    ) -> dict[int, Served]:
        if config.ensemble is not None:
            return self._build_ensemble(config, wanted, current)
        built: dict[int, Served] = {}
        try:
            for version, path in sorted(wanted.items()):
                source = (path.stat().st_mtime_ns, config)
                old = current.get(version)
                if old is not None and old.built_from == source:
                    built[version] = old  # unchanged on disk: keep serving it
                    continue
                if config.generation is not None:
                    built[version] = await self._build_generative(config, version, path, source)
                    continue
                engines = await (self._start_engine_processes(config, version, path)
                                 if self.devices.devices else self._open_engine(config, path))
                try:
                    where = f"{config.name}/config.yaml (version {version})"
                    first = next(iter(engines.values()))
                    completed = complete_with_engine(config, first.inputs, first.outputs, where)
                except TieredError:
                    await asyncio.gather(*(in_thread(e.close) for e in engines.values()))
                    raise
                built[version] = ModelVersion(
                    completed, version, engines, built_from=source,
                    recorder=VersionRecorder(time.monotonic) if self._telemetry else None,
                    build=_build_facts(path.parent),
                )
        except BaseException:
            for version, served in built.items():  # undo what this load started
                if current.get(version) is not served:
                    self._drain_later(served)
            raise
        return built

    def _build_ensemble(self, config: ModelConfig, wanted: dict[int, Path],
                        current: dict[int, Served]) -> dict[int, Served]:
        """Check the steps against the models serving them now; a version whose
        config and steps' models are unchanged keeps serving (and counting)."""
        assert config.ensemble is not None
        found = config_file(self.root / config.name)
        where = f"{config.name}/{found.name if found else CONFIG}"
        models = []
        for index, step in enumerate(config.ensemble.steps):
            try:
                models.append(self.get(step.model, step_version(step.version)).config)
            except TieredError as error:
                raise ConfigError(f"{where}.ensemble.steps[{index}].model: {step.model!r} is "
                                  f"not served here; load it first ({error})") from error
        check_steps(config, models, where)
        source = (config, tuple(models))
        built: dict[int, Served] = {}
        for version in wanted:
            old = current.get(version)
            built[version] = old if old is not None and old.built_from == source else \
                EnsembleVersion(config, version, self.get, built_from=source,
                                recorder=VersionRecorder(time.monotonic) if self._telemetry
                                else None, build=_build_facts(wanted[version]))
        return built

    async def _open_engine(self, config: ModelConfig, path: Path) -> dict[str, Engine]:
        """The engine in this process, warm: a new canary's first answers are not
        judged by a cold engine."""
        engine = await asyncio.to_thread(self._engine_factory, config.backend, path,
                                         config.engine, f"{config.name}/config.yaml.engine")
        try:
            await asyncio.to_thread(warm_up, engine)
        except BaseException:
            engine.close()
            raise
        return {self.devices.label(engine.device): engine}

    async def _start_engine_processes(self, config: ModelConfig, version: int,
                                      path: Path) -> dict[str, Engine]:
        """One engine process per device, started side by side (each warms its own)."""
        spec = EngineSpec(f"{config.name} v{version}", config.backend, path, dict(config.engine),
                          f"{config.name}/config.yaml (version {version}).engine",
                          config.instance_count)
        limits = self.profile.limits
        engines = {device.name: DeviceEngine(device, spec, self.devices,
                                             limits.device_arena_mib * MiB,
                                             limits.engine_batch_timeout_s)
                   for device in self.devices.devices}
        started = await asyncio.gather(*(in_thread(e.start) for e in engines.values()),
                                       return_exceptions=True)
        failed = [error for error in started if isinstance(error, BaseException)]
        strings = [s.name for e in engines.values() for s in e.inputs if s.dtype.hasobject]
        if failed or strings:
            await asyncio.gather(*(in_thread(e.close) for e in engines.values()))
        if failed:
            raise failed[0]
        if strings:  # string tensors do not fit an arena: this process runs it
            log.warning("%s v%d: input %r holds strings, which an engine process cannot "
                        "take; it runs in the agent's process", config.name, version, strings[0])
            return await self._open_engine(config, path)
        log.info("%s v%d: one engine process on each of %s", config.name, version,
                 ", ".join(engines))
        return engines

    async def _build_generative(self, config: ModelConfig, version: int, path: Path,
                                source: tuple) -> GenerativeVersion:
        where = f"{config.name}/config.yaml (version {version})"
        completed = with_tensors(config, where)
        assert config.generation is not None
        chat = await asyncio.to_thread(ChatTemplate.of, path)  # a bad template fails first
        vision = config.generation.vision
        version_dir = path if path.is_dir() else path.parent
        stage = None if vision is None else await asyncio.to_thread(
            VisionStage.open, version_dir, vision, f"{where}.generation.vision")
        if runs_in_a_process(config.generation.engine_core, config.backend, config.engine,
                             nvml_gpu_count):
            spec = CoreSpec(f"{config.name} v{version}", config.backend, path,
                            dict(config.engine), f"{where}.engine")
            tokenizer = await asyncio.to_thread(open_tokenizer, config.backend, path)
            engine: GenerativeEngine | EngineCores = EngineCores(
                [EngineCore(spec, device) for device in self.devices.devices]
                or [EngineCore(spec)], tokenizer)  # a core per device of the agent, or one
            await in_thread(engine.start)
        else:
            engine = await asyncio.to_thread(
                open_generative, config.backend, path, config.engine, f"{where}.engine")
        return GenerativeVersion(
            completed, version, engine, (config.backend, str(path)), built_from=source,
            recorder=VersionRecorder(time.monotonic) if self._telemetry else None,
            build=_build_facts(path.parent), device=self.devices.label(engine.device),
            chat=chat, vision=stage)

    def _drain_later(self, version: Served) -> None:
        task = asyncio.get_running_loop().create_task(
            version.drain(self.profile.limits.drain_timeout_s)
        )
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)


def _build_facts(version_dir: Path) -> dict[str, str]:
    """Key figures of the version's build report (build.json), if it has one.

    A report that cannot be read costs its facts, never the version: serving
    does not depend on it.
    """
    try:
        report = build_report.read_report(version_dir)
    except ConfigError as error:
        log.warning("%s", error)
        return {}
    return build_report.version_facts(report) if report else {}


def model_file(root: Path, name: str, version: int) -> Path:
    """Where version `version` of model `name` keeps its ONNX file (dirs created)."""
    check_model_name(name)
    if version < 1:
        raise ConfigError(f"version: must be a positive integer, got {version}")
    path = root / name / str(version) / MODEL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def read_model_config(root: Path, name: str, profile: TierProfile) -> ModelConfig:
    """DIR/<name>'s config (config.yaml or config.pbtxt), parsed as the agent serves it."""
    config_path = config_file(root / name)
    if config_path is None:
        raise NotFound(f"model_name: no model {name!r} in repository {root}")
    inside_repository(root, config_path, name)
    where = f"{name}/{config_path.name}"
    data = (triton_config.parse(config_path.read_text(), where)
            if config_path.name == TRITON_CONFIG else read_yaml(config_path))
    return parse_model_config(name, data, profile, where)


def config_file(model_dir: Path) -> Path | None:
    """A model's config.yaml, or Triton's config.pbtxt; None when it has neither."""
    found = [model_dir / n for n in (CONFIG, TRITON_CONFIG) if (model_dir / n).is_file()]
    if len(found) > 1:
        raise ConfigError(f"{model_dir.name}: both {CONFIG} and {TRITON_CONFIG}; keep one")
    return found[0] if found else None


def write_config(root: Path, name: str, config: dict) -> Path:
    """Write DIR/<name>/config.yaml from a mapping (the keys config.yaml takes)."""
    import yaml

    check_model_name(name)
    path = root / name / CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
