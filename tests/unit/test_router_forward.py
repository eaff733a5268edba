"""The bytes the router forwards: the client's request, with the version it routes to."""

from __future__ import annotations

import numpy as np
import pytest

from tiered.errors import TieredError
from tiered.protocol import codec
from tiered.protocol import grpc_service_pb2 as pb
from tiered.router import forward


def request(version: str = "") -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m", model_version=version, id="r1")
    tensor = message.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    tensor.parameters["binary_data_size"].int64_param = 8
    message.raw_input_contents.append(b"\x00" * 8)
    return message


# client's version, routed version -> version the agent reads
VERSIONS = {
    "latest-to-latest": ("", 0, ""),
    "latest-to-stable": ("", 3, "3"),
    "named-to-the-same": ("3", 3, "3"),
    "named-to-another": ("2", 13, "13"),
    "named-to-latest": ("2", 0, ""),
}


@pytest.mark.parametrize("sent, routed, read", VERSIONS.values(), ids=VERSIONS)
def test_the_agent_reads_the_routed_version_and_the_rest_unchanged(sent, routed, read):
    message = request(sent)
    forwarded = pb.ModelInferRequest.FromString(
        forward.with_version(message, message.SerializeToString(), routed))
    expected = request(read)
    assert forwarded == expected


def test_bytes_already_asking_for_the_version_go_on_untouched():
    message = request("3")
    raw = message.SerializeToString()
    assert forward.with_version(message, raw, 3) is raw


def test_an_answer_that_does_not_parse_is_an_upstream_error_naming_the_agent():
    with pytest.raises(TieredError, match="agent a:1 answered bytes that are not"):
        forward.parse_response(b"\xff\xff\xff", "a:1")


GREEDY = {
    "unset": ({}, [], True),
    "zero-parameter": ({"temperature": 0.0}, [], True),
    "int-zero-parameter": ({"temperature": 0}, [], True),
    "sampled-parameter": ({"temperature": 0.7}, [], False),
    "zero-input": ({}, [0.0], True),
    "sampled-input": ({}, [0.8], False),
}


@pytest.mark.parametrize("parameters, temperature, expected", GREEDY.values(), ids=GREEDY)
def test_greedy_reads_the_temperature_parameter_or_input(parameters, temperature, expected):
    request = pb.ModelInferRequest(model_name="m")
    for name, value in parameters.items():
        codec.set_parameter(request.parameters[name], value)
    if temperature:
        request.inputs.add(name="temperature", datatype="FP32", shape=[1])
        request.raw_input_contents.append(np.array(temperature, np.float32).tobytes())
    assert forward.greedy(request) == expected
