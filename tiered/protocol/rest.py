"""KServe v2 REST beside gRPC, with Triton's binary-data extension.

An HTTP request becomes the v2 protobuf request a gRPC client would have
sent, the same servicer method answers it, and its answer becomes JSON (and
binary data). Servicers see the call through `_Context`, which reads HTTP
headers where gRPC metadata would be, so credentials (bearer tokens, client
certificates under mTLS), tracing and routing hints work as over gRPC, and
requests count in the same statistics. Errors keep gRPC's message and take
the HTTP code of its status (`status.http_status`), in Triton's body
`{"error": "..."}`.

Binary-data extension: when the request carries `Inference-Header-Content-Length`,
the body is that many bytes of JSON followed by the inputs' bytes, each input
naming its length in `parameters.binary_data_size`; outputs asked for as
binary (`binary_data`, or the request's `binary_data_output`) follow the
response's JSON in the same way. BYTES elements are 4-byte length-prefixed;
JSON `data` is row-major (flat or nested); FP16 inputs travel as binary only.

Bounded: bodies by the gRPC message limit, requests in flight by the gRPC
concurrency limit. Never imports agent or router code: servers hand it a
servicer.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from aiohttp import web
from google.protobuf.descriptor import FieldDescriptor

from tiered.errors import ConfigError, InvalidArgument
from tiered.protocol import codec, messages, status
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol.security import Authorizer

log = logging.getLogger(__name__)

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_DATA_SIZE = "binary_data_size"
BINARY_DATA = "binary_data"
BINARY_DATA_OUTPUT = "binary_data_output"
UNIMPLEMENTED_PATHS = ("/v2/trace/setting", "/v2/models/{model}/trace/setting", "/v2/logging")
# A body's JSON is parsed on the event loop, holding it (~70 ms for 4 MiB on a
# 2-core machine, and ~15x the text in memory): a larger JSON part is refused;
# tensors that large travel as binary data (the binary tensor extension) or
# over gRPC.
MAX_JSON_BYTES = 4 << 20
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


# -- protobuf -> JSON ------------------------------------------------------------


def message_json(message) -> dict[str, Any]:
    """A message as Triton's HTTP server writes it: every scalar field, 64-bit
    integers as numbers (perf_analyzer reads them so), enums by name, unset
    sub-messages and oneof members left out."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        oneof = field.containing_oneof
        if oneof is not None and message.WhichOneof(oneof.name) != field.name:
            continue
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            inner = field.message_type.fields_by_name["value"]
            out[field.name] = {key: _json_value(inner, item) for key, item in value.items()}
        elif field.is_repeated:
            out[field.name] = [_json_value(field, item) for item in value]
        elif field.message_type is None or message.HasField(field.name):
            out[field.name] = _json_value(field, value)
    return out


def _json_value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None:
        return message_json(value)
    if field.enum_type is not None:
        known = field.enum_type.values_by_number.get(value)
        return known.name if known is not None else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode()
    return value


