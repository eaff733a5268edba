"""Shared fixtures: model repositories built in code and real agent processes."""

from __future__ import annotations

import fcntl
import os
import re

# The test processes' own torch (training, engines in-process) and every
# process they start wait as `tiered` does (tiered.cli.quiet_idle_threads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The workers share two cores: a process's CPU thread pools (torch's) would only
# contend, as the local system's do (tiered.local.supervisor.thread_share).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import shutil
import time
import urllib.request
from collections.abc import Callable
from itertools import zip_longest
from pathlib import Path

import pytest

from tiered import names
from tiered.agent.repository import model_file, write_config
from tiered.local.processes import AgentProcess
from tiered.models import zoo

# Every datatype the identity model carries through the wire and back.
IDENTITY_DATATYPES = tuple(zoo.V2_TO_ONNX)


def build_repository(root: Path) -> Path:
    """The models most integration tests share."""
    zoo.add_sub(model_file(root, "add_sub", 1))
    write_config(root, "add_sub", {
        "max_batch_size": 8,
        # Triton's rule, so that concurrent requests merge even though each
        # batch takes microseconds: an idle engine would run each alone.
        "dynamic_batching": {"max_queue_delay_us": 2000, "preferred_batch_sizes": [8],
                             "wait_when_idle": True},
    })
    zoo.identity(model_file(root, "identity", 1), IDENTITY_DATATYPES)
    write_config(root, "identity", {"max_batch_size": 4, "dynamic_batching": {}})
    zoo.mlp(model_file(root, "mlp", 1), seed=1)
    write_config(root, "mlp", {"max_batch_size": 16})  # no dynamic batching
    # Slow enough (ms per image) that a one-slot queue overflows under load.
    zoo.resnet18(model_file(root, "slow", 1), image_size=96, num_classes=10)
    write_config(root, "slow", {"max_batch_size": 1, "max_queue_size": 1})
    return root


