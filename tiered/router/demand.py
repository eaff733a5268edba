"""Demand for tiers scaled to zero: counted, and held until they wake.

The routing table lists a model's tiers that may scale to zero and have no
agent now as `asleep`. Counted as demand the router could not place there
(`unmet`):
- a request hinted to such a tier: the next tier answers it, as any
  preference, unless it is kept to its tier (`tiered-tier-strict`);
- a request for a model asleep on every tier: for its cheapest tier;
- a request another tier answered slower than its SLO: for each sleeping
  tier above that one (a cheaper tier stood in and missed).
A request kept to a sleeping tier, or for a model asleep everywhere, waits
here, as Knative's activator holds requests while a pod starts, until the
table gives the tier (or the model) an agent or the request's deadline
passes. The controller reads the counts (Telemetry.Routes) and wakes the
tier; the held request then goes on, so the first request after waking is
never lost. Bounded: at most MAX_WAITING requests held at once.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from tiered import errors
from tiered.protocol import error_text, routing

MAX_WAITING = 1024  # requests held for a waking tier, over every model
WAKE_POLL_S = 0.05  # how often a held request looks at the table again


class Demand:
    """Unmet requests per (model, tier), since the router started, and those held now."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.unmet: Counter[tuple[str, str]] = Counter()
        self.waiting: Counter[tuple[str, str]] = Counter()

    def wanted(self, model: str, tier: str) -> None:
        self.unmet[(model, tier)] += 1

    async def until_awake(self, model: str, tier: str | None,
                          table: Callable[[], routing.RoutingTable],
                          deadline: float) -> routing.ModelRoute:
        """The model's route once `tier` (None: any tier) has agents in the
        table; DeadlineExceeded when the deadline passes first."""
        if sum(self.waiting.values()) >= MAX_WAITING:
            raise errors.ResourceExhausted(f"{MAX_WAITING} requests wait for tiers to wake; "
                                           "retry later")
        route = table().models.get(model)
        key = (model, tier or (route.asleep[0] if route is not None and route.asleep else ""))
        self.waiting[key] += 1
        try:
            while True:
                route = table().models.get(model)
                if route is None:
                    raise errors.NotFound(error_text.unknown_model(
                        model, ": not in the routing table"))
                if (tier in route.tiers) if tier is not None else bool(route.tiers):
                    return route
                left = deadline - self.clock()
                if left <= 0:
                    raise errors.DeadlineExceeded(
                        f"tier {key[1]!r} of model {model!r} is scaled to zero and did not "
                        "wake within the request's deadline")
                await asyncio.sleep(min(WAKE_POLL_S, left))
        finally:
            self.waiting[key] -= 1
            if not self.waiting[key]:
                del self.waiting[key]

    def report(self) -> list[tuple[str, str, int, int]]:
        """(model, tier, unmet requests so far, held now), sorted."""
        keys = sorted(set(self.unmet) | set(self.waiting))
        return [(model, tier, self.unmet[(model, tier)], self.waiting[(model, tier)])
                for model, tier in keys]