# -- JSON -> protobuf: checked, each error naming its field ------------------------


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: expected a JSON object, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _string(holder: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = holder.get(key, default)
    if not isinstance(value, str):
        raise InvalidArgument(f"{where}.{key}: expected a string, got {_kind(value)}")
    return value


def _integer(holder: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = holder.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{where}.{key}: expected an integer >= 0, got {value!r}")
    return value


def _scalars(value: Any, where: str) -> dict[str, Any]:
    """A `parameters` object: names to strings, numbers or booleans."""
    parameters = _object(value, where)
    for key, item in parameters.items():
        if not isinstance(item, (str, int, float)) or (isinstance(item, float)
                                                       and not math.isfinite(item)):
            raise InvalidArgument(f"{where}.{key}: expected a string, number or boolean, "
                                  f"got {_kind(item)}")
        if isinstance(item, int) and not -2**63 <= item < 2**64:
            raise InvalidArgument(f"{where}.{key}: {item} does not fit in 64 bits")
    return parameters


def _set_parameters(target, parameters: Mapping[str, Any]) -> None:
    for key, value in parameters.items():
        codec.set_parameter(target[key], value)


def _parse_json(data: bytes, where: str) -> Any:
    try:
        document = json.loads(data)
    except ValueError as error:  # UnicodeDecodeError too
        raise InvalidArgument(f"{where}: not valid JSON: {error}") from None
    except RecursionError:
        raise InvalidArgument(f"{where}: JSON nested too deeply") from None
    # A \udXXX escape alone is text no protobuf string holds: refused here, not
    # a UnicodeEncodeError (500) where it is copied into a message. Only a body
    # with such an escape is walked.
    if b"\\ud" in data or b"\\uD" in data:
        _check_unicode(document, where)
    return document


def _check_unicode(document: Any, where: str) -> None:
    pending = [document]  # a stack, not recursion: the parser allows deep nesting
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidArgument(f"{where}: a string holds a lone surrogate "
                                      f"({ascii(item)[:40]}), which is not Unicode text"
                                      ) from None


def _body_object(body: bytes) -> dict[str, Any]:
    """The JSON object of a control request; an empty body is an empty object."""
    return {} if not body.strip() else _object(_parse_json(body, "request body"), "request body")


@dataclass(frozen=True)
class BinaryOutputs:
    """Which outputs go back as binary data: each output's own `binary_data`,
    else the request's `binary_data_output`."""

    default: bool
    named: Mapping[str, bool]

    def wanted(self, name: str) -> bool:
        return self.named.get(name, self.default)


def infer_request(model: str, version: str, body: bytes, json_length: int
                  ) -> tuple[pb.ModelInferRequest, BinaryOutputs]:
    """The ModelInferRequest of a REST infer body: `json_length` bytes of JSON,
    then the binary inputs in order."""
    document = _object(_parse_json(body[:json_length], "request body"), "request body")
    request = pb.ModelInferRequest(model_name=model, model_version=version,
                                   id=_string(document, "id", "request", ""))
    parameters = dict(_scalars(document.get("parameters", {}), "parameters"))
    default_binary = parameters.pop(BINARY_DATA_OUTPUT, False)
    if not isinstance(default_binary, bool):
        raise InvalidArgument(f"parameters.{BINARY_DATA_OUTPUT}: expected a boolean, "
                              f"got {default_binary!r}")
    _set_parameters(request.parameters, parameters)

    inputs = document.get("inputs")
    if not isinstance(inputs, list):
        raise InvalidArgument(f"inputs: expected a list of tensors, got {_kind(inputs)}")
    offset, bytes_elements = json_length, 0
    for index, item in enumerate(inputs):
        tensor = _object(item, f"inputs[{index}]")
        name = _string(tensor, "name", f"inputs[{index}]")
        where = f"inputs[{index}] {name!r}"
        datatype = _string(tensor, "datatype", where)
        shape = tensor.get("shape")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise InvalidArgument(f"{where}.shape: expected a list of integers, got {shape!r}")
        count = codec.element_count(shape, field=where)  # bounded before it reaches a message
        if datatype == "BYTES":
            bytes_elements += count
            codec.check_bytes_elements(bytes_elements, "inputs")
        tensor_parameters = dict(_scalars(tensor.get("parameters", {}), f"{where}.parameters"))
        size = tensor_parameters.pop(BINARY_DATA_SIZE, None)
        message = request.inputs.add(name=name, datatype=datatype, shape=shape)
        _set_parameters(message.parameters, tensor_parameters)
        sources = [what for what, given in (
            ("data", "data" in tensor), (f"parameters.{BINARY_DATA_SIZE}", size is not None),
            (f"parameters.{codec.SHARED_MEMORY_REGION}",
             codec.SHARED_MEMORY_REGION in tensor_parameters)) if given]
        if len(sources) != 1:
            raise InvalidArgument(f"{where}: give exactly one of data, parameters."
                                  f"{BINARY_DATA_SIZE} or parameters.{codec.SHARED_MEMORY_REGION}"
                                  f"{'; got ' + ' and '.join(sources) if sources else ''}")
        if size is not None:
            size = _integer({BINARY_DATA_SIZE: size}, BINARY_DATA_SIZE, f"{where}.parameters")
            if offset + size > len(body):
                raise InvalidArgument(f"{where}.parameters.{BINARY_DATA_SIZE}: {size} bytes, "
                                      f"but only {len(body) - offset} bytes of binary data "
                                      "are left in the body")
            request.raw_input_contents.append(body[offset:offset + size])
            offset += size
        elif "data" in tensor:
            request.raw_input_contents.append(
                json_tensor_bytes(tensor["data"], datatype, shape, where))
    if offset != len(body):
        raise InvalidArgument(f"{HEADER_LENGTH}: {len(body) - json_length} bytes of binary "
                              f"data follow the JSON, but the inputs' {BINARY_DATA_SIZE} add "
                              f"up to {offset - json_length}")
    return request, _add_outputs(document, default_binary, request)


def _add_outputs(document: Mapping[str, Any], default: bool,
                 request: pb.ModelInferRequest) -> BinaryOutputs:
    """The requested outputs into `request`; which of them go back binary."""
    outputs = document.get("outputs", [])
    if not isinstance(outputs, list):
        raise InvalidArgument(f"outputs: expected a list, got {_kind(outputs)}")
    named = {}
    for index, item in enumerate(outputs):
        tensor = _object(item, f"outputs[{index}]")
        name = _string(tensor, "name", f"outputs[{index}]")
        where = f"outputs[{index}] {name!r}"
        parameters = dict(_scalars(tensor.get("parameters", {}), f"{where}.parameters"))
        if BINARY_DATA in parameters:
            wanted = parameters.pop(BINARY_DATA)
            if not isinstance(wanted, bool):
                raise InvalidArgument(f"{where}.parameters.{BINARY_DATA}: expected a boolean, "
                                      f"got {wanted!r}")
            named[name] = wanted
        _set_parameters(request.outputs.add(name=name).parameters, parameters)
    return BinaryOutputs(default, named)


# JSON number kinds (numpy's) each datatype kind accepts.
_ACCEPTS = {"b": ("b", "booleans"), "i": ("iu", "integers"), "u": ("iu", "integers"),
            "f": ("iuf", "numbers")}


def json_tensor_bytes(data: Any, datatype: str, shape: list[int], where: str) -> bytes:
    """A tensor's JSON `data` as the raw little-endian bytes gRPC carries."""
    dtype = codec.dtype_of(datatype, field=f"{where}.datatype")
    count = codec.element_count(shape, field=where)
    if datatype == "BYTES":
        codec.check_bytes_elements(count, where)
    if datatype == "FP16":
        raise InvalidArgument(f"{where}.data: FP16 has no JSON form; send it as binary data "
                              f"(parameters.{BINARY_DATA_SIZE})")
    if not isinstance(data, list):
        raise InvalidArgument(f"{where}.data: expected a list, got {_kind(data)}")
    try:
        values = np.array(data).reshape(-1)  # nested lists flatten row-major
    except ValueError:
        raise InvalidArgument(f"{where}.data: nested lists of unequal lengths") from None
    if values.size != count:
        raise InvalidArgument(f"{where}.data: {values.size} values for shape {shape}, "
                              f"expected {count}")
    if datatype == "BYTES":
        if values.size and values.dtype.kind != "U":
            raise InvalidArgument(f"{where}.data: expected strings for BYTES")
        return codec.serialize_bytes(values)
    kinds, what = _ACCEPTS[dtype.kind]
    if dtype.kind in "iu" and values.dtype.kind in "fO":
        # Integers beyond int64 beside smaller ones read as floats: look at each.
        exact = np.array(data, dtype=object).reshape(-1)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in exact):
            values, kinds = exact, "O"
    if values.size and values.dtype.kind not in kinds:
        raise InvalidArgument(f"{where}.data: expected {what} for {datatype}")
    if dtype.kind in "iu" and values.size:
        info = np.iinfo(dtype)
        if values.min() < info.min or values.max() > info.max:
            raise InvalidArgument(f"{where}.data: values outside the range of {datatype}")
    return values.astype(dtype).tobytes()


# -- the answer -> JSON and binary -----------------------------------------------


def infer_response(response: pb.ModelInferResponse, binary: BinaryOutputs
                   ) -> tuple[bytes, int | None]:
    """The body of a REST infer answer, and the length of its JSON when binary
    outputs follow it (None: all JSON)."""
    header: dict[str, Any] = {"model_name": response.model_name,
                              "model_version": response.model_version}
    if response.id:
        header["id"] = response.id
    if response.parameters:
        header["parameters"] = codec.parameters_of(response.parameters)
    outputs, buffers = [], []
    for index, tensor in enumerate(response.outputs):
        item: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                                "shape": list(tensor.shape)}
        parameters = codec.parameters_of(tensor.parameters)
        if codec.SHARED_MEMORY_REGION in parameters:
            # Its data is in the region; as Triton, no parameters (a client
            # reading `parameters` expects binary_data_size there).
            for key in (codec.SHARED_MEMORY_REGION, codec.SHARED_MEMORY_BYTE_SIZE,
                        codec.SHARED_MEMORY_OFFSET):
                parameters.pop(key, None)
        else:
            where = f"outputs {tensor.name!r}"
            raw = _output_bytes(response, index, where)
            if binary.wanted(tensor.name):
                parameters[BINARY_DATA_SIZE] = len(raw)
                buffers.append(raw)
            else:
                item["data"] = _json_data(raw, tensor.datatype, tensor.shape, where)
        if parameters:
            item["parameters"] = parameters
        outputs.append(item)
    header["outputs"] = outputs
    text = json.dumps(header, separators=(",", ":")).encode()
    if not buffers:
        return text, None
    return b"".join([text, *buffers]), len(text)


