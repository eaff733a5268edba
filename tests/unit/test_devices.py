"""Which devices get engine processes, where a request goes, and how their
figures add up: the pure parts of one agent over several devices."""

from __future__ import annotations

import re

import pytest

from tiered.agent.batching import least_loaded
from tiered.agent.devices import Device, resolve_devices
from tiered.errors import ConfigError
from tiered.profiles import load_profile, parse_devices
from tiered.telemetry.energy import DeviceEnergy
from tiered.telemetry.recorder import VersionRecorder, energy_per_version


def no_gpus() -> int:
    return 0


def gpus(count):
    return lambda: count


@pytest.mark.parametrize("setting, environ, count, expected", [
    ("auto", {}, 0, ()),  # no GPU: the engine runs in the agent
    ("auto", {}, 1, ()),  # one GPU gains nothing from a process of its own
    ("auto", {}, 4, tuple(Device(f"cuda:{i}", str(i)) for i in range(4))),
    ("auto", {"CUDA_VISIBLE_DEVICES": "2,3"}, 8, (Device("cuda:2", "2"), Device("cuda:3", "3"))),
    ("auto", {"CUDA_VISIBLE_DEVICES": ""}, 8, ()),
    ("auto", {"CUDA_VISIBLE_DEVICES": "1,-1,2"}, 8, ()),  # CUDA stops at -1: one GPU
    ("auto", {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}, 0,
     (Device("cuda:0", "GPU-aa"), Device("cuda:1", "GPU-bb"))),
    ([], {}, 8, ()),
    ([5], {}, 0, (Device("cuda:5", "5"),)),  # a list is taken as it is, even of one
    (["cpu", "cpu"], {}, 0, (Device("cpu:0", ""), Device("cpu:1", ""))),
])
def test_devices_resolve_from_the_profile_the_environment_and_nvml(setting, environ, count,
                                                                    expected):
    assert resolve_devices(setting, environ, gpus(count)) == expected


@pytest.mark.parametrize("setting, message", [
    ("all", "expected 'auto' or a list"),
    ([0, "gpu1"], r"devices\[1\]: 'gpu1' is not a GPU index"),
    ([True], r"devices\[0\]: True is not"),
    ([0, "0"], "GPU 0 is listed twice"),
])
def test_a_bad_devices_setting_names_what_is_wrong(setting, message):
    with pytest.raises(ConfigError, match=message):
        parse_devices(setting)


def test_the_datacenter_profile_puts_every_gpu_to_work():
    assert load_profile("datacenter").devices == "auto"
    assert load_profile("edge").devices == ()


@pytest.mark.parametrize("loads, expected", [
    ([3, 1, 2], 1),
    ([0, 0, 0], 0),  # ties: the first, so light traffic batches on one device
    ([None, 5, 5], 1),  # a device that is down takes nothing
    ([None, None], None),
    ([], None),
])
def test_a_request_goes_to_the_device_with_the_least_work(loads, expected):
    assert least_loaded(loads) == expected


class Clock:
    def __init__(self) -> None:
        self.now = 0.5

    def __call__(self) -> float:
        return self.now


def test_a_versions_energy_is_the_sum_of_its_shares_of_each_device():
    clock = Clock()
    a, b = VersionRecorder(clock), VersionRecorder(clock)
    for _ in range(6):
        a.request_succeeded(0.01, 0.0, 0.01, 1)
    a.batch_ran(0.3, "cuda:0", 4)  # a alone on cuda:0
    a.batch_ran(0.1, "cuda:1", 2)  # a and b share cuda:1, 1:3 by busy time
    b.request_succeeded(0.01, 0.0, 0.01, 3)
    b.batch_ran(0.3, "cuda:1", 3)
    clock.now = 2.0
    summaries = {"a": a.since(0.0, 1.0), "b": b.since(0.0, 1.0)}
    used = {"cuda:0": DeviceEnergy(150.0, "nvml", 1.0, 50.0),  # 100 J above idle
            "cuda:1": DeviceEnergy(90.0, "nvml", 1.0, 50.0),  # 40 J above idle
            "cuda:2": DeviceEnergy(50.0, "nvml", 1.0, None)}  # idle draw not known
    energy = energy_per_version(used, summaries)
    assert energy["a"].by_device == pytest.approx({"cuda:0": 100.0, "cuda:1": 10.0})
    assert energy["a"].joules == pytest.approx(110.0)
    assert energy["a"].joules_per_inference == pytest.approx(110.0 / 6)
    assert energy["b"].by_device == pytest.approx({"cuda:1": 30.0})
    assert energy["b"].source == "nvml"
    assert summaries["a"].device_inferences == {"cuda:0": 4, "cuda:1": 2}
    assert summaries["a"].device_busy_s == pytest.approx({"cuda:0": 0.3, "cuda:1": 0.1})


@pytest.mark.parametrize("flag, message", [
    ("0,gpu1", r"--devices\[1\]: 'gpu1' is not a GPU index"),
    ("0,0", "--devices: GPU 0 is listed twice"),
])
def test_a_bad_devices_flag_stops_the_agent_naming_the_flag(tmp_path, capsys, flag, message):
    from tiered.cli import main

    code = main(["agent", "--tier", "edge", "--model-repository", str(tmp_path), "--insecure",
                 "--devices", flag])
    assert code == 2
    assert re.search(message, capsys.readouterr().err)
