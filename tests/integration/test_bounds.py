"""Per-connection bounds on a real agent: one client connection holding
idle streams cannot take every concurrent call of the server, so other
clients are still answered; the streams beyond its share wait on the
client's side or are refused at once, and none hangs."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import grpc
import pytest

from tiered.local.processes import AgentProcess
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
from tiered.protocol.handlers import MAX_STREAMS_PER_CONNECTION

CALLS = MAX_STREAMS_PER_CONNECTION + 40  # the server's limit on concurrent calls
HELD = CALLS + 20  # idle streams one client opens on one connection


@pytest.fixture(scope="module")
def small_agent(shared_repository, tmp_path_factory):
    """An edge agent that takes CALLS calls at once."""
    profile = tmp_path_factory.mktemp("bounds") / "edge.yaml"
    edge = Path(__file__).resolve().parents[2] / "tiered" / "profiles" / "edge.yaml"
    text = edge.read_text()
    profile.write_text(text.replace("max_concurrent_rpcs: 1024", f"max_concurrent_rpcs: {CALLS}"))
    assert profile.read_text() != text
    with AgentProcess("edge", shared_repository,
                      extra_args=["--profile", str(profile), "--front-ends", "0"]) as process:
        yield process


async def held_streams_leave_room_for_others(address: str) -> None:
    # A subchannel pool of its own each: two connections, not one shared.
    apart = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=apart) as hog, \
            grpc.aio.insecure_channel(address, options=apart) as other:
        quiet = asyncio.Event()

        async def nothing():
            await quiet.wait()
            return
            yield  # an async generator that sends no request

        calls = [pb_grpc.GRPCInferenceServiceStub(hog).ModelStreamInfer(nothing())
                 for _ in range(HELD)]
        waits = [asyncio.ensure_future(call.wait_for_connection()) for call in calls]
        await asyncio.wait(waits, timeout=5)
        await asyncio.sleep(1.0)  # the server has taken every stream it will
        live = await pb_grpc.GRPCInferenceServiceStub(other).ServerLive(
            pb.ServerLiveRequest(), timeout=5)
        assert live.live
        ready = await pb_grpc.GRPCInferenceServiceStub(other).ModelReady(
            pb.ModelReadyRequest(name="add_sub"), timeout=5)
        assert ready.ready
        quiet.set()  # every held stream ends as its client closes it
        codes = Counter(await asyncio.wait_for(
            asyncio.gather(*(call.code() for call in calls)), 30))
        # The server took its share; streams beyond it waited on the client's
        # side, or, sent before the client knew the cap, were refused at once
        # (HTTP/2 REFUSED_STREAM, which gRPC reports as UNAVAILABLE).
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
        assert codes[grpc.StatusCode.OK] >= MAX_STREAMS_PER_CONNECTION, codes
        for wait in waits:
            wait.cancel()


def test_a_connection_holding_idle_streams_leaves_the_agent_to_other_clients(small_agent):
    asyncio.run(held_streams_leave_room_for_others(small_agent.address))
    assert small_agent.alive()

