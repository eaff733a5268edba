"""The router's gRPC services: the v2 inference service and tiered.v1.Telemetry.

Each method converts the request, calls the data plane (`dataplane.Router`)
and converts its answer; errors are domain errors, mapped once by
`translate_errors`. No routing decision is made here. ModelInfer takes and
gives bytes (`add_to_server`): the agent's answer goes back as it came.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

import tiered
from tiered import errors
from tiered.protocol import descriptors, security
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc
from tiered.protocol.handlers import GenericOnly
from tiered.protocol.status import translate_errors
from tiered.protocol.streaming import answer_stream
from tiered.router import dataplane, forward, hints

PLACEMENT = ("the router does not load or unload models: placement is the controller's job "
             "(change the TieredModel, or call RepositoryModelLoad on an agent)")


class RouterServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Convert, call the router, convert. Unlisted Triton methods: UNIMPLEMENTED."""

    def __init__(self, router: dataplane.Router,
                 authorizer: security.Authorizer = security.Authorizer()) -> None:
        self.router = router
        self.authorizer = authorizer  # inference credentials, checked as agents check them
        self.serving = True

    @translate_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @translate_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.serving and await self.router.any_agent_ready())

    @translate_errors
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="tiered-router", version=tiered.__version__,
                                         extensions=("model_configuration", "statistics",
                                                     "parameters"))

    @translate_errors
    async def ModelReady(self, request, context):
        if request.name not in self.router.table.models:
            return pb.ModelReadyResponse(ready=False)
        return await self.router.metadata_call(request.name, "ModelReady", request)

    @translate_errors
    async def ModelMetadata(self, request, context):
        return await self.router.metadata_call(request.name, "ModelMetadata", request)

    @translate_errors
    async def ModelConfig(self, request, context):
        return await self.router.metadata_call(request.name, "ModelConfig", request)

    @translate_errors
    async def ModelInfer(self, request: bytes, context) -> bytes:
        self.authorizer.require_inference(context)
        answer = await self.router.infer(parse_request(request), request,
                                         context.invocation_metadata(), context.time_remaining())
        return answer.raw

    @translate_errors
    async def ModelStatistics(self, request, context):
        models = self.router.table.models
        if request.name and request.name not in models:
            raise errors.NotFound(f"name: {request.name!r} is not in the routing table")
        return pb.ModelStatisticsResponse(model_stats=self.router.statistics.messages(
            [request.name] if request.name else models, request.version,
            self.router.clock(), time.time()))

    @translate_errors
    async def RepositoryIndex(self, request, context):
        self.authorizer.require_inference(context)
        models = sorted(self.router.table.models)
        ready = await asyncio.gather(*(self.router.model_ready(m) for m in models))
        rows = [pb.RepositoryIndexResponse.ModelIndex(
            name=model, state="READY" if up else "UNAVAILABLE",
            reason="" if up else f"no agent of the model answered ModelReady true within "
                                 f"{forward.READY_PROBE_S:g} s")
            for model, up in zip(models, ready, strict=True) if up or not request.ready]
        return pb.RepositoryIndexResponse(models=rows)

    async def RepositoryModelLoad(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, PLACEMENT)

    async def RepositoryModelUnload(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, PLACEMENT)

    async def _no_shared_memory(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, hints.SHARED_MEMORY)

    SystemSharedMemoryStatus = SystemSharedMemoryRegister = SystemSharedMemoryUnregister = \
        CudaSharedMemoryStatus = CudaSharedMemoryRegister = CudaSharedMemoryUnregister = \
        _no_shared_memory

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest],
                               context) -> AsyncIterator[pb.ModelStreamInferResponse]:
        # Each streamed request is forwarded on its own: a decoupled model's
        # on a stream of its own to one agent, its responses relayed as they
        # come (`streams`); any other's as a ModelInfer, so nothing is ever
        # retried after part of an answer went out. One failure is one error
        # message in the stream, which goes on.
        metadata = context.invocation_metadata()

        async def infer(request: pb.ModelInferRequest):
            self.authorizer.require_inference(context)  # refused in the stream, per request
            raw = request.SerializeToString()
            if await self.router.is_decoupled(request.model_name):
                return self.router.stream(request, raw, metadata, context.time_remaining())
            answer = await self.router.infer(request, raw, metadata, context.time_remaining())
            return answer.response

        async for response in answer_stream(request_iterator, infer):
            yield response


def parse_request(raw: bytes) -> pb.ModelInferRequest:
    try:
        return pb.ModelInferRequest.FromString(raw)
    except DecodeError:
        raise errors.InvalidArgument("request: not a ModelInferRequest") from None


def add_to_server(inference: RouterServicer, server) -> None:
    """The v2 service on `server` as generic handlers (`GenericOnly`), ModelInfer
    with bytes in and out: the request goes on as it came, the answer back as
    the agent sent it."""
    services = GenericOnly(server)
    services.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        descriptors.INFERENCE_SERVICE,
        {"ModelInfer": grpc.unary_unary_rpc_method_handler(inference.ModelInfer)}),))
    # After the bytes handler, which answers ModelInfer first.
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(inference, services)


class TelemetryServicer(tpb_grpc.TelemetryServicer):
    """Agreement from the router's shadow tally, Routes from the table in use;
    Stats is the agents' to answer."""

    def __init__(self, router: dataplane.Router) -> None:
        self.router = router

    async def Stats(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "the router keeps no Stats: ask the agents")

    @translate_errors
    async def Agreement(self, request, context):
        agreement = self.router.agreement
        return tpb.AgreementResponse(instance=agreement.instance, tiers=[
            tpb.TierAgreement(tier=row.tier, agreed=row.agreed, disagreed=row.disagreed)
            for row in agreement.tiers(request.model_name, request.model_version)])

    @translate_errors
    async def Routes(self, request, context):
        table = self.router.table  # one table for the whole answer
        return tpb.RoutesResponse(table_version=table.version, routes=[
            tpb.TierRoute(model_name=model, tier=tier, stable=route.stable,
                          canary=route.canary or 0)
            for model, routes in table.models.items()
            if not request.model_name or model == request.model_name
            for tier, route in routes.tiers.items()],
            instance=self.router.agreement.instance, unmet=[
                tpb.UnmetDemand(model_name=model, tier=tier, requests=requests,
                                waiting=waiting)
                for model, tier, requests, waiting in self.router.demand.report()
                if not request.model_name or model == request.model_name])
