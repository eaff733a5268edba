"""Autoscaling on the local system, real processes end to end: load through
the router scales the edge tier's agents up (each a process of its own, in
the routing table once it serves); without load it scales down after its
window and, idle, goes to zero while the regional tier carries what edge
did; a request hinted to edge then wakes it, and one kept to edge waits for
it to wake and is answered there. Every client request is answered."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.integration.test_local_system import apply, status_of
from tiered.controller.host.state import RunningSystem, StateLayout
from tiered.controller.store import StateStore
from tiered.demo.rollouts import Traffic
from tiered.local.supervisor import ControllerSettings, LocalSystem, LocalUp, RouterPorts

pytest.importorskip("tritonclient.grpc")

MAX_EDGE = 3
STRICT_EDGE = {"tiered-tier": "edge", "tiered-tier-strict": "true"}
EDGE = {"autoscaling": {"max_replicas": MAX_EDGE, "target": 0.01, "scale_down_window_s": 3,
                        "scale_to_zero": True, "idle_s": 6},
        "batching": {"max_batch_size": 1}}


def spec(models: Path) -> dict:
    return {
        "apiVersion": "tiered.dev/v1alpha1", "kind": "TieredModel",
        "metadata": {"name": "digits"},
        "spec": {
            "artifact": {"uri": str(models / "digits-v2.onnx"),
                         "calibration": str(models / "digits-calibration.npz"),
                         "eval": str(models / "digits-eval.npz")},
            "tiers": {"edge": EDGE, "regional": {"batching": {"max_batch_size": 1}}},
            "rollout": {"stages": [{"name": "edge", "weights": {"edge": 50}}]},
        },
    }


@pytest.fixture(scope="module")
def system(tmp_path_factory, digits_models):
    state = tmp_path_factory.mktemp("autoscaling")
    lines: list[str] = []
    local = LocalUp(LocalSystem(state_dir=str(state), tiers=("edge", "regional"),
                                router=RouterPorts(port=0),
                                controller=ControllerSettings(interval_s=0.5)),
                    state, progress=lines.append)
    try:
        running = local.start()
        with StateStore(StateLayout(state).store) as store:
            yield local, running, state, store, lines
    finally:
        local.stop()


def edge_agents(state: Path) -> tuple[str, ...]:
    system = RunningSystem.read(StateLayout(state).system)
    assert system is not None
    return system.agents.get("edge", ())


def wait_for(local: LocalUp, done, timeout_s: float, what: str, store=None) -> None:
    """Supervise (as `tiered up` does) until `done()`; the status says why not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        local.restart_dead()
        local.follow_scale()
        if done():
            return
        time.sleep(0.2)
    said = status_of(store).scaling if store is not None else ""
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}: {said}")


def test_load_scales_edge_up_then_down_to_zero_and_no_request_fails(system, digits_models):
    local, running, state, store, lines = system
    apply(state, spec(digits_models))
    wait_for(local, lambda: (s := status_of(store).rollout) is not None and
             s.stable_version == 1, 120, "version 1 to serve")
    images = np.load(digits_models / "digits-eval.npz")["input"]
    wait_for(local, lambda: served_by(running.router, images[:1]) == "edge", 60,
             "the router to route edge")
    load = Traffic(running.router, images, rate_per_s=40.0)
    load.start()
    try:
        wait_for(local, lambda: len(edge_agents(state)) == MAX_EDGE, 90,
                 f"{MAX_EDGE} edge agents", store)
        scale = status_of(store).scaling["edge"]
        assert scale.replicas == MAX_EDGE and "concurrency" in scale.reason, scale
        time.sleep(2.0)  # the new agents take requests
    finally:
        load.finish()
    failed = {k: v for k, v in load.outcomes.items() if k != "ok"}
    assert load.outcomes["ok"] > 100 and not failed, load.outcomes
    assert any(re.match(r"edge: agent 2 of \d serving after a [0-9.]+ s cold start", line)
               for line in lines), lines
    wait_for(local, lambda: len(edge_agents(state)) == 0, 90, "edge to go to zero", store)
    status = status_of(store)
    assert status.scaling["edge"].replicas == 0
    # idle, it went to zero; a later evaluation (on a slow machine, before
    # this read) says so in its own words
    reason = status.scaling["edge"].reason
    assert "going to zero" in reason or reason == "at zero: no unmet demand", reason
    assert any("leaves the routing table" in line for line in lines)
    assert json.loads(StateLayout(state).scale.read_text()) == {"edge": 0}
    wait_for(local, lambda: not local.leaving, 30, "the edge agents to stop")
    # Edge asleep: regional answers, and a request hinted to edge counts as
    # demand the router could not place there, which wakes it.
    time.sleep(2.0)  # a table without edge is written and read
    assert served_by(running.router, images[:1], {}) == "regional"
    assert served_by(running.router, images[:1], {"tiered-tier": "edge"}) == "regional"
    wait_for(local, lambda: len(edge_agents(state)) == 1, 60, "edge to wake", store)
    # Idle again, it sleeps; a request kept to edge waits for it to wake and
    # is answered there.
    wait_for(local, lambda: not edge_agents(state) and not local.leaving, 60,
             "edge to sleep again", store)
    time.sleep(2.0)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(served_by, running.router, images[:1])
        wait_for(local, held.done, 60, "the held request", store)
    assert held.result() == "edge"
    assert "woken: " in status_of(store).scaling["edge"].reason or \
        status_of(store).scaling["edge"].replicas == 1


def served_by(router: str, image: np.ndarray, headers: dict | None = None) -> str | None:
    """The tier that answered one request through the router (None: refused)."""
    with grpcclient.InferenceServerClient(router) as client:
        tensor = grpcclient.InferInput("input", list(image.shape), "FP32")
        tensor.set_data_from_numpy(image)
        try:
            answer = client.infer("digits", [tensor], headers=STRICT_EDGE if headers is None
                                  else headers)
        except InferenceServerException:
            return None
        return answer.get_response().parameters["tiered-tier"].string_param
