"""Faults: what breaks around a running system, and what must hold when it does.

(a) An agent killed (SIGKILL) under a stream of requests through the router,
    with a second agent on the tier: every streamed request gets an answer or
    an error message, the stream goes on, and the next stream works. (Unary
    traffic through the same kill is tests/integration/test_router.py's.) A
    stream straight to an agent that dies ends with an error, never a hang.
(b) The routing table file replaced by a truncated table, an empty file and
    binary garbage: the router keeps serving with the last good table, logs
    each rejection, and loads a good table written afterwards. (A table with
    an invalid field is test_router.py's.)
(c) The local state store on a file corrupted while in use, on a full disk
    (a tiny tmpfs) and on a read-only file system (a read-only bind mount):
    errors are ConfigError naming the file, nothing crashes, and a store on a
    restored copy has the last good records. The mounts are made in a private
    mount namespace (`unshare -m`); where that is not allowed they skip.
(d) A corrupt artifact: `tiered build` of a truncated ONNX file fails with a
    clear message and writes nothing; a wrong `--sha256` refuses before building.

Where traffic is involved the tests count requests sent, answered and lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from tiered.agent.repository import model_file, write_config
from tiered.controller.store import StateStore
from tiered.errors import ConfigError
from tiered.local.processes import AgentProcess, RouterProcess
from tiered.models import zoo

WINDOW = 4  # streamed requests in flight at once
STREAM_DEADLINE_S = 60.0



@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults-repository")
    # A few ms per image: requests are in flight when an agent is killed.
    zoo.resnet18(model_file(root, "slow", 1), image_size=64, num_classes=10)
    write_config(root, "slow", {"max_batch_size": 1, "engine": {"intra_op_threads": 1}})
    return root


@pytest.fixture(scope="module")
def agents(repository):
    started = [AgentProcess("edge", repository).start() for _ in range(2)]
    yield started
    for process in started:
        process.stop()


def table_of(version: int, agents) -> dict:
    return {"version": version, "models": {"slow": {"tiers": {"edge": {
        "agents": [a.address for a in agents], "stable": 1}}}}}


def replace(path: Path, data: bytes) -> None:
    staging = path.with_suffix(".tmp")
    staging.write_bytes(data)
    os.replace(staging, path)


@pytest.fixture(scope="module")
def table_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults-router") / "routing.yaml"


@pytest.fixture(scope="module")
def router(agents, table_path):
    replace(table_path, json.dumps(table_of(1, agents)).encode())
    with RouterProcess(table_path) as process:
        yield process
        assert process.alive(), process.log_tail()


def table_version(router) -> float:
    text = urllib.request.urlopen(router.metrics_url, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("tiered_router_table_version "):
            return float(line.split()[1])
    raise AssertionError("no tiered_router_table_version")


def image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((1, 3, 64, 64), dtype=np.float32)


def sync_inputs() -> list[grpcclient.InferInput]:
    item = grpcclient.InferInput("input", [1, 3, 64, 64], "FP32")
    item.set_data_from_numpy(image())
    return [item]


class Traffic:
    """Unary requests from a thread until stopped, counted."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sent = self.answered = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        inputs = sync_inputs()
        with grpcclient.InferenceServerClient(self.address) as client:
            while not self._stop.is_set():
                self.sent += 1
                try:
                    client.infer("slow", inputs, client_timeout=10)
                    self.answered += 1
                except InferenceServerException as error:
                    self.failures.append(f"{error.status()}: {error.message()}")
                time.sleep(0.01)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "a request hung"


# -- (b) the routing table file ---------------------------------------------------------


