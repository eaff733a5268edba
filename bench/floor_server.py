"""The transport floor: a v2 server that does no work, for benchmarks to stand beside.

It answers ModelInfer at once with zeros of a fixed output shape, using the same
grpcio stack, stubs and message sizes as the agent, so a client's latency and
throughput against it are what gRPC in Python costs on this machine before any
model, queue or batcher. `bench/agent.py` runs it in the same run as the agent.

    python bench/floor_server.py --output logits:1000 --output probabilities:4
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc


class FloorServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, outputs: dict[str, int]) -> None:
        self.outputs = outputs
        self.responses: dict[tuple[str, int], pb.ModelInferResponse] = {}

    def _response(self, output: str, batch: int) -> pb.ModelInferResponse:
        key = (output, batch)
        if key not in self.responses:
            width = self.outputs[output]
            response = pb.ModelInferResponse(model_version="1")
            response.outputs.add(name=output, datatype="FP32", shape=[batch, width])
            response.raw_output_contents.append(np.zeros((batch, width), np.float32).tobytes())
            self.responses[key] = response
        return self.responses[key]

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=True)

    async def ModelStatistics(self, request, context):
        return pb.ModelStatisticsResponse()

    async def ModelInfer(self, request, context):
        output = request.outputs[0].name if request.outputs else next(iter(self.outputs))
        batch = request.inputs[0].shape[0] if request.inputs else 1
        response = pb.ModelInferResponse()
        response.CopyFrom(self._response(output, batch))
        response.model_name, response.id = request.model_name, request.id
        return response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", action="append", required=True, metavar="NAME:WIDTH",
                        help="an output the server answers with: name and row width")
    args = parser.parse_args()
    outputs = {name: int(width) for name, width in (o.split(":") for o in args.output)}
    asyncio.run(common.serve_v2(FloorServicer(outputs), "floor server"))


if __name__ == "__main__":
    main()
