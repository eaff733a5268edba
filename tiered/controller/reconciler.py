"""The one Reconciler both backends run: read, observe, plan, apply.

`reconcile(name)` is level-based: it reads the model and its stored status
through the backend, lets the backend observe (and bring about) the agents
of the versions the spec wants, reads the live stage's telemetry when the
rollout is judged (and each autoscaled tier's load), asks the pure plan (`tiered.controller.plan`) what should
be, and has the backend apply it: versions kept or retired, the status
written at the revision read (a `Conflict` means someone wrote first: the
caller reconciles again), the routing table rewritten from every model.

A backend is an adapter with nothing to decide: the local one keeps models in
a SQLite store and runs agents as processes on this machine; the Kubernetes
one keeps TieredModel resources and runs Deployments. A difference in
behaviour between them is a bug.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tiered.controller import desired, plan
from tiered.controller.judge import RolloutJudge
from tiered.controller.metrics import RolloutMetrics
from tiered.errors import ConfigError
from tiered.rollout.spec import TieredModel, load_tiered_model
from tiered.rollout.status import RolloutStatus, TieredModelStatus, load_status
from tiered.rollout.wire import to_plain

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rewrite:
    """A model stored at an older API version, and its form at the current one
    (the status under "status")."""

    from_version: str
    body: Mapping[str, Any]


@dataclass(frozen=True)
class Stored:
    """One model as a backend keeps it: the document and its status, plain."""

    name: str
    document: Mapping[str, Any]  # what load_tiered_model reads
    status: Mapping[str, Any] | None
    generation: int
    revision: Any = None  # what a write must match (the store's revision)
    deleting: bool = False  # Kubernetes: a deletionTimestamp is set
    held: bool = True  # Kubernetes: it carries the controller's finalizer
    rewrite: Rewrite | None = None  # Kubernetes: stored at an older API version

    @property
    def settled(self) -> bool:
        """Kept as the controller keeps a model: at the current API version,
        held by its finalizer (always, in the local store)."""
        return self.held and self.rewrite is None


def decode_status(name: str, plain: Mapping[str, Any] | None) -> TieredModelStatus:
    """A stored status; ConfigError naming the field when it is malformed."""
    return load_status(plain, f"{name}.status")


def readable_status(stored: Stored) -> TieredModelStatus:
    """The stored status, or a fresh one that says why the stored one was unreadable."""
    try:
        return decode_status(stored.name, stored.status)
    except ConfigError as error:
        log.warning("%s", error)
        return TieredModelStatus(message=f"status unreadable, rebuilt: {error}")


@dataclass(frozen=True)
class Routed:
    """What the routing table is made from: each model serving a version with
    its rollout, and the models whose spec or status cannot be read now (a
    spec edited into one the controller refuses, a status being rewritten):
    those keep the routes the last table gave them."""
    models: list[tuple[TieredModel, RolloutStatus]]
    unreadable: frozenset[str]


def routed(models: Iterable[Stored]) -> Routed:
    """The models the routing table names: those serving a version."""
    routes, unreadable = [], set()
    for stored in models:
        if stored.deleting:
            continue
        try:
            spec = load_tiered_model(stored.document, stored.name)
            rollout = decode_status(stored.name, stored.status).rollout
        except ConfigError as error:
            log.warning("%s keeps its routes until it reads again: %s", stored.name, error)
            unreadable.add(stored.name)
            continue
        if rollout is not None:
            routes.append((spec, rollout))
    return Routed(routes, frozenset(unreadable))


def autoscaled(spec: TieredModel) -> bool:
    return any(tier.autoscaling is not None for tier in spec.tiers.values())


class Backend(Protocol):
    """What a backend does for the Reconciler: observe and apply, never decide."""

    def read(self, name: str) -> Stored | None:
        """The model, or None when it is gone."""

    def finalize(self, stored: Stored) -> None:
        """A model being deleted: let it go (its routes first)."""

    def settle(self, stored: Stored) -> Stored:
        """Write the model as the controller keeps it (see `Stored.settled`);
        what it is then."""

    def prepare(self, spec: TieredModel, wanted: plan.Versions,
                replicas: Mapping[tuple[str, int], int]
                ) -> tuple[dict[tuple[str, int], plan.VersionState], frozenset[int]]:
        """Bring about the agents of the wanted versions (`replicas` per tier
        and version, as last decided); their state per (tier, version), and the versions
        with agents in place."""

    def agents(self, spec: TieredModel, rollout: RolloutStatus) -> Mapping[str, Sequence[str]]:
        """Per tier, the agents whose telemetry judges the rollout."""

    def routers(self) -> Sequence[str]:
        """Every router whose shadow agreement counts."""

    def apply(self, spec: TieredModel, made: plan.Plan) -> None:
        """Keep the plan's versions on the agents, as many as its replicas;
        remove those it retires."""

    def write_status(self, stored: Stored, status: TieredModelStatus) -> None:
        """Write at the revision read; Conflict when someone wrote in between."""

    def record(self, spec: TieredModel, made: plan.Plan, now: float) -> None:
        """Keep the plan's snapshot and tell its events (history, Events)."""

    def write_routing(self) -> None:
        """The routing table, from every model's stored status."""


