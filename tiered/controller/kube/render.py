"""Desired Kubernetes objects for a TieredModel, pure: (spec, status, settings) -> dicts.

Per tier and per served version (stable, and the canary while it is live):
a Deployment of agents (a DaemonSet when the tier runs one agent per node)
whose init container builds that version for the tier from the artifact
(`tiered build`, which checks the sha256 first), and a headless Service in
front of them. The router's table lives in one ConfigMap for the namespace.
Every object carries the TieredModel as its controller owner, so Kubernetes
deletes them with it, and a hash of its own desired form, so the controller
replaces only what changed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tiered import names
from tiered.controller import desired, plan
from tiered.errors import ConfigError
from tiered.protocol import routing
from tiered.protocol.verdict import read_verdict
from tiered.rollout.spec import TieredModel, TierSpec, Toleration
from tiered.rollout.status import ArtifactVersion, TieredModelStatus
from tiered.rollout.wire import API_GROUP, API_VERSION, KIND, to_plain
from tiered.settings import Quantity, load_dataclass, read_yaml

AGENT_PORT = 8001
AGENT_METRICS_PORT = 8002
AGENT_HTTP_PORT = 8000  # KServe v2 REST
MODELS_DIR = "/models"
TLS_DIR = "/etc/tiered/tls"
TOKENS_DIR = "/etc/tiered/tokens"  # one directory per token Secret, beside TLS_DIR
ROUTING_KEY = "routing.yaml"
GPU_TIERS = (names.Tier.REGIONAL, names.Tier.DATACENTER)

LABEL_MODEL = f"{API_GROUP}/model"
LABEL_TIER = f"{API_GROUP}/tier"
LABEL_VERSION = f"{API_GROUP}/version"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
MANAGER = "tiered-controller"
# Kubernetes' recommended labels on every object the controller makes, beside
# the selector's; AgentPods.labels adds the release's (instance, a renamed name).
STANDARD_LABELS = {"app.kubernetes.io/name": "tiered", "app.kubernetes.io/part-of": "tiered",
                   "app.kubernetes.io/component": "agent"}
SPEC_HASH = f"{API_GROUP}/spec-hash"
FINALIZER = f"{API_GROUP}/routing"
BUILD_CONTAINER = "build"  # the init container that verifies and builds the artifact
AGENT_CONTAINER = "agent"  # the container that serves it
TERMINATION_LOG = "/dev/termination-log"


_SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


@dataclass(frozen=True)
class PodSettings:
    """What the agent pods of one tier get beside what the TieredModel asks for."""

    priority_class_name: str = ""
    runtime_class_name: str = ""  # e.g. "nvidia" for a GPU tier
    # Kubernetes TopologySpreadConstraints; one without a labelSelector spreads
    # its own workload's pods.
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    extra_args: tuple[str, ...] = ()  # appended to `tiered agent`
    extra_env: tuple[Mapping[str, Any], ...] = ()  # EnvVars of the agent and its build


@dataclass(frozen=True)
class Placement:
    """What a TieredModel may ask of the cluster for its agent pods (the
    chart's agents.placement; None: no limit): the node labels it may select
    on, the tolerations it may carry (each exactly one of these), and the most
    a container may request or be limited to per resource (a resource not
    named: none of it). A tier asking beyond them is refused, and says why."""

    node_selector_keys: tuple[str, ...] | None = None
    tolerations: tuple[Toleration, ...] | None = None
    max_resources: Mapping[str, Quantity] | None = None

    def refusal(self, tier: TierSpec) -> str | None:
        """Why `tier` asks beyond these, or None (a setting left None allows anything)."""
        where = "the chart's agents.placement"
        if self.node_selector_keys is not None:
            for key in tier.node_selector:
                if key not in self.node_selector_keys:
                    return (f"nodeSelector: {key!r} is not a label agents may select on here "
                            f"({where}.nodeSelectorKeys: "
                            f"{', '.join(self.node_selector_keys) or 'none'})")
        if self.tolerations is not None:
            for toleration in tier.tolerations:
                if toleration not in self.tolerations:
                    return (f"tolerations: {to_plain(toleration)} is not one agents may carry "
                            f"here ({where}.tolerations)")
        if self.max_resources is not None:
            for kind in ("requests", "limits"):
                for name, amount in getattr(tier.resources, kind).items():
                    most = self.max_resources.get(name)
                    if most is None:
                        return (f"resources.{kind}: {name} is not given to agents here "
                                f"({where}.maxResources)")
                    if Quantity(amount).value() > Quantity(most).value():
                        return (f"resources.{kind}.{name}: {amount} is above the most agents "
                                f"get here, {most} ({where}.maxResources)")
        return None


@dataclass(frozen=True)
class SecretFile:
    """One key of a Secret, which a pod reads as a file."""

    secret: str
    key: str = "tokens"

    def __post_init__(self) -> None:
        if not _SECRET_NAME.fullmatch(self.secret) or len(self.secret) > 253:
            raise ConfigError(f"secret: expected a Secret's name, got {self.secret!r}")
        if not _SECRET_KEY.fullmatch(self.key) or self.key in (".", "..") or len(self.key) > 253:
            raise ConfigError(f"key: expected a Secret's key, got {self.key!r}")


@dataclass(frozen=True)
class AgentAuth:
    """The token files agents require (the chart's agents.auth), each one key of
    a Secret mounted read-only: `inference` is the agents' --inference-token-file
    (the router then presents one of them), `admin` their --admin-token-file.
    None: no such token (inference open; load and unload refused)."""

    inference: SecretFile | None = None
    admin: SecretFile | None = None

    def files(self) -> tuple[tuple[str, str, SecretFile], ...]:
        """(volume name, agent flag, where it is read) of each token file set."""
        named = (("inference-tokens", "--inference-token-file", self.inference),
                 ("admin-tokens", "--admin-token-file", self.admin))
        return tuple((name, flag, file) for name, flag, file in named if file is not None)


@dataclass(frozen=True)
class AgentPods:
    """Settings of every agent pod, read from a YAML file (camelCase keys; the
    chart writes it into a ConfigMap): labels, the REST port, per-tier settings,
    placement limits and the token Secrets the agents require."""

    labels: Mapping[str, str] = field(default_factory=dict)  # e.g. app.kubernetes.io/instance
    http_port: int | None = AGENT_HTTP_PORT  # None: gRPC only (--no-http)
    tiers: Mapping[str, PodSettings] = field(default_factory=dict)
    placement: Placement = field(default_factory=Placement)
    auth: AgentAuth = field(default_factory=AgentAuth)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tiers) - set(names.TIERS))
        if unknown:
            raise ConfigError(f"tiers: unknown tier {unknown[0]!r}; expected one of "
                              f"{', '.join(names.TIERS)}")
        taken = sorted(set(self.labels) & {LABEL_MODEL, LABEL_TIER, LABEL_VERSION, LABEL_MANAGED})
        if taken:
            raise ConfigError(f"labels: {taken[0]!r} is the controller's own selector label")
        port = self.http_port
        if port is not None and (not 0 < port < 65536 or port in (AGENT_PORT, AGENT_METRICS_PORT)):
            raise ConfigError(f"httpPort: expected a free port in 1..65535 (not {AGENT_PORT} "
                              f"or {AGENT_METRICS_PORT}), got {self.http_port}")

    def tier(self, tier: str) -> PodSettings:
        return self.tiers.get(tier) or PodSettings()


def load_agent_pods(path: Path) -> AgentPods:
    """AgentPods from a YAML file; errors name the file and the key."""
    return load_dataclass(AgentPods, read_yaml(path), str(path), _camel)


@dataclass(frozen=True)
class ClusterSettings:
    """Where the controller works and what it runs there."""

    namespace: str
    agent_image: str = "tiered-agent:latest"
    agent_gpu_image: str = "tiered-agent-cuda:latest"
    routing_configmap: str = "tiered-routing"
    router: str | None = None  # the router's gRPC address, where shadow agreement is read
    image_pull_policy: str = "IfNotPresent"
    # A kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt) the agents serve with,
    # requiring client certificates from the same CA; None: plaintext (--insecure).
    tls_secret: str | None = None
    agent_pods: AgentPods = field(default_factory=AgentPods)


@dataclass(frozen=True)
class Owner:
    name: str
    uid: str


def dns_label(*parts: str) -> str:
    """A DNS-1035 label (Service names need one) from `parts`, at most 63 characters."""
    name = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"m-{name}"
    if len(name) > 63:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = f"{name[:54].rstrip('-')}-{digest}"
    return name


def workload_name(model: str, tier: str, version: int) -> str:
    return dns_label(model, tier, f"v{version}")


def agent_address(model: str, tier: str, version: int, namespace: str) -> str:
    return f"{workload_name(model, tier, version)}.{namespace}.svc:{AGENT_PORT}"


def _labels(model: str, tier: str, version: int) -> dict[str, str]:
    return {LABEL_MODEL: dns_label(model), LABEL_TIER: tier, LABEL_VERSION: str(version),
            LABEL_MANAGED: MANAGER}


def _object_labels(model: str, tier: str, version: int, settings: ClusterSettings
                   ) -> dict[str, str]:
    """The selector's labels and the standard ones, on each object and pod."""
    return {**STANDARD_LABELS, **settings.agent_pods.labels, **_labels(model, tier, version)}


def pod_selector(model: str, tier: str, version: int) -> str:
    """The label selector of one (tier, version)'s agent pods."""
    return ",".join(f"{k}={v}" for k, v in _labels(model, tier, version).items())


def _owner_reference(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": owner.name,
            "uid": owner.uid, "controller": True, "blockOwnerDeletion": True}


def _with_hash(obj: dict[str, Any]) -> dict[str, Any]:
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
    obj["metadata"].setdefault("annotations", {})[SPEC_HASH] = digest
    return obj


SECURITY_CONTEXT = {
    "runAsNonRoot": True, "runAsUser": 10001, "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def agent_workload(spec: TieredModel, tier: str, artifact: ArtifactVersion, owner: Owner,
                   settings: ClusterSettings, replicas: int | None = None) -> dict[str, Any]:
    """The Deployment (or DaemonSet) serving `artifact`'s version on `tier`,
    with `replicas` pods (None: the spec's)."""
    tier_spec = spec.tiers[tier]
    pods = settings.agent_pods
    extra = pods.tier(tier)
    selector = _labels(spec.name, tier, artifact.version)
    labels = _object_labels(spec.name, tier, artifact.version, settings)
    http = ["--http-port", str(pods.http_port)] if pods.http_port is not None else ["--no-http"]
    env = {"env": [dict(e) for e in extra.extra_env]} if extra.extra_env else {}
    image = settings.agent_gpu_image if tier in GPU_TIERS else settings.agent_image
    volumes = [{"name": "models", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "models", "mountPath": MODELS_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    security = ["--insecure"]
    # Kubernetes' gRPC probe speaks plaintext only: under TLS the port is probed.
    probe: dict[str, Any] = {"grpc": {"port": AGENT_PORT}}
    if settings.tls_secret:
        probe = {"tcpSocket": {"port": AGENT_PORT}}
        volumes.append({"name": "tls", "secret": {"secretName": settings.tls_secret}})
        agent_mounts = [*mounts, {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}]
        security = ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key",
                    "--tls-ca", f"{TLS_DIR}/ca.crt", "--tls-client-auth"]
    else:
        agent_mounts = mounts
    # Only the agent reads its tokens, and only the one key: the build gets none.
    auth: list[str] = []
    for name, flag, file in pods.auth.files():
        volumes.append({"name": name, "secret": {
            "secretName": file.secret, "items": [{"key": file.key, "path": file.key}],
            "defaultMode": 0o440}})
        agent_mounts = [*agent_mounts,
                        {"name": name, "mountPath": f"{TOKENS_DIR}/{name}", "readOnly": True}]
        auth += [flag, f"{TOKENS_DIR}/{name}/{file.key}"]
    resources = {k: dict(v) for k, v in (("requests", tier_spec.resources.requests),
                                         ("limits", tier_spec.resources.limits)) if v}
    # A pod given GPUs sees those alone (the device plugin): one engine process
    # on each, when there are several.
    devices = ["--devices", "auto"] if tier in GPU_TIERS and tier_spec.resources.gpus else []
    pod = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001},
        "initContainers": [{
            "name": BUILD_CONTAINER, "image": image,
            "imagePullPolicy": settings.image_pull_policy,
            "command": ["tiered", *desired.build_args(spec, tier, artifact, MODELS_DIR),
                        "--termination-log", TERMINATION_LOG],
            "volumeMounts": mounts, **env,
            "securityContext": SECURITY_CONTEXT, "resources": resources,
            # The build writes its JSON verdict where the kubelet reads the
            # termination message (its last log lines when it could not).
            "terminationMessagePath": TERMINATION_LOG,
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }],
        "containers": [{
            "name": AGENT_CONTAINER, "image": image,
            "imagePullPolicy": settings.image_pull_policy,
            "command": ["tiered", "agent", "--tier", tier, "--model-repository", MODELS_DIR,
                        "--host", "0.0.0.0", "--port", str(AGENT_PORT),
                        "--metrics-port", str(AGENT_METRICS_PORT), *http, *security,
                        *auth, *devices, *extra.extra_args],
            "ports": [{"name": "grpc", "containerPort": AGENT_PORT},
                      {"name": "metrics", "containerPort": AGENT_METRICS_PORT},
                      *([{"name": "http", "containerPort": pods.http_port}]
                        if pods.http_port is not None else [])],
            **env,
            "readinessProbe": {**probe, "periodSeconds": 5},
            "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
            "volumeMounts": agent_mounts, "securityContext": SECURITY_CONTEXT,
            "resources": resources,
        }],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 45,  # the agent drains in-flight requests
        # Neither the build nor the agent speaks to the Kubernetes API: no
        # token in the pod for whoever might get into it.
        "automountServiceAccountToken": False,
    }
    if tier_spec.node_selector:
        pod["nodeSelector"] = dict(tier_spec.node_selector)
    if tier_spec.tolerations:
        pod["tolerations"] = [{k: v for k, v in (("key", t.key), ("operator", t.operator),
                                                 ("value", t.value), ("effect", t.effect)) if v}
                              for t in tier_spec.tolerations]
    if extra.priority_class_name:
        pod["priorityClassName"] = extra.priority_class_name
    if extra.runtime_class_name:
        pod["runtimeClassName"] = extra.runtime_class_name
    if extra.topology_spread_constraints:
        pod["topologySpreadConstraints"] = [
            {"labelSelector": {"matchLabels": selector}, **c}
            for c in extra.topology_spread_constraints]
    template = {"metadata": {"labels": labels}, "spec": pod}
    workload_spec: dict[str, Any] = {"selector": {"matchLabels": selector}, "template": template}
    if not tier_spec.per_node:
        workload_spec["replicas"] = tier_spec.replicas if replicas is None else replicas
    return _with_hash({
        "apiVersion": "apps/v1", "kind": "DaemonSet" if tier_spec.per_node else "Deployment",
        "metadata": {"name": workload_name(spec.name, tier, artifact.version),
                     "namespace": settings.namespace, "labels": labels,
                     "ownerReferences": [_owner_reference(owner)]},
        "spec": workload_spec,
    })


def agent_service(spec: TieredModel, tier: str, version: int, owner: Owner,
                  settings: ClusterSettings) -> dict[str, Any]:
    """A headless Service: the router resolves every agent pod behind it."""
    http_port = settings.agent_pods.http_port
    return _with_hash({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": workload_name(spec.name, tier, version),
                     "namespace": settings.namespace,
                     "labels": _object_labels(spec.name, tier, version, settings),
                     "ownerReferences": [_owner_reference(owner)]},
        "spec": {"clusterIP": "None", "selector": _labels(spec.name, tier, version),
                 "ports": [{"name": "grpc", "port": AGENT_PORT, "targetPort": "grpc"},
                           {"name": "metrics", "port": AGENT_METRICS_PORT,
                            "targetPort": "metrics"},
                           *([{"name": "http", "port": http_port, "targetPort": "http"}]
                             if http_port is not None else [])]},
    })


