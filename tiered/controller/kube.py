"""The Kubernetes backend: the controller over TieredModel resources.

Level-based, as controllers are: a watch on TieredModels (resumed from its
resourceVersion, re-listed on 410 Gone) and a periodic resync put names on a
work queue; `reconcile(name)` reads the object, computes what should exist
from spec + status (`tiered.controller.render`, pure) and makes it so:

- a finalizer, so the routing table forgets a deleted model before it goes;
- the artifact's version number (kept in status.artifacts);
- per tier and served version, a Deployment (or DaemonSet) and a headless
  Service, owned by the TieredModel (garbage-collected with it), replaced
  only when their desired form changes; versions no longer served are
  deleted after a grace period that lets every router read a table without
  them;
- the rollout: a new version starts once its agents are available on every
  tier; a live one is judged from the agents' Telemetry.Stats and the
  router's shadow counters with the same rollout engine as the local backend;
- the status, through the status subresource, at the resourceVersion read
  (a 409 means someone wrote first: re-read and reconcile again);
- the router's routing table, one ConfigMap for the namespace.

Only the elected leader reconciles (a coordination.k8s.io Lease); errors
requeue with per-name exponential backoff.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

import yaml
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tiered.controller import desired, render
from tiered.controller.crd import PLURAL
from tiered.controller.judge import RolloutJudge
from tiered.errors import ConfigError, Conflict, TieredError
from tiered.protocol.security import PLAINTEXT, ChannelCache, TransportSecurity
from tiered.rollout import engine
from tiered.rollout.spec import (
    API_GROUP,
    API_VERSION,
    TieredModel,
    TieredModelStatus,
    load_tiered_model,
)

log = logging.getLogger(__name__)

RESYNC_S = 30.0
WATCH_TIMEOUT_S = 60
RETIRE_GRACE_S = 120.0  # kubelet refreshes mounted ConfigMaps within about a minute
WAIT_AVAILABLE_S = 5.0
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
RETIRE_AFTER = f"{API_GROUP}/retire-after"
WORKLOAD_KINDS = ("Deployment", "DaemonSet", "Service")


class LeaseElector:
    """Leader election on a coordination.k8s.io/v1 Lease, as client-go does it:
    hold the lease by renewing it; take it over once it has expired."""

    def __init__(self, api, namespace: str, name: str, identity: str,
                 duration_s: int = 15, clock: Callable[[], float] = time.time) -> None:
        self.api, self.namespace, self.name = api, namespace, name
        self.identity, self.duration_s, self.clock = identity, duration_s, clock

    def try_acquire_or_renew(self) -> bool:
        now = _micro_time(self.clock())
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as error:
            if error.status != 404:
                raise
            body = {"metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {"holderIdentity": self.identity,
                             "leaseDurationSeconds": self.duration_s,
                             "acquireTime": now, "renewTime": now, "leaseTransitions": 0}}
            try:
                self.api.create_namespaced_lease(self.namespace, body)
            except ApiException as create_error:
                if create_error.status == 409:
                    return False  # another candidate created it first
                raise
            return True
        spec = lease.spec
        holder = spec.holder_identity
        renewed = spec.renew_time.timestamp() if spec.renew_time else 0.0
        expired = renewed + (spec.lease_duration_seconds or self.duration_s) < self.clock()
        if holder != self.identity and not expired:
            return False
        transitions = (spec.lease_transitions or 0) + (holder != self.identity)
        body = {"metadata": {"name": self.name, "namespace": self.namespace,
                             "resourceVersion": lease.metadata.resource_version},
                "spec": {"holderIdentity": self.identity,
                         "leaseDurationSeconds": self.duration_s,
                         "acquireTime": (now if holder != self.identity else
                                         _micro_time(spec.acquire_time.timestamp())
                                         if spec.acquire_time else now),
                         "renewTime": now, "leaseTransitions": transitions}}
        try:
            self.api.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as error:
            if error.status == 409:
                return False  # someone renewed or took it in between
            raise
        return True

    def release(self) -> None:
        """Let the next candidate take over at once (on a clean shutdown)."""
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
            if lease.spec.holder_identity != self.identity:
                return
            body = {"metadata": {"name": self.name, "namespace": self.namespace,
                                 "resourceVersion": lease.metadata.resource_version},
                    "spec": {"holderIdentity": "", "leaseDurationSeconds": 1,
                             "renewTime": _micro_time(0.0),
                             "leaseTransitions": lease.spec.lease_transitions or 0}}
            self.api.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as error:
            log.warning("lease not released: %s", error.reason)


def _micro_time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class WorkQueue:
    """Names due at a time, each queued once; failures back off per name."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._due: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._failures: dict[str, int] = {}
        self._wake = threading.Condition()

    def add(self, name: str, after_s: float = 0.0) -> None:
        with self._wake:
            due = self._clock() + max(0.0, after_s)
            if name in self._due and self._due[name] <= due:
                return
            self._due[name] = due
            heapq.heappush(self._heap, (due, name))
            self._wake.notify()

    def get(self, stop: threading.Event, poll_s: float = 0.5) -> str | None:
        with self._wake:
            while not stop.is_set():
                while self._heap and self._due.get(self._heap[0][1]) != self._heap[0][0]:
                    heapq.heappop(self._heap)  # superseded by an earlier due time
                if self._heap and self._heap[0][0] <= self._clock():
                    _, name = heapq.heappop(self._heap)
                    del self._due[name]
                    return name
                wait = self._heap[0][0] - self._clock() if self._heap else poll_s
                self._wake.wait(min(poll_s, max(0.0, wait)))
        return None

    def done(self, name: str, requeue_after_s: float | None, failed: bool) -> float | None:
        """Requeue as asked, or after the name's next backoff step when it failed."""
        if failed:
            count = self._failures.get(name, 0)
            self._failures[name] = count + 1
            requeue_after_s = BACKOFF_S[min(count, len(BACKOFF_S) - 1)]
        else:
            self._failures.pop(name, None)
        if requeue_after_s is not None:
            self.add(name, requeue_after_s)
        return requeue_after_s