def made_once(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """Folder `name`, filled by `make(folder)` once per test run: under
    pytest-xdist the workers share one copy (the first makes it while the
    others wait on a lock), so a model trained for the session is trained
    once, not once a worker."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, above every worker's own
    folder, done = base / name, base / f"{name}.done"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def answered_and_in_flight(agent: AgentProcess, model: str) -> tuple[int, int]:
    """The requests for `model` the agent has answered and those it holds, from its /metrics."""
    text = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()

    def total(family: str) -> int:
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(f'{family}{{model="{model}"')))

    return total("nv_inference_request_success"), total("tiered_in_flight_requests")


def wait_until_held(agent: AgentProcess, model: str, count: int,
                    timeout_s: float = 30.0) -> tuple[int, int]:
    """Poll until the agent has answered or holds `count` requests for
    `model` (on a busy machine a client may take a while to send them);
    the last (answered, in flight)."""
    deadline = time.monotonic() + timeout_s
    answered, in_flight = answered_and_in_flight(agent, model)
    while answered + in_flight < count and time.monotonic() < deadline:
        answered, in_flight = answered_and_in_flight(agent, model)
    return answered, in_flight


def sigterm_with_calls_in_flight(server, model: str, inputs: list) -> tuple[int, list, int]:
    """60 calls to `model` (one at a time, so many are in flight at the
    signal, and under load many wait in gRPC's queue unread), then one
    SIGTERM through `server.stop()`: (calls in flight at the signal, every
    call's outcome, the server's exit code)."""
    import asyncio

    import tritonclient.grpc.aio as aioclient

    async def main():
        async with aioclient.InferenceServerClient(server.address) as client:
            calls = [asyncio.create_task(client.infer(model, inputs)) for _ in range(60)]
            # The calls leave together, before any answer can come back: once
            # one is answered, all have been sent. 0.1 s more is margin for
            # them to cross loopback; a call the server has not received by
            # the signal could rightly be refused.
            await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(0.1)
            in_flight = sum(not call.done() for call in calls)
            # One SIGTERM: a second one, once the drained server has closed
            # its event loop, would end it by the signal (-15) on its way out.
            stopped = asyncio.create_task(asyncio.to_thread(server.stop))
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            return in_flight, outcomes, await stopped

    try:
        return asyncio.run(main())
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_repository(tmp_path_factory) -> Path:
    return build_repository(tmp_path_factory.mktemp("repository"))


@pytest.fixture(scope="session")
def agent_in_one_process(shared_repository) -> AgentProcess:
    """One edge agent serving the shared repository for the whole session."""
    with AgentProcess("edge", shared_repository) as process:
        yield process
        assert process.alive(), f"the shared agent died:\n{process.log_tail()}"


@pytest.fixture(scope="session")
def agent(agent_in_one_process) -> AgentProcess:
    """The shared agent; a module that tests the protocol overrides this with
    `either_agent`, so that it runs against each way of serving it."""
    return agent_in_one_process


@pytest.fixture(scope="session")
def agent_with_front_ends(shared_repository) -> AgentProcess:
    """The same agent with two front-end processes feeding its engine process."""
    with AgentProcess("edge", shared_repository, extra_args=["--front-ends", "2"]) as process:
        yield process
        assert process.alive(), f"the agent with front ends died:\n{process.log_tail()}"


def either_agent(request) -> AgentProcess:
    """Each agent in turn (as a module's parametrized `agent` fixture): the
    protocol must not depend on how the agent is served."""
    return request.getfixturevalue(
        "agent_in_one_process" if request.param == "one process" else "agent_with_front_ends")


EITHER_AGENT = ("one process", "front ends")


@pytest.fixture(scope="session")
def generative_model(tmp_path_factory) -> Path:
    """A tiny Llama with random weights (it rarely ends a sequence early, and
    4000 tokens of it take seconds, so a long generation holds its slot),
    built by onnxruntime-genai's builder, INT4 on CPU, once per session."""
    import subprocess
    import sys

    pytest.importorskip("onnxruntime_genai")
    from tiered.models.tinyllama import TinyLlama, write_checkpoint

    def make(out: Path) -> None:
        untrained = {"train_steps": 0} if "train_steps" in TinyLlama.__dataclass_fields__ else {}
        shape = TinyLlama(context=4096, layers=4, hidden=256, intermediate=512, **untrained)
        checkpoint = write_checkpoint(out / "checkpoint", shape)
        built = subprocess.run(
            [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(checkpoint),
             "-i", str(checkpoint), "-o", str(out / "model"), "-p", "int4", "-e", "cpu",
             "-c", str(out / "cache")], capture_output=True, text=True)
        assert built.returncode == 0, built.stderr[-2000:]

    return made_once(tmp_path_factory, "generative", make) / "model"


def add_generative(root: Path, name: str, model_dir: Path, config: dict) -> Path:
    """Version 1 of generative model `name` in repository `root`: a copy of `model_dir`."""
    import shutil

    shutil.copytree(model_dir, root / name / "1")
    write_config(root, name, {"backend": "onnxruntime-genai", **config})
    return root


@pytest.fixture(scope="session")
def digits_models(tmp_path_factory) -> Path:
    """The trained digits variants (v1, v2, heavy) and their data files, once per session."""
    from tiered.local.supervisor import prepare_sample_models

    return made_once(tmp_path_factory, "digits-models",
                     lambda out: prepare_sample_models(out, lambda line: None))


@pytest.fixture(scope="session")
def tinyvlm_models(tmp_path_factory) -> Path:
    """The trained tiny vision-language checkpoint v1 (questions about
    digits), its eval and calibration files, and `made.json` (what
    `write_tinyvlm` measured of it), once per session."""
    pytest.importorskip("transformers")
    import dataclasses
    import json

    from tiered.models import tinyvlm

    def make(out: Path) -> None:
        made = {"v1": dataclasses.asdict(tinyvlm.write_tinyvlm(out, "v1"))}
        (out / "made.json").write_text(json.dumps(made, default=str))

    return made_once(tmp_path_factory, "tinyvlm-models", make)


@pytest.fixture(scope="session")
def tinyvlm_repositories(tinyvlm_models, tmp_path_factory) -> Path:
    """tinyvlm v1 built whole by the real `tiered build` for the edge (vision
    stage INT8, decoder INT4 on onnxruntime-genai), the regional tier (vision
    stage FP16, decoder on onnxruntime-genai: FP32 on a CPU) and the
    datacenter (vision stage FP16, decoder on the torch engine): `<tier>/` is
    each repository (model `tinyvlm`, version 1), `<tier>.json` the build's
    report, once per session."""
    import subprocess
    import sys

    from tiered.models import tinyvlm

    def make(out: Path) -> None:
        for tier in names.TIERS:
            done = subprocess.run(
                [sys.executable, "-m", "tiered", "build", str(tinyvlm_models / "tinyvlm-v1"),
                 "--tier", tier, "--model", "tinyvlm", "--version", "1",
                 "--repository", str(out / tier),
                 "--eval", str(tinyvlm_models / tinyvlm.EVAL_FILE),
                 "--calibration", str(tinyvlm_models / tinyvlm.CALIBRATION_FILE)],
                capture_output=True, text=True, timeout=600, check=False)
            assert done.returncode == 0, done.stderr[-3000:]
            (out / f"{tier}.json").write_text(done.stdout)

    return made_once(tmp_path_factory, "tinyvlm-repositories", make)


@pytest.fixture(scope="session")
def tinyllama_models(tmp_path_factory) -> Path:
    """The trained tiny Llama checkpoints (v1, v2, v3) and tinyllama-eval.json,
    once per session."""
    pytest.importorskip("transformers")
    from tiered.models import tinyllama

    def make(out: Path) -> None:
        for variant in tinyllama.VARIANTS:
            tinyllama.write_tinyllama(out, variant)

    return made_once(tmp_path_factory, "tinyllama-models", make)


# `make test` runs the tests on pytest-xdist workers, scheduled by
# `pytest_xdist_make_scheduler` below: each file is one scope, whole on one
# worker, so its module fixtures (a local system, an agent) start once and
# its tests keep their order. The files that run whole local systems through
# rollouts judged on real latencies are two scopes, each scope's files one
# after another on one worker: one system at a time per worker, two at most
# on the two cores. The walkthrough, the longest file, is a scope alone; the
# other four together take about as long. They start first; the generative
# one leads, so that another worker trains the digits models the others need
# meanwhile. The bench smoke tests are independent, each starting its own
# processes: they are shared out one by one. The other long files follow.
LOCAL_SYSTEMS = (("test_local_generative.py", "test_local_system.py", "test_chaos.py",
                  "test_autoscaling.py"),
                 ("test_walkthrough.py", "test_local_vision_language.py"))
SPREAD_FILES = ("test_bench_smoke.py",)
LONG_FILES = ("test_both_backends.py", "test_background_builds.py", "test_kube_controller.py")


def scope_of(nodeid: str) -> str:
    """The scope a test runs in: one worker runs a scope's tests in order."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    for index, files in enumerate(LOCAL_SYSTEMS):
        if name in files:
            return f"local systems {index}"
    return nodeid if name in SPREAD_FILES else path


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False  # xdist's default puts scopes of many tests first
    return ByScope(config, log)


# The session's models, made once a run (`made_once`): the first test to ask
# for one, or one waiting on its lock while another worker makes it, spends
# its setup on the making (minutes on two busy cores), which pytest-timeout
# counts. Such tests get MAKING_TIMEOUT_S unless they set their own.
SESSION_MADE = frozenset({"digits_models", "tinyllama_models", "tinyvlm_models",
                          "tinyvlm_repositories"})
MAKING_TIMEOUT_S = 900


def pytest_collection_modifyitems(config, items) -> None:
    first = (*(name for row in zip_longest(*LOCAL_SYSTEMS) for name in row if name),
             *SPREAD_FILES,
             *LONG_FILES)  # the longest start first
    items.sort(key=lambda item: first.index(item.path.name) if item.path.name in first
               else len(first))  # a stable sort: each file's order is kept
    for item in items:
        if item.get_closest_marker("timeout") is None \
                and SESSION_MADE.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.timeout(MAKING_TIMEOUT_S))


def frames_fed(agent: AgentProcess) -> dict[str, float]:
    """Requests an agent's front ends passed on, by frame, from its /metrics."""
    text = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
    return {kind: float(value) for kind, value in re.findall(
        r'^tiered_front_end_requests_total{frame="(\w+)".*} (\S+)$', text, re.M)}


def children(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (started by any of its threads)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def exited(pid: int) -> bool:
    """Gone, or exited and not yet reaped (a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def engine_processes(agent) -> dict[str, list[int]]:
    """The agent's engine processes (of devices and engine cores), by the
    model they run."""
    found: dict[str, list[int]] = {}
    for pid in children(agent.pid):
        try:
            model = environ_of(pid).get("TIERED_ENGINE", "").split(" v")[0]
        except OSError:
            continue
        if model:
            found.setdefault(model, []).append(pid)
    return found


def environ_of(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)
