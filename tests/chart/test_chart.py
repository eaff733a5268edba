"""The Helm chart, rendered by the real helm and checked object by object.

Every rendered object is validated with kubernetes-validate --strict against
Kubernetes 1.30.0; then the chart's own promises are asserted: hardened
containers, least-privilege RBAC, controller arguments that name objects the
chart really renders, selectors and Service ports that meet.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

import tiered
from tests.chart import helm
from tests.chart.conftest import FULL_VALUES

WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job", "CronJob")
IMAGE_REPO = "ghcr.io/tiered/"


# ---- helpers -------------------------------------------------------------------

def objects(rendered: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in rendered if obj["kind"] == kind]


def one(rendered: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [obj for obj in objects(rendered, kind) if obj["metadata"]["name"] == name]
    names = [obj["metadata"]["name"] for obj in objects(rendered, kind)]
    assert len(found) == 1, f"expected one {kind} {name!r}; rendered: {names}"
    return found[0]


def workloads(rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [obj for obj in rendered if obj["kind"] in WORKLOADS]


def pod_spec(workload: Mapping[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(workload: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def container(workload: Mapping[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    return found


def mounts(c: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in c.get("volumeMounts", [])}


def volumes(workload: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod_spec(workload).get("volumes", [])}


def selected_workloads(rendered, service) -> list[dict[str, Any]]:
    selector = service["spec"]["selector"].items()
    return [w for w in workloads(rendered)
            if selector <= w["spec"]["template"]["metadata"]["labels"].items()]


def fullname() -> str:
    return f"{helm.RELEASE}-tiered"


def image(repository: str) -> str:
    return f"{IMAGE_REPO}{repository}:{tiered.__version__}"


# ---- the chart itself ------------------------------------------------------------

def test_chart_metadata_matches_the_package():
    chart = yaml.safe_load((helm.CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "tiered"
    assert chart["version"] == "0.1.0"
    assert chart["appVersion"] == tiered.__version__


def test_crd_in_the_chart_is_the_one_tiered_crds_writes():
    # crds/ is generated; a stale copy would install an old schema.
    crd = yaml.safe_load((helm.CHART / "crds" / "tieredmodels.tiered.dev.yaml").read_text())
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == "tieredmodels.tiered.dev"
    assert crd["spec"]["scope"] == "Namespaced"


def test_the_crd_upgrade_path_keeps_every_released_version(tmp_path, helm_binary):
    """Helm installs crds/ but never upgrades it: the README's upgrade applies
    `helm show crds` first. An API server refuses a CRD that drops a version
    objects are stored at, so every released version stays, served read-only;
    `helm template --include-crds` renders the same CRD."""
    shown = helm.run_helm(["show", "crds"], None, tmp_path)
    assert shown.returncode == 0, shown.stderr
    (crd,) = [d for d in yaml.safe_load_all(shown.stdout) if d]
    rendered = [d for d in helm.render(None, tmp_path)
                if d["kind"] == "CustomResourceDefinition"]
    assert rendered == [crd]
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    assert set(versions) == {"v1alpha1", "v1alpha2"}  # every version a release stored
    assert [name for name, v in versions.items() if v["storage"]] == ["v1alpha2"]
    old = versions["v1alpha1"]
    assert old["served"] and old["deprecated"]
    (rule,) = old["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert rule["rule"] == "false" and "read-only" in rule["message"]
    assert "x-kubernetes-validations" not in versions["v1alpha2"]["schema"]["openAPIV3Schema"]
    # Conversion None: the API server only relabels, and the controller rewrites.
    assert crd["spec"].get("conversion", {"strategy": "None"}) == {"strategy": "None"}


@pytest.mark.parametrize("values", [None, FULL_VALUES], ids=["default", "full"])
@pytest.mark.parametrize("strict", [False, True], ids=["lint", "lint-strict"])
def test_helm_lint_passes(values, strict, tmp_path, helm_binary):
    args = ["lint", "--kube-version", helm.KUBE_VERSION] + (["--strict"] if strict else [])
    result = helm.run_helm(args, values, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


# ---- values.schema.json ------------------------------------------------------------

def _schema() -> dict[str, Any]:
    return json.loads((helm.CHART / "values.schema.json").read_text())


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    while "$ref" in schema:
        path = schema["$ref"].removeprefix("#/").split("/")
        target: Any = root
        for part in path:
            target = target[part]
        schema = target
    return schema


def _leaves(values: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(values, Mapping) and values:
        for key, value in values.items():
            yield from _leaves(value, (*path, key))
    else:
        yield path


def _schema_for(path: tuple[str, ...], root: Mapping[str, Any]) -> Mapping[str, Any] | None:
    node: Mapping[str, Any] = root
    for key in path:
        node = _resolve(node, root)
        if key in node.get("properties", {}):
            node = node["properties"][key]
        elif isinstance(node.get("additionalProperties"), Mapping):
            node = node["additionalProperties"]
        elif node.get("type") == "object" and node.get("additionalProperties") is not False:
            return node  # a free-form Kubernetes object (affinity terms)
        else:
            return None
    return _resolve(node, root)


def test_values_schema_is_draft7_and_accepts_the_defaults():
    schema = _schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    values = yaml.safe_load((helm.CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)
    jsonschema.Draft7Validator(schema).validate(helm.deep_merge(values, FULL_VALUES))


def test_values_schema_describes_every_value():
    schema = _schema()
    values = yaml.safe_load((helm.CHART / "values.yaml").read_text())
    undescribed = [".".join(path) for path in _leaves(values) if _schema_for(path, schema) is None]
    assert undescribed == []


def test_values_schema_closes_the_charts_own_objects():
    # Unknown keys (typos) in our own sections are errors, not silently ignored.
    schema = _schema()
    for path in [(), ("images",), ("tls",), ("controller",), ("router",),
                 ("router", "http"), ("router", "podDisruptionBudget"), ("agents",),
                 ("agents", "http"), ("agents", "tiers"), ("agents", "tiers", "datacenter"),
                 ("router", "auth"), ("agents", "auth")]:
        node = _schema_for(path, schema)
        assert node is not None and node.get("additionalProperties") is False, path


@pytest.mark.parametrize("setting", [
    "router.replicas=-1",
    "router.replica=2",
    "tls.clientAuth=maybe",
    "tls.serverName=Not_A_Name",
    "images.agent.pullPolicy=Sometimes",
    "controller.resources.requests.cpu=lots",
    "tls.validityDays=0",
    "tls.secrets.gateway=mine",
    "router.service.type=LoadBalancer",
    "router.tolerations[0].operator=Maybe",
    "router.http.enable=false",
    "router.podDisruptionBudget.maxUnavailable=most",
    "router.priorityClassName=Not_A_Class",
    "router.extraEnv[0].value=x",                        # an EnvVar without a name
    "controller.extraArgs=--debug",                      # a string, not a list
    "controller.topologySpreadConstraints[0].maxSkew=1",  # no topologyKey
    "agents.tier.edge.priorityClassName=high",
    "agents.tiers.gpu.priorityClassName=high",
    "agents.tiers.edge.priorityClass=high",
    "agents.gpuRuntimeClassName=Not_A_Class",
    "agents.tiers.datacenter.topologySpreadConstraints[0].whenUnsatisfiable=Always",
    "router.auth.inferenceTokenSecret=Client_Tokens",
    "router.auth.agentToken=agent-tokens",
    "agents.auth.inferenceTokenKey=a/b",
    "agents.auth.adminTokenKey=..",
])
def test_invalid_values_are_rejected_by_the_schema(setting, tmp_path, helm_binary):
    result = helm.run_helm([*helm.template_args(), "--set", setting], None, tmp_path)
    assert result.returncode != 0, f"--set {setting} rendered"
    assert "schema" in result.stderr, result.stderr


# ---- every object is a valid Kubernetes 1.30 object ---------------------------------

def test_every_rendered_object_validates_strictly_against_kubernetes(any_render):
    kinds = set()
    for obj in any_render:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, helm.KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            pytest.fail(f"{where}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{where}: no Kubernetes {helm.KUBE_VERSION} schema for {obj['apiVersion']}")
        kinds.add(obj["kind"])
    assert {"CustomResourceDefinition", "Deployment", "Service", "ConfigMap", "Role",
            "RoleBinding", "ServiceAccount"} <= kinds


def test_strict_validation_rejects_an_unknown_field(default_render):
    # Guards the test above against a validator that accepts anything.
    deployment = dict(workloads(default_render)[0])
    deployment["spec"] = {**deployment["spec"], "replica": 2}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, helm.KUBE_VERSION, strict=True)


# Cluster-scoped: the CRD, and the admission policy on the controller's
# workloads (named after the release and its namespace, bound to that namespace).
CLUSTER_KINDS = {"CustomResourceDefinition", "ValidatingAdmissionPolicy",
                 "ValidatingAdmissionPolicyBinding"}


def test_everything_lands_in_the_release_namespace(any_render):
    for obj in any_render:
        if obj["kind"] in CLUSTER_KINDS:
            assert "namespace" not in obj["metadata"], obj["metadata"]["name"]
        else:
            assert obj["metadata"].get("namespace") == helm.NAMESPACE, obj["metadata"]["name"]


# ---- hardening ---------------------------------------------------------------------

def test_every_container_runs_hardened(any_render):
    for workload in workloads(any_render):
        pod = pod_spec(workload)["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 10001
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in containers(workload):
            where = f"{workload['metadata']['name']}/{c['name']}"
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True, where
            assert sc["runAsUser"] == 10001, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in sc["capabilities"], where
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert sc.get("privileged", False) is False, where
            assert mounts(c)["/tmp"]["name"] == "tmp", where
            assert "emptyDir" in volumes(workload)["tmp"], where
            assert c["image"].startswith(IMAGE_REPO), where
            assert c["resources"].get("limits", {}).get("memory"), where


def test_only_the_controller_gets_an_api_token(any_render):
    for workload in workloads(any_render):
        spec = pod_spec(workload)
        is_controller = workload["metadata"]["name"] == f"{fullname()}-controller"
        assert spec["automountServiceAccountToken"] is is_controller, workload["metadata"]["name"]
        if is_controller:
            assert spec["serviceAccountName"] == f"{fullname()}-controller"


def tls_secret_of(workload: dict) -> str | None:
    return volumes(workload).get("tls", {}).get("secret", {}).get("secretName")


def test_each_component_mounts_its_own_tls_secret_read_only(full_render, default_render,
                                                           insecure_render):
    for render, secret in ((full_render, lambda component: "tiered-tls"),
                           (default_render, lambda component: f"{fullname()}-{component}-tls")):
        for workload in workloads(render):
            component = workload["metadata"]["name"].removeprefix(f"{fullname()}-")
            assert tls_secret_of(workload) == secret(component)
            for c in containers(workload):
                tls = mounts(c)["/etc/tiered/tls"]
                assert tls["name"] == "tls" and tls["readOnly"] is True
    for workload in workloads(insecure_render):
        assert "tls" not in volumes(workload)


def test_tls_is_on_by_default_with_a_key_pair_per_component(default_render, full_render,
                                                           insecure_render):
    made = {s["metadata"]["name"]: s for s in objects(default_render, "Secret")}
    assert set(made) == {f"{fullname()}-{c}-tls" for c in ("router", "controller", "agents")}
    for secret in made.values():
        assert secret["type"] == "kubernetes.io/tls"
        assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    assert len({s["data"]["tls.key"] for s in made.values()}) == 3
    assert len({s["data"]["ca.crt"] for s in made.values()}) == 1
    # Secrets of the user's own, or no TLS: the chart makes none.
    assert objects(full_render, "Secret") == [] and objects(insecure_render, "Secret") == []


@pytest.mark.parametrize("tls", [
    {"secrets": {"router": "r"}},                               # the others unnamed
    {"secrets": {"router": "r", "controller": "c"}},
])
def test_naming_some_component_secrets_but_not_all_is_refused(tls, tmp_path, helm_binary):
    result = helm.run_helm(helm.template_args(), {"tls": tls}, tmp_path)
    assert result.returncode != 0 and "name a Secret for every component" in result.stderr


def test_component_secrets_may_be_named_one_by_one(tmp_path, helm_binary):
    render = helm.render({"tls": {"secretName": "shared", "secrets": {"router": "edge-proxy"}}},
                         tmp_path)
    secrets = {w["metadata"]["name"]: tls_secret_of(w) for w in workloads(render)}
    assert secrets == {f"{fullname()}-router": "edge-proxy",
                       f"{fullname()}-controller": "shared"}
    controller = container(one(render, "Deployment", f"{fullname()}-controller"), "controller")
    args = controller["args"]
    assert args[args.index("--agent-tls-secret") + 1] == "shared"
    assert "--tls-server-name" not in args  # the address dialled, as before


def test_image_pull_secrets_reach_every_pod(full_render):
    for workload in workloads(full_render):
        assert pod_spec(workload)["imagePullSecrets"] == [{"name": "registry"}]


# ---- RBAC: least privilege ---------------------------------------------------------

LEAST_PRIVILEGE = {
    ("tiered.dev", "tieredmodels"): {"get", "list", "watch", "update", "patch"},
    ("tiered.dev", "tieredmodels/status"): {"get", "update", "patch"},
    ("tiered.dev", "tieredmodels/finalizers"): {"update"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "update", "patch", "delete"},
    ("apps", "daemonsets"): {"get", "list", "watch", "create", "update", "patch", "delete"},
    ("", "services"): {"get", "list", "watch", "create", "update", "patch", "delete"},
    ("", "configmaps"): {"get", "list", "watch", "create", "update", "patch", "delete"},
    ("", "events"): {"create", "patch"},
    ("", "pods"): {"list"},  # a failed build's termination message, for status
    ("discovery.k8s.io", "endpointslices"): {"list"},  # every agent and router pod
    ("autoscaling", "horizontalpodautoscalers"): {"list"},  # theirs, not fought over
    ("coordination.k8s.io", "leases"): {"get", "create", "update"},
}


def granted(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    """(API group, resource) -> verbs, with no wildcard anywhere."""
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), set()).update(rule["verbs"])
    return grants


def test_controller_role_is_exactly_least_privilege(any_render):
    assert objects(any_render, "ClusterRole") == []
    assert objects(any_render, "ClusterRoleBinding") == []
    assert granted(one(any_render, "Role", f"{fullname()}-controller")) == LEAST_PRIVILEGE


READ = {"get", "list", "watch"}


def test_user_roles_grant_the_verbs_and_nothing_is_bound_to_them(any_render):
    assert granted(one(any_render, "Role", f"{fullname()}-viewer")) == {
        ("tiered.dev", "tieredmodels"): READ, ("tiered.dev", "tieredmodels/status"): READ}
    # apply creates/replaces/deletes; the rollout verbs replace the status subresource
    assert granted(one(any_render, "Role", f"{fullname()}-operator")) == {
        ("tiered.dev", "tieredmodels"): READ | {"create", "update", "patch", "delete"},
        ("tiered.dev", "tieredmodels/status"): {"get", "update", "patch"}}
    bound = {b["roleRef"]["name"] for b in objects(any_render, "RoleBinding")}
    assert bound == {f"{fullname()}-controller"}


def test_user_roles_can_be_left_out(helm_binary, tmp_path):
    rendered = helm.render({"userRoles": {"create": False}}, tmp_path)
    assert [r["metadata"]["name"] for r in objects(rendered, "Role")] == [
        f"{fullname()}-controller"]


def test_role_is_bound_to_the_controllers_service_account(any_render):
    role = one(any_render, "Role", f"{fullname()}-controller")
    (binding,) = objects(any_render, "RoleBinding")
    (account,) = objects(any_render, "ServiceAccount")
    controller = one(any_render, "Deployment", f"{fullname()}-controller")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": account["metadata"]["name"],
                                    "namespace": helm.NAMESPACE}]
    assert pod_spec(controller)["serviceAccountName"] == account["metadata"]["name"]


# ---- the controller ----------------------------------------------------------------

TLS_ARGS = ["--tls-cert", "/etc/tiered/tls/tls.crt", "--tls-key", "/etc/tiered/tls/tls.key",
            "--tls-ca", "/etc/tiered/tls/ca.crt"]


def security_args(workload: dict, server: bool) -> list[str]:
    """What a component must pass: TLS from its mounted Secret (in the full
    render, which sets clientAuth and serverName: mTLS at the router too, and
    the name agents are checked against; in the default one, the name in the
    agents' certificate the chart makes), else an explicit --insecure."""
    secret = tls_secret_of(workload)
    if secret is None:
        return ["--insecure"]
    if secret == "tiered-tls":
        return [*TLS_ARGS, *(["--tls-client-auth"] if server else []),
                "--tls-server-name", "tiered-agents.tiered-system.svc"]
    return [*TLS_ARGS, "--tls-server-name", f"{fullname()}-agents.{helm.NAMESPACE}.svc"]


def test_controller_arguments_name_objects_the_chart_renders(any_render):
    deployment = one(any_render, "Deployment", f"{fullname()}-controller")
    assert deployment["spec"]["replicas"] == 1
    c = container(deployment, "controller")
    assert c["command"] == ["tiered"]
    assert c["args"] == [
        "controller", "--kubernetes", "--namespace", "$(POD_NAMESPACE)",
        "--routing-configmap", f"{fullname()}-routing",
        "--router", f"{fullname()}-router.{helm.NAMESPACE}.svc:8001",
        "--agent-image", image("tiered-agent"),
        "--agent-gpu-image", image("tiered-agent-cuda"),
        "--agent-pods", "/etc/tiered/agent-pods/agent-pods.yaml",
        "--leader-elect", "--metrics-port", "8080", *security_args(deployment, server=False),
        *({None: [], "tiered-tls": ["--agent-tls-secret", "tiered-tls"]}.get(
            tls_secret_of(deployment), ["--agent-tls-secret", f"{fullname()}-agents-tls"])),
    ]
    args = dict(zip(c["args"], c["args"][1:]))
    # The routing ConfigMap it rewrites is the one the router mounts.
    routing = one(any_render, "ConfigMap", args["--routing-configmap"])
    assert routing["data"] == {"routing.yaml": "version: 0\nmodels: {}\n"}
    assert routing["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # The router whose shadow agreement it reads is behind a Service the chart renders.
    host, port = args["--router"].split(":")
    service_name, namespace, svc = host.split(".")
    assert (namespace, svc) == (helm.NAMESPACE, "svc")
    service = one(any_render, "Service", service_name)
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    (router,) = selected_workloads(any_render, service)
    assert router["metadata"]["name"] == f"{fullname()}-router"
    # The agent pod settings it reads are the chart's ConfigMap, mounted read-only.
    settings = mounts(c)["/etc/tiered/agent-pods"]
    assert settings["readOnly"] is True and "subPath" not in settings
    config_map = volumes(deployment)[settings["name"]]["configMap"]["name"]
    assert "agent-pods.yaml" in one(any_render, "ConfigMap", config_map)["data"]


def test_controller_knows_its_pod_and_serves_metrics_on_8080(any_render):
    c = container(one(any_render, "Deployment", f"{fullname()}-controller"), "controller")
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
           for e in c["env"]}
    assert env["POD_NAMESPACE"] == "metadata.namespace"
    assert env["POD_NAME"] == "metadata.name"
    assert c["ports"] == [{"name": "metrics", "containerPort": 8080, "protocol": "TCP"}]
    assert c["livenessProbe"]["tcpSocket"]["port"] == 8080
    assert c["readinessProbe"]["tcpSocket"]["port"] == 8080


# ---- the router --------------------------------------------------------------------

def test_router_reads_the_routing_configmap_and_probes_grpc_health(any_render):
    router = one(any_render, "Deployment", f"{fullname()}-router")
    assert router["spec"]["replicas"] == 2
    c = container(router, "router")
    assert c["args"] == ["router", "--routing-table", "/etc/tiered/routing/routing.yaml",
                         "--host", "0.0.0.0", "--port", "8001", "--metrics-port", "8003",
                         "--http-port", "8000", "--max-message-bytes", "67108864",
                         "--max-json-bytes", "4194304", *security_args(router, server=True)]
    routing = mounts(c)["/etc/tiered/routing"]
    # A subPath mount would never see the controller's rewrites.
    assert "subPath" not in routing and routing["readOnly"] is True
    assert volumes(router)[routing["name"]]["configMap"]["name"] == f"{fullname()}-routing"
    # Kubernetes' gRPC probe is plaintext only: under TLS the port is probed.
    probe_of = ({"tcpSocket": {"port": 8001}} if "/etc/tiered/tls" in mounts(c)
                else {"grpc": {"port": 8001}})
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe] == {**c[probe], **probe_of}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "grpc": 8001, "metrics": 8003, "http": 8000}
    service = one(any_render, "Service", f"{fullname()}-router")
    assert service["spec"]["type"] == "ClusterIP"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": 8001, "metrics": 8003, "http": 8000}


