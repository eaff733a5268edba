"""Per model-version telemetry in time slots, readable "since a cursor".

Each version records into one-second slots kept over a sliding window
(default 60 s): latency, queue and compute histograms, a bounded reservoir of
raw latencies, counts, and the engine's busy time. A reader passes the cursor
it got last time and receives the merge of the slots completed since, plus a
new cursor — nothing is counted twice or skipped as long as it reads within
the window. Energy meters are read at slot boundaries, so a span of slots has
a joule figure too. Pure bookkeeping: the clock and rng are injected, nothing
here does I/O beyond calling the meters it is given.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

from tiered.telemetry.energy import EnergyMeter, EnergyReading, attribute
from tiered.telemetry.histogram import Histogram, Reservoir

SLOT_S = 1.0
WINDOW_S = 60.0
RESERVOIR_PER_SLOT = 64


@dataclass
class Slot:
    start: float
    latency: Histogram = field(default_factory=Histogram)
    queue: Histogram = field(default_factory=Histogram)
    compute: Histogram = field(default_factory=Histogram)
    samples: list[float] = field(default_factory=list)  # the reservoir's kept latencies
    success: int = 0
    failure: int = 0
    inferences: int = 0
    busy_s: float = 0.0


@dataclass
class Summary:
    """Slots merged: what happened to one version between two cursors."""

    start: float
    end: float
    latency: Histogram = field(default_factory=Histogram)
    queue: Histogram = field(default_factory=Histogram)
    compute: Histogram = field(default_factory=Histogram)
    samples: list[float] = field(default_factory=list)
    success: int = 0
    failure: int = 0
    inferences: int = 0
    busy_s: float = 0.0

    def add(self, slot: Slot) -> None:
        self.latency.merge(slot.latency)
        self.queue.merge(slot.queue)
        self.compute.merge(slot.compute)
        self.samples.extend(slot.samples)
        self.success += slot.success
        self.failure += slot.failure
        self.inferences += slot.inferences
        self.busy_s += slot.busy_s


def slot_start(now: float, slot_s: float = SLOT_S) -> float:
    return math.floor(now / slot_s) * slot_s


class VersionRecorder:
    """Slots of one model version. Used from one thread (the agent's loop)."""

    def __init__(self, clock: Callable[[], float], rng: random.Random | None = None,
                 slot_s: float = SLOT_S, window_s: float = WINDOW_S,
                 reservoir: int = RESERVOIR_PER_SLOT) -> None:
        self.slot_s = slot_s
        self._clock = clock
        self._rng = rng or random.Random(0)
        self._reservoir_size = reservoir
        self._slots: deque[Slot] = deque(maxlen=max(1, int(window_s / slot_s)))
        self._reservoir: Reservoir | None = None

    def _slot(self) -> Slot:
        start = slot_start(self._clock(), self.slot_s)
        if not self._slots or self._slots[-1].start != start:
            self._slots.append(Slot(start))
            self._reservoir = Reservoir(self._reservoir_size, self._rng,
                                        samples=self._slots[-1].samples)
        return self._slots[-1]

    def request_succeeded(self, latency_s: float, queue_s: float, compute_s: float,
                          batch_size: int) -> None:
        slot = self._slot()
        slot.latency.record(latency_s)
        slot.queue.record(queue_s)
        slot.compute.record(compute_s)
        assert self._reservoir is not None
        self._reservoir.add(latency_s)
        slot.success += 1
        slot.inferences += batch_size

    def request_failed(self, latency_s: float) -> None:
        self._slot().failure += 1

    def batch_ran(self, compute_s: float) -> None:
        """The engine was busy this long on one batch (for energy attribution)."""
        self._slot().busy_s += compute_s

    def since(self, cursor: float, until: float) -> Summary:
        """Slots that started at or after `cursor` and ended by `until`."""
        summary = Summary(start=cursor, end=until)
        for slot in self._slots:
            if slot.start >= cursor and slot.start + self.slot_s <= until:
                summary.add(slot)
        return summary


class EnergyLedger:
    """Meter readings at slot boundaries, to tell the joules of a span."""

    def __init__(self, meters: Mapping[str, EnergyMeter], window_s: float = WINDOW_S,
                 slot_s: float = SLOT_S) -> None:
        self.meters = dict(meters)  # device ("cpu", "cuda:0") -> meter
        self._readings: deque[tuple[float, dict[str, EnergyReading]]] = deque(
            maxlen=int(window_s / slot_s) + 2)

    def mark(self, at: float) -> None:
        """Read every meter now (call at each slot boundary)."""
        self._readings.append((at, {d: m.read() for d, m in self.meters.items()}))

    def used(self, start: float, end: float) -> dict[str, EnergyReading]:
        """Joules per device between the marks nearest `start` and `end`; a span
        that begins before the first mark counts from that mark."""
        marks = [(at, r) for at, r in self._readings if at <= end]
        if not marks:
            return {}
        before = [r for at, r in marks if at <= start]
        first, last = (before[-1] if before else marks[0][1]), marks[-1][1]
        return {
            device: EnergyReading(last[device].joules - first[device].joules,
                                  last[device].source, last[device].at)
            for device in last if device in first
        }


@dataclass(frozen=True)
class VersionEnergy:
    joules: float
    joules_per_inference: float | None
    source: str


def energy_per_version(
    used: Mapping[str, EnergyReading],
    summaries: Mapping[Hashable, Summary],
    devices: Mapping[Hashable, str],
) -> dict[Hashable, VersionEnergy]:
    """Each device's joules split among the versions running on it by busy time."""
    result: dict[Hashable, VersionEnergy] = {}
    for device, reading in used.items():
        on_device = [k for k in summaries if devices.get(k) == device]
        shares = attribute(
            reading.joules,
            {k: summaries[k].busy_s for k in on_device},
            {k: summaries[k].inferences for k in on_device},
        )
        for key, share in shares.items():
            result[key] = VersionEnergy(share.joules, share.joules_per_inference, reading.source)
    return result

