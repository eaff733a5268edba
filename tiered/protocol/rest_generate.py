"""Triton's generate extension over REST: a generate body (each top-level key
an input) as a ModelInferRequest, a response as the generate answer's JSON,
and the server-sent events `generate_stream` sends, one a response.
"""

from __future__ import annotations

import json
from typing import Any

from tiered.errors import InvalidArgument
from tiered.protocol import codec, messages
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol.rest_json import (
    body_object,
    json_data,
    json_tensor_bytes,
    output_bytes,
    parameters_object,
    set_parameters,
    string_field,
)

GENERATE_RESERVED = ("id", "parameters")


def generate_request(model: str, version: str, body: bytes) -> pb.ModelInferRequest:
    """The ModelInferRequest of a generate body (Triton's generate extension):
    each top-level key but `id` and `parameters` is an input, given as a
    string, a number, a boolean or a list of one of those."""
    document = body_object(body)
    request = pb.ModelInferRequest(model_name=model, model_version=version,
                                   id=string_field(document, "id", "request", ""))
    set_parameters(request.parameters,
                   parameters_object(document.get("parameters", {}), "parameters"))
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
        data = json_data(output_bytes(response, index, where), tensor.datatype,
                         tensor.shape, where)
        out[tensor.name] = data[0] if tensor.datatype == "BYTES" and len(data) == 1 else data
    if response.parameters:
        out["parameters"] = codec.parameters_of(response.parameters)
    return out


def event(value: Any) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"


def is_last(response: pb.ModelInferResponse) -> bool:
    """Whether a streamed response ends the stream: the final one, or any
    response of a model that marks none final."""
    final = response.parameters.get(messages.FINAL_RESPONSE)
    return final is None or final.bool_param
