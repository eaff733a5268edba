"""KServe v2 REST's JSON to and from the v2 protobuf messages, with Triton's
binary-data extension: an infer body as a ModelInferRequest (`infer_request`),
a ModelInferResponse as an infer body (`infer_response`), any other message
as Triton's HTTP server writes it (`message_json`), and the checked JSON
readers the other REST modules share (each error naming its field).

Binary-data extension: when the request carries `Inference-Header-Content-Length`,
the body is that many bytes of JSON followed by the inputs' bytes, each input
naming its length in `parameters.binary_data_size`; outputs asked for as
binary (`binary_data`, or the request's `binary_data_output`) follow the
response's JSON in the same way. BYTES elements are 4-byte length-prefixed;
JSON `data` is row-major (flat or nested); FP16 inputs travel as binary only.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.descriptor import FieldDescriptor

from tiered.errors import InvalidArgument
from tiered.protocol import codec
from tiered.protocol import grpc_service_pb2 as pb

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_DATA_SIZE = "binary_data_size"
BINARY_DATA = "binary_data"
BINARY_DATA_OUTPUT = "binary_data_output"
# A body's JSON is parsed on the event loop, holding it (~70 ms for 4 MiB on a
# 2-core machine, and ~15x the text in memory): a larger JSON part is refused;
# tensors that large travel as binary data (the binary tensor extension) or
# over gRPC.
MAX_JSON_BYTES = 4 << 20


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


def json_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: expected a JSON object, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def string_field(holder: Mapping[str, Any], key: str, where: str,
                 default: str | None = None) -> str:
    value = holder.get(key, default)
    if not isinstance(value, str):
        raise InvalidArgument(f"{where}.{key}: expected a string, got {_kind(value)}")
    return value


def integer_field(holder: Mapping[str, Any], key: str, where: str,
                  default: int | None = None) -> int:
    value = holder.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{where}.{key}: expected an integer >= 0, got {value!r}")
    return value


def parameters_object(value: Any, where: str) -> dict[str, Any]:
    """A `parameters` object: names to strings, numbers or booleans."""
    parameters = json_object(value, where)
    for key, item in parameters.items():
        if not isinstance(item, (str, int, float)) or (isinstance(item, float)
                                                       and not math.isfinite(item)):
            raise InvalidArgument(f"{where}.{key}: expected a string, number or boolean, "
                                  f"got {_kind(item)}")
        if isinstance(item, int) and not -2**63 <= item < 2**64:
            raise InvalidArgument(f"{where}.{key}: {item} does not fit in 64 bits")
    return parameters


def set_parameters(target, parameters: Mapping[str, Any]) -> None:
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


def body_object(body: bytes) -> dict[str, Any]:
    """The JSON object of a control request; an empty body is an empty object."""
    if not body.strip():
        return {}
    return json_object(_parse_json(body, "request body"), "request body")


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
    document = json_object(_parse_json(body[:json_length], "request body"), "request body")
    request = pb.ModelInferRequest(model_name=model, model_version=version,
                                   id=string_field(document, "id", "request", ""))
    parameters = dict(parameters_object(document.get("parameters", {}), "parameters"))
    default_binary = parameters.pop(BINARY_DATA_OUTPUT, False)
    if not isinstance(default_binary, bool):
        raise InvalidArgument(f"parameters.{BINARY_DATA_OUTPUT}: expected a boolean, "
                              f"got {default_binary!r}")
    set_parameters(request.parameters, parameters)

    inputs = document.get("inputs")
    if not isinstance(inputs, list):
        raise InvalidArgument(f"inputs: expected a list of tensors, got {_kind(inputs)}")
    offset, bytes_elements = json_length, 0
    for index, item in enumerate(inputs):
        tensor = json_object(item, f"inputs[{index}]")
        name = string_field(tensor, "name", f"inputs[{index}]")
        where = f"inputs[{index}] {name!r}"
        datatype = string_field(tensor, "datatype", where)
        shape = tensor.get("shape")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise InvalidArgument(f"{where}.shape: expected a list of integers, got {shape!r}")
        count = codec.element_count(shape, field=where)  # bounded before it reaches a message
        if datatype == "BYTES":
            bytes_elements += count
            codec.check_bytes_elements(bytes_elements, "inputs")
        tensor_parameters = dict(parameters_object(tensor.get("parameters", {}),
                                                   f"{where}.parameters"))
        size = tensor_parameters.pop(BINARY_DATA_SIZE, None)
        message = request.inputs.add(name=name, datatype=datatype, shape=shape)
        set_parameters(message.parameters, tensor_parameters)
        sources = [what for what, given in (
            ("data", "data" in tensor), (f"parameters.{BINARY_DATA_SIZE}", size is not None),
            (f"parameters.{codec.SHARED_MEMORY_REGION}",
             codec.SHARED_MEMORY_REGION in tensor_parameters)) if given]
        if len(sources) != 1:
            raise InvalidArgument(f"{where}: give exactly one of data, parameters."
                                  f"{BINARY_DATA_SIZE} or parameters.{codec.SHARED_MEMORY_REGION}"
                                  f"{'; got ' + ' and '.join(sources) if sources else ''}")
        if size is not None:
            size = integer_field({BINARY_DATA_SIZE: size}, BINARY_DATA_SIZE,
                                 f"{where}.parameters")
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
        tensor = json_object(item, f"outputs[{index}]")
        name = string_field(tensor, "name", f"outputs[{index}]")
        where = f"outputs[{index}] {name!r}"
        parameters = dict(parameters_object(tensor.get("parameters", {}), f"{where}.parameters"))
        if BINARY_DATA in parameters:
            wanted = parameters.pop(BINARY_DATA)
            if not isinstance(wanted, bool):
                raise InvalidArgument(f"{where}.parameters.{BINARY_DATA}: expected a boolean, "
                                      f"got {wanted!r}")
            named[name] = wanted
        set_parameters(request.outputs.add(name=name).parameters, parameters)
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
            raw = output_bytes(response, index, where)
            if binary.wanted(tensor.name):
                parameters[BINARY_DATA_SIZE] = len(raw)
                buffers.append(raw)
            else:
                item["data"] = json_data(raw, tensor.datatype, tensor.shape, where)
        if parameters:
            item["parameters"] = parameters
        outputs.append(item)
    header["outputs"] = outputs
    text = json.dumps(header, separators=(",", ":")).encode()
    if not buffers:
        return text, None
    return b"".join([text, *buffers]), len(text)


def output_bytes(response: pb.ModelInferResponse, index: int, where: str) -> bytes:
    """Output `index`'s bytes: its raw content, or its typed contents as raw."""
    if len(response.raw_output_contents) == len(response.outputs):
        return response.raw_output_contents[index]
    tensor = response.outputs[index]
    return codec.to_raw(codec.from_contents(tensor.contents, tensor.datatype, tensor.shape,
                                            field=where))[2]


def json_data(raw: bytes, datatype: str, shape, where: str) -> list:
    flat = codec.from_raw(raw, datatype, tuple(shape), field=where).reshape(-1)
    if datatype != "BYTES":
        return flat.tolist()  # FP16 as the numbers it holds
    try:
        return [item.decode() for item in flat]
    except UnicodeDecodeError:
        raise InvalidArgument(f"{where}: a BYTES element is not UTF-8 text; ask for this output "
                              f"as binary data (parameters.{BINARY_DATA}: true)") from None
