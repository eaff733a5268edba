"""Leader election on a coordination.k8s.io/v1 Lease: one controller reconciles."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone

from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)


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
