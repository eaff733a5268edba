"""KServe v2 REST and OpenAI's API beside gRPC: the aiohttp server.

An HTTP request becomes the v2 protobuf request a gRPC client would have
sent (`rest_json`, `rest_generate`, `rest_openai`), the same servicer method
answers it,
and its answer becomes JSON (and binary data). Servicers see the call through
`_Context`, which reads HTTP headers where gRPC metadata would be, so
credentials (bearer tokens, client certificates under mTLS), tracing and
routing hints work as over gRPC, and requests count in the same statistics.
Errors keep gRPC's message and take the HTTP code of its status
(`status.http_status`), in Triton's body `{"error": "..."}`.

Bounded: bodies by the gRPC message limit, requests in flight by the gRPC
concurrency limit. Never imports agent or router code: servers hand it a
servicer.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from tiered.engines.generative import GENERATIVE_BACKENDS
from tiered.errors import ConfigError, InvalidArgument
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import rest_openai, status
from tiered.protocol.rest_generate import event, generate_json, generate_request, is_last
from tiered.protocol.rest_json import (
    HEADER_LENGTH,
    MAX_JSON_BYTES,
    body_object,
    infer_request,
    infer_response,
    integer_field,
    json_object,
    message_json,
    parameters_object,
    string_field,
)
from tiered.protocol.security import Authorizer

UNIMPLEMENTED_PATHS = ("/v2/trace/setting", "/v2/models/{model}/trace/setting", "/v2/logging")
# A body not received within this long is refused (408): a slow sender holds
# one of the calls in flight. 64 MiB takes 54 s at 10 Mbit/s.
BODY_READ_S = 60.0
HEALTH_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})  # outside the in-flight cap

Infer = Callable[[pb.ModelInferRequest, Any], Awaitable[pb.ModelInferResponse]]


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Refused(Exception):
    """A request refused before it reaches the servicer: this HTTP status and message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Context:
    """What a servicer method reads of its call, for a call that came over HTTP
    (in place of grpc.aio's ServicerContext)."""

    __slots__ = ("_request", "_metadata", "code", "details")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        if self._metadata is None:
            self._metadata = tuple((key.lower(), value)
                                   for key, value in self._request.headers.items())
        return self._metadata

    def time_remaining(self) -> float | None:
        return None  # HTTP carries no deadline; the request's `timeout` parameter does

    def auth_context(self) -> dict[str, list[bytes]]:
        transport = self._request.transport
        certificate = transport.get_extra_info("peercert") if transport else None
        names = [value.encode() for part in (certificate or {}).get("subject", ())
                 for key, value in part if key == "commonName"]
        return {"x509_common_name": names} if names else {}

    def peer(self) -> str:
        return f"http:{self._request.remote}"

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def over_bytes(method: Callable[[bytes, Any], Awaitable[bytes]]) -> Infer:
    """A ModelInfer that takes and gives bytes (the router's), as one that
    takes and gives messages."""
    async def infer(request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        return pb.ModelInferResponse.FromString(
            await method(request.SerializeToString(), context))
    return infer


def _error(code: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=code)


def _json(value: Any) -> web.Response:
    return web.Response(body=json.dumps(value, separators=(",", ":")).encode(),
                        content_type="application/json")


def _json_length(value: str | None, body_length: int) -> int:
    if value is None:
        return body_length
    try:
        length = int(value)
    except ValueError:
        raise InvalidArgument(f"{HEADER_LENGTH}: expected a byte count, got {value!r}") from None
    if not 0 <= length <= body_length:
        raise InvalidArgument(f"{HEADER_LENGTH}: {length} is outside the body's "
                              f"{body_length} bytes")
    return length


class RestFrontDoor:
    """The v2 REST endpoints over one servicer (the agent's or the router's).

    `infer`: the servicer's ModelInfer as message in, message out, where it is
    not that already (`over_bytes`). `authorizer`: the credentials a call's
    body is read only after, for the `roles` the servicer checks (it checks
    them again, as for gRPC); None where it checks none."""

    def __init__(self, servicer, *, max_body_bytes: int, max_in_flight: int,
                 max_json_bytes: int = MAX_JSON_BYTES, infer: Infer | None = None,
                 authorizer: Authorizer | None = None,
                 roles: tuple[str, ...] = ("inference", "admin", "shared_memory")) -> None:
        self.servicer = servicer
        self.infer_method = infer or servicer.ModelInfer
        self.max_body_bytes = max_body_bytes
        self.max_json_bytes = max_json_bytes
        self.body_read_s = BODY_READ_S
        self.max_in_flight = max_in_flight
        self.authorizer = authorizer
        self.roles = roles
        self._in_flight = 0

    async def _body(self, request: web.Request, role: str) -> bytes:
        """The request's body, read once the caller holds `role` (inference,
        admin, shared_memory): an unauthorized body is never read or parsed."""
        if self.authorizer is not None and role in self.roles:
            getattr(self.authorizer, f"require_{role}")(_Context(request))
        try:
            return await asyncio.wait_for(request.read(), self.body_read_s)
        except TimeoutError:
            raise _Refused(408, f"request body: not received within {self.body_read_s:g} s") \
                from None

    async def _json_body(self, request: web.Request, role: str) -> bytes:
        """A body that is all JSON, within the JSON limit."""
        body = await self._body(request, role)
        self._check_json(len(body))
        return body

    def _check_json(self, size: int) -> None:
        if size > self.max_json_bytes:
            raise _Refused(413, f"request JSON ({size} bytes): larger than the limit of "
                            f"{self.max_json_bytes} bytes; send tensors this large as binary "
                            f"data ({HEADER_LENGTH}, the binary tensor extension) or over gRPC")

    def application(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._guard])
        model_routes = []
        for model in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            model_routes += [
                web.get(model, self.model_metadata),
                web.get(f"{model}/ready", self.model_ready),
                web.get(f"{model}/config", self.model_config),
                web.get(f"{model}/stats", self.statistics),
                web.post(f"{model}/infer", self.infer),
                web.post(f"{model}/generate", self.generate),
                web.post(f"{model}/generate_stream", self.generate_stream),
            ]
        shared = []
        for kind in ("system", "cuda"):
            base = f"/v2/{kind}sharedmemory"
            shared += [
                web.get(f"{base}/status", self.shared_memory_status),
                web.get(f"{base}/region/{{region}}/status", self.shared_memory_status),
                web.post(f"{base}/region/{{region}}/register", self.shared_memory_register),
                web.post(f"{base}/unregister", self.shared_memory_unregister),
                web.post(f"{base}/region/{{region}}/unregister", self.shared_memory_unregister),
            ]
        app.add_routes([
            web.get("/v1/models", self.openai_models),
            web.post("/v1/completions", self.openai_completions),
            web.post("/v1/chat/completions", self.openai_chat),
            web.get("/v2/health/live", self.live),
            web.get("/v2/health/ready", self.ready),
            web.get("/v2", self.server_metadata),
            web.get("/v2/models/stats", self.statistics),  # before /v2/models/{model}
            *model_routes,
            web.post("/v2/repository/index", self.repository_index),
            web.post("/v2/repository/models/{model}/load", self.load),
            web.post("/v2/repository/models/{model}/unload", self.load),
            *shared,
            *(web.route("*", path, self.unimplemented) for path in UNIMPLEMENTED_PATHS),
        ])
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """Bounds, and every failure as Triton's error body (OpenAI's, on its
        paths); never an exception out. Health checks are answered whatever
        else is in flight."""
        response = await self._bounded(request, handler)
        if request.path.startswith(rest_openai.PREFIX) and response.status >= 400 \
                and isinstance(response, web.Response) and response.text:
            try:
                message = str(json.loads(response.text).get("error", ""))
            except (ValueError, AttributeError):
                return response
            return web.json_response(rest_openai.error_json(response.status, message),
                                     status=response.status)
        return response

    async def _bounded(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path in HEALTH_PATHS:
            return await handler(request)
        if self._in_flight >= self.max_in_flight:
            return _error(429, f"too many requests in flight: at most {self.max_in_flight}")
        self._in_flight += 1
        try:
            if (request.content_length or 0) > self.max_body_bytes:
                return self._too_large(request.content_length)
            return await handler(request)
        except _Aborted as aborted:
            return _error(status.http_status(aborted.code), aborted.details)
        except _Refused as refused:
            return _error(refused.code, str(refused))
        except web.HTTPRequestEntityTooLarge:
            return self._too_large(None)
        except web.HTTPException as refused:
            if refused.status == 404:
                return _error(404, f"no such endpoint: {request.method} {request.path}")
            if refused.status == 405:
                return _error(405, f"{request.path}: method {request.method} not allowed")
            return _error(refused.status, refused.reason)
        except Exception as error:  # noqa: BLE001 -- a server never dies of a request
            return _error(status.http_status(status.status_code(error)), status.describe(error))
        finally:
            self._in_flight -= 1

    def _too_large(self, size: int | None) -> web.Response:
        got = f" ({size} bytes)" if size is not None else ""
        return _error(413, f"request body{got}: larger than the limit of "
                      f"{self.max_body_bytes} bytes")

    async def _call(self, method, message, request: web.Request):
        """One servicer method, as gRPC would call it; its status as an exception."""
        context = _Context(request)
        try:
            return await method(message, context)
        except _Aborted:
            raise
        except Exception as error:
            if context.code is not None:  # a method that set its status and raised
                raise _Aborted(context.code, context.details) from None
            raise error

    # -- health and metadata

    async def live(self, request: web.Request) -> web.Response:
        answer = await self._call(self.servicer.ServerLive, pb.ServerLiveRequest(), request)
        return web.Response(status=200 if answer.live else 503)

    async def ready(self, request: web.Request) -> web.Response:
        answer = await self._call(self.servicer.ServerReady, pb.ServerReadyRequest(), request)
        return web.Response(status=200 if answer.ready else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        answer = await self._call(self.servicer.ServerMetadata, pb.ServerMetadataRequest(),
                                  request)
        return _json(message_json(answer))

    @staticmethod
    def _model(request: web.Request) -> tuple[str, str]:
        return request.match_info["model"], request.match_info.get("version", "")

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = self._model(request)
        answer = await self._call(self.servicer.ModelReady,
                                  pb.ModelReadyRequest(name=name, version=version), request)
        return web.Response(status=200 if answer.ready else 503)

    async def model_metadata(self, request: web.Request) -> web.Response:
        name, version = self._model(request)
        answer = await self._call(self.servicer.ModelMetadata,
                                  pb.ModelMetadataRequest(name=name, version=version), request)
        return _json(message_json(answer))

    async def model_config(self, request: web.Request) -> web.Response:
        name, version = self._model(request)
        answer = await self._call(self.servicer.ModelConfig,
                                  pb.ModelConfigRequest(name=name, version=version), request)
        return _json(message_json(answer.config))  # Triton answers the config itself

    async def statistics(self, request: web.Request) -> web.Response:
        name, version = request.match_info.get("model", ""), request.match_info.get("version", "")
        answer = await self._call(self.servicer.ModelStatistics,
                                  pb.ModelStatisticsRequest(name=name, version=version), request)
        return _json(message_json(answer))

    async def unimplemented(self, request: web.Request) -> web.Response:
        return _error(501, f"{request.path}: not implemented by this server")

    # -- inference

    async def infer(self, request: web.Request) -> web.Response:
        name, version = self._model(request)
        body = await self._body(request, "inference")
        json_length = _json_length(request.headers.get(HEADER_LENGTH), len(body))
        self._check_json(json_length)
        message, binary = infer_request(name, version, body, json_length)
        answer = await self._call(self.infer_method, message, request)
        payload, json_length = infer_response(answer, binary)
        if json_length is None:
            response = web.Response(body=payload, content_type="application/json")
        else:
            response = web.Response(body=payload, content_type="application/octet-stream",
                                    headers={HEADER_LENGTH: str(json_length)})
        if request.headers.get("Accept-Encoding"):
            response.enable_compression()  # gzip or deflate, as the client accepts
        return response

    async def generate(self, request: web.Request) -> web.Response:
        """The whole answer of a generate body, as JSON."""
        name, version = self._model(request)
        message = generate_request(name, version, await self._json_body(request, "inference"))
        return _json(generate_json(await self._call(self.infer_method, message, request)))

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """A generate body's responses as server-sent events, one a response
        (a token, for a generative model)."""
        name, version = self._model(request)
        message = generate_request(name, version, await self._json_body(request, "inference"))
        return await self._events(request, message,
                                  lambda response: event(generate_json(response)))

    async def _events(self, request: web.Request, message: pb.ModelInferRequest,
                      each: Callable[[pb.ModelInferResponse], bytes],
                      last: Callable[[], bytes] = lambda: b"") -> web.StreamResponse:
        """A streamed request's responses as server-sent events, `each` the
        events of one and `last` those that close a stream that ended well.
        An error before the first response is an HTTP error; one after it,
        an event of its own that ends the stream."""

        async def requests():
            yield message

        answers = self.servicer.ModelStreamInfer(requests(), _Context(request))
        stream: web.StreamResponse | None = None
        try:
            async for answer in answers:
                if answer.error_message:
                    if stream is None:
                        return _error(400, answer.error_message)
                    await stream.write(event({"error": answer.error_message}))
                    break
                if stream is None:
                    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                         "Cache-Control": "no-cache"})
                    await stream.prepare(request)
                await stream.write(each(answer.infer_response))
                if is_last(answer.infer_response):
                    await stream.write(last())
                    break
        finally:
            await answers.aclose()
        if stream is None:
            return _error(500, "the stream ended without a response")
        await stream.write_eof()
        return stream

    # -- OpenAI's API (rest_openai)

    async def openai_models(self, request: web.Request) -> web.Response:
        """The ready models that generate (a generative backend's)."""
        index = await self._call(self.servicer.RepositoryIndex,
                                 pb.RepositoryIndexRequest(ready=True), request)
        names = []
        for name in sorted({model.name for model in index.models}):
            answer = await self._call(self.servicer.ModelConfig,
                                      pb.ModelConfigRequest(name=name), request)
            if answer.config.backend in GENERATIVE_BACKENDS:
                names.append(name)
        return _json(rest_openai.models_json(names))

    async def openai_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, rest_openai.completion_call)

    async def openai_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, rest_openai.chat_call)

    async def _openai(self, request: web.Request,
                      parse: Callable[[bytes], rest_openai.Call]) -> web.StreamResponse:
        call = parse(await self._json_body(request, "inference"))
        if not call.stream:
            answer = await self._call(self.infer_method, call.request, request)
            return _json(rest_openai.answer_json(call, answer))
        usage = rest_openai.Usage()
        first = True

        def each(response: pb.ModelInferResponse) -> bytes:
            nonlocal first
            chunk = rest_openai.chunk_json(call, response, usage, first)
            first = False
            return event(chunk)

        def last() -> bytes:
            closing = event(rest_openai.usage_chunk(call, usage)) if call.include_usage else b""
            return closing + rest_openai.DONE

        return await self._events(request, call.request, each, last)

    # -- repository

    async def repository_index(self, request: web.Request) -> web.Response:
        document = body_object(await self._json_body(request, "inference"))
        ready = document.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgument(f"ready: expected a boolean, got {ready!r}")
        answer = await self._call(self.servicer.RepositoryIndex,
                                  pb.RepositoryIndexRequest(ready=ready), request)
        return _json([message_json(model) for model in answer.models])

    async def load(self, request: web.Request) -> web.Response:
        document = body_object(await self._json_body(request, "admin"))
        unload = request.path.endswith("/unload")
        message = (pb.RepositoryModelUnloadRequest if unload else pb.RepositoryModelLoadRequest)(
            model_name=request.match_info["model"])
        for key, value in parameters_object(document.get("parameters", {}), "parameters").items():
            parameter = message.parameters[key]
            if isinstance(value, bool):
                parameter.bool_param = value
            elif isinstance(value, int):
                parameter.int64_param = value
            else:
                parameter.string_param = str(value)
        method = self.servicer.RepositoryModelUnload if unload \
            else self.servicer.RepositoryModelLoad
        await self._call(method, message, request)
        return web.Response()

    # -- shared memory (Triton's system and CUDA extensions)

    @staticmethod
    def _cuda(request: web.Request) -> bool:
        return request.path.startswith("/v2/cudasharedmemory")

    async def shared_memory_status(self, request: web.Request) -> web.Response:
        region = request.match_info.get("region", "")
        if self._cuda(request):
            method, message = self.servicer.CudaSharedMemoryStatus, \
                pb.CudaSharedMemoryStatusRequest(name=region)
        else:
            method, message = self.servicer.SystemSharedMemoryStatus, \
                pb.SystemSharedMemoryStatusRequest(name=region)
        answer = await self._call(method, message, request)
        return _json([message_json(r) for _, r in sorted(answer.regions.items())])

    async def shared_memory_register(self, request: web.Request) -> web.Response:
        region = request.match_info["region"]
        document = body_object(await self._json_body(request, "shared_memory"))
        if self._cuda(request):
            handle = json_object(document.get("raw_handle"), "raw_handle")
            try:
                raw = base64.b64decode(string_field(handle, "b64", "raw_handle"), validate=True)
            except ValueError:
                raise InvalidArgument("raw_handle.b64: not base64") from None
            method, message = self.servicer.CudaSharedMemoryRegister, \
                pb.CudaSharedMemoryRegisterRequest(
                    name=region, raw_handle=raw,
                    device_id=integer_field(document, "device_id", "request", 0),
                    byte_size=integer_field(document, "byte_size", "request"))
        else:
            method, message = self.servicer.SystemSharedMemoryRegister, \
                pb.SystemSharedMemoryRegisterRequest(
                    name=region, key=string_field(document, "key", "request"),
                    offset=integer_field(document, "offset", "request", 0),
                    byte_size=integer_field(document, "byte_size", "request"))
        await self._call(method, message, request)
        return web.Response()

    async def shared_memory_unregister(self, request: web.Request) -> web.Response:
        region = request.match_info.get("region", "")
        if self._cuda(request):
            method, message = self.servicer.CudaSharedMemoryUnregister, \
                pb.CudaSharedMemoryUnregisterRequest(name=region)
        else:
            method, message = self.servicer.SystemSharedMemoryUnregister, \
                pb.SystemSharedMemoryUnregisterRequest(name=region)
        await self._call(method, message, request)
        return web.Response()


@dataclass
class RestServer:
    """A started REST server: where it listens, and how to stop it."""

    runner: web.AppRunner
    port: int
    scheme: str

    async def stop(self) -> None:
        """Stop listening, let requests in flight finish (up to the drain time)."""
        await self.runner.cleanup()


async def serve(door: RestFrontDoor, host: str, port: int, ssl_context: ssl.SSLContext | None,
                drain_timeout_s: float, reuse_port: bool = False) -> RestServer:
    """Listen on host:port (0: a free port); HTTPS with `ssl_context`; with
    `reuse_port`, a port other processes of ours listen on too."""
    runner = web.AppRunner(door.application(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context,
                       shutdown_timeout=drain_timeout_s, reuse_port=reuse_port)
    try:
        await site.start()
    except OSError as error:
        await runner.cleanup()
        raise ConfigError(f"cannot serve REST on {host}:{port}: {error.strerror or error}") \
            from error
    return RestServer(runner, runner.addresses[0][1], "https" if ssl_context else "http")
