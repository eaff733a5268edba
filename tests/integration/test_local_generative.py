"""A generative TieredModel on the local system, end to end: `tiered up`'s
processes (an agent per tier, the router, the controller), the spec of
examples/tinyllama.yaml applied with `tiered apply` (its artifact a checkpoint
directory, pinned by the digest of its files), every tier's build made in the
background and loaded, and traffic from `tiered load` (text prompts, greedy,
part streamed and part whole) through the router while each rollout is judged.

- v1 is built and served on the three tiers, and answers through the router.
- v2 (the same greedy output) is promoted through both stages, judged on the
  agents' token telemetry and the router's shadowed greedy agreement.
- v3 (several times the compute per token) is rolled back on time to first
  token or time per output token.
- Every request `tiered load` sent is answered.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tiered import names
from tiered.controller.host.state import StateLayout
from tiered.controller.reconciler import decode_status
from tiered.controller.store import StateStore
from tiered.local.processes import interruptible
from tiered.local.supervisor import ControllerSettings, LocalSystem, LocalUp, RouterPorts

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("tritonclient.grpc")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tinyllama.yaml"
MODEL = "tinyllama"


def spec(variant: str, models: Path) -> dict:
    """examples/tinyllama.yaml (its stages and analysis as users get them),
    pointing at the session's checkpoints."""
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["artifact"] = {"uri": str(models / f"tinyllama-{variant}"),
                                    "eval": str(models / "tinyllama-eval.json")}
    return document


@pytest.fixture(scope="module")
def system(tmp_path_factory, tinyllama_models):
    state = tmp_path_factory.mktemp("state")
    local = LocalUp(LocalSystem(state_dir=str(state), router=RouterPorts(port=0),
                                # a pass a second: the analysis runs every 3 s
                                controller=ControllerSettings(interval_s=1.0)),
                    state, progress=lambda line: None)
    try:
        running = local.start()
        yield local, running, state
    finally:
        local.stop()


@pytest.fixture(scope="module")
def store(system):
    _, _, state = system
    with StateStore(StateLayout(state).store) as opened:
        yield opened


@pytest.fixture(scope="module")
def served(system, store, tinyllama_models):
    """v1 built on every tier, loaded and routed."""
    local, running, state = system
    apply(state, spec("v1", tinyllama_models))
    wait_for(local, store, lambda s: s is not None and s.stable_version == 1, 240)
    deadline = time.monotonic() + 240
    while next(c for c in status_of(store).conditions if c.type == "Ready").status != "True":
        assert time.monotonic() < deadline, status_of(store)
        time.sleep(0.5)
    return running


@contextlib.contextmanager
def traffic(router: str, models: Path):
    """`tiered load` through the router while a rollout is judged; every
    request it sent is answered.

    It starts once the canary serves: a rollout starts when its version is
    built and loaded on every tier, and the builds need no traffic. Its rate
    paces the stages: each waits for ~200 stable samples on every tier it
    judges (enough to bound stable's p95 at the example's confidence), and
    stable gets 70% of a tier's third of the load: at 40 requests/s a stage
    takes ~21 s, at 20 it took ~43 s."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tiered", "load", MODEL, "--router", router,
         "--rate", "40", "--max-tokens", "8", "--stream-share", "0.3", "--timeout", "20",
         "--tier", "edge,regional,datacenter",  # clients at every tier
         "--inputs", str(models / "tinyllama-eval.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=interruptible())
    try:
        yield
    except BaseException:
        process.kill()
        process.communicate()
        raise
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    lines = out.splitlines()
    assert process.returncode == 0, out[-3000:] + err[-3000:]
    total = re.match(r"total: sent (\d+)  ok (\d+)  errors 0  tok/s [\d.]+  ttft p50 [\d.]+ ms",
                     lines[-1])
    assert total and total[1] == total[2] and int(total[2]) > 100, lines[-3:]


def tiered(state: Path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "tiered", *args, "--state", str(state)],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def apply(state: Path, document: dict) -> None:
    path = state / "spec.yaml"
    path.write_text(yaml.safe_dump(document))
    assert f"tieredmodel/{MODEL}" in tiered(state, "apply", "-f", str(path)).stdout


def status_of(store: StateStore):
    return decode_status(MODEL, store.get(MODEL).status)


def wait_for(local: LocalUp, store: StateStore, done, timeout_s: float):
    """The rollout once `done(rollout)`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        local.restart_dead()
        rollout = status_of(store).rollout
        if done(rollout):
            return rollout
        time.sleep(0.5)
    raise AssertionError(f"timed out; status {status_of(store)}")


