"""Leader election on a coordination.k8s.io/v1 Lease: one controller reconciles.

With client-go's semantics, so that two controllers never lead at once:

- a leader that has not renewed within `renew_deadline_s` of its last
  successful renewal stops leading, whatever the reason (a write refused, the
  API server unreachable): it stops before the Lease can expire for anyone
  else, since `renew_deadline_s` < `duration_s`;
- a candidate times the holder's expiry from when *it* last saw the Lease
  record change, on its own monotonic clock, never from the renewTime the
  holder wrote (the two machines' clocks need not agree).

Pure timing decisions (`LeaseClock`) are separate from the API calls
(`LeaseElector`), so the rules are tested without a server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from kubernetes.client import V1LeaseSpec
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)


@dataclass
class LeaseClock:
    """What one candidate has seen of the Lease, on its own clock."""

    duration_s: float
    renew_deadline_s: float
    record: tuple | None = None  # (holder, renewTime, transitions) last seen
    seen_at: float = float("-inf")  # when that record was first seen
    renewed_at: float = float("-inf")  # when this candidate last renewed, as the holder

    def observe(self, record: tuple, now: float) -> None:
        if record != self.record:
            self.record, self.seen_at = record, now

    def expired(self, now: float) -> bool:
        """The holder's term is over: the record has not changed for a whole duration."""
        return now >= self.seen_at + self.duration_s

    def renewed(self, now: float) -> None:
        self.renewed_at = now

    def still_leading(self, now: float) -> bool:
        """A leader is one only within renew_deadline_s of its last renewal."""
        return now < self.renewed_at + self.renew_deadline_s


class LeaseElector:
    """Hold the Lease by renewing it; take it over once it has expired."""

    def __init__(self, api, namespace: str, name: str, identity: str,
                 duration_s: int = 15, renew_deadline_s: float | None = None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.api, self.namespace, self.name = api, namespace, name
        self.identity, self.duration_s, self.clock = identity, duration_s, clock
        self.monotonic = monotonic
        # client-go's defaults are 15 s and 10 s: two thirds of the duration.
        deadline = renew_deadline_s if renew_deadline_s is not None else duration_s * 2 / 3
        if not 0 < deadline < duration_s:
            raise ValueError(f"renew deadline {deadline:g} s must be within the lease "
                             f"duration {duration_s} s")
        self.lease_clock = LeaseClock(duration_s, deadline)

    @property
    def retry_period_s(self) -> float:
        """How often to try: several tries fit in one renew deadline."""
        return self.lease_clock.renew_deadline_s / 5

    def leading(self) -> bool:
        return self.lease_clock.still_leading(self.monotonic())

    def try_acquire_or_renew(self) -> bool:
        """Whether this candidate holds the Lease now. An API error is raised;
        the caller decides, by `leading()`, whether it still leads."""
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
            self.lease_clock.renewed(self.monotonic())
            return True
        spec = _spec(lease)
        holder = spec.holder_identity
        seen = self.monotonic()
        self.lease_clock.observe((holder, spec.renew_time, spec.lease_transitions), seen)
        if holder and holder != self.identity and not self.lease_clock.expired(seen):
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
        self.lease_clock.renewed(seen)
        return True

    def release(self) -> None:
        """Let the next candidate take over at once (on a clean shutdown)."""
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
            if _spec(lease).holder_identity != self.identity:
                return
            body = {"metadata": {"name": self.name, "namespace": self.namespace,
                                 "resourceVersion": lease.metadata.resource_version},
                    "spec": {"holderIdentity": "", "leaseDurationSeconds": 1,
                             "renewTime": _micro_time(0.0),
                             "leaseTransitions": _spec(lease).lease_transitions or 0}}
            self.api.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as error:
            log.warning("lease not released: %s", error.reason)


def _spec(lease) -> V1LeaseSpec:
    """The Lease's spec; an empty one (no holder) where it has none, which
    the API allows (a Lease made by hand, `kubectl create` with no spec)."""
    return lease.spec or V1LeaseSpec()


def _micro_time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
