"""A client cannot roll a canary back by sending it bad requests.

A real agent serves stable (v1) and canary (v2) of one model; a client sends
each version good requests, and the canary 100 requests of the wrong shape
and 20 asking for an output it does not have (both INVALID_ARGUMENT), as a
client that found a sticky key landing on the canary could. The agent's
telemetry counts those as client errors, apart from its failures; the
controller's judge reads it over gRPC and the rollout engine decides: the
error-rate test sees no failure, says how many client errors it left out,
and two looks in a row do not roll the canary back.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")

import tritonclient.grpc as triton  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tiered import names  # noqa: E402
from tiered.agent.repository import model_file, write_config  # noqa: E402
from tiered.controller.judge import RolloutJudge  # noqa: E402
from tiered.local.processes import AgentProcess  # noqa: E402
from tiered.models import zoo  # noqa: E402
from tiered.protocol import telemetry_pb2 as tpb  # noqa: E402
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc  # noqa: E402
from tiered.protocol.security import ChannelCache  # noqa: E402
from tiered.rollout import engine  # noqa: E402
from tiered.rollout.spec import load_tiered_model  # noqa: E402
from tiered.telemetry.recorder import SLOT_S  # noqa: E402

MODEL, GOOD, BAD_SHAPE, BAD_OUTPUT = "mlp", 40, 100, 20
SPEC = {
    "name": MODEL, "artifact": {"uri": "/m.onnx", "sha256": "a" * 64}, "tiers": {"edge": {}},
    "rollout": {"stages": [{"name": "edge", "weights": {"edge": 10}, "min_requests": 10,
                            "min_duration_s": 0}],
                "analysis": {"error_rate": {"max": 0.02, "max_ratio": 2.0},
                             "min_samples": 20, "consecutive_failure_limit": 2,
                             "interval_s": 1}},
}


def infer(client: triton.InferenceServerClient, version: str, count: int, shape=(1, 16),
          output: str | None = None) -> list[str]:
    """`count` requests to `version`; the status of each that failed."""
    refused = []
    for i in range(count):
        data = triton.InferInput("input", list(shape), "FP32")
        data.set_data_from_numpy(np.random.default_rng(i).random(shape, np.float32))
        outputs = [triton.InferRequestedOutput(output)] if output else None
        try:
            client.infer(MODEL, [data], model_version=version, outputs=outputs)
        except InferenceServerException as error:
            refused.append(error.status())
    return refused


def test_bad_requests_to_the_canary_are_client_errors_and_never_roll_it_back(tmp_path):
    zoo.mlp(model_file(tmp_path, MODEL, 1), seed=1)
    zoo.mlp(model_file(tmp_path, MODEL, 2), seed=2)
    write_config(tmp_path, MODEL, {"max_batch_size": 16,
                                   "version_policy": {"specific": [1, 2]}})
    spec = load_tiered_model(SPEC)
    with AgentProcess("edge", tmp_path) as agent:
        judge = RolloutJudge(ChannelCache())
        status = engine.start(spec, 1, 2, time.time())
        agents = {"edge": [agent.address]}
        judge.read(spec, status, agents, (), time.time())  # the stage's first look: cursors
        with triton.InferenceServerClient(agent.address) as client:
            assert infer(client, "1", GOOD) == [] and infer(client, "2", GOOD) == []
            refused = infer(client, "2", BAD_SHAPE, shape=(1, 15))
            refused += infer(client, "2", BAD_OUTPUT, output="no_such_output")
        assert refused == ["StatusCode.INVALID_ARGUMENT"] * (BAD_SHAPE + BAD_OUTPUT)

        # Telemetry counts a request once its one-second slot has closed.
        time.sleep(SLOT_S * 1.5)
        reply = tpb_grpc.TelemetryStub(ChannelCache()(agent.address)).Stats(
            tpb.StatsRequest(model_name=MODEL), timeout=10)
        canary = next(v for v in reply.versions if v.model_version == "2")
        assert (canary.success, canary.failure, canary.client_errors) == \
            (GOOD, 0, BAD_SHAPE + BAD_OUTPUT)

        for look in range(2):  # two windows: the limit of failures in a row
            now = time.time() + look * spec.rollout.analysis.interval_s
            reading = judge.read(spec, status, agents, (), now)
            decision = engine.decide(spec, status, reading.measurements, now)
            status = decision.status
            assert decision.action != names.Action.ROLLBACK, decision.reason
            (rate,) = [m for m in decision.analysis.metrics if m.metric == "error_rate"]
            assert rate.outcome == names.Outcome.SUCCESSFUL, rate.reason
            assert rate.numbers["errors_canary"] == 0
            assert rate.numbers["client_errors_canary"] == BAD_SHAPE + BAD_OUTPUT
            assert f"client errors, not judged: canary {BAD_SHAPE + BAD_OUTPUT}" in rate.reason
        assert status.consecutive_failures == 0