@dataclasses.dataclass(frozen=True)
class ControllerOptions:
    identity: str = "tiered-controller"
    leader_elect: bool = True
    lease_name: str = "tiered-controller"
    lease_duration_s: int = 15
    resync_s: float = RESYNC_S
    retire_grace_s: float = RETIRE_GRACE_S
    agent_addresses: Mapping[str, str] = dataclasses.field(default_factory=dict)  # tests
    transport: TransportSecurity = PLAINTEXT  # channels to the agents' Telemetry service


class KubeController:
    """Reconciles the TieredModels of one namespace."""

    def __init__(self, settings: render.ClusterSettings, api_client, *,
                 options: ControllerOptions = ControllerOptions(),
                 clock: Callable[[], float] = time.time,
                 progress: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.options = options
        self.clock = clock
        self.progress = progress or (lambda line: log.info("%s", line))
        self.custom = client.CustomObjectsApi(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.elector = LeaseElector(client.CoordinationV1Api(api_client), settings.namespace,
                                    options.lease_name, options.identity,
                                    options.lease_duration_s, clock)
        self.queue = WorkQueue()
        self.judge = RolloutJudge(ChannelCache(options.transport))
        self._table_version = 0

    # -- running ----------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Campaign for the lease; while leading, watch and reconcile."""
        while not stop.is_set():
            if self.options.leader_elect and not self._acquire(stop):
                continue
            self.progress(f"leading: reconciling TieredModels in {self.settings.namespace}")
            leading = threading.Event()
            leading.set()
            threads = [threading.Thread(target=self._watch, args=(stop, leading), daemon=True),
                       threading.Thread(target=self._work, args=(stop, leading), daemon=True)]
            for thread in threads:
                thread.start()
            while not stop.is_set() and leading.is_set():
                stop.wait(self.elector.duration_s / 3)
                if self.options.leader_elect and not self._renew():
                    self.progress("lost the lease: no longer leading")
                    leading.clear()
            leading.clear()
            for thread in threads:  # a watch blocked on a quiet stream ends with the process
                thread.join(2.0)
        if self.options.leader_elect:
            self.elector.release()

    def _acquire(self, stop: threading.Event) -> bool:
        try:
            if self.elector.try_acquire_or_renew():
                return True
        except Exception as error:  # noqa: BLE001 -- the API may be away: keep campaigning
            log.warning("lease: %s", error)
        stop.wait(self.elector.duration_s / 3)
        return False

    def _renew(self) -> bool:
        try:
            return self.elector.try_acquire_or_renew()
        except Exception as error:  # noqa: BLE001 -- one failed renewal is not yet a loss
            log.warning("lease renewal: %s", error)
            return True

    def _watch(self, stop: threading.Event, leading: threading.Event) -> None:
        version = None
        while not stop.is_set() and leading.is_set():
            try:
                if version is None:  # (re)list: every name once, and where to watch from
                    listing = self.custom.list_namespaced_custom_object(
                        API_GROUP, API_VERSION, self.settings.namespace, PLURAL)
                    version = listing["metadata"]["resourceVersion"]
                    for item in listing["items"]:
                        self.queue.add(item["metadata"]["name"])
                stream = watch.Watch().stream(
                    self.custom.list_namespaced_custom_object, API_GROUP, API_VERSION,
                    self.settings.namespace, PLURAL, resource_version=version,
                    timeout_seconds=WATCH_TIMEOUT_S)
                for event in stream:
                    if stop.is_set() or not leading.is_set():
                        return
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        if obj.get("code") == 410:
                            version = None  # too old: re-list
                            break
                        raise TieredError(f"watch error: {obj.get('message')}")
                    version = obj["metadata"]["resourceVersion"]
                    self.queue.add(obj["metadata"]["name"])
            except ApiException as error:
                if error.status == 410:
                    version = None
                    continue
                log.warning("watch: %s %s; retrying", error.status, error.reason)
                stop.wait(1.0)
            except Exception as error:  # noqa: BLE001 -- connection loss: watch again
                log.warning("watch: %s; retrying", error)
                stop.wait(1.0)

    def _work(self, stop: threading.Event, leading: threading.Event) -> None:
        next_resync = time.monotonic() + self.options.resync_s
        while not stop.is_set() and leading.is_set():
            if time.monotonic() >= next_resync:
                next_resync = time.monotonic() + self.options.resync_s
                for name in self._names():
                    self.queue.add(name)
            name = self.queue.get(stop, poll_s=0.5)
            if name is None or not leading.is_set():
                continue
            try:
                after = self.reconcile(name)
            except Conflict as error:
                log.info("%s: %s", name, error)
                self.queue.done(name, 0.0, failed=False)
            except Exception as error:  # noqa: BLE001 -- requeued with backoff
                delay = self.queue.done(name, None, failed=True)
                self.progress(f"{name}: reconcile failed ({error}); again in {delay:g} s")
            else:
                self.queue.done(name, after, failed=False)

    def _names(self) -> list[str]:
        try:
            listing = self.custom.list_namespaced_custom_object(
                API_GROUP, API_VERSION, self.settings.namespace, PLURAL)
        except Exception as error:  # noqa: BLE001 -- the next resync tries again
            log.warning("resync list: %s", error)
            return []
        return [item["metadata"]["name"] for item in listing["items"]]

    # -- reconcile --------------------------------------------------------------

    def reconcile(self, name: str) -> float | None:
        """Make the world match one TieredModel; seconds until it wants another look."""
        try:
            obj = self.custom.get_namespaced_custom_object(
                API_GROUP, API_VERSION, self.settings.namespace, PLURAL, name)
        except ApiException as error:
            if error.status != 404:
                raise
            self.judge.forget(name)
            self._write_routing()
            return None
        metadata = obj["metadata"]
        if metadata.get("deletionTimestamp"):
            return self._finalize(obj)
        if render.FINALIZER not in (metadata.get("finalizers") or []):
            obj["metadata"]["finalizers"] = [*(metadata.get("finalizers") or []),
                                             render.FINALIZER]
            obj = self._replace_model(obj)
        try:
            spec = load_tiered_model(obj, name)
            if spec.artifact.sha256 is None:
                raise ConfigError("artifact.sha256: required on Kubernetes (`tiered apply "
                                  "--kubernetes` pins it when the artifact is a local file)")
        except ConfigError as error:
            self._write_status(obj, dataclasses.replace(self._status(obj), message=str(error)))
            return None  # nothing to do until the spec changes (the watch will say)
        return self._reconcile(obj, spec)

    def _reconcile(self, obj: dict[str, Any], spec: TieredModel) -> float | None:
        now = self.clock()
        current = self._status(obj)
        owner = render.Owner(spec.name, obj["metadata"]["uid"])
        target, artifacts = desired.version_of(spec.artifact, current.artifacts)
        rollout = current.rollout
        wanted = desired.wanted_versions(rollout, target)
        self._apply(render.desired_objects(spec, rollout, artifacts, wanted, owner,
                                           self.settings))
        waiting = [tier for tier in spec.tiers if target in wanted
                   and target not in desired.served_versions(rollout)
                   and not self._available(spec, tier, target)]
        requeue: float | None = self.options.resync_s
        if waiting:
            refused = {tier: why for tier in waiting
                       if (why := self._build_failure(spec, tier, target))}
            if refused:
                message = f"version {target} refused: " + "; ".join(
                    f"{tier}: {why}" for tier, why in refused.items())
            else:
                message = (f"version {target}: waiting for its agents on "
                           f"{', '.join(waiting)} (building and starting)")
            requeue = WAIT_AVAILABLE_S
        else:
            transition = desired.follow_spec(spec, rollout, target, now)
            if transition is not None:
                rollout = transition.status
                self.progress(f"{spec.name}: {transition.reason}")
            if desired.live(rollout):
                agents = {tier: tuple(self._address(spec, tier, v)
                                      for v in desired.served_versions(rollout))
                          for tier in spec.tiers}
                decision, _ = self.judge.judge(spec, rollout, agents,
                                               self.settings.router_metrics, now)
                rollout = decision.status
                if decision.action != engine.HOLD:
                    self.progress(f"{spec.name}: {decision.action}: {decision.reason}")
                requeue = decision.requeue_after_s
                if requeue is None or requeue > spec.rollout.analysis.interval_s:
                    requeue = spec.rollout.analysis.interval_s
            else:
                self.judge.forget(spec.name)
            message = rollout.message
        retire_in = self._retire(spec, desired.wanted_versions(rollout, target), now)
        status = TieredModelStatus(
            rollout=rollout, artifacts=artifacts, **render.status_fields(spec, rollout),
            observed_generation=obj["metadata"].get("generation", 0), message=message)
        self._write_status(obj, status)
        self._write_routing()
        return min(v for v in (requeue, retire_in, self.options.resync_s) if v is not None)

    def _finalize(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        self.judge.forget(name)
        self._write_routing(without=name)
        finalizers = [f for f in obj["metadata"].get("finalizers") or []
                      if f != render.FINALIZER]
        obj["metadata"]["finalizers"] = finalizers
        self._replace_model(obj)
        self.progress(f"{name}: deleted; its routes are gone")

    # -- reading and writing ----------------------------------------------------

    def _status(self, obj: Mapping[str, Any]) -> TieredModelStatus:
        try:
            return render.decode_status(obj)
        except ConfigError as error:  # a status we cannot read is rebuilt, and says so
            log.warning("%s", error)
            return TieredModelStatus(message=f"status unreadable, rebuilt: {error}")

    def _replace_model(self, obj: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.custom.replace_namespaced_custom_object(
                API_GROUP, API_VERSION, self.settings.namespace, PLURAL,
                obj["metadata"]["name"], obj)
        except ApiException as error:
            if error.status == 409:
                raise Conflict(f"{obj['metadata']['name']} changed while reconciling") from None
            raise

    def _write_status(self, obj: dict[str, Any], status: TieredModelStatus) -> None:
        body = render.status_body(obj, status)
        if body["status"] == obj.get("status"):
            return
        try:
            self.custom.replace_namespaced_custom_object_status(
                API_GROUP, API_VERSION, self.settings.namespace, PLURAL,
                obj["metadata"]["name"], body)
        except ApiException as error:
            if error.status == 409:
                raise Conflict(f"{obj['metadata']['name']}: written by someone else since "
                               "it was read") from None
            raise

    def _write_routing(self, without: str | None = None) -> None:
        """The namespace's routing table, from every model's stored status."""
        listing = self.custom.list_namespaced_custom_object(
            API_GROUP, API_VERSION, self.settings.namespace, PLURAL)
        models = []
        for item in listing["items"]:
            if item["metadata"]["name"] == without or item["metadata"].get("deletionTimestamp"):
                continue
            status = self._status(item).rollout
            try:
                spec = load_tiered_model(item, item["metadata"]["name"])
            except ConfigError:
                continue
            if status is not None:
                models.append((spec, status))
        name = self.settings.routing_configmap
        try:
            existing = self.core.read_namespaced_config_map(name, self.settings.namespace)
            current = (existing.data or {}).get(render.ROUTING_KEY)
        except ApiException as error:
            if error.status != 404:
                raise
            existing, current = None, None
        table = (yaml.safe_load(current) or {}) if current else {}
        version = table.get("version", 0)
        wanted = render.routing_configmap(models, version + 1, self.settings)
        if current and table.get("models") == yaml.safe_load(
                wanted["data"][render.ROUTING_KEY])["models"]:
            return  # unchanged: no write, no new version
        if existing is None:
            self.core.create_namespaced_config_map(self.settings.namespace, wanted)
        else:
            wanted["metadata"]["resourceVersion"] = existing.metadata.resource_version
            self.core.replace_namespaced_config_map(name, self.settings.namespace, wanted)

    # -- owned objects ----------------------------------------------------------

    def _call(self, kind: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        """`verb` (read, create, replace, patch, delete, list) on an owned kind."""
        api, suffix = {"Service": (self.core, "service"),
                       "Deployment": (self.apps, "deployment"),
                       "DaemonSet": (self.apps, "daemon_set")}[kind]
        return getattr(api, f"{verb}_namespaced_{suffix}")(*args, **kwargs)

    def _apply(self, objects: list[dict[str, Any]]) -> None:
        for obj in objects:
            kind = obj["kind"]
            name, namespace = obj["metadata"]["name"], self.settings.namespace
            try:
                existing = self._call(kind, "read", name, namespace)
            except ApiException as error:
                if error.status != 404:
                    raise
                self._call(kind, "create", namespace, obj)
                self.progress(f"created {obj['kind']} {name}")
                continue
            annotations = existing.metadata.annotations or {}
            if (annotations.get(render.SPEC_HASH) == obj["metadata"]["annotations"][
                    render.SPEC_HASH] and RETIRE_AFTER not in annotations):
                continue
            body = dict(obj, metadata={**obj["metadata"],
                                       "resourceVersion": existing.metadata.resource_version})
            self._call(kind, "replace", name, namespace, body)
            self.progress(f"updated {obj['kind']} {name}")

    def _available(self, spec: TieredModel, tier: str, version: int) -> bool:
        per_node = spec.tiers[tier].per_node
        try:
            workload = self._call("DaemonSet" if per_node else "Deployment", "read",
                                  render.workload_name(spec.name, tier, version),
                                  self.settings.namespace)
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        status = workload.status
        if status is None:
            return False
        ready = status.number_available if per_node else status.available_replicas
        return bool(ready and ready >= 1)

    def _build_failure(self, spec: TieredModel, tier: str, version: int) -> str | None:
        """Why the build failed on a pod of this tier and version, if it did (a
        sha256 mismatch, an engine that refused the model)."""
        response = self.core.list_namespaced_pod(
            self.settings.namespace, label_selector=render.pod_selector(spec.name, tier, version),
            _preload_content=False)  # plain JSON: the kubelet's status as it is
        return render.build_failure(json.loads(response.data).get("items") or [])

    def _retire(self, spec: TieredModel, served: tuple[int, ...], now: float) -> float | None:
        """Delete owned objects of versions no longer served, once their grace has
        passed (marked on the object, so a restarted controller keeps the count);
        seconds until the next one is due, if any."""
        selector = f"{render.LABEL_MODEL}={render.dns_label(spec.name)}"
        due = []
        for kind in WORKLOAD_KINDS:
            listing = self._call(kind, "list", self.settings.namespace, label_selector=selector)
            for obj in listing.items:
                version = int((obj.metadata.labels or {}).get(render.LABEL_VERSION, "0"))
                if version in served:
                    continue
                annotations = obj.metadata.annotations or {}
                if RETIRE_AFTER not in annotations:
                    after = now + self.options.retire_grace_s
                    patch = {"metadata": {"annotations": {RETIRE_AFTER: f"{after:.0f}"}}}
                    self._call(kind, "patch", obj.metadata.name, self.settings.namespace, patch)
                    due.append(self.options.retire_grace_s)
                elif now >= float(annotations[RETIRE_AFTER]):
                    self._call(kind, "delete", obj.metadata.name, self.settings.namespace)
                    self.progress(f"deleted {kind} {obj.metadata.name} (version {version} "
                                  "no longer served)")
                else:
                    due.append(float(annotations[RETIRE_AFTER]) - now)
        return min(due) if due else None

    def _address(self, spec: TieredModel, tier: str, version: int) -> str:
        service = render.workload_name(spec.name, tier, version)
        return self.options.agent_addresses.get(
            service, render.agent_address(spec.name, tier, version, self.settings.namespace))