def _output_bytes(response: pb.ModelInferResponse, index: int, where: str) -> bytes:
    """Output `index`'s bytes: its raw content, or its typed contents as raw."""
    if len(response.raw_output_contents) == len(response.outputs):
        return response.raw_output_contents[index]
    tensor = response.outputs[index]
    return codec.to_raw(codec.from_contents(tensor.contents, tensor.datatype, tensor.shape,
                                            field=where))[2]


def _json_data(raw: bytes, datatype: str, shape, where: str) -> list:
    flat = codec.from_raw(raw, datatype, tuple(shape), field=where).reshape(-1)
    if datatype != "BYTES":
        return flat.tolist()  # FP16 as the numbers it holds
    try:
        return [item.decode() for item in flat]
    except UnicodeDecodeError:
        raise InvalidArgument(f"{where}: a BYTES element is not UTF-8 text; ask for this output "
                              f"as binary data (parameters.{BINARY_DATA}: true)") from None


# -- the generate extension ---------------------------------------------------------


GENERATE_RESERVED = ("id", "parameters")


def generate_request(model: str, version: str, body: bytes) -> pb.ModelInferRequest:
    """The ModelInferRequest of a generate body (Triton's generate extension):
    each top-level key but `id` and `parameters` is an input, given as a
    string, a number, a boolean or a list of one of those."""
    document = _body_object(body)
    request = pb.ModelInferRequest(model_name=model, model_version=version,
                                   id=_string(document, "id", "request", ""))
    _set_parameters(request.parameters, _scalars(document.get("parameters", {}), "parameters"))
    for name, value in document.items():
        if name in GENERATE_RESERVED:
            continue
        items = value if isinstance(value, list) else [value]
        datatype = _generate_datatype(items, name)
        request.inputs.add(name=name, datatype=datatype, shape=[len(items)])
        request.raw_input_contents.append(
            json_tensor_bytes(items, datatype, [len(items)], name))
    return request


