from __future__ import annotations

import pytest

from tiered.protocol import telemetry_messages
from tiered.telemetry.energy import (
    CpuPowerModel,
    EnergyMeter,
    EnergyReading,
    IdleDraw,
    ModeledCpuMeter,
)
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


def test_client_errors_are_counted_apart_from_failures():
    clock = Clock(100.2)
    recorder = VersionRecorder(clock)
    recorder.request_failed(0.001, by_client=True)
    recorder.request_failed(0.001, by_client=True)
    recorder.request_failed(0.003)
    clock.now = 101.2
    summary = recorder.since(cursor=0.0, until=101.0)
    assert (summary.success, summary.failure, summary.client_errors) == (0, 1, 2)
    assert telemetry_messages.version_stats("m", 1, "cpu", summary, None, 0, 0, 1e-5,
                                            1.1).client_errors == 2


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
    idle_watts = 0.0  # known: every joule is active

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
        a.batch_ran(0.3, "cpu", 1)
    b.request_succeeded(0.01, 0.0, 0.01, 1)
    b.batch_ran(0.1, "cpu", 1)
    g.request_succeeded(0.01, 0.0, 0.01, 4)
    g.batch_ran(0.2, "cuda:0", 4)
    ledger.mark(1.0)
    used = ledger.used(0.0, 1.0)
    assert used["cpu"].joules == pytest.approx(10.0) and used["cuda:0"].joules == 100.0
    summaries = {k: r.since(0.0, 1.0) for k, r in {"a": a, "b": b, "g": g}.items()}
    energy = energy_per_version(used, summaries)
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


class PowerMeter(EnergyMeter):
    """A GPU counter: `idle_w` all the time, plus what the test adds while busy."""

    source = "nvml"

    def __init__(self, clock: Clock, idle_w: float) -> None:
        self.clock, self.idle_w, self.active_j = clock, idle_w, 0.0

    def read(self) -> EnergyReading:
        return EnergyReading(self.idle_w * self.clock.now + self.active_j, self.source,
                             self.clock.now)


def serve(utilisation: float, idle_slots: int = 2, busy_slots: int = 10):
    """A version alone on a 60 W-idle GPU: idle slots first, then slots in which
    it answers 100 x `utilisation` requests of 10 ms and 0.5 J above idle each.
    Returns the device's energy over the busy slots and the version's."""
    clock = Clock(0.0)
    meter = PowerMeter(clock, idle_w=60.0)
    ledger, recorder = EnergyLedger({"cuda": meter}), VersionRecorder(clock)
    ledger.mark(0.0)
    for second in range(1, idle_slots + busy_slots + 1):
        if second > idle_slots:
            clock.now = second - 0.5
            for _ in range(round(100 * utilisation)):
                recorder.request_succeeded(0.01, 0.0, 0.01, 1)
                recorder.batch_ran(0.01, "cuda", 1)
                meter.active_j += 0.5
        clock.now = float(second)
        ledger.mark(clock.now, recorder.busy_by_device(second - 1, second))
    start = float(idle_slots)
    used = ledger.used(start, clock.now)
    energy = energy_per_version(used, {"v": recorder.since(start, clock.now)})
    return used["cuda"], energy.get("v")


def test_a_versions_joules_per_inference_does_not_depend_on_how_long_its_device_idles():
    (device_20, at_20), (device_100, at_100) = serve(0.2), serve(1.0)
    assert at_20.joules_per_inference == pytest.approx(0.5)
    assert at_100.joules_per_inference == pytest.approx(0.5)
    assert (at_20.source, at_20.idle_watts) == ("nvml", pytest.approx(60.0))
    # Split whole, the idle draw would make the quieter version look 3x costlier.
    assert device_20.joules / 200 == pytest.approx(3.5)
    assert device_100.joules / 1000 == pytest.approx(1.1)


def test_idle_is_measured_from_slots_without_busy_time_and_reported():
    device, _ = serve(0.2)
    assert device.idle_watts == pytest.approx(60.0) and device.seconds == 10.0
    assert device.active_joules == pytest.approx(100.0)
    (message,) = telemetry_messages.device_energy({"cuda": device})
    assert message.HasField("idle_watts") and message.idle_watts == pytest.approx(60.0)
    assert message.joules == pytest.approx(700.0) and message.source == "nvml"


def test_until_an_idle_slot_no_version_reports_energy():
    device, version = serve(0.2, idle_slots=0)
    assert device.idle_watts is None and device.active_joules is None and version is None
    (message,) = telemetry_messages.device_energy({"cuda": device})
    assert not message.HasField("idle_watts")


def test_idle_draw_is_the_least_power_of_recent_slots_without_busy_time():
    idle = IdleDraw(history=3)
    assert idle.watts is None
    idle.slot(joules=80.0, seconds=1.0, busy_s=0.0)  # a slot the power state came down in
    idle.slot(joules=300.0, seconds=1.0, busy_s=0.4)  # busy: not an idle sample
    idle.slot(joules=120.0, seconds=2.0, busy_s=0.0)
    assert idle.watts == pytest.approx(60.0)
    for _ in range(3):  # the device now idles higher: the old sample ages out
        idle.slot(joules=70.0, seconds=1.0, busy_s=0.0)
    assert idle.watts == pytest.approx(70.0)


def test_a_models_idle_draw_is_its_configured_watts_not_a_measurement():
    cpu, wall = [0.0], [0.0]
    meter = ModeledCpuMeter(CpuPowerModel(watts_per_busy_core=10, idle_watts=5),
                            cpu_seconds=lambda: cpu[0], clock=lambda: wall[0])
    ledger = EnergyLedger({"cpu": meter})
    assert ledger.idle["cpu"].watts == 5.0  # known before any slot
    ledger.mark(0.0)
    cpu[0], wall[0] = 0.1, 1.0  # background CPU time in an idle slot: not idle draw
    ledger.mark(1.0, {})
    assert ledger.idle["cpu"].watts == 5.0
    cpu[0], wall[0] = 0.5, 2.0
    ledger.mark(2.0, {"cpu": 0.4})
    assert ledger.used(1.0, 2.0)["cpu"].active_joules == pytest.approx(4.0)  # 0.4 s x 10 W
