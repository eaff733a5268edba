"""Tokens through the router, on real processes.

An agent requires an inference token. A router in front of it requires its
clients' own tokens (gRPC and REST, unary and streamed) and presents its own
token to the agent on every call; a router without that token is refused by
the agent, and says so. A client's token is checked where it arrives and not
passed on.
"""

from __future__ import annotations

import http.client
import json

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")

import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tiered.local.processes import AgentProcess, RouterProcess  # noqa: E402
from tiered.protocol import routing  # noqa: E402

MODEL = "mlp"


def inputs() -> list[grpcclient.InferInput]:
    data = grpcclient.InferInput("input", [1, 16], "FP32")
    data.set_data_from_numpy(np.ones((1, 16), np.float32))
    return [data]


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def refusal(address: str, headers: dict[str, str]) -> str:
    with grpcclient.InferenceServerClient(address) as client, \
            pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, inputs(), headers=headers)
    return f"{caught.value.status()}: {caught.value.message()}"


def rest_status(address: str, headers: dict[str, str]) -> int:
    host, port = address.rsplit(":", 1)
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                                   "data": [1.0] * 16}]})
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", f"/v2/models/{MODEL}/infer", body=body, headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


def test_the_router_checks_its_clients_tokens_and_presents_its_own_to_agents(
        shared_repository, tmp_path):
    files = {}
    for name, text in (("agent", "agent-secret\n"), ("clients", "client-secret\n"),
                       ("router", "agent-secret\n")):
        files[name] = tmp_path / name
        files[name].write_text(text)
    with AgentProcess("edge", shared_repository,
                      extra_args=["--inference-token-file", str(files["agent"])]) as agent:
        table = tmp_path / "routing.yaml"
        table.write_text(routing.dump_table(routing.RoutingTable(1, {MODEL: routing.ModelRoute(
            {"edge": routing.TierRoute((agent.address,), 1)})})))
        with RouterProcess(table, extra_args=[
                "--inference-token-file", str(files["clients"]),
                "--agent-token-file", str(files["router"])]) as router, \
                RouterProcess(table) as without_a_token:
            with grpcclient.InferenceServerClient(router.address) as client:
                answer = client.infer(MODEL, inputs(), headers=bearer("client-secret"))
                assert answer.as_numpy("probabilities").shape == (1, 4)
                streamed = []
                client.start_stream(callback=lambda result, error: streamed.append(
                    error or result), headers=bearer("client-secret"))
                client.async_stream_infer(MODEL, inputs())
                client.stop_stream()
                assert [type(r).__name__ for r in streamed] == ["InferResult"], streamed
            assert refusal(router.address, {}).startswith("StatusCode.UNAUTHENTICATED")
            assert refusal(router.address, bearer("wrong")).startswith(
                "StatusCode.PERMISSION_DENIED")
            # The client's token for the agent is not passed on by the router.
            assert refusal(router.address, bearer("agent-secret")).startswith(
                "StatusCode.PERMISSION_DENIED")
            assert rest_status(router.http_address, {}) == 401
            assert rest_status(router.http_address,
                               {"Authorization": "Bearer client-secret"}) == 200
            # An open router without the agent's token: the agent refuses it.
            said = refusal(without_a_token.address, bearer("agent-secret"))
            assert "inference needs a token" in said, said