def _generate_datatype(items: list, name: str) -> str:
    kinds = {"BYTES": str, "BOOL": bool}
    for datatype, kind in kinds.items():
        if items and all(isinstance(i, kind) for i in items):
            return datatype
    if items and not any(isinstance(i, bool) for i in items):
        if all(isinstance(i, int) for i in items):
            return "INT64"
        if all(isinstance(i, (int, float)) for i in items):
            return "FP64"
    raise InvalidArgument(f"{name}: expected a string, a number, a boolean or a non-empty "
                          f"list of one of those, got {items!r}")


def generate_json(response: pb.ModelInferResponse) -> dict[str, Any]:
    """A generate answer: the outputs by name (a BYTES output of one element
    as its text, any other as a list), beside the model's name and version."""
    out: dict[str, Any] = {"model_name": response.model_name,
                           "model_version": response.model_version}
    if response.id:
        out["id"] = response.id
    for index, tensor in enumerate(response.outputs):
        where = f"outputs {tensor.name!r}"
        data = _json_data(_output_bytes(response, index, where), tensor.datatype,
                          tensor.shape, where)
        out[tensor.name] = data[0] if tensor.datatype == "BYTES" and len(data) == 1 else data
    if response.parameters:
        out["parameters"] = codec.parameters_of(response.parameters)
    return out