class Reconciler:
    """Reconciles one model at a time against one backend."""

    def __init__(self, backend: Backend, judge: RolloutJudge, *,
                 clock: Callable[[], float], progress: Callable[[str], None],
                 retire_grace_s: float = plan.RETIRE_GRACE_S,
                 metrics: RolloutMetrics | None = None) -> None:
        self.backend = backend
        self.metrics = metrics or RolloutMetrics()
        self.judge = judge
        self.clock = clock
        self.progress = progress
        self.retire_grace_s = retire_grace_s

    def reconcile(self, name: str) -> float | None:
        """Make the world match one model; seconds until it wants another look."""
        stored = self.backend.read(name)
        if stored is not None and not stored.deleting and not stored.settled:
            stored = self.backend.settle(stored)
        if stored is None or stored.deleting:
            self.judge.forget(name, loads=True)
            self.metrics.forget(name)
            if stored is not None:
                self.backend.finalize(stored)
            self.backend.write_routing()
            return None
        status = readable_status(stored)
        try:
            spec = load_tiered_model(stored.document, name)
            wanted = plan.versions(spec, status)
        except ConfigError as error:  # nothing to do until the spec changes
            self._write(stored, dataclasses.replace(status, message=str(error)))
            return None
        states, present = self.backend.prepare(spec, wanted, plan.workload_replicas(
            spec, status.rollout, status.scaling, wanted.wanted))
        now = self.clock()
        reading = None
        if plan.judging(spec, status, wanted, states):
            reading = self.judge.read(spec, status.rollout,
                                      self.backend.agents(spec, status.rollout),
                                      self.backend.routers(), now, status.stage_samples)
        elif not desired.live(status.rollout):
            self.judge.forget(name)
        routed = (self.judge.routed(name, self.backend.routers())
                  if plan.asks_routers(status) else None)
        loads = (self.judge.loads(name, self.backend.agents(spec, status.rollout),
                                  self.backend.routers())
                 if status.rollout is not None and autoscaled(spec) else None)
        made = plan.plan(spec, status, plan.Observation(stored.generation, states, present,
                                                        reading, routed, loads),
                         now, self.retire_grace_s)
        self.backend.apply(spec, made)
        self._write(stored, made.status)
        self.backend.record(spec, made, now)
        self.metrics.observe(name, made.status, (event.reason for event in made.events))
        for event in made.events:
            self.progress(f"{name}: {event.message}")
        self.backend.write_routing()
        return made.requeue_after_s

    def _write(self, stored: Stored, status: TieredModelStatus) -> None:
        if to_plain(status) != stored.status:
            self.backend.write_status(stored, status)
