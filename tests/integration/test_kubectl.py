"""The real kubectl against the Kubernetes API double, with the real controller.

kubectl (v1.33, fetched beside helm by `make test`) is the client a user
types into: it discovers the API (aggregated discovery), checks the server
validates fields (OpenAPI v3) before `apply`, asks for server-side Tables for
`get`, lists Events by involvedObject field selectors for `describe` and
list-watches one object by name for `wait`. Here it applies the Kubernetes
example, the controller (a real process; its agents' Telemetry faked as in
test_kube_controller.py, Deployments and DaemonSets made available as a
kubelet would) makes the model Ready, and kubectl shows and waits on it.

Nothing here depends on the spec's field spellings: the API version comes
from `tiered.rollout.wire`, the printer columns from the CRD, the tier names
from the example's `spec.tiers` keys.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("kubernetes")

from kubernetes import client  # noqa: E402

from tests.fake_agents import telemetry_servers  # noqa: E402
from tests.kubeapi import CRD_PATH, FakeKubeAPI, load_crd, version_priority  # noqa: E402
from tiered.controller.kube import render  # noqa: E402
from tiered.protocol import telemetry_pb2 as tpb  # noqa: E402
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc  # noqa: E402
from tiered.rollout.wire import API_GROUP, API_VERSION  # noqa: E402

BIN = Path(sys.executable).parent
KUBECTL = BIN / "kubectl"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples/kubernetes/digits.yaml"
NAMESPACE = "kubectl"
NAME = "digits"

pytestmark = pytest.mark.skipif(
    not KUBECTL.is_file(),
    reason="kubectl is fetched beside helm by `make test` (tests/chart/fetch_helm.py)")


def served() -> list[dict]:
    """The CRD's served versions, kubectl's preferred first."""
    versions = [v for v in load_crd(CRD_PATH)["spec"]["versions"] if v.get("served")]
    return sorted(versions, key=lambda v: version_priority(v["name"]))


def columns() -> list[dict]:
    """The printer columns of the version kubectl prefers, as the CRD declares them."""
    return served()[0].get("additionalPrinterColumns") or []


def tiers() -> list[str]:
    return list(yaml.safe_load(EXAMPLE.read_text())["spec"]["tiers"])


class FakeTelemetry(tpb_grpc.TelemetryServicer):
    """One tier's agents of version 1: a steady, healthy reading."""

    def __init__(self, tier: str) -> None:
        self.tier = tier

    def Stats(self, request, context):
        return tpb.StatsResponse(
            tier=self.tier, start=request.cursor, end=time.time(), window_s=1.0,
            versions=[tpb.VersionStats(
                model_name=request.model_name, model_version="1", success=40,
                inferences=40, latency_samples_s=[0.004] * 40, has_energy=True,
                joules_per_inference=0.1)])


@pytest.fixture(scope="module")
def api():
    with FakeKubeAPI() as fake:
        yield fake


@pytest.fixture(scope="module")
def home(api, tmp_path_factory) -> Path:
    """HOME for kubectl: its kubeconfig (context namespace NAMESPACE) and caches."""
    path = tmp_path_factory.mktemp("kubectl-home")
    config = yaml.safe_load(api.kubeconfig(path / "kubeconfig").read_text())
    for context in config["contexts"]:
        context["context"]["namespace"] = NAMESPACE
    (path / "kubeconfig").write_text(yaml.safe_dump(config))
    return path


