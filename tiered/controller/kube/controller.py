"""The Kubernetes controller process: leader election, the watch, the work queue.

Level-based, as controllers are: a watch on TieredModels (resumed from its
resourceVersion, re-listed on 410 Gone) and a periodic resync put names on a
work queue; each name is reconciled by the one Reconciler both backends share
(`tiered.controller.reconciler`) through `KubeBackend`. Only the elected
leader reconciles (a coordination.k8s.io Lease); errors requeue with per-name
exponential backoff.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tiered.controller import plan
from tiered.controller.crd import PLURAL
from tiered.controller.judge import RolloutJudge
from tiered.controller.kube import render
from tiered.controller.kube.backend import KubeBackend
from tiered.controller.kube.lease import LeaseElector
from tiered.controller.kube.queue import WorkQueue
from tiered.controller.reconciler import Reconciler
from tiered.errors import Conflict, TieredError
from tiered.protocol.security import PLAINTEXT, ChannelCache, TransportSecurity
from tiered.rollout.wire import API_GROUP, API_VERSION

log = logging.getLogger(__name__)

RESYNC_S = 30.0
WATCH_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class ControllerOptions:
    identity: str = "tiered-controller"
    leader_elect: bool = True
    lease_name: str = "tiered-controller"
    lease_duration_s: int = 15
    resync_s: float = RESYNC_S
    retire_grace_s: float = plan.RETIRE_GRACE_S
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
        self.backend = KubeBackend(settings, api_client, options.agent_addresses, self.progress)
        self.reconciler = Reconciler(self.backend, RolloutJudge(ChannelCache(options.transport)),
                                     clock=clock, progress=self.progress,
                                     retire_grace_s=options.retire_grace_s)
        self.elector = LeaseElector(client.CoordinationV1Api(api_client), settings.namespace,
                                    options.lease_name, options.identity,
                                    options.lease_duration_s, clock=clock)
        self.queue = WorkQueue()
        self.leading = threading.Event()  # set while this controller's term lasts

    # -- running ----------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Campaign for the lease; while leading, watch and reconcile."""
        while not stop.is_set():
            if self.options.leader_elect and not self._acquire(stop):
                continue
            self.progress(f"leading: reconciling TieredModels in {self.settings.namespace}")
            self.leading.set()
            threads = [threading.Thread(target=self._watch, args=(stop,), daemon=True),
                       threading.Thread(target=self._work, args=(stop,), daemon=True)]
            for thread in threads:
                thread.start()
            while not stop.is_set() and self.leading.is_set():
                stop.wait(self.elector.retry_period_s)
                if self.options.leader_elect and not self._renew():
                    self.progress("lost the lease: no longer leading")
                    self.leading.clear()
                elif not all(thread.is_alive() for thread in threads):
                    # A renewal that came past the renew deadline (a busy
                    # machine) ended the watch and the worker, while the Lease
                    # is still ours: a new term starts them again.
                    self.progress("a renewal came late: starting the term again")
                    self.leading.clear()
            self.leading.clear()
            for thread in threads:  # a watch blocked on a quiet stream ends with the process
                thread.join(2.0)
        if self.options.leader_elect:
            self.elector.release()

    def is_leading(self) -> bool:
        """In a term, and (with leader election) renewed within the renew
        deadline: checked before every reconcile, so a leader whose renewals
        hang stops on time even before its renew loop notices."""
        return self.leading.is_set() and (not self.options.leader_elect
                                          or self.elector.leading())

    def _acquire(self, stop: threading.Event) -> bool:
        try:
            if self.elector.try_acquire_or_renew():
                return True
        except Exception as error:  # noqa: BLE001 -- the API may be away: keep campaigning
            log.warning("lease: %s", error)
        stop.wait(self.elector.retry_period_s)
        return False

    def _renew(self) -> bool:
        """Whether the term goes on: a renewal refused because another holds
        the Lease ends it; a failed one ends it once the renew deadline passes."""
        try:
            return self.elector.try_acquire_or_renew()
        except Exception as error:  # noqa: BLE001 -- one failed renewal is not yet a loss
            log.warning("lease renewal: %s", error)
            return self.elector.leading()

    def _watch(self, stop: threading.Event) -> None:
        version = None
        while not stop.is_set() and self.is_leading():
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
                    if stop.is_set() or not self.is_leading():
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

    def _work(self, stop: threading.Event) -> None:
        next_resync = time.monotonic() + self.options.resync_s
        while not stop.is_set() and self.is_leading():
            if time.monotonic() >= next_resync:
                next_resync = time.monotonic() + self.options.resync_s
                for name in self._names():
                    self.queue.add(name)
            name = self.queue.get(stop, poll_s=0.5)
            if name is None or not self.is_leading():
                continue
            try:
                after = self.reconciler.reconcile(name)
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
