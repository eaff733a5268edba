"""The pure helpers of bench/energy.py: slot windows, counter interpolation,
per-slot sums and the agreement check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "energy.py"
_spec = importlib.util.spec_from_file_location("bench_energy", _PATH)
energy = importlib.util.module_from_spec(_spec)
sys.modules["bench_energy"] = energy  # dataclasses look their module up
_spec.loader.exec_module(energy)


def test_window_starts_on_the_first_boundary_after_the_warm_up():
    assert energy.window_bounds(100.2, 5.0, 15) == (106.0, 121.0)
    assert energy.window_bounds(100.0, 5.0, 15) == (105.0, 120.0)  # exactly on a boundary
    assert energy.window_bounds(3.5, 0.0, 2, slot_s=2.0) == (4.0, 8.0)


def test_value_at_interpolates_between_samples_and_hits_them_exactly():
    samples = [(0.0, 10.0), (1.0, 20.0), (3.0, 20.0), (4.0, 60.0)]
    assert energy.value_at(samples, 0.0) == 10.0
    assert energy.value_at(samples, 0.5) == pytest.approx(15.0)
    assert energy.value_at(samples, 2.0) == 20.0
    assert energy.value_at(samples, 3.75) == pytest.approx(50.0)
    assert energy.value_at(samples, 4.0) == 60.0


def test_value_at_refuses_times_outside_the_samples():
    with pytest.raises(ValueError):
        energy.value_at([(1.0, 0.0), (2.0, 1.0)], 0.5)
    with pytest.raises(ValueError):
        energy.value_at([(1.0, 0.0), (2.0, 1.0)], 2.5)
    with pytest.raises(ValueError):
        energy.value_at([], 1.0)


def test_counter_updates_tells_how_often_and_by_how_much_the_counter_moved():
    # Read every 10 ms, the counter steps by 2 J every 50 ms.
    samples = [(i * 0.01, 2.0 * (i // 5)) for i in range(100)]
    seen = energy.counter_updates(samples)
    assert seen["samples"] == 100
    assert seen["changes"] == 19
    assert seen["median_update_s"] == pytest.approx(0.05)
    assert seen["median_step_j"] == pytest.approx(2.0)
    assert energy.counter_updates([(0.0, 1.0)])["median_update_s"] is None


def test_per_slot_joules_splits_the_span_into_whole_slots():
    samples = [(t / 10, 100.0 * t / 10) for t in range(0, 41)]  # 100 W for 4 s
    assert energy.per_slot_joules(samples, 1.0, 4.0) == pytest.approx([100.0] * 3)


def test_images_in_span_counts_only_slots_inside_it():
    counts = energy.merge_slot_counts([{9: 8, 10: 16, 11: 8}, {10: 8, 12: 64, 13: 8}])
    assert counts == {9: 8, 10: 24, 11: 8, 12: 64, 13: 8}
    assert energy.images_in_span(counts, 10.0, 13.0) == 24 + 8 + 64


def test_requests_in_flight_and_their_split_over_processes():
    assert energy.requests_in_flight(8, 512) == 64
    assert energy.requests_in_flight(64, 512) == 8
    assert energy.requests_in_flight(512, 512) == 2  # never fewer than two
    assert energy.split_workers(64, 8) == [8] * 8
    assert energy.split_workers(10, 4) == [3, 3, 2, 2]
    assert energy.split_workers(2, 8) == [1, 1]


def test_modeled_cpu_joules_is_the_agents_formula():
    from tiered.telemetry.energy import CpuPowerModel, ModeledCpuMeter

    model = CpuPowerModel(watts_per_busy_core=12.0, idle_watts=3.0)
    cpu, clock = iter([0.0, 4.0]), iter([100.0, 110.0])
    meter = ModeledCpuMeter(model, cpu_seconds=lambda: next(cpu), clock=lambda: next(clock))
    assert energy.modeled_cpu_joules(4.0, 10.0, 12.0, 3.0) == pytest.approx(
        meter.read().joules)


@pytest.mark.parametrize(("agent", "direct", "verdict"), [
    (0.105, 0.100, "PASS"),
    (0.091, 0.100, "PASS"),
    (0.111, 0.100, "FAIL"),
    (0.089, 0.100, "FAIL"),
    (None, 0.100, "N/A"),
    (0.100, 0.0, "N/A"),
])
def test_agreement_within_tolerance(agent, direct, verdict):
    result = energy.agreement(agent, direct, 0.10)
    assert result["verdict"] == verdict
    if verdict != "N/A":
        assert result["agent_over_direct"] == pytest.approx(agent / direct)