def test_v1_is_pinned_by_its_files_and_served_on_every_tier(system, store, served,
                                                            tinyllama_models):
    from tiered.files import sha256_tree

    local, running, state = system
    stored = store.get(MODEL).spec["spec"]["artifact"]
    assert stored["sha256"] == sha256_tree(tinyllama_models / "tinyllama-v1")
    for tier in ("edge", "regional", "datacenter"):
        config = yaml.safe_load((StateLayout(state).repository(tier) / MODEL /
                                 "config.yaml").read_text())
        assert config["version_policy"] == {"specific": [1]} and "max_batch_size" not in config
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(running.router)
    prompt = grpcclient.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"the quick brown"], dtype=object))
    for tier in ("edge", "regional", "datacenter"):
        answer = client.infer(MODEL, [prompt], parameters={"max_tokens": 8},
                              headers={"tiered-tier": tier, "tiered-tier-strict": "true"})
        assert answer.as_numpy("text_output")[0].decode().startswith(" fox jumps"), tier


@pytest.mark.timeout(600)  # three generative builds, then two stages: beside other workers
def test_the_same_greedy_output_is_promoted(system, store, served, tinyllama_models):
    local, _, state = system
    apply(state, spec("v2", tinyllama_models))
    wait_for(local, store, lambda s: s.canary_version == 2, 300)
    with traffic(served.router, tinyllama_models):
        ended = wait_for(local, store, lambda s: s.phase != names.Phase.PROGRESSING, 240)
    assert (ended.phase, ended.stable_version) == (names.Phase.PROMOTED, 2), ended.message
    status = tiered(state, "rollout", "status", MODEL).stdout
    assert "promote: stage 2/2 'everywhere' passed" in status, status
    assert "tpot_p95 on edge: Successful" in status and "agreement: Successful" in status


@pytest.mark.timeout(600)
def test_a_slower_version_is_rolled_back_on_token_latency(system, store, served,
                                                          tinyllama_models):
    local, _, state = system
    apply(state, spec("v3", tinyllama_models))
    wait_for(local, store, lambda s: s.canary_version == 3, 300)
    with traffic(served.router, tinyllama_models):
        ended = wait_for(local, store, lambda s: s.phase != names.Phase.PROGRESSING, 180)
    assert (ended.phase, ended.stable_version) == (names.Phase.ROLLED_BACK, 2), ended.message
    assert re.search(r"failed .*(ttft_p95|ttft_shift|tpot_p95) on \w+", ended.message), \
        ended.message


def test_the_examples_differ_in_their_checkpoint_only():
    """examples/tinyllama-v2.yaml and -v3.yaml (the demo's generative act) are
    tinyllama.yaml with another checkpoint: a rollout judges the model alone."""
    base = yaml.safe_load(EXAMPLE.read_text())
    assert base["spec"]["kind"] == "generative"
    for variant in ("v2", "v3"):
        other = yaml.safe_load(EXAMPLE.with_name(f"tinyllama-{variant}.yaml").read_text())
        assert other["spec"]["artifact"]["uri"].endswith(f"tinyllama-{variant}")
        other["spec"]["artifact"] = base["spec"]["artifact"]
        assert other == base
