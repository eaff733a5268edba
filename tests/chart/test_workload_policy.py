"""The admission policy on what the controller writes, evaluated as the API
server evaluates it.

The chart's ValidatingAdmissionPolicy holds CEL expressions. Each is run by a
CEL implementation (the `cel` module, Rust's cel-interpreter) with `object`
bound to a Deployment: every workload the controller's own code renders from
the chart's settings is admitted; each change a holder of the controller's
token could make to read a Secret through a pod is refused by at least one
expression. (No API server runs here: how Kubernetes binds the policy, its
matchConstraints and the binding's namespaceSelector, is checked on the
rendered objects only.)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import cel
import kubernetes_validate
import pytest

from tests.chart import helm
from tests.chart.test_chart import fullname, objects, one
from tests.chart.test_pod_settings import agent_pods
from tiered.controller.desired import ArtifactVersion
from tiered.controller.kube import render
from tiered.rollout.spec import load_tiered_model

POLICY = f"{fullname()}-{helm.NAMESPACE}-agent-workloads"
CONTROLLER = f"system:serviceaccount:{helm.NAMESPACE}:{fullname()}-controller"


def policy_of(rendered) -> dict[str, Any]:
    return one(rendered, "ValidatingAdmissionPolicy", POLICY)


def admitted(policy: dict[str, Any], workload: dict[str, Any]) -> list[str]:
    """The messages of the validations `workload` fails (none: admitted)."""
    return [v["message"] for v in policy["spec"]["validations"]
            if cel.evaluate(v["expression"], {"object": workload}) is not True]


@pytest.fixture(scope="module")
def controller_workloads(default_render, tmp_path_factory) -> list[dict[str, Any]]:
    """What the controller writes for a model on every tier, from the chart's
    agent-pods file and the agents' TLS Secret, as the chart starts it."""
    spec = load_tiered_model({
        "name": "digits", "artifact": {"uri": "https://models.example/d.onnx", "sha256": "a" * 64},
        "tiers": {"edge": {}, "regional": {},
                  "datacenter": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
        "rollout": {"stages": [{"name": "all", "weights": {"edge": 100}}]}})
    settings = render.ClusterSettings(
        helm.NAMESPACE, tls_secret=f"{fullname()}-agents-tls",
        agent_pods=agent_pods(default_render, tmp_path_factory.mktemp("pods")))
    objs = render.desired_objects(spec, [ArtifactVersion(1, spec.artifact.uri, "a" * 64)], [1],
                                  render.Owner("digits", "uid"), settings)
    workloads = [o for o in objs if o["kind"] in ("Deployment", "DaemonSet")]
    assert len(workloads) == 3
    return workloads


def test_the_policy_and_its_binding_are_valid_kubernetes_objects(default_render):
    policy = policy_of(default_render)
    binding = one(default_render, "ValidatingAdmissionPolicyBinding", POLICY)
    for obj in (policy, binding):
        kubernetes_validate.validate(obj, helm.KUBE_VERSION, strict=True)
    assert binding["spec"]["policyName"] == POLICY
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": helm.NAMESPACE}
    assert policy["spec"]["failurePolicy"] == "Fail"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert set(rule["resources"]) == {"deployments", "daemonsets"}


def test_it_applies_to_the_controllers_service_account_only(default_render):
    (condition,) = policy_of(default_render)["spec"]["matchConditions"]
    for user, applies in ((CONTROLLER, True), ("alice@example.com", False),
                          (f"system:serviceaccount:other:{fullname()}-controller", False)):
        assert cel.evaluate(condition["expression"],
                            {"request": {"userInfo": {"username": user}}}) is applies


def test_every_workload_the_controller_renders_is_admitted(default_render, controller_workloads):
    policy = policy_of(default_render)
    for workload in controller_workloads:
        assert admitted(policy, workload) == [], workload["metadata"]["name"]


def _pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _agent(workload: dict) -> dict:
    return _pod(workload)["containers"][0]


MOUNTS, READS, RUNS_AS, HOST = (f"the controller's pods {rule}" for rule in (
    "mount only", "read no", "run as", "use no"))  # the start of each rule's message

# A change a holder of the controller's token could make, and the rule that refuses it.
CHANGES: dict[str, tuple[Callable[[dict], None], str]] = {
    "mounts another Secret": (lambda w: _pod(w)["volumes"].append(
        {"name": "loot", "secret": {"secretName": "database-password"}}), MOUNTS),
    "mounts a Secret through a projected volume": (lambda w: _pod(w)["volumes"].append(
        {"name": "loot", "projected": {"sources": [{"secret": {"name": "database-password"}}]}}),
        MOUNTS),
    "mounts the host": (lambda w: _pod(w)["volumes"].append(
        {"name": "host", "hostPath": {"path": "/"}}), MOUNTS),
    "reads a Secret key into the environment": (lambda w: _agent(w).setdefault("env", []).append(
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "database-password", "key": "k"}}}),
        READS),
    "reads a whole Secret into the init container": (lambda w: _pod(w)["initContainers"][0]
        .setdefault("envFrom", []).append({"secretRef": {"name": "database-password"}}), READS),
    "runs as another ServiceAccount": (lambda w: _pod(w).update(serviceAccountName="admin"),
                                       RUNS_AS),
    "mounts its ServiceAccount token": (lambda w: _pod(w).update(
        automountServiceAccountToken=True), RUNS_AS),
    "uses the host network": (lambda w: _pod(w).update(hostNetwork=True), HOST),
    "runs privileged": (lambda w: _agent(w)["securityContext"].update(privileged=True), HOST),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_workload_changed_to_reach_secrets_or_the_host_is_refused(
        change, default_render, controller_workloads):
    make, rule = CHANGES[change]
    workload = copy.deepcopy(controller_workloads[0])
    make(workload)
    refusals = admitted(policy_of(default_render), workload)
    assert len(refusals) == 1 and refusals[0].startswith(rule), refusals


