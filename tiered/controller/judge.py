"""Reading a live rollout's telemetry: the I/O behind the plan's judgement.

Shared by both backends. Each pass reads every agent's Telemetry.Stats since
its cursor and the router's shadow-agreement counters, adds them to the
current stage's samples (`StageAccumulator`) and hands the plan a
`StageReading`; the rollout engine's decision is made there
(`tiered.controller.plan`). `routed` asks the routers whether their tables
route a model, which the plan's Ready condition is made of; `loads` reads
each tier's load for its autoscaling (`tiered.controller.scaling`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from tiered.controller import plan, scaling
from tiered.controller.measure import StageAccumulator, VersionReading
from tiered.controller.plan import StageReading
from tiered.protocol import telemetry_messages
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc
from tiered.rollout import engine
from tiered.rollout.spec import TieredModel
from tiered.rollout.status import RolloutStatus

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 10.0


def readings_of(tier: str, reply: tpb.StatsResponse) -> list[VersionReading]:
    """One agent's Stats reply as readings, a version each (numbered
    versions only); a generative version's with its Generation's tokens."""
    readings = []
    for v in reply.versions:
        if not v.model_version.isdigit():
            continue
        reading = VersionReading(tier, int(v.model_version), v.success, v.failure,
                                 tuple(v.latency_samples_s),
                                 v.joules_per_inference if v.has_energy else None,
                                 v.energy.source if v.has_energy else "",
                                 client_errors=v.client_errors)
        if v.HasField("generation"):
            g = v.generation
            reading = dataclasses.replace(
                reading, output_tokens=g.output_tokens,
                first_token_s=telemetry_messages.histogram_values(g.time_to_first_token),
                per_token_s=telemetry_messages.histogram_values(g.time_per_output_token),
                joules_per_output_token=(g.joules_per_output_token if v.has_energy and
                                         g.HasField("joules_per_output_token") else None))
        readings.append(reading)
    return readings


def tier_load(replies: Sequence[tpb.StatsResponse]) -> scaling.TierLoad:
    """A tier's agents' Stats replies (each of one model, every version) as
    its load: requests, and the metrics summed over agents."""
    requests, concurrency, utilization, spans = 0, 0.0, 0.0, []
    for reply in replies:
        span = reply.end - reply.start  # window_s is the agent's retention, not the span
        spans.append(span)
        for version in reply.versions:
            requests += version.success + version.failure
            if span > 0:
                concurrency += version.latency.sum_s / span
                utilization += version.busy_s / span
    window = sum(spans) / len(spans) if spans else 0.0
    return scaling.TierLoad(len(replies), window, requests, concurrency, utilization)


class RolloutJudge:
    """Per model: the live stage's samples and each agent's telemetry cursor."""

    def __init__(self, channel: Callable[[str], grpc.Channel], seed: int = 0) -> None:
        self._channel = channel
        self._rng = np.random.default_rng(seed)
        # (agent address, model) -> (the agent's instance, its clock's cursor)
        self._cursors: dict[tuple[str, str], tuple[str, float]] = {}
        self._stages: dict[str, StageAccumulator] = {}
        self._load_cursors: dict[tuple[str, str], tuple[str, float]] = {}  # as _cursors
        # (router, model) -> the router's instance when last read; (router,
        # model, tier) -> the unmet requests it had counted then
        self._unmet_seen: dict[tuple[str, str], str] = {}
        self._unmet_counts: dict[tuple[str, str, str], int] = {}

    def read(self, spec: TieredModel, status: RolloutStatus,
             agents: Mapping[str, Sequence[str]], routers: Sequence[str],
             now: float, saved: Mapping[str, Any] | None = None) -> StageReading:
        """This pass's reading of the live stage: its measurements so far, from
        every agent of every tier and the shadow agreement of every router.
        `saved` is the stage's state as the status kept it: a restarted
        controller goes on from there, cursors included."""
        stage = self._stages.get(spec.name)
        shadow = self._agreement(spec.name, status.canary_version, routers)
        if stage is None or not stage.matches(status.canary_version, status.stage_index):
            if saved is not None and (saved.get("canary_version"), saved.get("stage")) == (
                    status.canary_version, status.stage_index):
                stage = StageAccumulator.restore(saved, self._rng)
                self._cursors.update({(agent, spec.name): (instance, float(end))
                                      for agent, instance, end in saved.get("cursors", ())})
            else:
                stage = StageAccumulator(status.canary_version, status.stage_index,
                                         self._rng, shadow)
            self._stages[spec.name] = stage
        # One analysis per interval (numbered on the wall clock, so no two stages
        # share a number): a failure counts once per look, not once per poll,
        # and each window's energy is one J/inference sample.
        window = int(now // spec.rollout.analysis.interval_s)
        readings, unreadable, down = self._readings(spec.name, agents)
        stage.add(readings, window)
        stage.set_shadow(shadow)
        tiers = [t for t, w in engine.canary_weights(spec, status).items() if w > 0]
        cursors = [[agent, *kept] for (agent, model), kept in sorted(self._cursors.items())
                   if model == spec.name]
        return StageReading(status.canary_version, status.stage_index,
                            stage.measurements(status.stable_version, tiers, window),
                            stage.summary(status.stable_version, tiers, spec.kind),
                            tuple(unreadable),
                            {**stage.state(), "cursors": cursors}, devices_down=tuple(down))

    def forget(self, model: str, loads: bool = False) -> None:
        """No live rollout: the next one's samples start when it does;
        `loads`: the model is gone, its load cursors go too."""
        self._cursors = {k: v for k, v in self._cursors.items() if k[1] != model}
        self._stages.pop(model, None)
        if loads:
            self._load_cursors = {k: v for k, v in self._load_cursors.items()
                                  if k[1] != model}
            self._unmet_seen = {k: v for k, v in self._unmet_seen.items() if k[1] != model}
            self._unmet_counts = {k: v for k, v in self._unmet_counts.items()
                                  if k[1] != model}

    def _readings(self, model: str, agents: Mapping[str, Sequence[str]]
                  ) -> tuple[list[VersionReading], list[str], list[str]]:
        """This poll's readings, the agents that could not be read, and the
        engine processes the others report down."""
        readings, unreadable, down = [], [], []
        # Agents first read after the rollout's first look joined (or restarted)
        # during it, a tier scaling up say: all they answered is the rollout's.
        joined_during = any(key[1] == model for key in self._cursors)
        for tier, addresses in agents.items():
            for agent in addresses:
                try:
                    reply, first = self._since(self._cursors, agent, model,
                                               whole_first=joined_during)
                except grpc.RpcError as error:  # an agent away: its samples are missing
                    log.warning("telemetry of %s unreadable: %s", agent, error.code().name)
                    unreadable.append(agent)
                    continue
                down += [f"{agent} {share.device}: {share.down_reason}"
                         for version in reply.versions for share in version.devices
                         if not share.up]
                if first and not joined_during:
                    # The rollout's first look: what came before it is not its.
                    continue
                readings.extend(readings_of(tier, reply))
        return readings, unreadable, down

    def _since(self, cursors: dict[tuple[str, str], tuple[str, float]], agent: str,
               model: str, whole_first: bool = False) -> tuple[tpb.StatsResponse, bool]:
        """The agent's Stats since its cursor in `cursors` (moved on), and
        whether this is its first read: a new agent, or a restarted one behind
        the same address, whose clock is another. `whole_first`: a restarted
        one's whole window, rather than what its clock has past the old cursor."""
        key = (agent, model)
        instance, cursor = cursors.get(key, ("", 0.0))
        stub = tpb_grpc.TelemetryStub(self._channel(agent))
        reply = stub.Stats(tpb.StatsRequest(model_name=model, cursor=cursor),
                           timeout=RPC_TIMEOUT_S)
        first = key not in cursors or reply.instance != instance
        if first and whole_first and instance:
            reply = stub.Stats(tpb.StatsRequest(model_name=model), timeout=RPC_TIMEOUT_S)
        cursors[key] = (reply.instance, reply.end)
        return reply, first

    def loads(self, model: str, agents: Mapping[str, Sequence[str]],
              routers: Sequence[str] = ()) -> dict[str, scaling.TierLoad]:
        """Each tier's load since the last look (`scaling.TierLoad`), from its
        agents' Stats with cursors of their own (a first look reads the
        agent's whole window; an agent that cannot be read is left out), and
        the demand the routers could not place on it (`unmet`)."""
        unmet = self._unmet(model, routers)
        loads = {}
        for tier, addresses in agents.items():
            replies = []
            for agent in addresses:
                try:
                    reply, _ = self._since(self._load_cursors, agent, model, whole_first=True)
                except grpc.RpcError as error:
                    log.warning("load of %s unreadable: %s", agent, error.code().name)
                    continue
                replies.append(reply)
            loads[tier] = dataclasses.replace(tier_load(replies), unmet=unmet.get(tier, 0))
        return loads

    def _unmet(self, model: str, routers: Sequence[str]) -> dict[str, int]:
        """Per tier, the requests the routers could not place there since the
        last look (their counters are cumulative, per router instance; a
        router first seen gives its count as the baseline), plus those held
        now: a held request asks for its tier at every look until it wakes.
        A router first read (or restarted: another instance) gives its counts
        as the baseline; a tier counted since starts from zero."""
        unmet: dict[str, int] = {}
        for router in routers:
            try:
                reply = tpb_grpc.TelemetryStub(self._channel(router)).Routes(
                    tpb.RoutesRequest(model_name=model), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as error:
                log.warning("unmet demand of %s unreadable: %s", router, error.code().name)
                continue
            first = self._unmet_seen.get((router, model)) != reply.instance
            self._unmet_seen[(router, model)] = reply.instance
            for demand in reply.unmet:
                key = (router, model, demand.tier)
                before = demand.requests if first else self._unmet_counts.get(key, 0)
                self._unmet_counts[key] = demand.requests
                unmet[demand.tier] = (unmet.get(demand.tier, 0) + demand.requests - before
                                      + demand.waiting)
        return unmet

    def routed(self, model: str, routers: Sequence[str]) -> plan.Routed:
        """Whether the routing table each router uses routes `model` (None
        where the router could not be asked)."""
        answers = []
        for router in routers:
            try:
                reply = tpb_grpc.TelemetryStub(self._channel(router)).Routes(
                    tpb.RoutesRequest(model_name=model), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as error:
                log.warning("routes of %s unreadable: %s", router, error.code().name)
                answers.append((router, None))
                continue
            answers.append((router, any(r.model_name == model for r in reply.routes)))
        return tuple(answers)

    def _agreement(self, model: str, version: int, routers: Sequence[str]
                   ) -> dict[tuple[str, str, str], float]:
        """Every router's cumulative shadow comparisons of the canary version,
        from its Agreement RPC, as (router instance, tier, agree|disagree) ->
        count: each router counts on its own, and a restarted one is another
        instance. A router that cannot be read is left out of this poll."""
        counts: dict[tuple[str, str, str], float] = {}
        for router in routers:
            try:
                reply = tpb_grpc.TelemetryStub(self._channel(router)).Agreement(
                    tpb.AgreementRequest(model_name=model, model_version=str(version)),
                    timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as error:
                log.warning("shadow agreement of %s unreadable: %s", router,
                            error.code().name)
                continue
            for tier in reply.tiers:
                counts[(reply.instance, tier.tier, "agree")] = float(tier.agreed)
                counts[(reply.instance, tier.tier, "disagree")] = float(tier.disagreed)
        return counts