def desired_objects(spec: TieredModel, artifacts: Sequence[ArtifactVersion],
                    versions: Sequence[int], owner: Owner, settings: ClusterSettings,
                    replicas: Mapping[tuple[str, int], int] | None = None
                    ) -> list[dict[str, Any]]:
    """Workloads and Services for `versions` on each of the model's tiers;
    `replicas`: pods per (tier, version), as the plan decided (None: the spec's)."""
    by_version = {a.version: a for a in artifacts}
    objects = []
    for tier in (t for t in names.TIERS if t in spec.tiers):
        if settings.agent_pods.placement.refusal(spec.tiers[tier]):
            continue  # refused: plan reads why from the backend's state
        for version in sorted(versions):
            objects.append(agent_workload(spec, tier, by_version[version], owner, settings,
                                          (replicas or {}).get((tier, version))))
            objects.append(agent_service(spec, tier, version, owner, settings))
    return objects


def agents_of(settings: ClusterSettings) -> desired.AgentsOf:
    """Each (tier, version) behind its own headless Service."""
    return lambda spec, tier, version: (agent_address(spec.name, tier, version,
                                                      settings.namespace),)


def routing_configmap(table: routing.RoutingTable, settings: ClusterSettings
                      ) -> dict[str, Any]:
    """The router's table for every model of the namespace, in its ConfigMap."""
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": settings.routing_configmap, "namespace": settings.namespace,
                     "labels": {LABEL_MANAGED: MANAGER}},
        "data": {ROUTING_KEY: routing.dump_table(table)},
    }


