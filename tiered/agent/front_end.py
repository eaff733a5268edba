"""Front-end processes: several gRPC servers on one port feeding one engine process.

One Python process takes in about 2,000 requests a second, far less than a
GPU engine serves. With `front_ends: N` the agent process keeps the models,
batchers, statistics, telemetry and shared-memory regions (the engine
process) and starts N front ends that bind the agent's port together
(SO_REUSEPORT: the kernel spreads connections over them). A front end
answers ModelInfer and ModelStreamInfer through the feed (`feed.py`: it
checks each request against its model's config, writes the input bytes,
read from the wire or from the client's system shared memory, into its
arena (or names the client's CUDA ranges, which the engine copies on the
device), sends the plain requests of a model that came while its earlier
frames were in the engine as one frame, and builds each response) and
passes every other call, bytes untouched, to the engine process's own gRPC
server on a unix socket, so each behaves exactly as with one process. A
streamed request to a generative model goes through the feed too: the
engine sends its token ids and the front end makes the text (detokenizing,
stop strings), builds and writes each response (and cancels the request
there when its client goes away); one to any other decoupled model is
relayed on a stream of its own, so its responses come back one by one. A
front end checks who may call what (it alone sees the client's token and
certificate); the engine's socket lives in a private directory and trusts
its front ends.

`FrontEnds` starts, watches (a front end that dies is replaced) and stops
them; `main` is a front end (`python -m tiered.agent.front_end`, its
settings pickled on stdin).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from tiered.agent.feed import (
    Arena,
    FedError,
    FeedClient,
    ModelFacts,
    OutputInRegion,
    OutputOnDevice,
    Placement,
)
from tiered.agent.shared_memory import CudaRange, Placed, RegionViews, open_view
from tiered.errors import ConfigError, TieredError
from tiered.protocol import codec, descriptors, drain, messages
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol.handlers import SERVER_OPTIONS, seconds_left
from tiered.protocol.remembered import Remembered
from tiered.protocol.security import CALLER, Authorizer, TransportSecurity, add_port, claim
from tiered.protocol.status import describe, status_code
from tiered.protocol.streaming import answer_stream

log = logging.getLogger(__name__)

READY = "ready"
START_TIMEOUT_S = 60.0
RESTART_DELAY_S = 1.0
PORT_WAIT_S = 5.0
# A stopping front end drains within the drain timeout (`drain.stop`); past
# that and this much more, it is killed.
EXIT_SLACK_S = 5.0
MIN_CORES = 4  # below this a profile's front ends are not started
MODEL_FACTS_TTL_S = 5.0  # how long a front end trusts what it learned of a model
MODELS_REMEMBERED = 1024  # models it remembers at most
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _inference(method: str) -> str:
    return descriptors.method_path(descriptors.INFERENCE_SERVICE, method)


# Calls that need an inference, a shared-memory or an admin credential
# (checked here, where the client's address, metadata and certificate are seen).
_NEEDS_INFERENCE = frozenset(map(_inference, ("ModelInfer", "ModelStreamInfer",
                                              "RepositoryIndex")))
_NEEDS_SHARED_MEMORY = frozenset(map(_inference, (
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister")))
_REGION_PARAMETERS = frozenset((codec.SHARED_MEMORY_REGION, codec.SHARED_MEMORY_BYTE_SIZE,
                                codec.SHARED_MEMORY_OFFSET))
_NEEDS_ADMIN = frozenset(map(_inference, ("RepositoryModelLoad", "RepositoryModelUnload")))
# Calls that make a region come or go: once the engine has answered one, this
# front end's view forgets the region before the caller hears back, so the
# caller's next request here cannot meet the old view (the engine's notice on
# the feed may come later than its answer).
_CHANGES_A_REGION = {_inference(method): getattr(pb, method + "Request") for method in (
    "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister")}


@dataclass(frozen=True)
class FrontEndSettings:
    host: str
    port: int
    security: TransportSecurity
    authorizer: Authorizer
    feed: str  # the engine's feed socket
    engine: str  # the engine's gRPC server, "unix:PATH"
    max_message_bytes: int
    max_concurrent_rpcs: int
    drain_timeout_s: float
    arena_bytes: int


def reserve_port(host: str, port: int, wait_s: float = PORT_WAIT_S) -> socket.socket:
    """Hold `port` (a free one for 0) for the front ends to share. A port
    already in use, shared or not, is refused, as one agent's would be, after
    `wait_s` (the front ends of an agent that just died take a moment to go)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    deadline = time.monotonic() + wait_s
    while port:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(address)
                break
            except OSError as error:
                if time.monotonic() >= deadline:
                    raise ConfigError(
                        f"cannot listen on {host}:{port}: {error.strerror}") from error
        time.sleep(0.1)
    held = socket.socket(family, kind, proto)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind(address)
    return held


