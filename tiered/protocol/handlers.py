"""Registering a servicer on a grpc.aio server so each call costs less.

For each call it accepts, grpc.aio's server waits (`asyncio.wait`) on one
pending request per *registered* method: about 30 with our services, which
costs more per call than looking a generic handler up in a dict (measured on
the router: ~140k instructions and ~20 µs of CPU per request). `GenericOnly`
stands in for the server when a generated `add_*_to_server` is called, so
the handlers are added as generic ones only. `seconds_left` reads a call's
deadline the same way for every server.
"""

from __future__ import annotations

import math

# A client's connection opens at most this many calls at once (HTTP/2
# SETTINGS_MAX_CONCURRENT_STREAMS; more wait on the client's side), so no one
# connection holds all of a server's concurrent calls.
MAX_STREAMS_PER_CONNECTION = 256
# Options of every v2 server (agents, their front ends and engine processes,
# routers). The router pings its agents every second (HTTP/2 keepalive) to
# find a hung one, and a gRPC server answers pings more often than every 5
# minutes with GOAWAY: these servers allow them.
SERVER_OPTIONS = [("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
                  ("grpc.http2.min_ping_interval_without_data_ms", 500),
                  ("grpc.http2.max_ping_strikes", 0)]


class GenericOnly:
    """A server, to a generated `add_*_to_server`, that takes its handlers as
    generic ones only."""

    def __init__(self, server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers) -> None:
        pass  # the generated code gave the same handlers as generic ones


def seconds_left(context) -> float:
    """A call's remaining deadline in seconds; inf when the client set none."""
    remaining = context.time_remaining()
    return math.inf if remaining is None else remaining
