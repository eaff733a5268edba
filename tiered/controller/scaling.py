"""Autoscaling, pure: (a tier's autoscaling spec, what it did last, the load
read now, now) -> how many agents it runs, and why.

The load is the tier's agents' telemetry over the span since the last read
(`TierLoad`): requests answered, and the chosen metric summed over agents —
concurrency (the sum of the requests' latencies over the span: requests
inside an agent at once, by Little's law, as Knative's KPA scales) or
utilization (the engines' busy share of the span). The recommendation is
the fewest agents that hold the metric at its target,
ceil(total / target), kept where it is while the metric per agent is within
`tolerance` of the target (as the HPA does), within [minReplicas,
maxReplicas]. Against flapping, as the HPA's behavior does: a scale-up
follows the lowest recommendation of its window and a scale-down the
highest of its own, and one change adds at most maxScaleUp agents and
removes at most maxScaleDown (when set), one change a scalePeriodSeconds at
most. A tier with scaleToZero goes to zero after idleSeconds without a
request, and back to minReplicas when the routers report demand they could
not place there (`unmet`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tiered import names
from tiered.rollout.spec import Autoscaling
from tiered.rollout.status import Recommendation, TierScale

MAX_RECOMMENDATIONS = 64  # kept in the status; the oldest go first


@dataclass(frozen=True)
class TierLoad:
    """A tier's agents' telemetry over one span, summed over its agents."""

    agents: int  # agents read
    window_s: float  # the span read (each agent's, averaged)
    requests: int  # answered or failed, every version of the model
    concurrency: float  # sum of request latencies / span, summed over agents
    utilization: float  # engine busy seconds / span, summed over agents
    unmet: int = 0  # requests the routers could not place on the tier (it had no agent)

    def total(self, metric: str) -> float:
        return self.concurrency if metric == names.ScaleMetric.CONCURRENCY else self.utilization


def starting_replicas(auto: Autoscaling, replicas: int) -> int:
    """Where an autoscaled tier starts: the spec's replicas, within its bounds."""
    return min(max(replicas, auto.min_replicas), auto.max_replicas)


def decide(auto: Autoscaling, previous: TierScale | None, load: TierLoad | None,
           replicas: int, now: float) -> TierScale:
    """This look's scale of one tier; `replicas` is the spec's (where it starts)."""
    if previous is None:
        previous = TierScale(starting_replicas(auto, replicas), "starting at the spec's "
                             "replicas", last_request_at=now)  # changed_at 0: never
    current = previous.replicas
    if (current or not auto.scale_to_zero) and not \
            auto.min_replicas <= current <= auto.max_replicas:  # the spec changed
        bounded = min(max(current, auto.min_replicas), auto.max_replicas)
        return _changed(previous, bounded, f"{current} agents are outside minReplicas.."
                        f"maxReplicas ({auto.min_replicas}..{auto.max_replicas})"
                        + ("" if current else " and scaleToZero is off"), None, now,
                        previous.recommendations)
    if load is None:
        return _same(previous, f"{current} agents; no telemetry read this time", None)
    last_request = previous.last_request_at if previous.last_request_at is not None else now
    if load.requests or load.unmet:
        last_request = now
    if current == 0:
        if load.unmet:
            return _changed(previous, auto.min_replicas,
                            f"woken: {load.unmet} requests the routers could not place here",
                            None, now, (), last_request=now)
        return _same(previous, "at zero: no unmet demand", None)
    idle_s = now - last_request
    if auto.scale_to_zero and idle_s >= auto.idle_s:
        return _changed(previous, 0, f"no request for {idle_s:.0f} s (idleSeconds "
                        f"{auto.idle_s:g}): going to zero", 0.0, now, (), last_request)
    value = load.total(auto.metric) / load.agents if load.agents else 0.0
    wanted, why = _recommend(auto, current, load, value)
    kept = _remember(previous.recommendations, wanted, now, auto)
    chosen = current
    if wanted > current:
        chosen = min(max(_within(kept, now, auto.scale_up_window_s, min), current),
                     current + auto.max_scale_up)
    elif wanted < current:
        chosen = min(_within(kept, now, auto.scale_down_window_s, max), current)
        if auto.max_scale_down is not None:
            chosen = max(chosen, current - auto.max_scale_down)
    if chosen != wanted:
        why += (f"; {chosen} for now (the scale-up window's lowest, at most "
                f"+{auto.max_scale_up})" if wanted > current else
                "; {} for now (the scale-down window's highest{})".format(
                    chosen, "" if auto.max_scale_down is None
                    else f", at most -{auto.max_scale_down}"))
    wait_s = previous.changed_at + auto.scale_period_s - now
    if chosen != current and previous.changed_at and wait_s > 0:  # 0: never changed
        why += (f"; {current} until the period since the last change is over "
                f"(scalePeriodSeconds {auto.scale_period_s:g}, {wait_s:.0f} s more)")
        chosen = current
    if chosen == current:
        return TierScale(current, why, value, previous.changed_at, last_request, kept)
    return _changed(previous, chosen, why, value, now, kept, last_request)


def _recommend(auto: Autoscaling, current: int, load: TierLoad, value: float
               ) -> tuple[int, str]:
    """The agents that hold the metric at its target, and why."""
    metric = f"{auto.metric} {value:.3g} an agent over {load.agents} (target {auto.target:g})"
    if load.agents and abs(value / auto.target - 1.0) <= auto.tolerance:
        return current, f"{metric}: within {auto.tolerance:.0%}, {current} agents"
    needed = math.ceil(load.total(auto.metric) / auto.target - 1e-9)
    wanted = min(max(needed, auto.min_replicas), auto.max_replicas)
    bound = (f" (maxReplicas {auto.max_replicas})" if needed > wanted else
             f" (minReplicas {auto.min_replicas})" if needed < wanted else "")
    return wanted, f"{metric}: {wanted} agents wanted{bound}"


def _remember(kept: tuple[Recommendation, ...], wanted: int, now: float,
              auto: Autoscaling) -> tuple[Recommendation, ...]:
    """The recommendations the windows still need, this one added."""
    horizon = now - max(auto.scale_up_window_s, auto.scale_down_window_s)
    # The newest one older than the horizon still says what held at its start.
    older = [r for r in kept if r.t < horizon][-1:]
    recent = [*older, *(r for r in kept if r.t >= horizon)]
    if not recent or recent[-1].replicas != wanted:
        recent.append(Recommendation(now, wanted))
    return tuple(recent[-MAX_RECOMMENDATIONS:])


def _within(kept: tuple[Recommendation, ...], now: float, window_s: float, pick) -> int:
    """`pick` (min or max) of what was recommended over the window: each
    recommendation held from its time until the next one's."""
    start = now - window_s
    held = [r.replicas for i, r in enumerate(kept)
            if r.t >= start or (i + 1 < len(kept) and kept[i + 1].t > start)
            or i + 1 == len(kept)]
    return pick(held)


def _same(previous: TierScale, reason: str, value: float | None) -> TierScale:
    return TierScale(previous.replicas, reason, value, previous.changed_at,
                     previous.last_request_at, previous.recommendations)


def _changed(previous: TierScale, replicas: int, reason: str, value: float | None,
             now: float, kept: tuple[Recommendation, ...],
             last_request: float | None = None) -> TierScale:
    return TierScale(replicas, reason, value, now,
                     last_request if last_request is not None else previous.last_request_at,
                     kept)
