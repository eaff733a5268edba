"""TLS and mTLS on every gRPC hop, and who may load models, with real processes.

Certificates come from the openssl command line, made per test module: a CA,
the agent's and the router's certificates (for 127.0.0.1), an admin's and a
reader's client certificates, an outsider's from another CA, and one that
names only a Service (for pods dialled by IP).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tiered.local.processes import AgentProcess, RouterProcess
from tiered.protocol import security
from tiered.protocol.security import TransportSecurity

SERVICE_NAME = "mlp-edge-v1.tiers.svc"

if shutil.which("openssl") is None:
    pytest.skip("needs the openssl command to make certificates", allow_module_level=True)


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=directory)


def make_cert(directory: Path, name: str, ca: str, server: bool,
              names: str = "IP:127.0.0.1,DNS:localhost") -> None:
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory)
    extensions = directory / f"{name}.ext"
    extensions.write_text(f"subjectAltName={names}\n" if server else
                          "extendedKeyUsage=clientAuth\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "2", "-extfile", extensions.name, "-out", f"{name}.crt",
            cwd=directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pki")
    make_ca(directory, "ca")
    make_ca(directory, "other-ca")
    for name in ("agent", "router"):
        make_cert(directory, name, "ca", server=True)
    for name in ("tiered-admin", "reader"):
        make_cert(directory, name, "ca", server=False)
    make_cert(directory, "outsider", "other-ca", server=False)
    make_cert(directory, "service", "ca", server=True, names=f"DNS:{SERVICE_NAME}")
    return directory


def tls(pki: Path, name: str, client_auth: bool = True) -> list[str]:
    return ["--tls-cert", str(pki / f"{name}.crt"), "--tls-key", str(pki / f"{name}.key"),
            "--tls-ca", str(pki / "ca.crt"), *(["--tls-client-auth"] if client_auth else [])]


@pytest.fixture(scope="module")
def agent(pki, shared_repository):
    with AgentProcess("edge", shared_repository, security_args=tls(pki, "agent"),
                      extra_args=["--admin-cn", "tiered-admin"]) as process:
        yield process


def client(address: str, pki: Path, name: str | None) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(
        address, ssl=True, root_certificates=str(pki / "ca.crt"),
        private_key=str(pki / f"{name}.key") if name else None,
        certificate_chain=str(pki / f"{name}.crt") if name else None)


def mlp_inputs():
    tensor = grpcclient.InferInput("input", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
    return [tensor]


def test_mutual_tls_admits_only_certificates_of_its_ca(agent, pki):
    with client(agent.address, pki, "reader") as reader:
        assert reader.infer("mlp", mlp_inputs()).as_numpy("probabilities").shape == (1, 4)
    for name in ("outsider", None):  # another CA's certificate, or none at all
        with client(agent.address, pki, name) as stranger, \
                pytest.raises(InferenceServerException) as caught:
            stranger.is_server_live()
        assert "UNAVAILABLE" in caught.value.status()
    with grpcclient.InferenceServerClient(agent.address) as plaintext, \
            pytest.raises(InferenceServerException):
        plaintext.is_server_live()


def test_only_an_admin_certificate_may_load(agent, pki):
    with client(agent.address, pki, "reader") as reader, \
            pytest.raises(InferenceServerException) as caught:
        reader.load_model("mlp")
    assert caught.value.status() == "StatusCode.PERMISSION_DENIED"
    with client(agent.address, pki, "tiered-admin") as admin:
        admin.load_model("mlp")
        assert admin.is_model_ready("mlp")


def test_the_router_serves_tls_and_dials_agents_with_mtls(agent, pki, tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"version": 1, "models": {
        "mlp": {"tiers": {"edge": {"agents": [agent.address]}}}}}))
    with RouterProcess(table, security_args=tls(pki, "router", client_auth=False)) as router, \
            client(router.address, pki, None) as caller:  # the router asks for no client cert
        answer = caller.infer("mlp", mlp_inputs())
        assert answer.as_numpy("probabilities").shape == (1, 4)


def test_a_pod_dialled_by_ip_is_checked_against_its_services_name(pki, shared_repository):
    """A certificate that names only the Service: the pod's IP fails the
    check, unless the client is told the name (`--tls-server-name`)."""
    with AgentProcess("edge", shared_repository, security_args=tls(pki, "service")) as pod:
        for server_name, serves in ((SERVICE_NAME, True), (None, False)):
            transport = TransportSecurity(cert=pki / "reader.crt", key=pki / "reader.key",
                                          ca=pki / "ca.crt", server_name=server_name)
            with security.channel(pod.address, transport) as channel:
                try:
                    grpc.channel_ready_future(channel).result(timeout=5)
                    reached = True
                except grpc.FutureTimeoutError:
                    reached = False
            assert reached == serves, server_name


def test_plaintext_only_when_asked_and_then_with_a_warning(tmp_path, shared_repository):
    refused = subprocess.run(
        [sys.executable, "-m", "tiered", "agent", "--tier", "edge", "--model-repository",
         str(shared_repository), "--port", "0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "--insecure for plaintext" in refused.stderr
    with AgentProcess("edge", shared_repository) as plaintext:  # it passes --insecure
        assert "plaintext gRPC (--insecure)" in plaintext.log()
