from __future__ import annotations

import types

import pytest

from tiered.telemetry.energy import (
    MODEL,
    NVML,
    RAPL,
    CpuPowerModel,
    ModeledCpuMeter,
    NvmlMeter,
    RaplMeter,
    attribute,
    cpu_meter,
)


def write_zone(root, name, energy_uj, max_range_uj=1_000_000):
    zone = root / name
    zone.mkdir(exist_ok=True)
    (zone / "energy_uj").write_text(str(energy_uj))
    (zone / "max_energy_range_uj").write_text(str(max_range_uj))


def test_rapl_adds_packages_and_survives_wrap_around(tmp_path):
    write_zone(tmp_path, "intel-rapl:0", 900_000)
    write_zone(tmp_path, "intel-rapl:1", 100)
    write_zone(tmp_path, "intel-rapl:0:0", 5)  # a sub-zone: part of package 0
    meter = RaplMeter(tmp_path, clock=lambda: 1.0)
    write_zone(tmp_path, "intel-rapl:0", 50_000)  # wrapped: 100_000 to the top, 1, then 50_000
    write_zone(tmp_path, "intel-rapl:1", 200_100)
    write_zone(tmp_path, "intel-rapl:0:0", 999_999)
    reading = meter.read()
    assert reading.source == RAPL
    assert reading.joules == pytest.approx((150_001 + 200_000) / 1e6)
    write_zone(tmp_path, "intel-rapl:0", 60_000)
    assert meter.read().joules == pytest.approx((150_001 + 200_000 + 10_000) / 1e6)


def test_rapl_without_counters_falls_back_to_the_model_and_says_so(tmp_path):
    meter = cpu_meter(tmp_path)
    assert meter.source == MODEL


class FakeNvml(types.ModuleType):
    """The parts of pynvml the meter uses, with counters the test moves."""

    class NVMLError(Exception):
        pass

    def __init__(self, counter: bool):
        super().__init__("pynvml")
        self.has_counter = counter
        self.energy_mj = 1_000_000
        self.power_mw = 100_000
        self.initialised = False

    def nvmlInit(self):
        self.initialised = True

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not self.has_counter:
            raise self.NVMLError("Not Supported")
        return self.energy_mj

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.power_mw


def test_nvml_reads_the_energy_counter_since_start():
    nvml = FakeNvml(counter=True)
    meter = NvmlMeter(nvml, clock=lambda: 0.0)
    nvml.energy_mj += 2_500
    reading = meter.read()
    assert nvml.initialised and meter.counter
    assert (reading.joules, reading.source) == (pytest.approx(2.5), NVML)


def test_nvml_integrates_power_where_the_counter_is_missing():
    nvml = FakeNvml(counter=False)
    now = [0.0]
    meter = NvmlMeter(nvml, clock=lambda: now[0])
    now[0], nvml.power_mw = 2.0, 300_000  # 100 W -> 300 W over 2 s: 400 J
    assert meter.read().joules == pytest.approx(400.0)
    now[0] = 3.0  # 300 W for 1 s more
    assert meter.read().joules == pytest.approx(700.0)


def test_modeled_cpu_energy_is_busy_time_times_watts_plus_idle_share():
    cpu, wall = [10.0], [100.0]
    meter = ModeledCpuMeter(CpuPowerModel(watts_per_busy_core=12, idle_watts=3),
                            cpu_seconds=lambda: cpu[0], clock=lambda: wall[0])
    cpu[0], wall[0] = 12.5, 104.0
    reading = meter.read()
    assert reading.source == MODEL
    assert reading.joules == pytest.approx(2.5 * 12 + 4 * 3)


@pytest.mark.parametrize(
    "name, energy, busy, inferences, expected",
    [
        ("split by busy share", 100.0, {"a": 3.0, "b": 1.0}, {"a": 30, "b": 5},
         {"a": (75.0, 0.75, 2.5), "b": (25.0, 0.25, 5.0)}),
        ("one version takes it all", 10.0, {"a": 2.0}, {"a": 4}, {"a": (10.0, 1.0, 2.5)}),
        ("no answers: no per-inference figure", 10.0, {"a": 1.0}, {}, {"a": (10.0, 1.0, None)}),
        ("idle window attributes nothing", 50.0, {"a": 0.0}, {"a": 0}, {}),
    ],
)
def test_attribution(name, energy, busy, inferences, expected):
    result = attribute(energy, busy, inferences)
    assert set(result) == set(expected), name
    for key, (joules, share, per_inference) in expected.items():
        got = result[key]
        assert (got.joules, got.share) == pytest.approx((joules, share)), name
        assert got.joules_per_inference == (
            None if per_inference is None else pytest.approx(per_inference)), name
