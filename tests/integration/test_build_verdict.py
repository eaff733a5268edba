"""`tiered build` in a process of its own, as both controller backends run it:
whatever happens, its verdict is typed JSON, read back with `read_verdict`
from its stderr and from the --termination-log file Kubernetes would read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tiered.files import sha256_file
from tiered.models import zoo
from tiered.protocol.verdict import BuildVerdict, read_verdict


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> Path:
    return zoo.mlp(tmp_path_factory.mktemp("artifact") / "mlp.onnx", seed=1)


def tiered_build(artifact: Path, repository: Path, *flags: str
                 ) -> tuple[subprocess.CompletedProcess, BuildVerdict | None]:
    """Run an FP32 edge build (fast and exact) of version 1; return the process
    and the verdict of its termination log, checked equal to its stderr's."""
    log = repository.parent / "termination-log"
    done = subprocess.run(
        [sys.executable, "-m", "tiered", "build", str(artifact), "--tier", "edge",
         "--precision", "fp32", "--repository", str(repository), "--model", "mlp",
         "--version", "1", "--termination-log", str(log), *flags],
        capture_output=True, text=True, timeout=180, check=False,
    )
    told = read_verdict(log.read_text())
    assert log.read_text().count("\n") == 1, log.read_text()
    assert told == read_verdict(done.stderr), done.stderr
    assert done.stderr.splitlines()[-1] == told.to_json(), done.stderr  # the last line
    return done, told


def test_a_built_version_says_so_where_it_went_and_in_its_build_json(mlp, tmp_path) -> None:
    repository = tmp_path / "repository"

    done, told = tiered_build(mlp, repository, "--sha256", sha256_file(mlp))

    assert done.returncode == 0, done.stderr
    assert told == BuildVerdict(built=True, model="mlp", version=1, tier="edge",
                                reason=told.reason, installed=str(repository / "mlp" / "1"),
                                exit_code=0)
    assert told.reason.startswith("pass: within the threshold: top-1 agreement 1.0000")
    on_disk = json.loads((repository / "mlp" / "1" / "build.json").read_text())
    assert on_disk["verdict"] == told.to_dict()
    assert json.loads(done.stdout) == on_disk  # the report on stdout is the one installed


def test_a_gate_rejection_says_why_and_writes_nothing(mlp, tmp_path) -> None:
    repository = tmp_path / "repository"
    few = tmp_path / "eval.npz"
    np.savez(few, input=np.random.default_rng(0).standard_normal((10, 16)).astype(np.float32))

    done, told = tiered_build(mlp, repository, "--eval", str(few))

    assert done.returncode == 1, done.stderr
    assert (told.built, told.installed, told.exit_code) == (False, None, 1)
    assert told.reason.startswith("inconclusive: only 10 samples (the gate needs 100)")
    assert json.loads(done.stdout)["verdict"] == told.to_dict()
    assert not repository.exists()


def test_a_sha256_mismatch_is_refused_before_building(mlp, tmp_path) -> None:
    repository = tmp_path / "repository"
    wrong = "0" * 64

    done, told = tiered_build(mlp, repository, "--sha256", wrong)

    assert done.returncode == 2, done.stderr
    assert told == BuildVerdict(
        built=False, model="mlp", version=1, tier="edge", installed=None, exit_code=2,
        reason=f"artifact: {mlp} has sha256 {sha256_file(mlp)}, not the expected {wrong}; "
               "refusing to build it",
    )
    assert done.stdout == ""  # no report: it never built
    assert not repository.exists()


def test_calibration_or_eval_data_of_another_digest_is_refused(mlp, tmp_path) -> None:
    data = tmp_path / "eval.npz"
    np.savez(data, input=np.zeros((100, 16), np.float32))
    wrong = "0" * 64
    for flag in ("--calibration", "--eval"):
        done, told = tiered_build(mlp, tmp_path / "repository", flag, str(data),
                                  f"{flag}-sha256", wrong)
        assert done.returncode == 2, done.stderr
        assert told.reason == (f"artifact: {data} has sha256 {sha256_file(data)}, not the "
                               f"expected {wrong}; refusing to build it"), told.reason
    done, told = tiered_build(mlp, tmp_path / "repository", "--eval", str(data),
                              "--eval-sha256", sha256_file(data))
    assert done.returncode == 0 and told.built, done.stderr


def test_without_the_flag_no_termination_log_is_written(mlp, tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tiered", "build", str(mlp), "--sha256", "0" * 64, "--tier",
         "edge", "--repository", str(tmp_path / "repository"), "--model", "mlp",
         "--version", "1"],
        capture_output=True, text=True, timeout=180, check=False,
    )

    assert read_verdict(done.stderr).exit_code == done.returncode == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == []
