"""The shared-memory registry's bounds and callers (tiered.agent.shared_memory),
on a real /dev/shm object: every caller's names apart, a share per caller and
a bound on all of them together."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from tiered.agent.shared_memory import SHM_DIR, SharedMemory
from tiered.errors import AlreadyExists, InvalidArgument, NotFound

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm here")


@pytest.fixture
def key():
    name = f"tiered-unit-{uuid.uuid4().hex[:8]}"
    path = SHM_DIR / name
    path.write_bytes(np.arange(16, dtype=np.float32).tobytes())
    yield f"/{name}"
    path.unlink()


def test_each_caller_has_its_own_names_and_sees_only_them(key):
    registry = SharedMemory()
    registry.register_system("token:a", "r", key, 0, 64)
    registry.register_system("token:b", "r", key, 0, 32)
    with pytest.raises(AlreadyExists):
        registry.register_system("token:a", "r", key, 0, 64)
    assert [r.byte_size for r in registry.system_status("token:b", "")] == [32]
    with pytest.raises(NotFound):
        registry.system_status("", "r")
    parameters = {"shared_memory_region": "r", "shared_memory_byte_size": 64}
    read = registry.of("token:a").read(parameters, "FP32", [16], "input 'x'")
    np.testing.assert_array_equal(read, np.arange(16, dtype=np.float32))
    with pytest.raises(InvalidArgument, match="outside region 'r' of 32 bytes"):
        registry.of("token:b").read(parameters, "FP32", [16], "input 'x'")
    with pytest.raises(InvalidArgument, match="no shared-memory region 'r'"):
        registry.of("").read(parameters, "FP32", [16], "input 'x'")
    registry.unregister_system("token:b", "")  # every region of b's, none of a's
    assert registry.system_status("token:b", "") == []
    assert [r.name for r in registry.system_status("token:a", "")] == ["r"]
    registry.unregister_system("token:a", "")


def test_a_caller_is_held_to_its_share_and_all_callers_to_the_bound(key):
    registry = SharedMemory(max_regions=5, max_per_caller=3)
    for index in range(3):
        registry.register_system("a", f"r{index}", key, 0, 64)
    with pytest.raises(InvalidArgument, match="3 regions registered, the most one caller"):
        registry.register_system("a", "r3", key, 0, 64)
    registry.register_system("b", "r0", key, 0, 64)
    registry.register_system("c", "r0", key, 0, 64)
    with pytest.raises(InvalidArgument, match="5 regions are registered, the most this agent"):
        registry.register_system("d", "r0", key, 0, 64)
    assert open_files(key) == 5
    for caller in "abc":
        registry.unregister_system(caller, "")
    assert open_files(key) == 0  # each region's file closed as it went
    registry.register_system("d", "r0", key, 0, 64)
    registry.unregister_system("d", "")


def open_files(key: str) -> int:
    """This process's descriptors open on the shared-memory object `key`."""
    target = str(SHM_DIR / key.lstrip("/"))
    fds = Path("/proc/self/fd")
    return sum(1 for fd in os.listdir(fds) if _points_to(fds / fd, target))


def _points_to(link: Path, target: str) -> bool:
    try:
        return os.readlink(link) == target
    except OSError:
        return False


def test_a_batch_s_rows_go_to_each_request_s_range_and_a_range_too_small_fails_alone(key):
    """`write_rows` (the engine's writes for a frame of merged requests): each
    request's rows of each output land at its own range; one whose range is
    too small fails alone. (Its CUDA branch runs in the GPU tests.)"""
    registry = SharedMemory()
    registry.register_system("", "out", key, 0, 64)
    y = np.arange(6 * 2, dtype=np.float32).reshape(6, 2)  # three requests of 1, 3 and 2 rows

    def at(offset: int, rows: int) -> dict:
        return {"y": {"shared_memory_region": "out", "shared_memory_offset": offset,
                      "shared_memory_byte_size": rows * 8}}

    too_small = {"y": {**at(8, 3)["y"], "shared_memory_byte_size": 8}}
    failed = registry.of("").write_rows([at(0, 1), too_small, at(16, 2)], [1, 3, 2], {"y": y})
    assert list(failed) == [1] and "more than the 8" in str(failed[1])
    written = np.frombuffer((SHM_DIR / key[1:]).read_bytes(), np.float32).reshape(8, 2)
    np.testing.assert_array_equal(written[0], y[0])
    np.testing.assert_array_equal(written[2:4], y[4:6])
    np.testing.assert_array_equal(written[1], [2, 3])  # untouched: the file's own values
    registry.unregister_system("", "")