def _event(value: Any) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"


# -- the HTTP server ---------------------------------------------------------------


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
        """Bounds, and every failure as Triton's error body; never an exception out.
        Health checks are answered whatever else is in flight."""
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
        (a token, for a generative model). An error before the first is an
        HTTP error; one after it, an event of its own that ends the stream."""
        name, version = self._model(request)
        message = generate_request(name, version, await self._json_body(request, "inference"))

        async def requests():
            yield message

        answers = self.servicer.ModelStreamInfer(requests(), _Context(request))
        stream: web.StreamResponse | None = None
        try:
            async for answer in answers:
                if answer.error_message:
                    if stream is None:
                        return _error(400, answer.error_message)
                    await stream.write(_event({"error": answer.error_message}))
                    break
                if stream is None:
                    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                         "Cache-Control": "no-cache"})
                    await stream.prepare(request)
                await stream.write(_event(generate_json(answer.infer_response)))
                final = answer.infer_response.parameters.get(messages.FINAL_RESPONSE)
                if final is None or final.bool_param:
                    break
        finally:
            await answers.aclose()
        if stream is None:
            return _error(500, "the stream ended without a response")
        await stream.write_eof()
        return stream

    # -- repository

    async def repository_index(self, request: web.Request) -> web.Response:
        document = _body_object(await self._json_body(request, "inference"))
        ready = document.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgument(f"ready: expected a boolean, got {ready!r}")
        answer = await self._call(self.servicer.RepositoryIndex,
                                  pb.RepositoryIndexRequest(ready=ready), request)
        return _json([message_json(model) for model in answer.models])

    async def load(self, request: web.Request) -> web.Response:
        document = _body_object(await self._json_body(request, "admin"))
        unload = request.path.endswith("/unload")
        message = (pb.RepositoryModelUnloadRequest if unload else pb.RepositoryModelLoadRequest)(
            model_name=request.match_info["model"])
        for key, value in _scalars(document.get("parameters", {}), "parameters").items():
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
        document = _body_object(await self._json_body(request, "shared_memory"))
        if self._cuda(request):
            handle = _object(document.get("raw_handle"), "raw_handle")
            try:
                raw = base64.b64decode(_string(handle, "b64", "raw_handle"), validate=True)
            except ValueError:
                raise InvalidArgument("raw_handle.b64: not base64") from None
            method, message = self.servicer.CudaSharedMemoryRegister, \
                pb.CudaSharedMemoryRegisterRequest(
                    name=region, raw_handle=raw,
                    device_id=_integer(document, "device_id", "request", 0),
                    byte_size=_integer(document, "byte_size", "request"))
        else:
            method, message = self.servicer.SystemSharedMemoryRegister, \
                pb.SystemSharedMemoryRegisterRequest(
                    name=region, key=_string(document, "key", "request"),
                    offset=_integer(document, "offset", "request", 0),
                    byte_size=_integer(document, "byte_size", "request"))
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
                drain_timeout_s: float) -> RestServer:
    """Listen on host:port (0: a free port); HTTPS with `ssl_context`."""
    runner = web.AppRunner(door.application(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context,
                       shutdown_timeout=drain_timeout_s, reuse_port=False)
    try:
        await site.start()
    except OSError as error:
        await runner.cleanup()
        raise ConfigError(f"cannot serve REST on {host}:{port}: {error.strerror or error}") \
            from error
    return RestServer(runner, runner.addresses[0][1], "https" if ssl_context else "http")