def kubectl(home: Path, *args: str, code: int | None = 0,
            timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "KUBECONFIG": str(home / "kubeconfig"),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([str(KUBECTL), *args],  # its caches: under HOME/.kube
                          env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    if code is not None:
        assert done.returncode == code, f"kubectl {' '.join(args)}: {done.returncode}\n" \
                                        f"{done.stdout}{done.stderr}"
    return done


def parse_table(text: str) -> list[dict[str, str]]:
    """kubectl's aligned table as rows of {HEADER: cell}, cut at the headers' offsets."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = lines[0]
    names = header.split()
    starts = []
    for name in names:
        starts.append(header.index(name, starts[-1] + 1 if starts else 0))
    bounds = [*starts[1:], None]
    return [{name: line[start:end].strip() for name, start, end in zip(names, starts, bounds)}
            for line in lines[1:]]


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    with telemetry_servers({render.workload_name(NAME, tier, 1): FakeTelemetry(tier)
                            for tier in tiers()},
                           tmp_path_factory.mktemp("agents") / "addresses.json") as path:
        yield path


@pytest.fixture(scope="module")
def controller(api, home, agents):
    log_path = home / "controller.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tiered", "controller", "--kubernetes", "--namespace",
             NAMESPACE, "--kubeconfig", str(home / "kubeconfig"), "--agent-addresses",
             str(agents), "--insecure"], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait(what: str, check, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def make_available(api: FakeKubeAPI, count: int) -> None:
    """What the agents' pods would report: every workload of version 1 available."""
    def workloads():
        found = [(plural, o["metadata"]["name"]) for plural in ("deployments", "daemonsets")
                 for o in api.objects(plural) if o["metadata"]["namespace"] == NAMESPACE]
        return len(found) == count and found

    with client.ApiClient(api.client_configuration()) as kube:
        apps = client.AppsV1Api(kube)
        for plural, name in wait("the agents' workloads", workloads):
            if plural == "deployments":
                apps.patch_namespaced_deployment_status(name, NAMESPACE, {"status": {
                    "replicas": 1, "readyReplicas": 1, "availableReplicas": 1}})
            else:
                apps.patch_namespaced_daemon_set_status(name, NAMESPACE, {"status": {
                    "desiredNumberScheduled": 1, "currentNumberScheduled": 1,
                    "numberReady": 1, "numberAvailable": 1}})


def test_apply_creates_the_example_and_get_prints_its_columns(api, home):
    applied = kubectl(home, "apply", "-f", str(EXAMPLE))
    assert applied.stdout.strip() == f"tieredmodel.{API_GROUP}/{NAME} created"
    stored = api.objects("tieredmodels")
    assert [(o["metadata"]["namespace"], o["metadata"]["name"]) for o in stored] == [
        (NAMESPACE, NAME)]
    storage = next(v["name"] for v in served() if v.get("storage"))
    assert stored[0]["apiVersion"] == f"{API_GROUP}/{storage}"
    assert "kubectl.kubernetes.io/last-applied-configuration" in stored[0]["metadata"][
        "annotations"]
    # kubectl sent the create with server-side field validation, having found
    # the parameter in the OpenAPI v3 document of the group version
    create = next(r for r in api.requests if r.method == "POST" and "tieredmodels" in r.path)
    assert create.query.get("fieldValidation") == "Strict"
    written = yaml.safe_load(EXAMPLE.read_text())["apiVersion"]  # at the example's version
    assert create.path == f"/apis/{written}/namespaces/{NAMESPACE}/tieredmodels"

    # the short name, the category, the full name: one resource
    rows = parse_table(kubectl(home, "get", "tm").stdout)
    for other in ("tiered", f"tieredmodels.{API_GROUP}", f"tieredmodel.{API_VERSION}.{API_GROUP}"):
        also = parse_table(kubectl(home, "get", other).stdout)
        assert [list(r) for r in also] == [list(r) for r in rows]
        assert [r["NAME"] for r in also] == [r["NAME"] for r in rows]
    declared = [c["name"].upper() for c in columns()]
    assert list(rows[0]) == ["NAME", *declared] if declared else ["NAME", "AGE"]
    assert [r["NAME"] for r in rows] == [NAME]
    if "AGE" in rows[0]:
        assert rows[0]["AGE"].endswith(("s", "m")), rows[0]  # just made


def test_a_field_the_schema_lacks_is_refused_by_strict_validation(api, home, tmp_path):
    document = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"]["name"] = "typo"
    document["spec"]["noSuchField"] = 1
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(document))
    refused = kubectl(home, "apply", "-f", str(tmp_path / "typo.yaml"), code=1)
    assert 'unknown field "spec.noSuchField"' in refused.stderr, refused.stderr
    assert [o["metadata"]["name"] for o in api.objects("tieredmodels")] == [NAME]
    # --validate=false: the field is pruned, as the server does, and the object is made
    kubectl(home, "apply", "--validate=false", "-f", str(tmp_path / "typo.yaml"))
    typo = next(o for o in api.objects("tieredmodels") if o["metadata"]["name"] == "typo")
    assert "noSuchField" not in typo["spec"]
    kubectl(home, "delete", "tm", "typo")
    assert [o["metadata"]["name"] for o in api.objects("tieredmodels")] == [NAME]


def test_wait_returns_once_the_controller_made_the_model_ready(api, home, controller):
    make_available(api, len(tiers()))
    waited = kubectl(home, "wait", "--for=condition=Ready", f"tm/{NAME}", "--timeout=180s",
                     timeout=240)
    assert waited.stdout.strip() == f"tieredmodel.{API_GROUP}/{NAME} condition met"
    # kubectl waited on a list (then, until the condition came, a watch) of this one object
    assert any(r.query.get("fieldSelector") == f"metadata.name={NAME}"
               for r in api.requests if r.path.endswith("/tieredmodels"))
    ready = [c for c in api.objects("tieredmodels")[0]["status"]["conditions"]
             if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"


def test_get_prints_the_columns_kubectl_reads_from_the_object_itself(home):
    """Each server-side cell against kubectl's own client-side JSONPath."""
    row = parse_table(kubectl(home, "get", "tm").stdout)[0]
    assert row["NAME"] == NAME
    for column in columns():
        if column["type"] == "date":
            continue
        expected = kubectl(home, "get", "tm", NAME, "-o",
                           f"jsonpath={{{column['jsonPath']}}}").stdout.strip()
        # a missing field, a null and an empty string all print as nothing
        assert row[column["name"].upper()] == ("" if expected == "null" else expected), (
            column, row)
    if any(c["name"] == "Ready" for c in columns()):
        assert row["READY"] == "True"


def test_describe_lists_the_events_the_controller_emitted(api, home):
    with client.ApiClient(api.client_configuration()) as kube:  # about another object
        client.CoreV1Api(kube).create_namespaced_event(NAMESPACE, {
            "metadata": {"name": "elsewhere.1"}, "reason": "SomethingElse",
            "message": "not about the model", "type": "Normal",
            "involvedObject": {"kind": "TieredModel", "name": "other",
                               "namespace": NAMESPACE}})
    uid = api.objects("tieredmodels")[0]["metadata"]["uid"]
    events = wait("the controller's events", lambda: [
        e for e in api.objects("events") if e["involvedObject"].get("uid") == uid])
    described = kubectl(home, "describe", "tm", NAME).stdout
    assert f"Name:         {NAME}" in described and f"Namespace:    {NAMESPACE}" in described
    listed = described.split("\nEvents:", 1)[1]
    for event in events:
        assert event["reason"] in listed and event["message"] in listed, (event, listed)
    assert "SomethingElse" not in listed
    lookup = [r for r in api.requests if r.path.endswith("/events") and r.method == "GET"][-1]
    terms = dict(t.split("=", 1) for t in lookup.query["fieldSelector"].split(","))
    assert terms == {"involvedObject.name": NAME, "involvedObject.namespace": NAMESPACE,
                     "involvedObject.kind": "TieredModel", "involvedObject.uid": uid}


def test_wait_for_a_condition_that_never_comes_times_out(home):
    started = time.monotonic()
    waited = kubectl(home, "wait", "--for=condition=NeverComes", f"tm/{NAME}", "--timeout=3s",
                     code=None)
    assert waited.returncode != 0
    assert "timed out waiting for the condition" in waited.stderr, waited.stderr
    assert time.monotonic() - started >= 3


def test_kubectl_tiered_plugin_acts_on_the_kubeconfig_namespace(home):
    if not (BIN / "kubectl-tiered").is_file():
        pytest.skip("kubectl-tiered is installed with the package (pip install -e .)")
    shown = kubectl(home, "tiered", "get")
    assert NAME in shown.stdout, shown.stdout
