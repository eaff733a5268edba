"""`DeviceEngine`: an engine in a process of its own, driven as the agent
drives it (stage, run, wait, restart), with a real ONNX Runtime engine."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from tiered.agent.devices import Device, DeviceEngine, DevicePool, EngineLost, EngineSpec
from tiered.errors import ConfigError, EngineError
from tiered.models import zoo

CPU = Device("cpu:0", "")


HUNG_AFTER_S = 2.0


@pytest.fixture()
def engine(tmp_path):
    path = zoo.add_sub(tmp_path / "add_sub.onnx")
    pool = DevicePool([CPU])
    spec = EngineSpec("add_sub v1", "onnxruntime", path, {}, "test", instances=2)
    engine = DeviceEngine(CPU, spec, pool, arena_bytes=4096, batch_timeout_s=HUNG_AFTER_S)
    engine.start()
    yield engine, pool
    engine.close()


def rows(count: int, value: float) -> dict[str, np.ndarray]:
    x = np.full((count, 16), value, np.float32)
    return {"INPUT0": x, "INPUT1": x}


def test_batches_staged_in_the_arena_or_sent_inline_come_back_the_same(engine):
    engine, _ = engine
    assert engine.up and engine.device == "cpu"
    assert [s.name for s in engine.inputs] == ["INPUT0", "INPUT1"]
    staged = engine.stage([rows(1, 1.0), rows(2, 2.0)])  # 3 x 2 x 64 bytes: in the arena
    assert getattr(staged, "block", None) is not None
    out = engine.run(staged)
    np.testing.assert_allclose(out["OUTPUT0"][:, 0], [2.0, 4.0, 4.0])
    big = engine.stage([rows(40, 3.0)])  # 5 kB: more than the arena holds, sent inline
    assert getattr(big, "block", None) is None
    np.testing.assert_allclose(engine.run(big)["OUTPUT1"], 0.0)


def test_batches_from_several_threads_each_get_their_own_answer(engine):
    engine, _ = engine
    answers: dict[int, float] = {}

    def send(value: int) -> None:
        for _ in range(20):
            out = engine.run(engine.stage([rows(1, float(value))]))
            answers[value] = float(out["OUTPUT0"][0, 0])

    threads = [threading.Thread(target=send, args=(v,)) for v in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == {v: 2.0 * v for v in range(6)}


def test_an_engine_error_comes_back_as_the_same_kind_of_error(engine):
    engine, _ = engine
    with pytest.raises(EngineError, match="onnxruntime: .*INPUT"):  # the engine's own
        engine.run({"INPUT0": np.ones((1, 3), np.float32),
                    "INPUT1": np.ones((1, 3), np.float32)})
    out = engine.run(engine.stage([rows(1, 1.0)]), outputs=["OUTPUT1"])  # it goes on
    assert list(out) == ["OUTPUT1"] and out["OUTPUT1"].shape == (1, 16)


def test_a_killed_engine_process_fails_its_calls_and_starts_again(engine):
    engine, pool = engine
    first = engine.pid
    os.kill(first, signal.SIGKILL)
    assert engine.wait() == -signal.SIGKILL
    assert not engine.up
    with pytest.raises(EngineLost, match="cpu:0"):
        engine.run(engine.stage([rows(1, 1.0)]))
    engine.start()
    assert engine.up and engine.pid != first
    np.testing.assert_allclose(engine.run(engine.stage([rows(1, 1.0)]))["OUTPUT0"], 2.0)
    assert pool.cpu_seconds("cpu:0") > 0  # the dead process's CPU time is kept


def test_a_hung_engine_process_is_killed_and_its_batch_fails_over(engine):
    engine, _ = engine
    os.kill(engine.pid, signal.SIGSTOP)  # what a stalled GPU looks like from here
    started = time.monotonic()
    with pytest.raises(EngineLost, match="hung"):
        engine.run(engine.stage([rows(1, 1.0)]))
    assert HUNG_AFTER_S <= time.monotonic() - started < HUNG_AFTER_S + 5
    assert engine.wait() == -signal.SIGKILL and not engine.up
    engine.start()
    np.testing.assert_allclose(engine.run(engine.stage([rows(1, 1.0)]))["OUTPUT0"], 2.0)


def test_an_engine_that_cannot_load_says_why(tmp_path):
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"not onnx")
    spec = EngineSpec("broken v1", "onnxruntime", path, {}, "test", instances=1)
    engine = DeviceEngine(CPU, spec, DevicePool([CPU]), arena_bytes=4096)
    with pytest.raises(ConfigError, match="cpu:0: the engine process did not start: .*cannot "
                                          "load the model"):
        engine.start()
    assert not engine.up
