"""A vision-language TieredModel on the local system, end to end: `tiered
up`'s processes (an agent on the edge and one in the datacenter, the router,
the controller), examples/tinyvlm.yaml applied with `tiered apply` (its
artifact the trained tinyvlm checkpoint, a directory), both stages built for
each tier in the background and served, and questions about held-out digits
sent with the real tritonclient through the router while a rollout is judged.

- v1 serves on both tiers and answers the digits through the router.
- A version whose vision stage regressed (v1 with noise in its projector: its
  builds pass, since each is faithful to its own checkpoint, but it answers
  differently) is rolled back in its first stage on the answers the router's
  shadows compare, and no client request fails.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.integration.test_local_generative import tiered
from tiered import names
from tiered.controller.host.state import StateLayout
from tiered.controller.reconciler import decode_status
from tiered.controller.store import StateStore
from tiered.demo.rollouts import answer_text, ask_streamed
from tiered.local.supervisor import ControllerSettings, LocalSystem, LocalUp, RouterPorts
from tiered.models import tinyvlm

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("tritonclient.grpc")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tinyvlm.yaml"
MODEL, QUESTION = "tinyvlm", "what digit is this?"


def spec(checkpoint: Path, models: Path) -> dict:
    """examples/tinyvlm.yaml (its stages and analysis as users get them) on
    the edge and the datacenter, pointing at `checkpoint` and the session's
    data files."""
    document = yaml.safe_load(EXAMPLE.read_text())
    # Two of its three tiers (the regional tier serves as the edge does, in
    # FP32 on a CPU: `make demo` asks it), so that each version builds twice.
    del document["spec"]["tiers"]["regional"]
    for stage in document["spec"]["rollout"]["stages"]:
        stage["weights"].pop("regional", None)
    document["spec"]["artifact"] = {"uri": str(checkpoint),
                                    "eval": str(models / tinyvlm.EVAL_FILE),
                                    "calibration": str(models / tinyvlm.CALIBRATION_FILE)}
    return document


def noisy_projector(checkpoint: Path, out: Path, scale: float = 4.0) -> Path:
    """A copy of the checkpoint whose projector's weights carry noise (at 4x their
    own spread it answers 29% of held-out digits as the checkpoint does, and
    its builds still pass: each is judged against its own checkpoint)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(checkpoint, out)
    tensors = load_file(out / "model.safetensors")
    rng = np.random.default_rng(7)
    for name, value in tensors.items():
        if "multi_modal_projector" in name:
            tensors[name] = (value + rng.standard_normal(value.shape).astype(value.dtype)
                             * value.std() * scale)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    local = LocalUp(LocalSystem(state_dir=str(state), tiers=("edge", "datacenter"),
                                router=RouterPorts(port=0),
                                controller=ControllerSettings(interval_s=1.0)),
                    state, progress=lambda line: None)
    try:
        running = local.start()
        with StateStore(StateLayout(state).store) as store:
            yield local, running, state, store
    finally:
        local.stop()


def apply(state: Path, document: dict) -> None:
    path = state / "spec.yaml"
    path.write_text(yaml.safe_dump(document))
    assert f"tieredmodel/{MODEL}" in tiered(state, "apply", "-f", str(path)).stdout


def rollout_of(local: LocalUp, store: StateStore, done, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        local.restart_dead()
        rollout = decode_status(MODEL, store.get(MODEL).status).rollout
        if done(rollout):
            return rollout
        time.sleep(0.5)
    raise AssertionError(f"timed out: {decode_status(MODEL, store.get(MODEL).status)}")


def ask(router: str, image: np.ndarray, headers=None) -> str:
    return answer_text(ask_streamed(router, MODEL, QUESTION, headers, image=image))


class Questions:
    """Questions about held-out digits through the router, `workers` at a
    time, until stopped; every outcome counted."""

    def __init__(self, router: str, images: np.ndarray, workers: int = 4) -> None:
        self.router, self.images = router, images
        self.outcomes: Counter = Counter()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(workers)]

    def _run(self, worker: int) -> None:
        index = worker
        while not self.stop.is_set():
            try:
                ask(self.router, self.images[index % len(self.images)])
                self.outcomes["ok"] += 1
            except Exception as error:  # noqa: BLE001 -- counted, and the test fails on it
                self.outcomes[type(error).__name__] += 1
            index += len(self.threads)
            time.sleep(0.05)

    def __enter__(self) -> Questions:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


@pytest.mark.timeout(600)
def test_v1_serves_and_a_regressed_vision_stage_is_rolled_back_in_its_first_stage(
        system, tinyvlm_models, tmp_path):
    local, running, state, store = system
    apply(state, spec(tinyvlm_models / "tinyvlm-v1", tinyvlm_models))
    rollout_of(local, store, lambda r: r is not None and r.stable_version == 1, 300)
    data = np.load(tinyvlm_models / tinyvlm.EVAL_FILE)
    images, labels = data["image"][:40], data["label"][:40]
    for tier in ("edge", "datacenter"):
        deadline = time.monotonic() + 60
        while True:  # the routing table names the tier once its agent serves v1
            try:
                said = [ask(running.router, image, {"tiered-tier": tier,
                                                    "tiered-tier-strict": "true"})
                        for image in images[:10]]
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(1.0)
        right = sum(a == tinyvlm.NUMBER_WORDS[int(b)] for a, b in zip(said, labels,
                                                                     strict=False))
        assert right >= 8, (tier, said)

    apply(state, spec(noisy_projector(tinyvlm_models / "tinyvlm-v1", tmp_path / "noisy"),
                      tinyvlm_models))
    rollout_of(local, store, lambda r: r.canary_version == 2, 300)
    with Questions(running.router, images) as questions:
        ended = rollout_of(local, store, lambda r: r.phase != names.Phase.PROGRESSING, 240)
    assert (ended.phase, ended.stable_version, ended.stage_index) == (
        names.Phase.ROLLED_BACK, 1, 0), ended.message
    assert "agreement" in ended.message, ended.message
    assert set(questions.outcomes) == {"ok"} and questions.outcomes["ok"] > 40, \
        questions.outcomes