def front_end_count(wanted: int, cores: int | None = None) -> int:
    """`wanted`, but at most half the cores this process may use (the engine
    process, its batches and the clients need the rest), and none below
    MIN_CORES: there a front end would take the core the engine needs."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return 0 if cores < MIN_CORES else min(wanted, cores // 2)


class FrontEnds:
    """The engine process's view of its N front-end processes."""

    def __init__(self, count: int, settings: FrontEndSettings) -> None:
        self.count = count
        self.settings = settings
        self._processes: set[asyncio.subprocess.Process] = set()
        self._watchers: set[asyncio.Task] = set()
        self._stopping = False

    async def start(self) -> None:
        """Start every front end; return once each serves the port."""
        started = await asyncio.gather(*(self._spawn() for _ in range(self.count)),
                                       return_exceptions=True)
        failed = [error for error in started if isinstance(error, BaseException)]
        if failed:
            await self.stop()
            raise failed[0]

    async def _spawn(self) -> None:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tiered.agent.front_end",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self._processes.add(process)
        process.stdin.write(pickle.dumps(self.settings))
        process.stdin.close()
        try:
            line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            line = b""
        if line.decode().strip() != READY:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            code = await process.wait()
            self._processes.discard(process)
            raise ConfigError(f"a front-end process did not start (exit code {code}; "
                              "its error is above)")
        watcher = asyncio.get_running_loop().create_task(self._watch(process))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    async def _watch(self, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        self._processes.discard(process)
        if self._stopping:
            return
        log.warning("front-end process %d exited with code %s; starting another",
                    process.pid, code)
        await asyncio.sleep(RESTART_DELAY_S)
        if not self._stopping:
            try:
                await self._spawn()
            except ConfigError as error:
                log.error("%s", error)

    @property
    def pids(self) -> list[int]:
        return sorted(p.pid for p in self._processes)

    async def stop(self) -> None:
        """Each front end refuses new calls and finishes its in-flight ones."""
        self._stopping = True
        # Watchers first: one replacing a front end adds its process before
        # anything else, so once they are gone every process is in the set.
        watchers = list(self._watchers)
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        processes = list(self._processes)
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in processes)),
                                   self.settings.drain_timeout_s + EXIT_SLACK_S)
        except asyncio.TimeoutError:
            for process in processes:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            await asyncio.gather(*(p.wait() for p in processes))  # none left behind
        self._processes.clear()


# -- a front-end process -------------------------------------------------------------

def _forwarded(context, authorizer: Authorizer) -> list[tuple[str, str | bytes]]:
    """A call's metadata as passed on to the engine process: its caller as
    found here (CALLER) in place of anything the client sent under that name."""
    return [(key, value) for key, value in context.invocation_metadata() or ()
            if not key.startswith((":", "grpc-")) and key not in ("user-agent", CALLER)] \
        + [(CALLER, authorizer.caller(context))]


def _forget_the_region(regions: RegionViews, caller: str, message_type, request: bytes) -> None:
    """Forget the region a (un)register call names ("": all of the caller's);
    a request that does not parse names none (the engine refused it)."""
    try:
        name = message_type.FromString(request).name
    except DecodeError:
        return
    regions.forget(caller, name)


def _builds_here(request: pb.ModelInferRequest) -> bool:
    """Whether a front end builds the responses to a streamed request to a
    generative model: its text or token ids asked for, nothing in shared
    memory. The engine answers any other (and what is wrong with it)."""
    return all(output.name in (messages.TEXT_OUTPUT, messages.TOKEN_IDS)
               and not len(output.parameters) for output in request.outputs) \
        and not any(codec.SHARED_MEMORY_REGION in tensor.parameters
                    for tensor in request.inputs)


