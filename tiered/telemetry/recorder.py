"""Per model-version telemetry in time slots, readable "since a cursor".

Each version records into one-second slots kept over a sliding window
(default 60 s): latency, queue and compute histograms, a bounded reservoir of
raw latencies, counts, and the engine's busy time. A reader passes the cursor
it got last time and receives the merge of the slots completed since, plus a
new cursor — nothing is counted twice or skipped as long as it reads within
the window. Energy meters are read at slot boundaries, so a span of slots has
a joule figure too, and a slot in which a device's engines did not run is a
measurement of its idle draw. Pure bookkeeping: the clock and rng are
injected, nothing here does I/O beyond calling the meters it is given.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, fields

from tiered.telemetry.energy import (
    DeviceEnergy,
    EnergyMeter,
    EnergyReading,
    IdleDraw,
    attribute,
)
from tiered.telemetry.histogram import Histogram, Reservoir

SLOT_S = 1.0
WINDOW_S = 60.0
RESERVOIR_PER_SLOT = 64


@dataclass(kw_only=True)
class Tally:
    """What one version's requests and engines did: recorded into a slot,
    added up over slots into a summary."""

    latency: Histogram = field(default_factory=Histogram)
    queue: Histogram = field(default_factory=Histogram)
    compute: Histogram = field(default_factory=Histogram)
    samples: list[float] = field(default_factory=list)  # the reservoir's kept latencies
    success: int = 0
    failure: int = 0  # what the server caused
    client_errors: int = 0  # refused for what the client sent (tiered.errors.CLIENT_ERRORS)
    inferences: int = 0
    busy_s: float = 0.0
    # per device (a version may run on several): engine busy seconds, batch elements
    device_busy_s: dict[str, float] = field(default_factory=dict)
    device_inferences: dict[str, int] = field(default_factory=dict)
    # Generative versions: output tokens, time to first token, time per output token.
    output_tokens: int = 0
    first_token: Histogram = field(default_factory=Histogram)
    per_token: Histogram = field(default_factory=Histogram)

    def add(self, more: Tally) -> None:
        """Add `more` into this, field by field."""
        for counted in fields(Tally):
            total, extra = getattr(self, counted.name), getattr(more, counted.name)
            if isinstance(total, Histogram):
                total.merge(extra)
            elif isinstance(total, list):
                total.extend(extra)
            elif isinstance(total, dict):
                _add_into(total, extra)
            else:
                setattr(self, counted.name, total + extra)


@dataclass
class Slot(Tally):
    start: float


@dataclass
class Summary(Tally):
    """Slots merged: what happened to one version between two cursors."""

    start: float
    end: float


def _add_into(total: dict, more: Mapping) -> None:
    for key, value in more.items():
        total[key] = total.get(key, 0) + value


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

    def request_failed(self, latency_s: float, by_client: bool = False) -> None:
        """A failed request: a failure of the version, or (`by_client`) a
        client error, counted apart."""
        if by_client:
            self._slot().client_errors += 1
        else:
            self._slot().failure += 1

    def token(self, seconds_since_previous: float, first: bool) -> None:
        """One output token of a generative version; for the first, the time
        since its request arrived, else since the sequence's previous token."""
        slot = self._slot()
        slot.output_tokens += 1
        (slot.first_token if first else slot.per_token).record(seconds_since_previous)

    def batch_ran(self, compute_s: float, device: str, size: int = 0) -> None:
        """The engine on `device` was busy this long on a batch of `size`
        elements (for energy attribution)."""
        slot = self._slot()
        slot.busy_s += compute_s
        slot.device_busy_s[device] = slot.device_busy_s.get(device, 0.0) + compute_s
        slot.device_inferences[device] = slot.device_inferences.get(device, 0) + size

    def busy_by_device(self, cursor: float, until: float) -> dict[str, float]:
        """Engine busy time per device in the slots `since` would merge."""
        busy: dict[str, float] = {}
        for slot in self._slots:
            if slot.start >= cursor and slot.start + self.slot_s <= until:
                _add_into(busy, slot.device_busy_s)
        return busy

    def since(self, cursor: float, until: float) -> Summary:
        """Slots that started at or after `cursor` and ended by `until`."""
        summary = Summary(start=cursor, end=until)
        for slot in self._slots:
            if slot.start >= cursor and slot.start + self.slot_s <= until:
                summary.add(slot)
        return summary