def test_a_broken_table_file_keeps_the_last_good_table(router, agents, table_path):
    good = json.dumps(table_of(2, agents), indent=1).encode()
    replace(table_path, good)
    deadline = time.monotonic() + 15
    while table_version(router) != 2:
        assert time.monotonic() < deadline, router.log_tail()
        time.sleep(0.1)
    as_yaml = b"version: 3\nmodels:\n  slow:\n    tiers:\n      edge:\n        agen"
    broken = {
        "truncated JSON": good[: len(good) // 2],
        "truncated YAML": as_yaml,
        "empty": b"",
        "binary garbage": bytes(np.random.default_rng(1).integers(0, 256, 4096,
                                                                  dtype=np.uint8)),
    }
    with Traffic(router.address) as traffic:
        for what, data in broken.items():
            rejections = router.log().count("routing table rejected")
            replace(table_path, data)
            deadline = time.monotonic() + 15
            while router.log().count("routing table rejected") == rejections:
                assert time.monotonic() < deadline, f"{what}: not rejected\n{router.log_tail()}"
                time.sleep(0.1)
            assert table_version(router) == 2, what
            answered = traffic.answered
            deadline = time.monotonic() + 10
            while traffic.answered == answered:  # still serving with the last good table
                assert time.monotonic() < deadline, f"{what}: no answers\n{router.log_tail()}"
                time.sleep(0.05)
        replace(table_path, json.dumps(table_of(7, agents)).encode())
        deadline = time.monotonic() + 15
        while table_version(router) != 7:
            assert time.monotonic() < deadline, f"good table not loaded\n{router.log_tail()}"
            time.sleep(0.1)
        time.sleep(0.5)
    print(f"table faults: sent {traffic.sent} answered {traffic.answered} "
          f"failed {len(traffic.failures)}")
    assert not traffic.failures, traffic.failures[:3]
    assert traffic.sent - traffic.answered <= 0  # nothing lost
    assert traffic.answered > 10
    assert router.log().count("routing table rejected") >= len(broken)
    assert router.alive()


# -- (a) an agent killed under a stream --------------------------------------------------


class StreamTally:
    def __init__(self) -> None:
        self.sent = self.answered = 0
        self.errors: list[str] = []
        self.broken: str | None = None  # the stream itself ended with this error
        self.answered_after_kill = 0


async def stream(address: str, seconds: float, kill=None, kill_at_s: float = 1.0
                 ) -> StreamTally:
    """Stream requests (WINDOW in flight) for `seconds`; call `kill` part-way."""
    tally = StreamTally()
    window = asyncio.Semaphore(WINDOW)
    killed = asyncio.Event()
    started = time.monotonic()
    array = image()

    async def requests():
        index = 0
        while time.monotonic() - started < seconds:
            await window.acquire()
            if kill is not None and not killed.is_set() and time.monotonic() - started > kill_at_s:
                kill()
                killed.set()
            item = aioclient.InferInput("input", [1, 3, 64, 64], "FP32")
            item.set_data_from_numpy(array)
            tally.sent += 1
            index += 1
            yield {"model_name": "slow", "inputs": [item], "request_id": str(index)}

    async with aioclient.InferenceServerClient(address) as client:
        responses = client.stream_infer(requests(), stream_timeout=STREAM_DEADLINE_S)
        try:
            async for result, error in responses:
                window.release()
                if error is not None:
                    tally.errors.append(error.message())
                else:
                    tally.answered += 1
                    tally.answered_after_kill += killed.is_set()
        except Exception as error:  # noqa: BLE001 -- the stream broke: record how
            code = error.code() if hasattr(error, "code") else ""
            tally.broken = f"{type(error).__name__}: {code}"
    return tally


def test_a_stream_through_the_router_outlives_a_killed_agent(router, agents, table_path):
    replace(table_path, json.dumps(table_of(8, agents)).encode())
    deadline = time.monotonic() + 15
    while table_version(router) != 8:
        assert time.monotonic() < deadline, router.log_tail()
        time.sleep(0.1)
    doomed, survivor = agents
    started = time.monotonic()
    first = asyncio.run(stream(router.address, 4.0, kill=doomed.kill, kill_at_s=1.5))
    took_s = time.monotonic() - started
    second = asyncio.run(stream(router.address, 1.5))
    report = (f"stream across the kill: sent {first.sent} answered {first.answered} "
              f"errors {len(first.errors)} (lost {first.sent - first.answered - len(first.errors)}"
              f") broken {first.broken} in {took_s:.1f} s; next stream: sent {second.sent} "
              f"answered {second.answered} errors {len(second.errors)}")
    print(report)
    assert not doomed.alive() and survivor.alive()
    assert first.broken is None, report  # the stream to the router goes on
    assert first.sent == first.answered + len(first.errors), report  # nothing lost
    assert len(first.errors) <= WINDOW, report  # at most the requests in flight
    assert all("UNAVAILABLE" in e or "unavailable" in e.lower() for e in first.errors), report
    assert first.answered_after_kill > 0, report
    assert took_s < 4.0 + 10, report
    assert second.broken is None and not second.errors, report
    assert second.sent == second.answered > 0, report
    assert router.alive()


def test_a_stream_straight_to_a_dying_agent_ends_with_an_error(repository):
    with AgentProcess("edge", repository) as victim:
        started = time.monotonic()
        tally = asyncio.run(stream(victim.address, 30.0, kill=victim.kill, kill_at_s=1.0))
        took_s = time.monotonic() - started
    report = (f"direct stream: sent {tally.sent} answered {tally.answered} "
              f"unanswered {tally.sent - tally.answered} broken {tally.broken} "
              f"in {took_s:.1f} s")
    print(report)
    # The stream ends with the transport's error (UNAVAILABLE, or INTERNAL when the
    # client was sending as the connection dropped): its in-flight requests are not lost
    # silently, and nothing waits for the stream's deadline.
    assert tally.broken is not None and tally.broken.startswith("AioRpcError"), report
    assert tally.sent - tally.answered - len(tally.errors) <= WINDOW, report
    assert took_s < 15, report  # ended by the error, not by the 30 s of sending


# -- (c) the local state store -----------------------------------------------------------


def fill(store: StateStore, models: int = 8) -> dict:
    for index in range(models):
        record = store.apply(f"m{index}", {"artifact": {"uri": f"m{index}.onnx"}, "n": index})
        store.write_status(f"m{index}", record.revision, status={"message": "ok"})
        store.record(f"m{index}", {"stage": index})
    return {r.name: (r.spec, r.status, r.revision) for r in store.list()}


def operations(store: StateStore) -> dict:
    return {
        "apply": lambda: store.apply("new", {"n": -1}),
        "get": lambda: store.get("m1"),
        "list": lambda: store.list(),
        "write_status": lambda: store.write_status("m1", store.get("m1").revision,
                                                   status={}),
        "record": lambda: store.record("m1", {"stage": 99}),
        "history": lambda: store.history("m1"),
        "delete": lambda: store.delete("m2"),
    }


def test_a_store_corrupted_in_use_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "state.db"
    store = StateStore(path)
    good = fill(store)
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the records now live in the file
    restored = tmp_path / "restored.db"
    copy = sqlite3.connect(restored)
    store._db.backup(copy)  # the last good copy, as a backup would have it
    copy.close()
    size = path.stat().st_size
    with path.open("r+b") as file:  # garbage over everything past the header page
        file.seek(4096)
        file.write(np.random.default_rng(2).integers(0, 256, size - 4096,
                                                     dtype=np.uint8).tobytes())
    # Another process (a verb, a restarted controller) opening it: refused by name.
    with pytest.raises(ConfigError, match=str(path)):
        StateStore(path).list()
    # The CLI on it (while the controller still has it open): a message naming
    # the file, no traceback.
    verb = subprocess.run([sys.executable, "-m", "tiered", "get", "--state", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert verb.returncode != 0 and str(path) in verb.stderr, verb.stderr
    assert "Traceback" not in verb.stderr, verb.stderr
    # The connection that was open when it happened: SQLite may answer from its
    # cache; whatever it does, it is a result or a ConfigError naming the file.
    outcomes = {}
    for name, operation in operations(store).items():
        try:
            operation()
            outcomes[name] = "ok"
        except ConfigError as error:
            assert str(path) in str(error), error
            outcomes[name] = "ConfigError"
    print(f"store corrupted in use: open connection {outcomes}; verb: {verb.stderr.strip()}")
    store.close()
    # Restored from the copy: every last good record is there.
    with StateStore(restored) as again:
        assert {r.name: (r.spec, r.status, r.revision) for r in again.list()} == good
        assert [s for _, _, s in again.history("m3")] == [{"stage": 3}]


NAMESPACE_SCRIPT = textwrap.dedent("""
    import json, subprocess, sys
    from pathlib import Path
    from tiered.controller.store import StateStore
    from tiered.errors import ConfigError

    directory, mode = Path(sys.argv[1]), sys.argv[2]
    path, out = directory / "state.db", {}

    def attempt(name, operation):
        try:
            operation()
            out[name] = "ok"
        except ConfigError as error:
            out[name] = "ConfigError: " + str(error)
        except Exception as error:
            out[name] = f"CRASH {type(error).__name__}: {error}"

    if mode == "full":  # a 512 KiB file system, filled up while the store is in use
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(directory)],
                       check=True)
        store = StateStore(path)
        for index in range(3):
            store.apply(f"m{index}", {"n": index})
        filler = directory / "filler"
        try:
            with open(filler, "wb") as file:
                while True:
                    file.write(bytes(4096))
                    file.flush()
        except OSError as error:
            out["filler"] = error.strerror
        big = {"blob": "x" * (256 << 10)}
        attempt("apply", lambda: store.apply("big", big))
        attempt("record", lambda: store.record("m0", big))
        attempt("write_status", lambda: store.write_status(
            "m0", store.get("m0").revision, status=big))
        attempt("delete", lambda: store.delete("m1"))
        attempt("get", lambda: store.get("m1"))
        attempt("list", lambda: store.list())
        filler.unlink()  # space again: the store carries on
        attempt("apply after", lambda: store.apply("m3", {"n": 3}))
        out["names"] = [r.name for r in store.list()]
    else:  # the directory mounted read-only over itself
        subprocess.run(["mount", "--bind", "-o", "ro", str(directory), str(directory)],
                       check=True)
        attempt("open", lambda: StateStore(path).list())
    print(json.dumps(out))
""")


def in_namespace(directory: Path, mode: str) -> dict:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    probe = subprocess.run([unshare, "-m", "--propagation", "private", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    done = subprocess.run([unshare, "-m", "--propagation", "private", sys.executable, "-c",
                           NAMESPACE_SCRIPT, str(directory), mode],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_store_on_a_full_disk_refuses_writes_and_keeps_its_records(tmp_path):
    outcome = in_namespace(tmp_path, "full")
    print(f"store on a full disk: {outcome}")
    assert outcome["filler"] == "No space left on device", outcome
    path = str(tmp_path / "state.db")
    for write in ("apply", "record", "write_status", "delete"):
        assert outcome[write].startswith(f"ConfigError: state store {path}"), outcome
        assert "full" in outcome[write], outcome
    assert outcome["get"] == outcome["list"] == "ok", outcome
    assert outcome["apply after"] == "ok", outcome
    assert outcome["names"] == ["m0", "m1", "m2", "m3"], outcome  # the refused delete held


def test_a_store_on_a_read_only_file_system_is_refused_naming_the_file(tmp_path):
    with StateStore(tmp_path / "state.db") as store:
        good = fill(store)
    outcome = in_namespace(tmp_path, "read-only")
    print(f"store on a read-only file system: {outcome}")
    assert outcome["open"].startswith(f"ConfigError: state store {tmp_path / 'state.db'}"), \
        outcome
    with StateStore(tmp_path / "state.db") as store:  # writable again: all there
        assert {r.name: (r.spec, r.status, r.revision) for r in store.list()} == good


# -- (d) a corrupt artifact --------------------------------------------------------------


def build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiered", "build", *args],
                          capture_output=True, text=True, timeout=120)


def test_a_truncated_artifact_fails_the_build_and_writes_nothing(tmp_path):
    whole = zoo.mlp(tmp_path / "mlp.onnx", seed=1)
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    repository = tmp_path / "repository"
    repository.mkdir()
    done = build(str(truncated), "--tier", "regional", "--repository", str(repository),
                 "--model", "mlp", "--version", "1")
    assert done.returncode != 0, done.stdout
    message = [line for line in done.stderr.splitlines() if line.startswith("tiered build:")]
    assert message and str(truncated) in message[0] and "cannot load" in message[0], done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert list(repository.iterdir()) == []


def test_a_wrong_sha256_refuses_before_building(tmp_path):
    whole = zoo.mlp(tmp_path / "mlp.onnx", seed=1)
    repository = tmp_path / "repository"
    repository.mkdir()
    wrong = "0" * 64
    started = time.monotonic()
    done = build(str(whole), "--sha256", wrong, "--tier", "regional", "--repository",
                 str(repository), "--model", "mlp", "--version", "1")
    assert done.returncode != 0
    assert f"not the expected {wrong}; refusing to build it" in done.stderr, done.stderr
    assert done.stdout == ""  # no build report: it never built
    assert list(repository.iterdir()) == []
    print(f"wrong sha256 refused in {time.monotonic() - started:.1f} s")