class _Handlers(grpc.GenericRpcHandler):
    """Every method of the agent's services: inference through the feed,
    the rest passed to the engine process's gRPC server."""

    def __init__(self, feed: FeedClient, engine: grpc.aio.Channel,
                 authorizer: Authorizer, regions: RegionViews) -> None:
        self._feed = feed
        self._engine = engine
        self._authorizer = authorizer
        self._regions = regions
        self._handlers: dict[str, grpc.RpcMethodHandler] = {
            _inference("ModelInfer"): grpc.unary_unary_rpc_method_handler(
                self._infer, request_deserializer=pb.ModelInferRequest.FromString),
            _inference("ModelStreamInfer"): grpc.stream_stream_rpc_method_handler(
                self._stream, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=pb.ModelStreamInferResponse.SerializeToString),
        }
        pool = descriptors.reflection_pool()
        for name in descriptors.reflection_service_names():
            for method in pool.FindServiceByName(name).methods:
                path = descriptors.method_path(name, method.name)
                if path not in self._handlers:
                    self._handlers[path] = self._forwarder(
                        path, method.client_streaming, method.server_streaming)
        self._models: Remembered[tuple[str, str], ModelFacts] = Remembered(
            self._model_facts, time.monotonic, MODEL_FACTS_TTL_S, MODELS_REMEMBERED,
            unknown=ModelFacts())

    def service(self, handler_call_details):
        return self._handlers.get(handler_call_details.method)

    async def _facts(self, request: pb.ModelInferRequest) -> ModelFacts:
        """What the engine process's ModelConfig says of the request's model
        (`Remembered`: renewed in the background once MODEL_FACTS_TTL_S old).
        A model the engine cannot describe has no facts, and the engine
        answers its requests' errors."""
        return await self._models.get((request.model_name, request.model_version))

    async def _model_facts(self, key: tuple[str, str]) -> ModelFacts:
        ask = self._engine.unary_unary(
            _inference("ModelConfig"), request_serializer=pb.ModelConfigRequest.SerializeToString,
            response_deserializer=pb.ModelConfigResponse.FromString)
        try:
            answer = await ask(pb.ModelConfigRequest(name=key[0], version=key[1]), timeout=10)
        except grpc.aio.AioRpcError:
            return ModelFacts()
        return ModelFacts.of(answer.config)

    async def _in_regions(self, request: pb.ModelInferRequest, caller: str, facts: ModelFacts,
                          ) -> tuple[list[Placed | CudaRange] | None, dict[str, Placement]]:
        """For a request that may share a frame, where every input lies in
        shared memory: each input's range of a system region, which the feed
        reads straight into its arena, or of a CUDA region, which the engine
        copies on the device; the regions' parameters taken off the request;
        and its outputs asked
        for in regions, which the frame's answer writes here (system) or the
        engine writes (CUDA). (None, {}) where that is not so, or not known
        here: then the request travels alone and the engine reads and writes
        its regions."""
        alone: tuple[None, dict] = (None, {})
        if not facts.max_batch_size or not request.inputs:
            return alone
        in_region = [codec.SHARED_MEMORY_REGION in t.parameters for t in request.inputs]
        placed: dict[str, Placement] = {}
        for output in request.outputs:
            if len(output.parameters):
                found = await self._where(output.parameters, caller)
                if found is None or output.name in placed:
                    return alone
                parameters, where = found
                placed[output.name] = OutputInRegion(self._regions, caller, parameters) \
                    if isinstance(where, Placed) else OutputOnDevice(parameters)
        if not any(in_region):
            return None, placed
        if not all(in_region) or request.raw_input_contents:
            return alone
        buffers: list[Placed | CudaRange] = []
        for tensor in request.inputs:
            found = await self._where(tensor.parameters, caller)
            dtype = codec.DATATYPES.get(tensor.datatype)
            if found is None or dtype is None or dtype.hasobject \
                    or found[1].byte_size != math.prod(tensor.shape) * dtype.itemsize:
                return alone  # the engine answers what is wrong with it
            buffers.append(found[1])
        if len({isinstance(b, CudaRange) for b in buffers}) > 1:
            return alone  # a frame's input lies in one kind of memory
        for tensor in request.inputs:
            tensor.parameters.clear()
        return buffers, placed

    async def _where(self, parameters, caller: str,
                     ) -> tuple[dict[str, object], Placed | CudaRange] | None:
        """A tensor's parameters and the range they name, where that lies in
        a region known here (looked up from the engine process when new);
        else None."""
        found = codec.parameters_of(parameters)
        name = found.get(codec.SHARED_MEMORY_REGION)
        if not isinstance(name, str) or not set(found) <= _REGION_PARAMETERS:
            return None
        if not self._regions.knows(caller, name) and not await self._look_up(caller, name):
            return None
        placed = self._regions.place(caller, found)
        return None if placed is None else (found, placed)

    async def _look_up(self, caller: str, name: str) -> bool:
        """Ask the engine process where the caller's region lies: a system
        region is opened here, a CUDA region's size kept."""
        generation = self._regions.generation
        for method, message in (("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest),
                                ("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest)):
            ask = self._engine.unary_unary(
                _inference(method), request_serializer=message.SerializeToString,
                response_deserializer=getattr(pb, method + "Response").FromString)
            try:
                answer = await ask(message(name=name), metadata=[(CALLER, caller)], timeout=10)
                if name not in answer.regions:
                    continue
                found = answer.regions[name]
                if method == "CudaSharedMemoryStatus":
                    self._regions.keep_cuda(caller, name, found.byte_size, generation)
                else:
                    view = open_view(name, found.key, found.offset, found.byte_size)
                    self._regions.keep(caller, view, generation)
                break
            except grpc.aio.AioRpcError:
                continue  # NOT_FOUND: not a region of this kind
            except TieredError:
                return False
        return self._regions.knows(caller, name)

    async def _relay(self, request: pb.ModelInferRequest, context):
        """A decoupled model's responses to one request, from the engine
        process's own ModelStreamInfer; closing this cancels the call there."""
        call = self._engine.stream_stream(
            _inference("ModelStreamInfer"),
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )(iter([request]), metadata=_forwarded(context, self._authorizer),
          timeout=context.time_remaining())
        try:
            async for answer in call:
                if answer.error_message:
                    raise TieredError(answer.error_message)
                yield answer
        except grpc.aio.AioRpcError as error:
            raise TieredError(error.details() or str(error.code())) from error
        finally:
            call.cancel()

    async def _generated(self, request: pb.ModelInferRequest, seconds_left: float,
                         ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """A generative model's responses to one streamed request, built here
        from the tokens the engine sends (feed STREAM), each in its stream
        message; closing this cancels the request there."""
        outputs = tuple(output.name for output in request.outputs)
        flag = request.parameters.get(messages.EMPTY_FINAL_RESPONSE)
        empty_final = flag is not None and flag.bool_param  # the engine checks its type
        version = 0
        try:
            async for version, text, ids, prompt_tokens, finish, last in \
                    self._feed.generate(request, seconds_left):
                message = pb.ModelStreamInferResponse()
                messages.stream_response(messages.text_response(
                    message.infer_response, request.model_name, version, request.id, outputs,
                    text.encode(), ids, prompt_tokens, finish), last and not empty_final)
                yield message
        except FedError as error:
            raise TieredError(str(error)) from error
        if empty_final:
            yield pb.ModelStreamInferResponse(infer_response=messages.empty_final_response(
                request.model_name, version, request.id))

    def _check(self, path: str, context) -> None:
        if path in _NEEDS_INFERENCE:
            self._authorizer.require_inference(context)
        elif path in _NEEDS_SHARED_MEMORY:
            self._authorizer.require_shared_memory(context)
        elif path in _NEEDS_ADMIN:
            self._authorizer.require_admin(context)

    async def _infer(self, request, context) -> bytes:
        try:
            self._authorizer.require_inference(context)
            caller = self._authorizer.caller(context)
            claim(request, caller)
            facts = await self._facts(request)
            buffers, placed = await self._in_regions(request, caller, facts)
            return await self._feed.infer(request, seconds_left(context), facts, buffers, placed,
                                          caller)
        except FedError as error:
            await context.abort(_CODES.get(error.code, grpc.StatusCode.UNKNOWN), str(error))
        except Exception as error:  # the front end never dies of a request
            await context.abort(status_code(error), describe(error))

    async def _stream(self, requests: AsyncIterator, context):
        async def infer(request):
            self._authorizer.require_inference(context)  # refused in the stream, per request
            facts = await self._facts(request)
            caller = self._authorizer.caller(context)
            if facts.generates_text and _builds_here(request):
                claim(request, caller)
                return self._generated(request, seconds_left(context))
            if facts.decoupled:
                return self._relay(request, context)
            claim(request, caller)
            buffers, placed = await self._in_regions(request, caller, facts)
            try:
                answer = await self._feed.infer(request, seconds_left(context), facts, buffers,
                                                placed, caller)
            except FedError as error:
                raise TieredError(str(error)) from error
            return pb.ModelInferResponse.FromString(answer)

        async for response in answer_stream(requests, infer):
            yield response

    def _forwarder(self, path: str, client_streaming: bool, server_streaming: bool):
        engine, check, authorizer = self._engine, self._check, self._authorizer
        regions, changes_a_region = self._regions, _CHANGES_A_REGION.get(path)

        async def abort_with(error: Exception, context) -> None:
            if isinstance(error, grpc.aio.AioRpcError):
                await context.abort(error.code(), error.details() or "")
            await context.abort(status_code(error), describe(error))

        def call_options(context) -> dict:
            remaining = context.time_remaining()
            return {"metadata": _forwarded(context, authorizer),
                    "timeout": remaining}

        if not client_streaming and not server_streaming:
            async def unary(request: bytes, context) -> bytes:
                try:
                    check(path, context)
                    return await engine.unary_unary(path)(request, **call_options(context))
                except Exception as error:
                    await abort_with(error, context)
                finally:  # before the caller hears back, whatever the answer
                    if changes_a_region is not None:
                        _forget_the_region(regions, authorizer.caller(context),
                                           changes_a_region, request)
            return grpc.unary_unary_rpc_method_handler(unary)

        if client_streaming and not server_streaming:
            raise ConfigError(f"{path}: client-streaming calls are not forwarded")
        open_call = (engine.stream_stream if client_streaming else engine.unary_stream)(path)

        async def streaming(request_or_requests, context):
            try:
                check(path, context)
                async for answer in open_call(request_or_requests, **call_options(context)):
                    yield answer
            except Exception as error:
                await abort_with(error, context)
        return (grpc.stream_stream_rpc_method_handler(streaming) if client_streaming
                else grpc.unary_stream_rpc_method_handler(streaming))


async def serve(settings: FrontEndSettings) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    arena = Arena(settings.arena_bytes)
    regions = RegionViews()
    feed = await FeedClient.connect(settings.feed, arena, regions.forget)
    options = [("grpc.max_receive_message_length", settings.max_message_bytes),
               ("grpc.max_send_message_length", settings.max_message_bytes)]
    engine = grpc.aio.insecure_channel(settings.engine, options=options)
    server = grpc.aio.server(options=[*options, ("grpc.so_reuseport", 1), *SERVER_OPTIONS],
                             maximum_concurrent_rpcs=settings.max_concurrent_rpcs)
    server.add_generic_rpc_handlers([_Handlers(feed, engine, settings.authorizer, regions),
                                     drain.Marker()])
    add_port(server, f"{settings.host}:{settings.port}", settings.security)
    # Its own socket, beside the engine's, to drain itself through (`drain.stop`).
    own = f"unix:{Path(settings.feed).parent / f'front-end-{os.getpid()}.sock'}"
    server.add_insecure_port(own)
    await server.start()
    print(READY, flush=True)
    engine_gone = loop.create_task(feed.closed.wait())
    signalled = loop.create_task(stop.wait())
    await asyncio.wait([engine_gone, signalled], return_when=asyncio.FIRST_COMPLETED)
    if feed.closed.is_set():
        await server.stop(grace=0)  # nothing in flight can be answered now
    else:
        await drain.stop(server, own, settings.drain_timeout_s)
    await engine.close()
    lost = feed.closed.is_set() and not stop.is_set()
    for task in (engine_gone, signalled):
        task.cancel()
    arena.close()
    regions.close()
    if lost:
        log.error("front end %d: the engine process is gone; exiting", os.getpid())
    return 1 if lost else 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with contextlib.suppress(OSError, AttributeError):  # Linux: go when the engine goes
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    settings: FrontEndSettings = pickle.loads(sys.stdin.buffer.read())
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
