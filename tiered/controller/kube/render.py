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
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from tiered import names
from tiered.controller import desired, plan
from tiered.protocol import routing
from tiered.protocol.verdict import read_verdict
from tiered.rollout.spec import (
    API_GROUP,
    API_VERSION,
    KIND,
    ArtifactVersion,
    TieredModel,
    TieredModelStatus,
    to_plain,
)

AGENT_PORT = 8001
AGENT_METRICS_PORT = 8002
MODELS_DIR = "/models"
TLS_DIR = "/etc/tiered/tls"
ROUTING_KEY = "routing.yaml"
GPU_TIERS = (names.Tier.REGIONAL, names.Tier.DATACENTER)

LABEL_MODEL = f"{API_GROUP}/model"
LABEL_TIER = f"{API_GROUP}/tier"
LABEL_VERSION = f"{API_GROUP}/version"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
MANAGER = "tiered-controller"
SPEC_HASH = f"{API_GROUP}/spec-hash"
FINALIZER = f"{API_GROUP}/routing"
BUILD_CONTAINER = "build"  # the init container that verifies and builds the artifact
TERMINATION_LOG = "/dev/termination-log"


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
                   settings: ClusterSettings) -> dict[str, Any]:
    """The Deployment (or DaemonSet) serving `artifact`'s version on `tier`."""
    tier_spec = spec.tiers[tier]
    labels = _labels(spec.name, tier, artifact.version)
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
    resources = {k: dict(v) for k, v in (("requests", tier_spec.resources.requests),
                                         ("limits", tier_spec.resources.limits)) if v}
    pod = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001},
        "initContainers": [{
            "name": BUILD_CONTAINER, "image": image,
            "imagePullPolicy": settings.image_pull_policy,
            "command": ["tiered", *desired.build_args(spec, tier, artifact, MODELS_DIR),
                        "--termination-log", TERMINATION_LOG],
            "volumeMounts": mounts,
            "securityContext": SECURITY_CONTEXT, "resources": resources,
            # The build writes its JSON verdict where the kubelet reads the
            # termination message (its last log lines when it could not).
            "terminationMessagePath": TERMINATION_LOG,
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }],
        "containers": [{
            "name": "agent", "image": image, "imagePullPolicy": settings.image_pull_policy,
            "command": ["tiered", "agent", "--tier", tier, "--model-repository", MODELS_DIR,
                        "--host", "0.0.0.0", "--port", str(AGENT_PORT),
                        "--metrics-port", str(AGENT_METRICS_PORT), *security],
            "ports": [{"name": "grpc", "containerPort": AGENT_PORT},
                      {"name": "metrics", "containerPort": AGENT_METRICS_PORT}],
            "readinessProbe": {**probe, "periodSeconds": 5},
            "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
            "volumeMounts": agent_mounts, "securityContext": SECURITY_CONTEXT,
            "resources": resources,
        }],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 45,  # the agent drains in-flight requests
    }
    if tier_spec.node_selector:
        pod["nodeSelector"] = dict(tier_spec.node_selector)
    if tier_spec.tolerations:
        pod["tolerations"] = [{k: v for k, v in (("key", t.key), ("operator", t.operator),
                                                 ("value", t.value), ("effect", t.effect)) if v}
                              for t in tier_spec.tolerations]
    template = {"metadata": {"labels": labels}, "spec": pod}
    workload_spec: dict[str, Any] = {"selector": {"matchLabels": labels}, "template": template}
    if not tier_spec.per_node:
        workload_spec["replicas"] = tier_spec.replicas
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
    labels = _labels(spec.name, tier, version)
    return _with_hash({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": workload_name(spec.name, tier, version),
                     "namespace": settings.namespace, "labels": labels,
                     "ownerReferences": [_owner_reference(owner)]},
        "spec": {"clusterIP": "None", "selector": labels,
                 "ports": [{"name": "grpc", "port": AGENT_PORT, "targetPort": "grpc"},
                           {"name": "metrics", "port": AGENT_METRICS_PORT,
                            "targetPort": "metrics"}]},
    })


def desired_objects(spec: TieredModel, artifacts: Sequence[ArtifactVersion],
                    versions: Sequence[int],
                    owner: Owner, settings: ClusterSettings) -> list[dict[str, Any]]:
    """Workloads and Services for `versions` on each of the model's tiers."""
    by_version = {a.version: a for a in artifacts}
    objects = []
    for tier in (t for t in names.TIERS if t in spec.tiers):
        for version in sorted(versions):
            objects.append(agent_workload(spec, tier, by_version[version], owner, settings))
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

