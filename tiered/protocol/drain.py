"""Stopping a gRPC server without cancelling calls it has already taken in.

`grpc.aio.Server.stop(grace)` lets a call that has reached its handler
finish, but cancels (CANCELLED to the client) every call gRPC's core has
received and the server's event loop has not yet picked up. The loop picks
them up one at a time, so under load dozens wait there, sent well before the
signal. `stop` therefore first sends a marker call to the server through a
unix socket of its own: the core hands calls to generic handlers (every
handler of the agents' and the router's servers is one) in the order they
arrived, so once the marker reaches its handler, every call received before
it has one too, and the grace period covers them all. A call that arrives
after the marker came after the signal (health already says NOT_SERVING): it
is answered if picked up before the server stops; in the instant between,
gRPC cancels it.
"""

from __future__ import annotations

import logging
import time

import grpc

log = logging.getLogger(__name__)

MARKER = "/tiered.Drain/Marker"


async def _answer(request: bytes, context) -> bytes:
    return b""


_MARKER_HANDLER = grpc.unary_unary_rpc_method_handler(_answer)


class Marker(grpc.GenericRpcHandler):
    """Answers the marker; added after a server's other handlers."""

    def service(self, handler_call_details):
        return _MARKER_HANDLER if handler_call_details.method == MARKER else None


async def stop(server: grpc.aio.Server, own: str, timeout_s: float) -> None:
    """Stop `server`, which serves `Marker` and listens on `own` ("unix:PATH"):
    refuse new calls and answer every call received so far, all within
    `timeout_s` (the drain timeout); calls still running then are cancelled."""
    deadline = time.monotonic() + timeout_s
    try:
        async with grpc.aio.insecure_channel(own) as channel:
            await channel.unary_unary(MARKER)(b"", timeout=timeout_s)
    except grpc.aio.AioRpcError as error:
        # Refused for too many calls at once, it was still picked up in turn.
        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            log.warning("draining: the marker call failed (%s); calls not yet picked up "
                        "may be cancelled", error.code().name)
    await server.stop(grace=max(deadline - time.monotonic(), 0.0))
