"""Which agents the router holds down, and the probes that bring them back.

Passive health: a call that finds no connection to its agent (the forwarder
sees the agent's channel not READY after a failed call, or in
TRANSIENT_FAILURE, or not connected within its connect budget) marks the
agent down here. `policies.rank` puts down agents after every agent that is
up, so the next requests go elsewhere at once. A down agent is probed in the
background on the router's own channel to it (`grpc.health.v1` Check, or
ServerReady where an agent has no health service) and is up again once it
answers SERVING, so the channel requests use is connected before traffic
returns. The clock is injected; the event loop writes the state and /metrics
reads it from its own thread. Nothing here chooses a route.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5  # a down agent is probed this often
PROBE_TIMEOUT_S = 1.0  # one probe's budget, the reconnection it waits for included


@dataclass(frozen=True)
class Down:
    since: float  # router clock
    reason: str


class AgentHealth:
    """The agents held down, by address, since when and why."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        # What `policies.rank` reads: empty on the happy path, so ranking is untouched.
        self.down: dict[str, Down] = {}

    def mark_down(self, agent: str, reason: str) -> None:
        if agent not in self.down:
            self.down[agent] = Down(self.clock(), reason)
            log.warning("agent %s is down, probing it every %g s: %s", agent,
                        PROBE_INTERVAL_S, reason)

    def mark_up(self, agent: str) -> None:
        held = self.down.pop(agent, None)
        if held is not None:
            log.info("agent %s is up again after %.1f s down", agent, self.clock() - held.since)

    def why(self, agent: str) -> str:
        """'down for 1.2 s: REASON', or '' when the agent is up."""
        held = self.down.get(agent)
        return "" if held is None else f"down for {self.clock() - held.since:.1f} s: {held.reason}"

    def forget(self, keep: Iterable[str]) -> None:
        """Drop agents that left the routing table (bounded memory)."""
        kept = set(keep)
        for agent in [a for a in self.down if a not in kept]:
            del self.down[agent]


class Prober:
    """Probes every down agent each interval, all at once, each within its
    timeout; an agent that answers SERVING is marked up."""

    def __init__(self, health: AgentHealth, channel: Callable[[str], grpc.aio.Channel],
                 interval_s: float = PROBE_INTERVAL_S, timeout_s: float = PROBE_TIMEOUT_S
                 ) -> None:
        self.health = health
        self.channel = channel  # the channel requests use, so a probe's success connects it
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def probe_once(self) -> None:
        agents = list(self.health.down)
        if not agents:
            return
        answers = await asyncio.gather(*(self.serving(agent) for agent in agents))
        for agent, serving in zip(agents, answers, strict=True):
            if serving:
                self.health.mark_up(agent)

    async def serving(self, agent: str) -> bool:
        # wait_for_ready: the probe waits out the channel's reconnection
        # backoff (capped by forward.ChannelPool) instead of failing at once.
        if agent not in self.health.down:  # left the table since: no channel for it
            return False
        try:
            channel = self.channel(agent)
            try:
                answer = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=self.timeout_s,
                    wait_for_ready=True)
                return answer.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    log.debug("probe of %s: %s", agent, error.code().name)
                    return False
            ready = await pb_grpc.GRPCInferenceServiceStub(channel).ServerReady(
                pb.ServerReadyRequest(), timeout=self.timeout_s, wait_for_ready=True)
            return ready.ready
        except Exception as error:  # noqa: BLE001 -- a probe never stops the prober
            log.debug("probe of %s failed: %s", agent, error)
            return False

    async def run(self) -> None:
        while True:
            try:
                await self.probe_once()
            except Exception:  # noqa: BLE001 -- probing never stops the router
                log.exception("agent probe failed")
            await asyncio.sleep(self.interval_s)
