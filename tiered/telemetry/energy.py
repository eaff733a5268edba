"""Energy meters behind one interface, and attribution of energy to model versions.

Every reading carries its source — `nvml` (GPU counters), `rapl` (CPU package
counters) or `model` (CPU time times configured watts) — so that nobody
mistakes a model for a measurement. Meters are thin adapters over their
counters; the clock, the NVML module and the sysfs root are injected so tests
drive them with fakes. Attribution is pure arithmetic.

Versions are compared on active energy: what a device used above its idle
draw. Kubernetes gives each version its own pods, so a canary at a fifth of
the traffic idles four fifths of the time; split whole, its idle draw would
land on a fifth of the requests and it would look costlier than it is.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tiered import names

log = logging.getLogger(__name__)

NVML, RAPL, MODEL = names.EnergySource


@dataclass(frozen=True)
class EnergyReading:
    joules: float  # cumulative since the meter started
    source: str
    at: float  # clock seconds


class EnergyMeter(ABC):
    source: str
    # The idle draw when the meter knows it by construction (a model); None:
    # a counter, whose idle draw has to be measured (`IdleDraw`).
    idle_watts: float | None = None

    @abstractmethod
    def read(self) -> EnergyReading:
        """Joules used since the meter was created."""


class RaplMeter(EnergyMeter):
    """CPU package energy from powercap's `energy_uj` counters, wrap-around handled.

    The counters are per package (`intel-rapl:N`); sub-zones (`intel-rapl:N:M`)
    are parts of a package and are not added again.
    """

    source = RAPL

    def __init__(self, root: Path = Path("/sys/class/powercap"),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._zones = sorted(
            p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1
            and (p / "energy_uj").exists()
        )
        if not self._zones:
            raise OSError(f"no RAPL package counters under {root}")
        self._clock = clock
        self._ranges = [int((z / "max_energy_range_uj").read_text()) for z in self._zones]
        self._last = [self._raw(z) for z in self._zones]
        self._total_uj = 0

    @staticmethod
    def _raw(zone: Path) -> int:
        return int((zone / "energy_uj").read_text())

    def read(self) -> EnergyReading:
        for index, zone in enumerate(self._zones):
            raw = self._raw(zone)
            delta = raw - self._last[index]
            if delta < 0:  # the counter wrapped past max_energy_range_uj
                delta += self._ranges[index] + 1
            self._total_uj += delta
            self._last[index] = raw
        return EnergyReading(self._total_uj / 1e6, self.source, self._clock())


class NvmlMeter(EnergyMeter):
    """One GPU's energy: the total-energy counter (mJ, Volta and newer), or where
    the driver lacks it, sampled power integrated over time (call `read` often)."""

    source = NVML

    def __init__(self, pynvml: ModuleType, index: int | str = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = (pynvml.nvmlDeviceGetHandleByIndex(int(index)) if str(index).isdigit()
                        else pynvml.nvmlDeviceGetHandleByUUID(index))
        self._clock = clock
        try:
            self._start_mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            self.counter = True
        except pynvml.NVMLError:
            self.counter = False
            log.info("GPU %d has no energy counter; integrating sampled power", index)
        self._last_at = clock()
        self._last_w = self._power_w() if not self.counter else 0.0
        self._integrated_j = 0.0

    def _power_w(self) -> float:
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0

    def read(self) -> EnergyReading:
        now = self._clock()
        if self.counter:
            used_mj = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._start_mj
            return EnergyReading(used_mj / 1000.0, self.source, now)
        watts = self._power_w()
        self._integrated_j += (now - self._last_at) * (watts + self._last_w) / 2  # trapezoid
        self._last_at, self._last_w = now, watts
        return EnergyReading(self._integrated_j, self.source, now)


@dataclass(frozen=True)
class CpuPowerModel:
    """What a CPU draws, for machines with no counter: configured, not measured."""

    watts_per_busy_core: float = 10.0
    idle_watts: float = 5.0


class ModeledCpuMeter(EnergyMeter):
    """Process CPU time x watts per busy core, plus an idle share over wall time.

    Its idle draw is the configured `idle_watts`, not a measurement: the
    model's active energy is exactly its CPU time x watts per busy core.
    """

    source = MODEL

    def __init__(self, model: CpuPowerModel = CpuPowerModel(),
                 cpu_seconds: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.idle_watts = model.idle_watts
        self._cpu_seconds = cpu_seconds
        self._clock = clock
        self._cpu0, self._t0 = cpu_seconds(), clock()

    def read(self) -> EnergyReading:
        now = self._clock()
        busy = self._cpu_seconds() - self._cpu0
        joules = busy * self.model.watts_per_busy_core + (now - self._t0) * self.model.idle_watts
        return EnergyReading(joules, self.source, now)


def cpu_meter(root: Path = Path("/sys/class/powercap"),
              model: CpuPowerModel = CpuPowerModel()) -> EnergyMeter:
    """RAPL where its counters can be read, else the model (and say so)."""
    try:
        return RaplMeter(root)
    except (OSError, ValueError) as error:
        log.info("no RAPL counters (%s); CPU energy is modeled from CPU time", error)
        return ModeledCpuMeter(model)


def gpu_meter(index: int | str = 0) -> EnergyMeter | None:
    """NVML for GPU `index` (or its UUID), or None where there is no NVIDIA driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        return NvmlMeter(pynvml, index)
    except pynvml.NVMLError as error:
        log.info("no NVML (%s); no GPU energy", error)
        return None


