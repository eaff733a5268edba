from __future__ import annotations

import pytest

from tiered.telemetry.energy import EnergyMeter, EnergyReading
from tiered.telemetry.recorder import EnergyLedger, VersionRecorder, energy_per_version


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_reading_since_a_cursor_counts_each_completed_slot_once():
    clock = Clock(100.2)
    recorder = VersionRecorder(clock)
    recorder.request_succeeded(0.010, 0.001, 0.008, batch_size=2)
    recorder.request_failed(0.002)
    clock.now = 101.5
    recorder.request_succeeded(0.020, 0.002, 0.015, batch_size=1)

    first = recorder.since(cursor=0.0, until=101.5)  # slot 101 is not complete yet
    assert (first.success, first.failure, first.inferences) == (1, 1, 2)
    clock.now = 102.0
    second = recorder.since(cursor=101.0, until=102.0)
    assert (second.success, second.failure, second.inferences) == (1, 0, 1)
    assert second.latency.quantile(0.5) == pytest.approx(0.020, rel=0.01)
    assert second.samples == [0.020]


def test_slots_older_than_the_window_are_forgotten():
    clock = Clock(0.5)
    recorder = VersionRecorder(clock, window_s=5.0)
    recorder.request_succeeded(0.01, 0.0, 0.01, 1)
    clock.now = 10.5
    recorder.request_succeeded(0.01, 0.0, 0.01, 1)
    for t in range(6, 10):
        clock.now = t + 0.5
        recorder.request_succeeded(0.01, 0.0, 0.01, 1)
    assert recorder.since(0.0, 11.0).success == 5  # slots 6..10; slot 0 is gone


def test_reservoir_per_slot_is_bounded():
    clock = Clock(0.0)
    recorder = VersionRecorder(clock, reservoir=8)
    for _ in range(1000):
        recorder.request_succeeded(0.01, 0.0, 0.01, 1)
    clock.now = 1.0
    summary = recorder.since(0.0, 1.0)
    assert summary.success == 1000 and len(summary.samples) == 8


class CountingMeter(EnergyMeter):
    source = "model"

    def __init__(self, joules_per_read: float) -> None:
        self.joules, self.step = 0.0, joules_per_read

    def read(self) -> EnergyReading:
        self.joules += self.step
        return EnergyReading(self.joules, self.source, 0.0)


def test_energy_of_a_span_is_split_among_versions_on_the_same_device_by_busy_time():
    clock = Clock(0.0)
    ledger = EnergyLedger({"cpu": CountingMeter(10.0), "cuda:0": CountingMeter(100.0)})
    a, b, g = (VersionRecorder(clock) for _ in range(3))
    ledger.mark(0.0)
    clock.now = 0.5
    for _ in range(3):
        a.request_succeeded(0.01, 0.0, 0.01, 1)
        a.batch_ran(0.3)
    b.request_succeeded(0.01, 0.0, 0.01, 1)
    b.batch_ran(0.1)
    g.request_succeeded(0.01, 0.0, 0.01, 4)
    g.batch_ran(0.2)
    ledger.mark(1.0)
    used = ledger.used(0.0, 1.0)
    assert used["cpu"].joules == pytest.approx(10.0) and used["cuda:0"].joules == 100.0
    summaries = {k: r.since(0.0, 1.0) for k, r in {"a": a, "b": b, "g": g}.items()}
    energy = energy_per_version(used, summaries, {"a": "cpu", "b": "cpu", "g": "cuda:0"})
    assert energy["a"].joules == pytest.approx(9.0)  # 0.9 of the CPU's busy time
    assert energy["a"].joules_per_inference == pytest.approx(3.0)
    assert energy["b"].joules == pytest.approx(1.0)
    assert energy["g"].joules_per_inference == pytest.approx(25.0)
    assert energy["g"].source == "model"


def test_a_span_before_the_first_mark_has_no_energy():
    ledger = EnergyLedger({"cpu": CountingMeter(1.0)})
    assert ledger.used(0.0, 1.0) == {}
    ledger.mark(5.0)
    assert ledger.used(0.0, 4.0) == {}


def test_a_span_reaching_back_before_the_first_mark_counts_from_it():
    ledger = EnergyLedger({"cpu": CountingMeter(2.0)})
    ledger.mark(5.0)
    ledger.mark(6.0)
    ledger.mark(7.0)
    assert ledger.used(-55.0, 7.0)["cpu"].joules == pytest.approx(4.0)
