"""The certificates the chart makes when TLS is on by default, used by real
processes as the chart's pods use them.

`helm template` renders the chart with its default values twice (two
releases, so two CAs). The Secrets of one release are written out as the
pods mount them; a router starts with the TLS arguments the chart gives its
container, an agent with those the controller gives agent pods, on loopback:
a client trusting the router Secret's ca.crt infers through the router, which
dials the agent by IP and checks it against the name the chart passes; the
controller's key pair reaches the agent; the other release's router, and a
client without a certificate, are refused by it.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.chart import helm
from tiered.local.processes import AgentProcess, RouterProcess
from tiered.protocol import security
from tiered.protocol.security import TransportSecurity

MOUNT = "/etc/tiered/tls/"  # where every pod mounts its component's Secret
COMPONENTS = ("router", "controller", "agents")


def release(tmp_path: Path) -> tuple[dict[str, Path], list[str]]:
    """A default render's Secrets, each written to a folder as its pod
    mounts it, and the router container's TLS arguments pointing there."""
    objects = helm.render(None, tmp_path)
    folders = {}
    for component in COMPONENTS:
        name = f"{helm.RELEASE}-tiered-{component}-tls"
        (secret,) = [o for o in objects if o["kind"] == "Secret"
                     and o["metadata"]["name"] == name]
        assert secret["type"] == "kubernetes.io/tls"
        folder = folders[component] = tmp_path / component
        folder.mkdir()
        for key, value in secret["data"].items():
            (folder / key).write_bytes(base64.b64decode(value))
    (router,) = [o for o in objects if o["kind"] == "Deployment"
                 and o["metadata"]["name"] == f"{helm.RELEASE}-tiered-router"]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    start = args.index("--tls-cert")
    tls_args = [a.replace(MOUNT, f"{folders['router']}/") for a in args[start:]]
    return folders, tls_args


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    return [release(tmp_path_factory.mktemp(name)) for name in ("one", "other")]


@pytest.fixture(scope="module")
def agent(releases, shared_repository):
    """An agent serving with the agents' Secret, as the controller starts agent pods."""
    folder = releases[0][0]["agents"]
    with AgentProcess("edge", shared_repository, security_args=[
            "--tls-cert", str(folder / "tls.crt"), "--tls-key", str(folder / "tls.key"),
            "--tls-ca", str(folder / "ca.crt"), "--tls-client-auth"]) as process:
        yield process


def mlp_inputs():
    tensor = grpcclient.InferInput("input", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
    return [tensor]


def reaches(address: str, folder: Path | None, ca: Path, server_name: str) -> bool:
    transport = TransportSecurity(cert=folder and folder / "tls.crt",
                                  key=folder and folder / "tls.key", ca=ca,
                                  server_name=server_name)
    with security.channel(address, transport) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=5)
            return True
        except grpc.FutureTimeoutError:
            return False


def test_every_component_has_its_own_key_and_one_ca_per_release(releases):
    (folders, _), (others, _) = releases
    keys = {(folder / "tls.key").read_bytes() for folder in folders.values()}
    assert len(keys) == len(COMPONENTS)
    assert len({(folder / "ca.crt").read_bytes() for folder in folders.values()}) == 1
    assert (folders["router"] / "ca.crt").read_bytes() != (others["router"] / "ca.crt").read_bytes()


def test_a_client_infers_through_the_router_over_tls_to_an_mtls_agent(releases, agent,
                                                                      tmp_path):
    folders, tls_args = releases[0]
    assert tls_args[tls_args.index("--tls-server-name") + 1] == \
        f"{helm.RELEASE}-tiered-agents.{helm.NAMESPACE}.svc"
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"version": 1, "models": {
        "mlp": {"tiers": {"edge": {"agents": [agent.address]}}}}}))
    with RouterProcess(table, security_args=tls_args) as router, \
            grpcclient.InferenceServerClient(
                router.address, ssl=True,
                root_certificates=str(folders["router"] / "ca.crt")) as caller:
        answer = caller.infer("mlp", mlp_inputs())
        assert answer.as_numpy("probabilities").shape == (1, 4)


def test_the_agent_admits_this_releases_components_only(releases, agent):
    (folders, tls_args), (others, _) = releases
    name = tls_args[tls_args.index("--tls-server-name") + 1]
    ca = folders["agents"] / "ca.crt"
    assert reaches(agent.address, folders["controller"], ca, name)
    assert reaches(agent.address, folders["router"], ca, name)
    assert not reaches(agent.address, others["router"], ca, name)  # another release's CA
    assert not reaches(agent.address, None, ca, name)  # no client certificate
    assert not reaches(agent.address, folders["controller"], ca, "prod-tiered-router")
    with grpcclient.InferenceServerClient(agent.address) as plaintext, \
            pytest.raises(InferenceServerException):
        plaintext.is_server_live()
