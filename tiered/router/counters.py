"""What the router counts: Prometheus counters for dashboards, and the tally
of shadow comparisons that `tiered.v1.Telemetry/Agreement` serves.

The tally is the one source of the shadow figures: the Prometheus counter
`tiered_router_shadow` is collected from it, so the RPC and /metrics cannot
disagree. Counts are cumulative since the router started; `instance` tells a
reader when they started again. Nothing here chooses a route or talks to an
agent.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from tiered import names
from tiered.telemetry.histogram import LATENCY_BUCKETS_S

MAX_CACHED_CHILDREN = 4096  # labelled Prometheus children kept at hand
MAX_SHADOWED_VERSIONS = 1024  # (model, canary version) pairs tallied; the oldest go first

AGREE, DISAGREE, INCOMPARABLE, ERROR = "agree", "disagree", "incomparable", "error"
RESULTS = (AGREE, DISAGREE, INCOMPARABLE, ERROR)


@dataclass(frozen=True)
class TierAgreement:
    tier: str
    agreed: int
    disagreed: int


class ShadowAgreement:
    """Shadow comparisons by (model, canary version, tier) and result."""

    def __init__(self, instance: str | None = None,
                 max_versions: int = MAX_SHADOWED_VERSIONS) -> None:
        # Not from the router's rng: that one is seeded, and a router restarted
        # with the same --seed must still read as a new instance.
        self.instance = instance or uuid.uuid4().hex
        self.max_versions = max_versions
        self._rows: dict[tuple[str, str], dict[str, dict[str, int]]] = {}
        self._lock = threading.Lock()  # /metrics is collected on another thread

    def record(self, model: str, version: str, tier: str, result: str) -> None:
        with self._lock:
            tiers = self._rows.get((model, version))
            if tiers is None:
                if len(self._rows) >= self.max_versions:
                    del self._rows[next(iter(self._rows))]  # its rollout is long over
                tiers = self._rows[(model, version)] = {}
            counts = tiers.get(tier)
            if counts is None:
                counts = tiers[tier] = dict.fromkeys(RESULTS, 0)
            counts[result] += 1

    def tiers(self, model: str, version: str) -> list[TierAgreement]:
        """Every tier where `version` of `model` was shadowed (none if never)."""
        with self._lock:
            tiers = self._rows.get((model, version), {})
            return [TierAgreement(tier, tiers[tier][AGREE], tiers[tier][DISAGREE])
                    for tier in sorted(tiers, key=names.TIERS.index)]

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(
            "tiered_router_shadow", "Shadowed requests by top-1 agreement of the canary "
            "version with the answer", labels=["model", "tier", "version", "result"])

    def describe(self) -> list[CounterMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self._family()
        with self._lock:
            for (model, version), tiers in self._rows.items():
                for tier, counts in tiers.items():
                    for result, count in counts.items():
                        if count:
                            family.add_metric([model, tier, version, result], count)
        yield family


class RouterMetrics:
    """Prometheus counters; also what the periodic log line summarises."""

    def __init__(self, shadow: ShadowAgreement) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tiered_router_requests", "Requests answered, by where they went",
                                ["model", "tier", "version", "outcome"], registry=self.registry)
        self.failovers = Counter("tiered_router_failovers", "Attempts that failed over",
                                 ["model", "tier", "code"], registry=self.registry)
        self.escalations = Counter("tiered_router_escalations", "Cascade escalations",
                                   ["model", "from_tier"], registry=self.registry)
        self.registry.register(shadow)
        self.rejected = Counter("tiered_router_saturated", "Requests refused: all saturated",
                                ["model"], registry=self.registry)
        self.table_version = Gauge("tiered_router_table_version", "Routing table in use",
                                   registry=self.registry)
        self.energy_incomparable = Counter(
            "tiered_router_energy_incomparable", "slo-energy choices in which the tiers "
            "meeting the SLO had J/inference of different sources (nvml, rapl, model), so "
            "energy decided nothing and the fastest went first", ["model"],
            registry=self.registry)
        self.latency = Histogram(
            "tiered_router_request_duration_seconds", "Answered requests' time in the router, "
            "from arrival to answer, by the tier and version that answered",
            ["model", "tier", "version"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self._children: dict[tuple[object, ...], Counter | Histogram] = {}

    def _child(self, counter, *labels: str):
        """The labelled child, looked up once (the hot path counts through here)."""
        key = (counter, *labels)
        child = self._children.get(key)
        if child is None:
            child = counter.labels(*labels)
            if len(self._children) < MAX_CACHED_CHILDREN:
                self._children[key] = child
        return child

    def answered(self, model: str, tier: str, version: str, seconds: float) -> None:
        self._child(self.requests, model, tier, version, "ok").inc()
        self._child(self.latency, model, tier, version).observe(seconds)

    def ranked_without_energy(self, model: str) -> None:
        """Count one choice that energy could not decide (`Ranking.energy_incomparable`)."""
        self._child(self.energy_incomparable, model).inc()