class EnergyLedger:
    """Meter readings at slot boundaries, to tell the joules of a span, and
    each device's idle draw measured from the slots its engines sat out."""

    def __init__(self, meters: Mapping[str, EnergyMeter], window_s: float = WINDOW_S,
                 slot_s: float = SLOT_S) -> None:
        self.meters = dict(meters)  # device ("cpu", "cuda:0") -> meter
        self.idle = {device: IdleDraw(meter.idle_watts) for device, meter in self.meters.items()}
        self._readings: deque[tuple[float, dict[str, EnergyReading]]] = deque(
            maxlen=int(window_s / slot_s) + 2)

    @property
    def last_mark(self) -> float | None:
        return self._readings[-1][0] if self._readings else None

    def mark(self, at: float, busy_s: Mapping[str, float] | None = None) -> None:
        """Read every meter now (call at each slot boundary). `busy_s`: the
        engines' busy seconds per device since the previous mark (a device
        missing from it had none); None when not known, so that the span
        measures no idle draw."""
        readings = {d: m.read() for d, m in self.meters.items()}
        if busy_s is not None and self._readings:
            before, previous = self._readings[-1]
            for device, reading in readings.items():
                if device in previous:
                    self.idle[device].slot(reading.joules - previous[device].joules,
                                           at - before, busy_s.get(device, 0.0))
        self._readings.append((at, readings))

    def used(self, start: float, end: float) -> dict[str, DeviceEnergy]:
        """Joules per device between the marks nearest `start` and `end`, with
        the idle draw as now estimated; a span that begins before the first
        mark counts from that mark. Its seconds are those between the two
        readings (a mark is read a little after its slot boundary), so idle
        draw times them is what the meter counted as idle."""
        marks = [(at, r) for at, r in self._readings if at <= end]
        if not marks:
            return {}
        before = [(at, r) for at, r in marks if at <= start]
        (_, first), (_, last) = (before[-1] if before else marks[0]), marks[-1]
        return {
            device: DeviceEnergy(last[device].joules - first[device].joules,
                                 last[device].source, last[device].at - first[device].at,
                                 self.idle[device].watts)
            for device in last if device in first
        }


@dataclass(frozen=True)
class VersionEnergy:
    joules: float  # the version's share of its devices' active energy
    joules_per_inference: float | None
    source: str
    idle_watts: float  # of its devices, subtracted before the split
    by_device: Mapping[str, float] = field(default_factory=dict)  # its joules on each


def energy_per_version(
    used: Mapping[str, DeviceEnergy], summaries: Mapping[Hashable, Summary],
) -> dict[Hashable, VersionEnergy]:
    """Each device's active energy split among the versions that ran on it by
    their busy time there, and summed per version over its devices, so that a
    version's J/inference does not depend on how long its devices sat idle.
    Nothing from a device whose idle draw is not known yet: a figure with
    idle in it would not compare with one without."""
    shares: dict[Hashable, dict[str, float]] = {}
    for device, energy in used.items():
        active = energy.active_joules
        if active is None:
            continue
        split = attribute(active, {k: s.device_busy_s[device] for k, s in summaries.items()
                                   if device in s.device_busy_s}, {})
        for key, share in split.items():
            shares.setdefault(key, {})[device] = share.joules
    result: dict[Hashable, VersionEnergy] = {}
    for key, by_device in shares.items():
        joules, count = sum(by_device.values()), summaries[key].inferences
        sources = sorted({used[d].source for d in by_device})
        result[key] = VersionEnergy(
            joules, joules / count if count else None, "+".join(sources),
            sum(used[d].idle_watts or 0.0 for d in by_device), by_device)
    return result
