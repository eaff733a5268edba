"""A v2 proxy that forwards every ModelInfer to one upstream and does nothing else.

The router benchmark runs it beside `tiered router` so that the cost of a
Python gRPC hop (receive, forward over a grpc.aio channel, send back) is
measured apart from the router's own work (hints, policies, canary split,
accounting). It is the floor of such a hop: bytes in, bytes out (nothing
parsed or serialized), generic handlers, and the router's event loop.

    python bench/passthrough_server.py --upstream 127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from tiered.agent.server import grpc_options
from tiered.router.server import event_loop_factory

MAX_MESSAGE_BYTES = 256 << 20
SERVICE = "inference.GRPCInferenceService"
METHODS = ("ServerReady", "ModelReady", "ModelInfer")


def forwarding(channel: grpc.aio.Channel) -> grpc.GenericRpcHandler:
    """Each of METHODS answered with what the upstream answers, bytes untouched."""
    def forward(method: str) -> grpc.RpcMethodHandler:
        call = channel.unary_unary(f"/{SERVICE}/{method}", _registered_method=True)

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await call(request, timeout=context.time_remaining())

        return grpc.unary_unary_rpc_method_handler(handle)

    return grpc.method_handlers_generic_handler(SERVICE, {m: forward(m) for m in METHODS})


async def serve(upstream: str) -> None:
    channel = grpc.aio.insecure_channel(upstream, options=grpc_options(MAX_MESSAGE_BYTES))
    server = grpc.aio.server(options=grpc_options(MAX_MESSAGE_BYTES))
    server.add_generic_rpc_handlers((forwarding(channel),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"passthrough listening on 127.0.0.1:{port}", flush=True)  # ServerProcess waits for it
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, metavar="HOST:PORT")
    upstream = parser.parse_args().upstream
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve(upstream))


if __name__ == "__main__":
    main()