def build_failure(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """Why the build init container failed on one of these pods (as the kubelet
    reports them): its verdict's reason, read from the termination message;
    None while no build has failed."""
    for pod in pods:
        for container in (pod.get("status") or {}).get("initContainerStatuses") or []:
            if container.get("name") != BUILD_CONTAINER:
                continue
            for state in (container.get("state"), container.get("lastState")):
                terminated = (state or {}).get("terminated") or {}
                if terminated.get("exitCode"):
                    verdict = read_verdict(terminated.get("message") or "")
                    return verdict.reason if verdict is not None else (
                        f"the build exited with code {terminated['exitCode']} "
                        f"({terminated.get('reason') or 'Error'}) and no verdict")
    return None


def pod_progress(pods: Iterable[Mapping[str, Any]], now: datetime) -> str:
    """How far the furthest of these pods (as the kubelet reports them) is
    from serving, for a version that waits for its agents: "no pod yet",
    "unschedulable: ...", "build waiting: ImagePullBackOff", "building, 12 s",
    "agent ContainerCreating", "loading", "ready"."""
    return max((_progress(pod, now) for pod in pods), default=(0, "no pod yet"))[1]


def _progress(pod: Mapping[str, Any], now: datetime) -> tuple[int, str]:
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            said = (condition.get("message") or condition.get("reason") or "").strip()
            return 1, f"unschedulable: {said[:160]}"
    build = _container(status.get("initContainerStatuses"), BUILD_CONTAINER)
    agent = _container(status.get("containerStatuses"), AGENT_CONTAINER)
    built = ((build.get("state") or {}).get("terminated") or {}).get("exitCode") == 0
    if not built:
        state = build.get("state") or {}
        if "running" in state:
            started = _instant(state["running"].get("startedAt"))
            return 4, "building" + (f", {(now - started).total_seconds():.0f} s"
                                    if started is not None else "")
        waiting = (state.get("waiting") or {}).get("reason")
        return (3, f"build waiting: {waiting}") if waiting else (2, "scheduled")
    if agent.get("ready"):
        return 7, "ready"
    waiting = ((agent.get("state") or {}).get("waiting") or {}).get("reason")
    if waiting:
        return 5, f"agent {waiting}"
    return 6, "loading" if "running" in (agent.get("state") or {}) else "built"


def _container(statuses: Iterable[Mapping[str, Any]] | None, name: str) -> Mapping[str, Any]:
    return next((c for c in statuses or () if c.get("name") == name), {})


def _instant(stamp: str | None) -> datetime | None:
    try:
        return datetime.strptime(stamp or "", "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def event(model: str, uid: str, step: plan.Event, now: float, namespace: str
          ) -> dict[str, Any]:
    """A core/v1 Event about the TieredModel, as `kubectl describe` and
    `kubectl get events` show them."""
    stamp = datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{model}.", "namespace": namespace},
        "involvedObject": {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
                           "name": model, "namespace": namespace, "uid": uid},
        "reason": step.reason, "message": step.message[:1024],
        "type": "Warning" if step.warning else "Normal",
        "source": {"component": MANAGER}, "reportingComponent": MANAGER,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


def status_body(obj: Mapping[str, Any], status: TieredModelStatus) -> dict[str, Any]:
    """A write of `status` to the status subresource, valid only at the
    resourceVersion `obj` was read at (else 409)."""
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
            "metadata": {"name": obj["metadata"]["name"],
                         "namespace": obj["metadata"]["namespace"],
                         "resourceVersion": obj["metadata"]["resourceVersion"]},
            "status": to_plain(status)}