# ---- selectors and Services --------------------------------------------------------

def test_workload_selectors_match_their_pod_labels(any_render):
    for workload in workloads(any_render):
        selector = workload["spec"]["selector"]["matchLabels"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), workload["metadata"]["name"]
    # ...and no two workloads share pods.
    selectors = [tuple(sorted(w["spec"]["selector"]["matchLabels"].items()))
                 for w in workloads(any_render)]
    assert len(set(selectors)) == len(selectors)


def test_services_select_one_workload_and_target_its_ports(any_render):
    for service in objects(any_render, "Service"):
        name = service["metadata"]["name"]
        targets = selected_workloads(any_render, service)
        assert len(targets) == 1, f"{name} selects {[w['metadata']['name'] for w in targets]}"
        container_ports = [p for c in containers(targets[0]) for p in c.get("ports", [])]
        by_name = {p["name"]: p["containerPort"] for p in container_ports if "name" in p}
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if isinstance(target, str):
                assert target in by_name, f"{name}: no container port named {target}"
                target = by_name[target]
            assert target in {p["containerPort"] for p in container_ports}, f"{name}: {target}"
            assert target == port["port"], f"{name}: port {port['port']} -> {target}"


def test_probes_hit_ports_the_container_serves(any_render):
    for workload in workloads(any_render):
        for c in containers(workload):
            served = {p["containerPort"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe in c:
                    handler = c[probe].get("grpc") or c[probe].get("tcpSocket")
                    assert handler["port"] in served, f"{c['name']} {probe}"


# ---- agents ------------------------------------------------------------------------

def test_the_chart_runs_no_agents_of_its_own(any_render):
    # Agents are the controller's to create, per TieredModel, tier and version.
    names = {w["metadata"]["name"] for w in workloads(any_render)}
    assert names == {f"{fullname()}-controller", f"{fullname()}-router"}


# ---- NOTES.txt ---------------------------------------------------------------------

def notes_for(values: Mapping[str, Any], tmp_path: Path) -> str:
    """NOTES.txt as `helm install` prints it for `values`."""
    # `helm install --dry-run` needs a cluster; render NOTES.txt through `tpl`
    # in a copy of the chart instead.
    chart = tmp_path / "tiered"
    shutil.copytree(helm.CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.tpl")
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n'
        'data:\n  notes: {{ tpl (.Files.Get "notes.tpl") . | quote }}\n')
    result = helm.run_helm([*helm.template_args(), "--show-only", "templates/zz-notes.yaml"],
                           values, tmp_path, chart=chart)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["data"]["notes"]


def test_notes_say_how_to_apply_watch_and_reach_the_router(tmp_path, helm_binary):
    notes = notes_for(FULL_VALUES, tmp_path)
    for expected in ("kubectl apply", "kubectl get tieredmodels", "tiered get --kubernetes",
                     f"{fullname()}-router.{helm.NAMESPACE}.svc:8001",
                     f"kubectl port-forward -n {helm.NAMESPACE} svc/{fullname()}-router",
                     "every gRPC hop uses its component's Secret", "/etc/tiered/tls",
                     "--for=condition=Ready tm/<name>", "kubectl tiered rollout report",
                     "tiered load <name>"):
        assert expected in notes, f"{expected!r} missing from NOTES:\n{notes}"


def test_chart_files_are_where_helm_expects_them():
    templates = {p.name for p in (helm.CHART / "templates").iterdir()}
    assert {"_helpers.tpl", "NOTES.txt"} <= templates
    assert Path(helm.CHART / "values.schema.json").is_file()