IDLE_SLOTS = 300  # idle slots an idle estimate remembers: minutes of idle time


class IdleDraw:
    """A device's idle power: the least mean power over its last `history`
    slots in which none of its engines ran; None until there was one.

    The least, because an idle slot can still hold work the engines' busy
    time does not show (a batch that began in it and ended after, a model
    loading, the power state coming down after a burst): those only raise a
    slot's power. A meter that knows its idle draw (a model) is not measured.
    """

    def __init__(self, known: float | None = None, history: int = IDLE_SLOTS) -> None:
        self.known = known
        self._slots: deque[float] = deque(maxlen=history)

    def slot(self, joules: float, seconds: float, busy_s: float) -> None:
        """One span between two meter readings and the engines' busy time in it."""
        if self.known is None and seconds > 0 and busy_s <= 0:
            self._slots.append(joules / seconds)

    @property
    def watts(self) -> float | None:
        if self.known is not None:
            return self.known
        return min(self._slots) if self._slots else None


@dataclass(frozen=True)
class DeviceEnergy:
    """What one device used over a span, and the part above its idle draw."""

    joules: float  # everything, idle included
    source: str
    seconds: float
    idle_watts: float | None  # None while unknown

    @property
    def active_joules(self) -> float | None:
        """Joules above idle (never below 0: the idle estimate is a least value
        and a span can dip under it); None while the idle draw is unknown."""
        if self.idle_watts is None:
            return None
        return max(0.0, self.joules - self.idle_watts * self.seconds)


@dataclass(frozen=True)
class Attribution:
    joules: float
    share: float  # of the device's busy compute time in the window
    inferences: int
    joules_per_inference: float | None  # None when nothing was answered


def attribute(
    energy_j: float, busy_s: Mapping[Hashable, float], inferences: Mapping[Hashable, int]
) -> dict[Hashable, Attribution]:
    """Split a device's energy in a window among model versions by their share
    of its busy compute time (as Kepler splits node energy among pods).

    With no busy time nothing is attributed: the energy was idle draw.
    """
    total = sum(busy_s.values())
    if total <= 0:
        return {}
    result = {}
    for key, busy in busy_s.items():
        share = busy / total
        joules = energy_j * share
        count = inferences.get(key, 0)
        result[key] = Attribution(joules, share, count, joules / count if count else None)
    return result
