"""A v2 proxy that forwards every ModelInfer to one upstream and does nothing else.

The router benchmark runs it beside `tiered router` so that the cost of a
Python gRPC hop (receive, forward over a grpc.aio channel, send back) is
measured apart from the router's own work (hints, policies, canary split,
accounting).

    python bench/passthrough_server.py --upstream 127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench import common
from tiered.agent.server import grpc_options
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 256 << 20


class Passthrough(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, upstream: pb_grpc.GRPCInferenceServiceStub) -> None:
        self.upstream = upstream

    async def ServerReady(self, request, context):
        return await self.upstream.ServerReady(request)

    async def ModelReady(self, request, context):
        return await self.upstream.ModelReady(request)

    async def ModelInfer(self, request: pb.ModelInferRequest, context):
        return await self.upstream.ModelInfer(request, timeout=context.time_remaining())


async def serve(upstream: str) -> None:
    channel = grpc.aio.insecure_channel(upstream, options=grpc_options(MAX_MESSAGE_BYTES))
    await common.serve_v2(Passthrough(pb_grpc.GRPCInferenceServiceStub(channel)), "passthrough",
                          MAX_MESSAGE_BYTES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, metavar="HOST:PORT")
    asyncio.run(serve(parser.parse_args().upstream))


if __name__ == "__main__":
    main()
