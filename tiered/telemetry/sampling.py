"""Which finished requests keep their trace. Pure: decided when a request ends.

Every failed request is kept; a slow one is kept with probability
min(1, 0.1 x latency_ms / 100) — 10% at 100 ms, certain from 1 s — and every
other one at the configured base rate. `u` is a uniform draw in [0, 1) the
caller supplies, so the decision is testable.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TraceDecision:
    keep: bool
    probability: float
    reason: str  # "error", "latency" or "base rate"


def keep_probability(failed: bool, latency_ms: float, base_rate: float) -> tuple[float, str]:
    if failed:
        return 1.0, "error"
    by_latency = min(1.0, 0.1 * latency_ms / 100.0)
    if by_latency > base_rate:
        return by_latency, "latency"
    return base_rate, "base rate"


def decide(failed: bool, latency_ms: float, base_rate: float, u: float) -> TraceDecision:
    probability, reason = keep_probability(failed, latency_ms, base_rate)
    return TraceDecision(u < probability, probability, reason)
