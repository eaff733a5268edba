"""`tiered get --watch` and `tiered rollout status --watch` as processes: they
print again when the store changes, end when the rollout does, and end
quietly (no traceback) when the reader closes the pipe or Ctrl-C comes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiered.controller.plan import make_snapshot
from tiered.controller.store import StateStore
from tiered.local.processes import interruptible
from tiered.rollout import engine
from tiered.rollout.spec import TieredModelStatus, load_tiered_model, to_plain

SHA = "ab" * 32
DOCUMENT = {"name": "digits", "artifact": {"uri": "/models/digits.onnx", "sha256": SHA},
            "tiers": {"edge": {}, "regional": {}},
            "rollout": {"stages": [{"name": "edge", "weights": {"edge": 10}}]}}
SPEC = load_tiered_model(DOCUMENT)
NEXT = {**DOCUMENT, "artifact": {"uri": "/models/digits.onnx", "sha256": "cd" * 32}}
DEADLINE_S = 60.0  # generous: the machine may be loaded


@pytest.fixture
def state(tmp_path) -> Path:
    return tmp_path / "state"


def write(store: StateStore, message: str, rollout=None, **status) -> None:
    record = store.get("digits")
    written = TieredModelStatus(rollout=rollout, message=message,
                                observed_generation=record.generation, **status)
    store.write_status("digits", record.revision, status=to_plain(written))


def tiered(state: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tiered", *args, "--state", str(state)],
                            env=interruptible(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until(process: subprocess.Popen, text: str) -> list[str]:
    lines = []
    while True:
        line = process.stdout.readline()
        assert line, f"ended before {text!r}: {lines} {process.stderr.read()}"
        lines.append(line)
        if text in line:
            return lines


def test_get_watch_prints_the_table_again_when_it_changes_and_ends_on_ctrl_c(state):
    with StateStore(state / "state.db") as store:
        store.apply("digits", DOCUMENT)
        write(store, "first message")
        process = tiered(state, "get", "--watch", "--interval", "0.2")
        try:
            read_until(process, "first message")
            write(store, "second message")
            read_until(process, "second message")
            process.send_signal(signal.SIGINT)
            assert process.wait(DEADLINE_S) == 130
            assert "Traceback" not in process.stderr.read()
        finally:
            process.kill()


@pytest.mark.parametrize("verb", [("get", "--watch", "--interval", "0.2"),
                                  ("rollout", "status", "digits", "--watch")])
def test_a_watch_whose_reader_goes_away_ends_quietly(state, verb):
    with StateStore(state / "state.db") as store:
        store.apply("digits", DOCUMENT)
        write(store, "v1", engine.start(SPEC, 1, 2, 0.0))
        process = tiered(state, *verb)
        try:
            process.stdout.readline()
            process.stdout.close()  # as `| head -1` does
            deadline = time.monotonic() + DEADLINE_S
            count = 0
            while process.poll() is None and time.monotonic() < deadline:
                count += 1
                write(store, f"message {count}", engine.start(SPEC, 1, 2, 0.0))
                store.record("digits", make_snapshot(SPEC, engine.start(SPEC, 1, 2, 0.0),
                                                     "hold", f"step {count}"))
                time.sleep(0.3)
            assert process.wait(DEADLINE_S) == 0
            assert process.stderr.read() == ""
        finally:
            process.kill()


def test_rollout_status_watch_waits_for_the_new_version_and_exits_when_it_ends(state):
    """Right after `apply`, the previous rollout's Promoted is not this one's end."""
    with StateStore(state / "state.db") as store:
        store.apply("digits", DOCUMENT)
        promoted = engine.promote(SPEC, engine.start(SPEC, 1, 2, 0.0), 0.0, full=True).status
        write(store, "v2 serving", promoted,
              artifacts=({"version": 1, "uri": "/m", "sha256": "ef" * 32},
                         {"version": 2, "uri": "/m", "sha256": SHA}))
        store.apply("digits", NEXT)  # a new version, not yet seen by a controller
        process = tiered(state, "rollout", "status", "digits", "--watch")
        try:
            time.sleep(3.0)
            assert process.poll() is None, process.stdout.read()
            record = store.get("digits")
            status = TieredModelStatus(
                rollout=engine.abort(SPEC, engine.start(SPEC, 2, 3, 0.0), 0.0).status,
                artifacts=({"version": 1, "uri": "/m", "sha256": "ef" * 32},
                           {"version": 2, "uri": "/m", "sha256": SHA},
                           {"version": 3, "uri": "/m", "sha256": "cd" * 32}),
                observed_generation=record.generation)
            store.write_status("digits", record.revision, status=to_plain(status))
            assert process.wait(DEADLINE_S) == 3  # aborted
        finally:
            process.kill()