def test_allowed_secrets_and_the_tls_secret_are_the_only_exceptions(tmp_path, helm_binary,
                                                                    controller_workloads):
    rendered = helm.render({"controller": {"workloadPolicy": {"allowedSecrets": ["proxy"]}},
                            "tls": {"secretName": "mine"}}, tmp_path)
    policy = policy_of(rendered)
    workload = copy.deepcopy(controller_workloads[0])
    _agent(workload)["env"] = [{"name": "HTTPS_PROXY", "valueFrom": {
        "secretKeyRef": {"name": "proxy", "key": "url"}}}]
    for volume in _pod(workload)["volumes"]:
        if "secret" in volume:
            volume["secret"]["secretName"] = "mine"
    assert admitted(policy, workload) == []
    assert admitted(policy_of(helm.render(None, tmp_path)), workload)  # not in the default


def test_the_policy_can_be_switched_off(tmp_path, helm_binary):
    off = helm.render({"controller": {"workloadPolicy": {"enabled": False}}}, tmp_path)
    assert objects(off, "ValidatingAdmissionPolicy") == []
    assert objects(off, "ValidatingAdmissionPolicyBinding") == []


def test_the_agents_token_secrets_are_admitted_and_no_other(tmp_path, helm_binary):
    from tests.chart.test_auth import AUTH

    rendered = helm.render(AUTH, tmp_path)
    policy = policy_of(rendered)
    spec = load_tiered_model({
        "name": "digits", "artifact": {"uri": "https://models.example/d.onnx", "sha256": "a" * 64},
        "tiers": {"edge": {}}, "rollout": {"stages": [{"name": "all", "weights": {"edge": 100}}]}})
    settings = render.ClusterSettings(helm.NAMESPACE, tls_secret=f"{fullname()}-agents-tls",
                                      agent_pods=agent_pods(rendered, tmp_path))
    (workload,) = [o for o in render.desired_objects(
        spec, [ArtifactVersion(1, spec.artifact.uri, "a" * 64)], [1],
        render.Owner("digits", "uid"), settings) if o["kind"] == "Deployment"]
    tokens = {v["secret"]["secretName"] for v in _pod(workload)["volumes"] if "secret" in v}
    assert tokens == {f"{fullname()}-agents-tls", "agent-tokens", "agent-admins"}
    assert admitted(policy, workload) == []
    assert admitted(policy_of(helm.render(None, tmp_path)), workload)  # not in the default
    # The router's client tokens are its own: not the agents' to mount.
    for other in ("client-tokens", "database-password"):
        changed = copy.deepcopy(workload)
        next(v for v in _pod(changed)["volumes"] if v["name"] == "inference-tokens")[
            "secret"]["secretName"] = other
        refusals = admitted(policy, changed)
        assert len(refusals) == 1 and refusals[0].startswith(MOUNTS), refusals
