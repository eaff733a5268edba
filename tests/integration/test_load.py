"""`tiered load` as a process against a real router and agent: requests shaped
from the model's metadata (random, or rows of an .npz), a progress line a
second, a summary, and exit 0 only when every request was answered."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from tiered.cli.load import LoadCounts, synthetic_inputs
from tiered.local.processes import RouterProcess, interruptible


@pytest.fixture(scope="module")
def router(agent, tmp_path_factory):
    table = tmp_path_factory.mktemp("load") / "routing.yaml"
    routes = {model: {"policy": "slo-energy",
                      "tiers": {"edge": {"agents": [agent.address], "stable": 1}}}
              for model in ("mlp", "add_sub")}
    table.write_text(json.dumps({"version": 1, "models": routes}))
    with RouterProcess(table, http_port=None) as process:
        yield process


def load(router, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiered", "load", *args,
                           "--router", router.address], capture_output=True, text=True,
                          timeout=120, check=False)


SECOND = re.compile(r"^\d\d:\d\d:\d\d  sent (\d+)  ok (\d+)  errors (\d+)  p50 \S+ ms  "
                    r"p95 \S+ ms$")


@pytest.mark.parametrize("model", ["mlp", "add_sub"])
def test_load_sends_a_steady_rate_and_prints_a_line_a_second(router, model):
    done = load(router, model, "--rate", "20", "--duration", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    seconds = [SECOND.match(line) for line in lines[1:-1]]
    assert len(seconds) >= 2 and all(seconds), lines
    total = re.match(r"total: sent (\d+)  ok (\d+)  errors 0", lines[-1])
    assert total and total[1] == total[2], lines[-1]
    assert 40 <= int(total[1]) <= 61  # 20/s for 3 s, whatever the machine's load


def test_load_draws_inputs_from_an_npz(router, tmp_path):
    np.savez(tmp_path / "samples.npz", input=np.ones((5, 16), dtype=np.float32))
    done = load(router, "mlp", "--rate", "10", "--duration", "1.5", "--inputs",
                str(tmp_path / "samples.npz"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "from " in done.stdout.splitlines()[0]


def test_an_unknown_model_is_named_and_exits_1(router):
    done = load(router, "nonesuch", "--rate", "5", "--duration", "1")
    assert done.returncode == 1
    assert "no metadata for model 'nonesuch'" in done.stderr and "Traceback" not in done.stderr


def test_inputs_follow_the_metadata_and_counts_read_plainly():
    rng = np.random.default_rng(0)
    arrays = synthetic_inputs([("x", "FP32", [-1, 4]), ("n", "INT64", [2]),
                               ("s", "BYTES", [-1])], rng)
    assert (arrays["x"].shape, arrays["x"].dtype) == ((1, 4), np.float32)
    assert (arrays["n"].shape, arrays["n"].dtype) == ((2,), np.int64)
    assert arrays["s"].shape == (1,)
    rows = {"x": np.arange(12, dtype=np.float32).reshape(3, 4)}
    assert synthetic_inputs([("x", "FP32", [-1, 4])], rng, rows)["x"].shape == (1, 4)
    counts = LoadCounts(sent=3)
    counts.answered(2.0)
    counts.answered(4.0)
    counts.failed("UNAVAILABLE: no agent")
    assert counts.line() == "sent 3  ok 2  errors 1  p50 3.00 ms  p95 3.90 ms"
    assert LoadCounts().line() == "sent 0  ok 0  errors 0  p50 - ms  p95 - ms"


def test_ctrl_c_ends_the_load_with_its_summary(router):
    import signal

    process = subprocess.Popen([sys.executable, "-m", "tiered", "load", "mlp", "--rate", "10",
                                "--router", router.address], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=interruptible())
    try:
        lines = [process.stdout.readline() for _ in range(3)]  # the heading, two seconds
        assert SECOND.match(lines[-1].rstrip("\n")), lines
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, out + err
        assert out.splitlines()[-1].startswith("total: sent") and "Traceback" not in err
    finally:
        process.kill()
