"""The v2 inference servicer of an agent: convert, call the repository, convert.

Every unary method goes through `translate_errors`, the one mapping of domain
errors to gRPC codes. Streamed requests run concurrently (bounded per stream)
and each answer or error travels back as its own stream message, so one bad
request never ends the stream. A generative (decoupled) model answers a
streamed request with one response per token, each flagged
`triton_final_response` (true on the last), and ModelInfer with the whole
text; a client that goes away stops its sequence. Any other decoupled model
answers a streamed request with a response per row of its outputs (none for
none) and refuses ModelInfer, as Triton does.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from opentelemetry import trace

import tiered
from tiered.agent.config import ENSEMBLE
from tiered.agent.feed import StreamHead
from tiered.agent.generation import TEXT_OUTPUT, TOKEN_IDS, GenerationRequest
from tiered.agent.generative import GenerativeVersion
from tiered.agent.model import ModelVersion, response_rows
from tiered.agent.repository import ModelRepository
from tiered.agent.scheduler import Piece
from tiered.agent.sequences import SequenceFlags
from tiered.agent.shared_memory import CallerRegions, SharedMemory
from tiered.errors import InvalidArgument, TieredError, Unimplemented
from tiered.protocol import error_text, messages
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
from tiered.protocol.handlers import seconds_left
from tiered.protocol.security import CALLER, Authorizer, claim
from tiered.protocol.status import describe, translate_errors
from tiered.protocol.streaming import answer_stream
from tiered.telemetry.tracing import context_from_metadata

# Triton's platform names, which some clients and dashboards key on.
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "torch": "pytorch_libtorch",
             "tensorrt": "tensorrt_plan", "onnxruntime-genai": "onnxruntime_genai",
             "torch-generative": "pytorch_libtorch", ENSEMBLE: "ensemble"}
WHOLE = 1 << 30  # ModelInfer's text: take every token ready at once


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, repository: ModelRepository, tracer: trace.Tracer | None = None,
                 authorizer: Authorizer | None = None,
                 shared_memory: SharedMemory | None = None) -> None:
        self.repository = repository
        self.shared_memory = shared_memory or SharedMemory()
        self.tracer = tracer  # None: tracing off, no spans made
        self.authorizer = authorizer or Authorizer()
        self.ready = False  # set once the repository is loaded; cleared on shutdown

    @translate_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @translate_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.ready)

    @translate_errors
    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self.repository.is_ready(request.name, request.version))

    @translate_errors
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(
            name="tiered", version=tiered.__version__, extensions=messages.SERVER_EXTENSIONS
        )

    @translate_errors
    async def ModelMetadata(self, request, context):
        model = self.repository.get(request.name, request.version)
        versions = self.repository.served(request.name).versions
        return messages.model_metadata(model.config, versions, PLATFORMS[model.config.backend])

    @translate_errors
    async def ModelConfig(self, request, context):
        model = self.repository.get(request.name, request.version)
        facts = {"tier": self.repository.profile.tier, **model.describe(),
                 **model.build}
        config = messages.model_config(
            model.config, PLATFORMS[model.config.backend], model.config.backend,
            model.on_gpu, facts,
        )
        return pb.ModelConfigResponse(config=config)

    @translate_errors
    async def ModelInfer(self, request, context):
        self.authorizer.require_inference(context)
        claim(request, self.authorizer.caller(context))
        return await self.answer(request, seconds_left(context), context.invocation_metadata())

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        metadata = context.invocation_metadata()

        def infer(request: pb.ModelInferRequest):
            self.authorizer.require_inference(context)  # refused in the stream, per request
            claim(request, self.authorizer.caller(context))
            return self.answer_streamed(request, seconds_left(context), metadata)

        # grpc.aio wants the handler itself to be an async generator.
        async for response in answer_stream(request_iterator, infer):
            yield response

    async def answer(self, request: pb.ModelInferRequest, seconds_left: float = math.inf,
                     metadata=(), raw: list | None = None) -> pb.ModelInferResponse:
        """One inference, however it came: from gRPC, or from a front-end process
        (`raw`: its input buffers, which travelled apart from the message)."""
        if self.tracer is None:
            return await self._infer(request, seconds_left, raw)
        with self.tracer.start_as_current_span(
            "ModelInfer",
            context=context_from_metadata(metadata),
            kind=trace.SpanKind.SERVER,
            attributes={"tiered.model": request.model_name, "tiered.tier":
                        self.repository.profile.tier},
        ):
            return await self._infer(request, seconds_left, raw)

    async def answer_streamed(self, request: pb.ModelInferRequest, seconds_left: float,
                              metadata=()):
        """A request of a stream: one response, or a generative model's
        responses as they come (an async iterator)."""
        model = self.repository.get(request.model_name, request.model_version)
        if not isinstance(model, GenerativeVersion):
            if model.config.decoupled:
                return self._row_responses(model, request, seconds_left)
            return await self.answer(request, seconds_left, metadata)
        call, generation = self._generation(model, request)
        deadline = time.monotonic() + min(call.timeout_s, seconds_left)
        responses = self._token_responses(model, call, generation, deadline)
        return responses if self.tracer is None else self._traced(
            responses, request, metadata, lambda message: messages.token_count(
                message.infer_response))

    def start_generation(self, body: bytes, seconds_left: float,
                         deliver: Callable[[Piece | TieredError], None],
                         ) -> tuple[StreamHead, Callable[[bool], None]]:
        """A front end's streamed request to a generative model (`feed.Answers`),
        authorized by the front end, which makes its text: `deliver` gets each
        token (its id alone), then or else the error that ends it. Returns
        what the front end needs to make the text and what stops the request
        early (`done`: a stop string ended it). Refusals are raised."""
        try:
            request = pb.ModelInferRequest.FromString(body)
        except DecodeError as error:
            raise InvalidArgument(f"the request does not parse: {error}") from error
        model = self.repository.get(request.model_name, request.model_version)
        if not isinstance(model, GenerativeVersion):
            raise InvalidArgument(f"model {request.model_name!r} does not generate text")
        call, generation = self._generation(model, request)
        deadline = time.monotonic() + min(call.timeout_s, seconds_left)
        span = None if self.tracer is None else _StreamSpan(
            self.tracer, request, (), self.repository.profile.tier)

        def counted(event: Piece | TieredError) -> None:
            assert span is not None
            if isinstance(event, TieredError):
                span.end(event)
            else:
                span.counted(1)
                if event.last:
                    span.end()
            deliver(event)

        try:
            started = model.start(replace(generation, text_elsewhere=True), deadline,
                                  deliver if span is None else counted)
        except TieredError as error:
            if span is not None:
                span.end(error)
            raise

        def stop(done: bool = False) -> None:
            started.close(done)
            if span is not None:
                span.end()
        return (model.version, model.config.generation.max_tokens_per_response,
                *model.tokenizer, generation.stop), stop

    async def _traced(self, answers: AsyncIterator, request: pb.ModelInferRequest, metadata,
                      tokens_in: Callable[[Any], int]) -> AsyncIterator:
        """A streamed generation's responses inside a span of their own
        (`_StreamSpan`)."""
        assert self.tracer is not None
        span = _StreamSpan(self.tracer, request, metadata, self.repository.profile.tier)
        try:
            async with contextlib.aclosing(answers) as each:
                async for answer in each:
                    span.counted(tokens_in(answer))
                    yield answer
        except Exception as error:
            span.end(error)
            raise
        finally:
            span.end()

    def _generation(self, model: GenerativeVersion, request: pb.ModelInferRequest,
                    raw: list | None = None) -> tuple[messages.InferCall, GenerationRequest]:
        try:
            call = messages.decode_infer_request(request, self._regions(request), raw)
            if call.output_regions:
                raise InvalidArgument("outputs: a generative model answers in the message, "
                                      "not in shared memory")
            outputs = call.outputs or (TEXT_OUTPUT, TOKEN_IDS)
            tokens = messages.VISUAL_TOKENS
            known = (TEXT_OUTPUT, TOKEN_IDS, *((tokens,) if model.vision else ()))
            for name in outputs:
                if name not in known:
                    raise InvalidArgument(f"outputs: unknown output {name!r}; model "
                                          f"{model.config.name!r} has {', '.join(known)}")
            if tokens in outputs and len(outputs) > 1:
                raise InvalidArgument(f"outputs: {tokens} (the vision stage's alone) is asked "
                                      "for by itself")
        except TieredError as error:
            model.count_rejected(error)
            raise
        return call, model.parse(call.inputs, call.parameters)

    def _text_response(self, call: messages.InferCall, model: GenerativeVersion,
                       pieces: list[Piece], response: pb.ModelInferResponse | None = None,
                       ) -> pb.ModelInferResponse:
        """The pieces' text and token ids as the call asked for them, in
        `response` where given (a stream message's, built in place)."""
        return messages.text_response(
            pb.ModelInferResponse() if response is None else response, model.config.name,
            model.version, call.id, call.outputs, "".join(p.text for p in pieces).encode(),
            [p.token_id for p in pieces], pieces[-1].prompt_tokens, pieces[-1].finish)

    async def _token_responses(self, model: GenerativeVersion, call: messages.InferCall,
                               generation: GenerationRequest, deadline: float):
        """The stream's messages, one per chunk of tokens, each built where it
        is sent (a stream message's response is not copied into it)."""
        empty_final = generation.empty_final_response
        most = model.config.generation.max_tokens_per_response
        async with contextlib.aclosing(model.generate(generation, deadline, most)) as chunks:
            async for pieces in chunks:
                message = pb.ModelStreamInferResponse()
                messages.stream_response(
                    self._text_response(call, model, pieces, message.infer_response),
                    pieces[-1].last and not empty_final)
                yield message
        if empty_final:
            yield pb.ModelStreamInferResponse(infer_response=messages.empty_final_response(
                model.config.name, model.version, call.id))

    async def _row_responses(self, model: ModelVersion, request: pb.ModelInferRequest,
                             seconds_left: float):
        """A decoupled model's responses to a request: one per row of its
        outputs, the last flagged final (or an empty final one, if asked)."""
        try:
            call = messages.decode_infer_request(request, self._regions(request))
            if call.output_regions:
                raise InvalidArgument("outputs: a decoupled model answers in its responses, "
                                      "not in shared memory")
            empty_final = messages.wants_empty_final(call.parameters)
        except TieredError as error:
            model.count_rejected(error)
            raise
        deadline = time.monotonic() + min(call.timeout_s, seconds_left)
        outputs = await model.infer(call.inputs, call.outputs, deadline, self.tracer)
        rows = response_rows(outputs, model.config.name)
        for index, row in enumerate(rows):
            response = messages.encode_infer_response(call, model.config.name, model.version,
                                                      row)
            yield messages.stream_response(response, index == len(rows) - 1 and not empty_final)
        if empty_final:
            yield messages.empty_final_response(model.config.name, model.version, call.id)

    async def _generate_whole(self, model: GenerativeVersion, request: pb.ModelInferRequest,
                              seconds_left: float, raw: list | None) -> pb.ModelInferResponse:
        call, generation = self._generation(model, request, raw)
        if call.outputs == (messages.VISUAL_TOKENS,):
            return messages.encode_infer_response(call, model.config.name, model.version, {
                messages.VISUAL_TOKENS: await model.visual_tokens(generation)})
        deadline = time.monotonic() + min(call.timeout_s, seconds_left)
        pieces: list[Piece] = []
        async with contextlib.aclosing(model.generate(generation, deadline, WHOLE)) as stream:
            async for chunk in stream:
                pieces += chunk
        response = self._text_response(call, model, pieces)
        # The router's cascade judges a generation by it (messages.MEAN_LOGPROB).
        response.parameters[messages.MEAN_LOGPROB].double_param = \
            sum(p.logprob for p in pieces) / len(pieces)
        return response

    async def answer_one(self, body: bytes, raw: list, seconds_left: float) -> bytes:
        """A front end's request that travelled alone (`feed.Answers`);
        authorized by the front end."""
        try:
            request = pb.ModelInferRequest.FromString(body)
        except DecodeError as error:
            raise InvalidArgument(f"the request does not parse: {error}") from error
        return (await self.answer(request, seconds_left, raw=raw)).SerializeToString()

    async def answer_group(self, model_name: str, version: str, inputs: dict[str, np.ndarray],
                           outputs: tuple[str, ...], rows: list[int], seconds_left: float,
                           ) -> tuple[str, str, dict[str, np.ndarray]]:
        """Plain requests a front end checked and merged row-wise (`feed.Answers`),
        run as one and counted as each."""
        model = self.repository.get(model_name, version)
        if isinstance(model, GenerativeVersion):
            raise InvalidArgument(f"model {model_name!r} generates text: its requests are "
                                  "not merged")
        answer = await model.infer(inputs, outputs, time.monotonic() + seconds_left,
                                   requests=rows)
        return model.config.name, str(model.version), answer

    async def _infer(self, request: pb.ModelInferRequest, seconds_left: float,
                     raw: list | None) -> pb.ModelInferResponse:
        model = self.repository.get(request.model_name, request.model_version)
        if isinstance(model, GenerativeVersion):
            return await self._generate_whole(model, request, seconds_left, raw)
        if model.config.decoupled:
            error = Unimplemented(error_text.decoupled_unary(model.config.name))
            model.count_rejected(error)
            raise error
        regions = self._regions(request)
        try:
            call = messages.decode_infer_request(request, regions, raw)
        except TieredError as error:
            model.count_rejected(error)
            raise
        deadline = time.monotonic() + min(call.timeout_s, seconds_left)
        try:
            sequence = SequenceFlags.of(call.parameters)
        except TieredError as error:
            model.count_rejected(error)
            raise
        outputs = await model.infer(call.inputs, call.outputs, deadline, self.tracer,
                                    sequence=sequence)
        return messages.encode_infer_response(call, model.config.name, model.version, outputs,
                                              regions)

    def regions(self, caller: str) -> CallerRegions:
        """The regions a front end named for `caller` in a merged frame (`feed.Answers`)."""
        return self.shared_memory.of(caller)

    def _regions(self, request: pb.ModelInferRequest) -> CallerRegions:
        """The shared-memory regions of the request's caller (`claim`), whose
        mark is taken off the request."""
        if CALLER not in request.parameters:
            return self.shared_memory.of("")
        caller = request.parameters[CALLER].string_param
        del request.parameters[CALLER]
        return self.shared_memory.of(caller)

    @translate_errors
    async def ModelStatistics(self, request, context):
        if request.name:
            entry = self.repository.served(request.name)
            versions = list(entry.versions.values())
            if request.version:
                versions = [self.repository.get(request.name, request.version)]
        else:
            versions = self.repository.all_versions()
        return pb.ModelStatisticsResponse(
            model_stats=[
                messages.model_statistics(v.config.name, v.version, v.stats) for v in versions
            ]
        )

    @translate_errors
    async def RepositoryIndex(self, request, context):
        self.authorizer.require_inference(context)
        rows = self.repository.index(ready_only=request.ready)
        return pb.RepositoryIndexResponse(
            models=[
                pb.RepositoryIndexResponse.ModelIndex(
                    name=r.name, version=r.version, state=r.state, reason=r.reason
                )
                for r in rows
            ]
        )

    @translate_errors
    async def RepositoryModelLoad(self, request, context):
        self.authorizer.require_admin(context)
        messages.repository_parameters(request.parameters)
        await self.repository.load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    @translate_errors
    async def RepositoryModelUnload(self, request, context):
        self.authorizer.require_admin(context)
        messages.repository_parameters(request.parameters)
        await self.repository.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory (Triton's system and CUDA shared-memory extensions) ---------

    @translate_errors
    async def SystemSharedMemoryStatus(self, request, context):
        self.authorizer.require_shared_memory(context)
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self.shared_memory.system_status(self.authorizer.caller(context),
                                                       request.name):
            response.regions[region.name].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(
                    name=region.name, key=region.key, offset=region.offset,
                    byte_size=region.byte_size))
        return response

    @translate_errors
    async def SystemSharedMemoryRegister(self, request, context):
        self.authorizer.require_shared_memory(context)
        self.shared_memory.register_system(self.authorizer.caller(context), request.name,
                                           request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @translate_errors
    async def SystemSharedMemoryUnregister(self, request, context):
        self.authorizer.require_shared_memory(context)
        self.shared_memory.unregister_system(self.authorizer.caller(context), request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @translate_errors
    async def CudaSharedMemoryStatus(self, request, context):
        self.authorizer.require_shared_memory(context)
        response = pb.CudaSharedMemoryStatusResponse()
        for region in self.shared_memory.cuda_status(self.authorizer.caller(context),
                                                     request.name):
            response.regions[region.name].CopyFrom(pb.CudaSharedMemoryStatusResponse.RegionStatus(
                name=region.name, device_id=region.device_id, byte_size=region.byte_size))
        return response

    @translate_errors
    async def CudaSharedMemoryRegister(self, request, context):
        self.authorizer.require_shared_memory(context)
        self.shared_memory.register_cuda(self.authorizer.caller(context), request.name,
                                         request.raw_handle, request.device_id,
                                         request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    @translate_errors
    async def CudaSharedMemoryUnregister(self, request, context):
        self.authorizer.require_shared_memory(context)
        self.shared_memory.unregister_cuda(self.authorizer.caller(context), request.name)
        return pb.CudaSharedMemoryUnregisterResponse()


class _StreamSpan:
    """A streamed generation's span (not made current: its tokens come across
    tasks), which counts its tokens and records when the first came; ended
    once, with the error that ended the stream if any."""

    def __init__(self, tracer, request: pb.ModelInferRequest, metadata, tier: str) -> None:
        self._span = tracer.start_span(
            "ModelStreamInfer", context=context_from_metadata(metadata),
            kind=trace.SpanKind.SERVER,
            attributes={"tiered.model": request.model_name, "tiered.tier": tier})
        self._tokens = 0
        self._ended = False

    def counted(self, tokens: int) -> None:
        if not self._tokens:
            self._span.add_event("first token")
        self._tokens += tokens

    def end(self, error: Exception | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        if error is not None:
            self._span.record_exception(error)
            self._span.set_status(trace.Status(trace.StatusCode.ERROR, describe(error)))
        self._span.set_attribute("tiered.output_tokens", self._tokens)
        self._span.end()
