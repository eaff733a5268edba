"""Tier profiles: how each tier runs models by default.

A profile names the tier's engine and precision, the engine's settings,
dynamic-batching defaults and the agent's limits; a model's config.yaml
overrides the engine and batching keys it names. The three built-in profiles
are package data beside this module (`edge.yaml`, `regional.yaml`,
`datacenter.yaml`), so an installed wheel carries them; `--profile FILE` names
any other. Settings only: nothing here starts an engine or serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from tiered import names
from tiered.errors import ConfigError
from tiered.settings import load_dataclass, read_yaml

__all__ = ["ServerLimits", "TierProfile", "load_profile"]

MiB = 1 << 20
MAX_FRONT_ENDS = 64
AUTO = "auto"
CPU = "cpu"  # an entry of `devices:`: a CPU engine process standing in for a device


def parse_devices(setting: Any, where: str = "devices") -> tuple[str, ...] | None:
    """The profile's `devices:` as entries (GPU index or UUID, or `cpu`); None for `auto`."""
    if setting == AUTO:
        return None
    if not isinstance(setting, (list, tuple)):
        raise ConfigError(f"{where}: expected {AUTO!r} or a list of GPU indices, GPU UUIDs "
                          f"or {CPU!r}, got {setting!r}")
    entries = []
    for index, entry in enumerate(setting):
        text = str(entry).strip()
        if isinstance(entry, bool) or not (text.isdigit() or text.startswith("GPU-")
                                           or text == CPU):
            raise ConfigError(f"{where}[{index}]: {entry!r} is not a GPU index, a GPU UUID "
                              f"(GPU-...) or {CPU!r}")
        entries.append(text)
    duplicated = sorted({e for e in entries if e != CPU and entries.count(e) > 1})
    if duplicated:
        raise ConfigError(f"{where}: GPU {duplicated[0]} is listed twice")
    return tuple(entries)


@dataclass(frozen=True)
class ServerLimits:
    """Bounds of one agent process (documented defaults)."""

    max_message_bytes: int = 64 * MiB  # larger gRPC messages get RESOURCE_EXHAUSTED, REST 413
    # A REST body's JSON part above this gets 413: it is parsed on the event
    # loop (see tiered.protocol.rest_json.MAX_JSON_BYTES); binary data is not.
    max_json_bytes: int = 4 * MiB
    max_concurrent_rpcs: int = 1024  # beyond this gRPC answers RESOURCE_EXHAUSTED
    max_queue_size: int = 256  # per model version, when its config sets none
    drain_timeout_s: float = 30.0  # unload and shutdown wait this long for in-flight work
    # How often Python hands the GIL between the event loop and engine threads.
    # Python's 5 ms default lets the loop starve engine threads under load.
    gil_switch_interval_ms: float = 5.0
    # Each front-end process's arena for request bytes on their way to the
    # engine; a request that does not fit travels through the socket instead.
    front_end_arena_mib: int = 64
    # Each engine process's arena for the batches on their way to its device
    # (`devices:`); a batch that does not fit travels through the socket.
    device_arena_mib: int = 256
    # An engine process that holds a batch longer than this is taken for hung
    # (a GPU gone can stall it rather than end it): it is killed and restarted,
    # and its requests go to the other devices.
    engine_batch_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_json_bytes", "max_concurrent_rpcs", "max_queue_size",
                     "front_end_arena_mib", "device_arena_mib"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.engine_batch_timeout_s > 0:
            raise ConfigError(f"engine_batch_timeout_s: must be > 0, got "
                              f"{self.engine_batch_timeout_s}")
        if not 0 < self.gil_switch_interval_ms <= 100:
            raise ConfigError(
                f"gil_switch_interval_ms: must be in (0, 100], got {self.gil_switch_interval_ms}"
            )


@dataclass(frozen=True)
class TierProfile:
    tier: str
    engine: str = "onnxruntime"
    precision: str = "fp32"
    # Default engine settings per backend (see tiered.engines); a model's
    # config.yaml `engine:` is laid over the one for its backend.
    onnxruntime: Mapping[str, Any] = field(default_factory=dict)
    torch: Mapping[str, Any] = field(default_factory=dict)
    tensorrt: Mapping[str, Any] = field(default_factory=dict)
    # How `tiered build` makes this tier's version of an artifact (precision,
    # calibration, the accuracy gate); read by tiered.engines.build.
    build: Mapping[str, Any] = field(default_factory=dict)
    dynamic_batching: Mapping[str, Any] = field(default_factory=dict)
    instance_count: int = 1
    # gRPC front-end processes feeding this process's engines (0: it serves gRPC itself)
    front_ends: int = 0
    # One engine process per device: `auto` (every visible GPU, when there are
    # two or more), or a list of GPU indices / UUIDs, or `cpu` entries (CPU
    # engine processes standing in for devices). [] runs engines in the agent.
    devices: Any = ()
    limits: ServerLimits = ServerLimits()

    @property
    def backends(self) -> dict[str, Mapping[str, Any]]:
        """Default engine settings by backend name."""
        return {"onnxruntime": self.onnxruntime, "torch": self.torch, "tensorrt": self.tensorrt}

    def __post_init__(self) -> None:
        if self.tier not in names.TIERS:
            raise ConfigError(f"tier: {self.tier!r} is not one of {', '.join(names.TIERS)}")
        if self.instance_count < 1:
            raise ConfigError(f"instance_count: must be >= 1, got {self.instance_count}")
        if not 0 <= self.front_ends <= MAX_FRONT_ENDS:
            raise ConfigError(f"front_ends: must be in 0..{MAX_FRONT_ENDS}, got {self.front_ends}")
        parse_devices(self.devices)


def load_profile(tier: str, path: Path | None = None) -> TierProfile:
    """The profile for `tier`, from `path` or from the built-in <tier>.yaml."""
    # A Traversable, not a Path: the package may be imported from a zip.
    source = path or resources.files(__name__).joinpath(f"{tier}.yaml")
    if not source.is_file():
        raise ConfigError(f"tier profile {source} not found (pass --profile FILE)")
    profile = load_dataclass(TierProfile, read_yaml(source), str(source))
    if profile.tier != tier:
        raise ConfigError(f"{source}: profile is for tier {profile.tier!r}, not {tier!r}")
    return profile
