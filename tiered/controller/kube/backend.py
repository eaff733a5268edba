"""The Kubernetes backend: the Reconciler's adapter for TieredModel resources.

It only observes and applies what the one Reconciler plans
(`tiered.controller.reconciler`):

- a finalizer, so the routing table forgets a deleted model before it goes;
- per tier and wanted version, a Deployment (or DaemonSet) whose init
  container builds the version (`tiered build`, which checks the sha256
  first) and a headless Service, owned by the TieredModel (garbage-collected
  with it) and replaced only when their desired form changes; a version is
  Ready once its workload has an available pod, Refused when a pod's build
  container failed (its JSON verdict is read from the termination message);
- the objects of a version the plan retires are deleted;
- the status through the status subresource, at the resourceVersion read
  (a 409 is a `Conflict`: re-read and reconcile again);
- the routing table, one ConfigMap for the namespace.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tiered.controller import desired, plan
from tiered.controller.crd import PLURAL
from tiered.controller.kube import render
from tiered.controller.reconciler import Rewrite, Stored, routed
from tiered.errors import ConfigError, Conflict
from tiered.protocol import routing
from tiered.rollout.spec import TieredModel, as_resource
from tiered.rollout.status import RolloutStatus, load_status
from tiered.rollout.wire import API_GROUP, API_VERSION, OLD_VERSIONS, to_plain

log = logging.getLogger(__name__)

WORKLOAD_KINDS = ("Deployment", "DaemonSet", "Service")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # on a Service's EndpointSlices


class KubeBackend:
    """Observes and applies for the Reconciler in one namespace."""

    def __init__(self, settings: render.ClusterSettings, api_client,
                 agent_addresses: Mapping[str, str],
                 progress: Callable[[str], None]) -> None:
        self.settings = settings
        self.namespace = settings.namespace
        self.agent_addresses = agent_addresses  # tests: service name -> address
        self.progress = progress
        self.custom = client.CustomObjectsApi(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.discovery = client.DiscoveryV1Api(api_client)
        self.autoscaling = client.AutoscalingV2Api(api_client)
        self._uids: dict[str, str] = {}  # owner references name the model's uid

    # -- the model --------------------------------------------------------------

    def read(self, name: str) -> Stored | None:
        try:
            obj = self._custom("get", name)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        self._uids[name] = obj["metadata"]["uid"]
        return _stored(obj, self._rewrite(obj))

    def _rewrite(self, obj: dict[str, Any]) -> Rewrite | None:
        """What to write when the object is stored at an older API version;
        None when it is not. Conversion between the versions is None (the API
        server only relabels), so the older view is read before any write
        (which would store the pruned view)."""
        if _rollout(obj) is not None or not obj.get("status"):
            return None
        for version in OLD_VERSIONS:
            try:
                older = self.custom.get_namespaced_custom_object(
                    API_GROUP, version, self.namespace, PLURAL, obj["metadata"]["name"])
            except ApiException as error:
                if error.status == 404:  # that version is no longer served
                    continue
                raise
            body = upgraded(obj, older)
            if body is not None:
                return Rewrite(version, body)
        return None

    def settle(self, stored: Stored) -> Stored:
        """Rewrite the model at the current API version (its spec, then its
        status) and add the finalizer, as the Reconciler asks."""
        obj = dict(stored.document)
        if stored.rewrite is not None:
            body = dict(stored.rewrite.body)
            status = body.pop("status")
            obj = self._replace_model(body)
            obj = self._custom("replace_status", stored.name, {**obj, "status": status})
            self.progress(f"{stored.name}: rewritten from {API_GROUP}/"
                          f"{stored.rewrite.from_version} as {API_VERSION}")
        metadata = dict(obj["metadata"])
        if render.FINALIZER not in (metadata.get("finalizers") or []):
            metadata["finalizers"] = [*(metadata.get("finalizers") or []), render.FINALIZER]
            obj = self._replace_model({**obj, "metadata": metadata})
        return _stored(obj)

    def finalize(self, stored: Stored) -> None:
        self.write_routing(without=stored.name)
        obj = dict(stored.document)
        obj["metadata"] = dict(obj["metadata"], finalizers=[
            f for f in obj["metadata"].get("finalizers") or [] if f != render.FINALIZER])
        self._replace_model(obj)
        self.progress(f"{stored.name}: deleted; its routes are gone")

    def write_status(self, stored: Stored, status) -> None:
        try:
            self._custom("replace_status", stored.name, render.status_body(stored.document,
                                                                           status))
        except ApiException as error:
            if error.status == 409:
                raise Conflict(f"{stored.name}: written by someone else since it was "
                               "read") from None
            raise

    def record(self, spec: TieredModel, made: plan.Plan, now: float) -> None:
        """Each step of the plan as a Kubernetes Event on the TieredModel (the
        status keeps the history); an Event that cannot be written is only logged."""
        for event in made.events:
            try:
                self.core.create_namespaced_event(self.namespace, render.event(
                    spec.name, self._uids.get(spec.name, ""), event, now, self.namespace))
            except ApiException as error:
                log.warning("%s: event not written: %s %s", spec.name, error.status,
                            error.reason)

    # -- agents -----------------------------------------------------------------

    def prepare(self, spec: TieredModel, wanted: plan.Versions,
                replicas: Mapping[tuple[str, int], int]
                ) -> tuple[dict[tuple[str, int], plan.VersionState], frozenset[int]]:
        owner = render.Owner(spec.name, self._uids[spec.name])
        for obj in render.desired_objects(spec, wanted.artifacts, wanted.wanted, owner,
                                          self.settings, replicas):
            self._apply(obj)
        others = self._scaled_by_others()
        states = {(tier, version): self._state(spec, tier, version, others)
                  for tier in spec.tiers for version in wanted.wanted}
        return states, frozenset(self._owned(spec))

    def agents(self, spec: TieredModel, rollout: RolloutStatus) -> Mapping[str, Sequence[str]]:
        """Every ready pod of each served version's workload, from the
        EndpointSlices of its headless Service (a Service address would reach
        one pod of several)."""
        return {tier: tuple(address for v in desired.served_versions(rollout)
                            for address in self._agent_pods(spec, tier, v))
                for tier in spec.tiers}

    def routers(self) -> Sequence[str]:
        """Every ready router pod behind the `--router` Service, else the
        address as given (one router, or not a Service of this cluster)."""
        if not self.settings.router:
            return ()
        host, _, _ = self.settings.router.rpartition(":")
        service, _, rest = host.partition(".")
        namespace = rest.split(".")[0] if rest.endswith(("svc", "svc.cluster.local")) else ""
        pods = self._endpoints(service, "grpc", namespace) if namespace else ()
        return pods or (self.settings.router,)

    def apply(self, spec: TieredModel, made: plan.Plan) -> None:
        """Size the workloads of the versions still wanted (the plan's replicas
        per tier and version; those on their way out keep theirs until they
        go); delete the objects of the versions it retires."""
        owner = render.Owner(spec.name, self._uids[spec.name])
        sized = sorted({version for _, version in made.replicas})
        for obj in render.desired_objects(spec, made.status.artifacts, sized, owner,
                                          self.settings, made.replicas):
            if obj["kind"] == "Deployment":  # unchanged ones are left alone (spec hash)
                self._apply(obj)
        for version, objects in self._owned(spec).items():
            if version not in made.retire:
                continue
            for kind, name in objects:
                self._call(kind, "delete", name, self.namespace)
                self.progress(f"deleted {kind} {name} (version {version} no longer served)")

    def write_routing(self, without: str | None = None) -> None:
        """The namespace's routing table, from every model's stored status."""
        items = self._custom("list")["items"]
        models = routed(_stored(item) for item in items
                        if item["metadata"]["name"] != without)
        name = self.settings.routing_configmap
        try:
            existing = self.core.read_namespaced_config_map(name, self.namespace)
        except ApiException as error:
            if error.status != 404:
                raise
            existing = None
        try:
            current = (existing.data or {}).get(render.ROUTING_KEY) if existing else None
            previous = routing.parse_table(yaml.safe_load(current)) if current else None
        except (ConfigError, yaml.YAMLError):
            previous = None  # a table we cannot read is replaced
        table = desired.next_table(previous, models.models, self._routable_agents,
                                   models.unreadable)
        if table is None:
            return  # unchanged: no write, no new version
        wanted = render.routing_configmap(table, self.settings)
        if existing is None:
            self.core.create_namespaced_config_map(self.namespace, wanted)
        else:
            wanted["metadata"]["resourceVersion"] = existing.metadata.resource_version
            self.core.replace_namespaced_config_map(name, self.namespace, wanted)

    # -- reading and writing ----------------------------------------------------

    def _custom(self, verb: str, *args: Any) -> Any:
        method = ("replace_namespaced_custom_object_status" if verb == "replace_status"
                  else f"{verb}_namespaced_custom_object")
        return getattr(self.custom, method)(API_GROUP, API_VERSION, self.namespace, PLURAL,
                                            *args)

    def _replace_model(self, obj: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._custom("replace", obj["metadata"]["name"], obj)
        except ApiException as error:
            if error.status == 409:
                raise Conflict(f"{obj['metadata']['name']} changed while reconciling") from None
            raise

    def _call(self, kind: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        """`verb` (read, create, replace, delete, list) on an owned kind."""
        api, suffix = {"Service": (self.core, "service"),
                       "Deployment": (self.apps, "deployment"),
                       "DaemonSet": (self.apps, "daemon_set")}[kind]
        return getattr(api, f"{verb}_namespaced_{suffix}")(*args, **kwargs)

    def _apply(self, obj: dict[str, Any]) -> None:
        kind, name = obj["kind"], obj["metadata"]["name"]
        try:
            existing = self._call(kind, "read", name, self.namespace)
        except ApiException as error:
            if error.status != 404:
                raise
            self._call(kind, "create", self.namespace, obj)
            self.progress(f"created {kind} {name}")
            return
        if (existing.metadata.annotations or {}).get(render.SPEC_HASH) == \
                obj["metadata"]["annotations"][render.SPEC_HASH]:
            return
        body = dict(obj, metadata={**obj["metadata"],
                                   "resourceVersion": existing.metadata.resource_version})
        if kind == "Deployment" and name in self._scaled_by_others():
            # An HPA (or KEDA) scales it: its replicas stay theirs, never fought over.
            body["spec"] = {**body["spec"], "replicas": existing.spec.replicas}
        self._call(kind, "replace", name, self.namespace, body)
        self.progress(f"updated {kind} {name}")

    def _scaled_by_others(self) -> frozenset[str]:
        """The Deployments of the namespace a HorizontalPodAutoscaler targets
        (KEDA's ScaledObjects make one too); none where HPAs cannot be listed."""
        try:
            found = self.autoscaling.list_namespaced_horizontal_pod_autoscaler(self.namespace)
        except ApiException as error:
            log.warning("HorizontalPodAutoscalers not listed (%s): replicas are set as the "
                        "plan says", error.status)
            return frozenset()
        return frozenset(hpa.spec.scale_target_ref.name for hpa in found.items
                         if hpa.spec.scale_target_ref.kind == "Deployment")

    def _owned(self, spec: TieredModel) -> dict[int, list[tuple[str, str]]]:
        """The model's workloads and Services, by version: (kind, name) each."""
        selector = f"{render.LABEL_MODEL}={render.dns_label(spec.name)}"
        owned: dict[int, list[tuple[str, str]]] = {}
        for kind in WORKLOAD_KINDS:
            for obj in self._call(kind, "list", self.namespace, label_selector=selector).items:
                version = int((obj.metadata.labels or {}).get(render.LABEL_VERSION, "0"))
                owned.setdefault(version, []).append((kind, obj.metadata.name))
        return owned

    def _state(self, spec: TieredModel, tier: str, version: int,
               scaled_by_others: frozenset[str] = frozenset()) -> plan.VersionState:
        """Its agents' state, and how many are ready where the plan sizes them
        (not a DaemonSet's, one a node, nor a Deployment an HPA scales)."""
        refused = self.settings.agent_pods.placement.refusal(spec.tiers[tier])
        if refused:
            return plan.VersionState(plan.REFUSED, refused)
        available = self._available(spec, tier, version)
        sized = None if spec.tiers[tier].per_node or render.workload_name(
            spec.name, tier, version) in scaled_by_others else available
        if available:
            return plan.VersionState(plan.READY, ready=sized)
        pods = self._pods(spec, tier, version)
        why = render.build_failure(pods)
        if why:
            return plan.VersionState(plan.REFUSED, why, ready=sized)
        return plan.VersionState(plan.PENDING,
                                 render.pod_progress(pods, datetime.now(timezone.utc)),
                                 ready=sized)

    def _available(self, spec: TieredModel, tier: str, version: int) -> int:
        """Its workload's available pods (none when it is not there yet)."""
        per_node = spec.tiers[tier].per_node
        try:
            workload = self._call("DaemonSet" if per_node else "Deployment", "read",
                                  render.workload_name(spec.name, tier, version),
                                  self.namespace)
        except ApiException as error:
            if error.status == 404:
                return 0
            raise
        status = workload.status
        if status is None:
            return 0
        return (status.number_available if per_node else status.available_replicas) or 0

    def _pods(self, spec: TieredModel, tier: str, version: int) -> list[dict[str, Any]]:
        """The pods of this tier and version, as plain JSON: the kubelet's
        status as it is (its build's verdict, how far it is from serving)."""
        response = self.core.list_namespaced_pod(
            self.namespace, label_selector=render.pod_selector(spec.name, tier, version),
            _preload_content=False)
        return json.loads(response.data).get("items") or []

    def _routable_agents(self, spec: TieredModel, tier: str, version: int) -> tuple[str, ...]:
        """The (tier, version)'s Service, except for a tier that may scale to
        zero while no pod of it is ready: none, so the table says it sleeps
        and the router holds what only it may answer until a pod serves."""
        service = render.agents_of(self.settings)(spec, tier, version)
        auto = spec.tiers[tier].autoscaling if tier in spec.tiers else None
        if auto is not None and auto.scale_to_zero and not self._agent_pods(spec, tier, version):
            return ()
        return tuple(service)

    def _agent_pods(self, spec: TieredModel, tier: str, version: int) -> tuple[str, ...]:
        service = render.workload_name(spec.name, tier, version)
        if service in self.agent_addresses:  # tests: agents outside the cluster
            return (self.agent_addresses[service],)
        return self._endpoints(service, "grpc", self.namespace)

    def _endpoints(self, service: str, port_name: str, namespace: str) -> tuple[str, ...]:
        """HOST:PORT of every ready endpoint of a Service, from its EndpointSlices."""
        slices = self.discovery.list_namespaced_endpoint_slice(
            namespace, label_selector=f"{SERVICE_NAME_LABEL}={service}")
        found = set()
        for piece in slices.items:
            port = next((p.port for p in piece.ports or () if p.name == port_name), None)
            if port is None:
                continue
            for endpoint in piece.endpoints or ():
                if endpoint.conditions is not None and endpoint.conditions.ready is False:
                    continue
                found.update(f"[{a}]:{port}" if ":" in a else f"{a}:{port}"
                             for a in endpoint.addresses)
        return tuple(sorted(found))


def _stored(obj: Mapping[str, Any], rewrite: Rewrite | None = None) -> Stored:
    metadata = obj["metadata"]
    return Stored(metadata["name"], obj, obj.get("status"), metadata.get("generation", 0),
                  metadata.get("resourceVersion"), bool(metadata.get("deletionTimestamp")),
                  held=render.FINALIZER in (metadata.get("finalizers") or []), rewrite=rewrite)


def _rollout(obj: Mapping[str, Any]) -> RolloutStatus | None:
    """The rollout in a TieredModel's status, read at the object's apiVersion;
    None when there is none or it does not read."""
    try:
        return load_status(obj.get("status"), "status",
                           obj["apiVersion"].partition("/")[2]).rollout
    except ConfigError:
        return None


def upgraded(current: Mapping[str, Any], older: Mapping[str, Any]) -> dict[str, Any] | None:
    """The object to write at the current API version when `older` (the same
    object read at an older version) is what is stored; None otherwise.

    Only a controller writes a status, and a status stored at one version never
    reads as a rollout at the other (the renamed `stableVersion` is required):
    so the object is stored at the older version when its rollout reads there
    and not here. The status goes under "status", for a separate write."""
    if _rollout(current) is not None or _rollout(older) is None:
        return None
    version = older["apiVersion"].partition("/")[2]
    body = as_resource({k: v for k, v in older.items() if k != "status"})
    body["metadata"] = dict(current["metadata"])  # its resourceVersion guards the write
    body["status"] = to_plain(load_status(older["status"], "status", version))
    return body
