"""The router's view of its agents' health: held down with a reason, probed
back over grpc.health.v1 (a real in-process gRPC server on loopback)."""

from __future__ import annotations

import asyncio
import socket

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tiered.router import forward
from tiered.router.health import AgentHealth, Prober


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_agent_is_held_down_once_with_its_first_reason():
    clock = Clock()
    agents = AgentHealth(clock)
    assert agents.why("a:1") == "" and not agents.down
    agents.mark_down("a:1", "refused")
    clock.now += 2.5
    agents.mark_down("a:1", "again")  # already down: since and reason stay
    assert agents.why("a:1") == "down for 2.5 s: refused"
    agents.mark_down("b:1", "hung")
    agents.forget(["b:1"])  # a:1 left the table
    assert set(agents.down) == {"b:1"}
    agents.mark_up("b:1")
    agents.mark_up("b:1")  # up twice is up
    assert not agents.down


def free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_a_down_agent_is_marked_up_only_once_it_answers_serving():
    async def scenario() -> tuple[list[set[str]], str, str]:
        server = grpc.aio.server()
        servicer = grpc_health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        nobody = free_address()
        pool = forward.ChannelPool()
        agents = AgentHealth(Clock())
        prober = Prober(agents, pool.channel, timeout_s=0.5)
        seen = []
        try:
            for agent in (address, nobody):
                agents.mark_down(agent, "refused")
            await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await prober.probe_once()
            seen.append(set(agents.down))  # answered, but not serving
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            await prober.probe_once()
            seen.append(set(agents.down))  # nobody listens at the other
            agents.forget([address])
            await prober.probe_once()  # nothing down: nothing asked
            seen.append(set(agents.down))
        finally:
            await pool.close()
            await server.stop(0)
        return seen, address, nobody

    seen, address, nobody = asyncio.run(scenario())
    assert seen == [{address, nobody}, {nobody}, set()]


def test_calls_take_turns_over_the_connected_channels_to_an_agent():
    """Each of an agent's connections gets a call in turn once connected; while
    the first (whose state the health follows) is not, every call goes to it."""
    async def scenario() -> tuple[int, int, int]:
        server = grpc.aio.server()
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        pool = forward.ChannelPool(connections=3)
        try:
            while_down = {id(pool.stream(address)) for _ in range(6)}
            await server.start()
            for channel in pool._channels[address]:
                await asyncio.wait_for(channel.channel_ready(), 10)
            streams = {id(pool.stream(address)) for _ in range(6)}
            infers = {id(pool.infer(address)) for _ in range(6)}
        finally:
            await pool.close()
            await server.stop(0)
        return len(while_down), len(streams), len(infers)

    assert asyncio.run(scenario()) == (1, 3, 3)
