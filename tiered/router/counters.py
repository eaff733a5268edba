"""What the router counts: Prometheus counters for dashboards, the tally
of shadow comparisons that `tiered.v1.Telemetry/Agreement` serves, and
whether each agent is up as the router sees it (`AgentStates`).

The tally is the one source of the shadow figures: the Prometheus counter
`tiered_router_shadow` is collected from it, so the RPC and /metrics cannot
disagree. Counts are cumulative since the router started; `instance` tells a
reader when they started again. Nothing here chooses a route or talks to an
agent.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tiered import names
from tiered.telemetry.histogram import LATENCY_BUCKETS_S

MAX_CACHED_CHILDREN = 4096  # labelled Prometheus children kept at hand
MAX_SHADOWED_VERSIONS = 1024  # (model, canary version) pairs tallied; the oldest go first

AGREE, DISAGREE, INCOMPARABLE, ERROR = "agree", "disagree", "incomparable", "error"
RESULTS = (AGREE, DISAGREE, INCOMPARABLE, ERROR)

# Why an agent was passed over (tiered_router_failovers_total's `reason`);
# an attempt that failed is counted by its code in lower case
# (unavailable, resource_exhausted, deadline_exceeded).
DOWN = "down"  # held down, or found without a connection
SATURATED = "saturated"  # at the router's in-flight limit for it


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
            "tiered_router_shadow", "Shadowed requests by agreement of the canary version "
            "with the answer (top-1 class; a generation's greedy token ids)",
            labels=["model", "tier", "version", "result"])

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


class AgentStates:
    """`tiered_router_agent_up{agent,tier}`: 1 while the router sends to an
    agent of the routing table in use, 0 while it holds it down (until a
    probe brings it back). Read from the table and the router's health at
    each scrape, so an agent that left the table leaves no series."""

    def __init__(self) -> None:
        self._agents: tuple[tuple[str, str], ...] = ()  # (address, tier)
        self._down: Container[str] = frozenset()

    def watch(self, agents: Iterable[tuple[str, str]], down: Container[str]) -> None:
        """Report `agents` (address, tier), each down while its address is in `down`."""
        self._down = down  # read, never written, from the scrape's thread
        self._agents = tuple(sorted(set(agents)))  # one assignment: a scrape sees old or new

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily("tiered_router_agent_up", "1 while the router sends requests "
                                 "to the agent, 0 while it holds it down after a failed "
                                 "connection, until a probe answers", labels=["agent", "tier"])

    def describe(self) -> list[GaugeMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        down = self._down
        for agent, tier in self._agents:
            family.add_metric([agent, tier], 0.0 if agent in down else 1.0)
        yield family


class RouterMetrics:
    """Prometheus counters; also what the periodic log line summarises."""

    def __init__(self, shadow: ShadowAgreement, agents: AgentStates | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tiered_router_requests", "Requests answered, by where they went",
                                ["model", "tier", "version", "outcome"], registry=self.registry)
        self.failovers = Counter(
            "tiered_router_failovers", "Agents passed over for a request, by their tier and "
            "why: down, saturated, or the code of a failed attempt (unavailable, "
            "resource_exhausted, deadline_exceeded)", ["model", "tier", "reason"],
            registry=self.registry)
        self.agents = agents or AgentStates()
        self.registry.register(self.agents)
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
        self.stage_floor = Counter(
            "tiered_router_stage_floor", "Requests without a tier hint that a live rollout "
            "stage's floor sent to a tier it stages ahead of the policy's first choice, by "
            "that tier (routing table `stage_floor`)", ["model", "tier"],
            registry=self.registry)
        self.latency = Histogram(
            "tiered_router_request_duration_seconds", "Answered requests' time in the router, "
            "from arrival to answer (a streamed request: to its last response), by the tier "
            "and version that answered", ["model", "tier", "version"],
            buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.first_token = Histogram(
            "tiered_router_time_to_first_token_seconds", "Streamed requests of decoupled "
            "(generative) models: from arrival at the router to their first response relayed "
            "to the client, by the tier and version that answered",
            ["model", "tier", "version"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.split_stage = Histogram(
            "tiered_router_split_vision_seconds", "Requests of a vision-language model split "
            "across tiers: the vision tier's time to encode their images, by the tiers of the "
            "split", ["model", "vision", "decoder"], buckets=LATENCY_BUCKETS_S,
            registry=self.registry)
        self.split_bytes = Counter(
            "tiered_router_split_bytes", "Requests split across tiers: the image bytes the "
            "vision tier took (what = image) and the visual-token bytes sent on to the "
            "decoder tier in their place (what = visual_tokens)", ["model", "what"],
            registry=self.registry)
        self.split_choices = Counter(
            "tiered_router_split_choices", "Requests with an image of a model whose routing "
            "table allows a split: whether the router chose split or whole, and why (unmeasured: "
            "that path had no figures yet; meets: the least energy among paths meeting the "
            "SLO; fastest: none met it; hinted: the request's tiered-split hint)",
            ["model", "choice", "reason"],
            registry=self.registry)
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

    def first_response(self, model: str, tier: str, version: str, seconds: float) -> None:
        """A streamed request's first response went out `seconds` after it arrived."""
        self._child(self.first_token, model, tier, version).observe(seconds)

    def split(self, model: str, split: tuple[str, str], seconds: float, image_bytes: int,
              token_bytes: int) -> None:
        """A request split across (vision, decoder) tiers: its vision stage's
        time and the bytes it swapped."""
        self._child(self.split_stage, model, *split).observe(seconds)
        self._child(self.split_bytes, model, "image").inc(image_bytes)
        self._child(self.split_bytes, model, "visual_tokens").inc(token_bytes)

    def chose_path(self, model: str, split: bool, reason: str) -> None:
        """Count one image request's choice of split or whole (`PathChoice`)."""
        self._child(self.split_choices, model, "split" if split else "whole", reason).inc()

    def failed_over(self, model: str, tier: str, reason: str) -> None:
        self._child(self.failovers, model, tier, reason).inc()

    def floored(self, model: str, tier: str) -> None:
        """Count one request a stage's floor moved to `tier` (`Ranking.floored`)."""
        self._child(self.stage_floor, model, tier).inc()

    def ranked_without_energy(self, model: str) -> None:
        """Count one choice that energy could not decide (`Ranking.energy_incomparable`)."""
        self._child(self.energy_incomparable, model).inc()
