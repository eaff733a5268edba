"""The REST adapter's conversions (pure) and its bounds, on an in-process server
over a stand-in servicer; the real servers are tests/integration/test_rest.py's."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from tiered import errors
from tiered.protocol import codec, rest, rest_generate, rest_json, status
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import model_config_pb2 as mc


@pytest.mark.parametrize("error, code", [
    (errors.InvalidArgument("x"), 400), (errors.ConfigError("x"), 400),
    (errors.NotFound("x"), 404), (errors.AlreadyExists("x"), 409),
    (errors.Unavailable("x"), 503), (errors.ResourceExhausted("x"), 429),
    (errors.DeadlineExceeded("x"), 504), (errors.EngineError("x"), 500),
    (errors.Conflict("x"), 409), (errors.Unauthenticated("x"), 401),
    (errors.PermissionDenied("x"), 403), (ValueError("a bug"), 500),
])
def test_each_domain_error_has_one_http_code(error, code):
    assert status.http_status(status.status_code(error)) == code


def test_unimplemented_is_501():
    assert status.http_status(grpc.StatusCode.UNIMPLEMENTED) == 501


def test_message_json_writes_64_bit_integers_as_numbers_and_only_the_set_oneof():
    config = mc.ModelConfig(name="m", max_batch_size=4)
    config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[3, 224])
    config.version_policy.latest.num_versions = 2
    config.dynamic_batching.max_queue_delay_microseconds = 2000
    config.parameters["tier"].string_value = "edge"
    out = rest_json.message_json(config)
    assert out["input"][0]["dims"] == [3, 224] and out["input"][0]["data_type"] == "TYPE_FP32"
    assert out["version_policy"] == {"latest": {"num_versions": 2}}
    assert out["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert out["parameters"] == {"tier": {"string_value": "edge"}}
    assert "sequence_batching" not in out  # unset sub-messages are left out
    assert json.loads(json.dumps(out)) == out


def binary_request(*buffers: bytes, **document) -> tuple[bytes, int]:
    header = json.dumps(document).encode()
    return header + b"".join(buffers), len(header)


def test_binary_inputs_are_cut_from_the_body_in_order_and_rest_parameters_dropped():
    a, b = np.arange(4, dtype="<f4").tobytes(), np.arange(2, dtype="<i8").tobytes()
    body, length = binary_request(a, b, id="r", parameters={"binary_data_output": True,
                                                            "priority": 2}, inputs=[
        {"name": "a", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 16}},
        {"name": "c", "datatype": "INT32", "shape": [2], "data": [7, 8]},
        {"name": "b", "datatype": "INT64", "shape": [2], "parameters": {"binary_data_size": 16}},
    ], outputs=[{"name": "y", "parameters": {"binary_data": False}}, {"name": "z"}])
    request, binary = rest_json.infer_request("m", "2", body, length)
    assert (request.model_name, request.model_version, request.id) == ("m", "2", "r")
    assert list(request.raw_input_contents) == [a, np.array([7, 8], "<i4").tobytes(), b]
    assert dict(request.parameters).keys() == {"priority"}
    assert all(not t.parameters for t in request.inputs)
    assert [o.name for o in request.outputs] == ["y", "z"]
    assert all(not o.parameters for o in request.outputs)
    assert (binary.wanted("y"), binary.wanted("z"), binary.wanted("other")) == \
        (False, True, True)


def test_shared_memory_inputs_keep_their_parameters_and_take_no_buffer():
    body, length = binary_request(inputs=[
        {"name": "a", "datatype": "FP32", "shape": [4],
         "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 16}}])
    request, _ = rest_json.infer_request("m", "", body, length)
    assert not request.raw_input_contents
    assert request.inputs[0].parameters["shared_memory_region"].string_param == "r"


@pytest.mark.parametrize("document, words", [
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2**70], "data": []}]},
     "inputs[0] 'x': shape [1180591620717411303424] has a dimension above 2**40"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": []}]},
     "inputs[0] 'x': shape [-1] has a negative dimension"),
    ({"inputs": [], "parameters": {"timeout": 2**64}},
     "parameters.timeout: 18446744073709551616 does not fit in 64 bits"),
])
def test_numbers_beyond_the_message_fields_are_refused_naming_them(document, words):
    body = json.dumps(document).encode()
    with pytest.raises(errors.InvalidArgument, match=re.escape(words)):
        rest_json.infer_request("m", "", body, len(body))


@pytest.mark.parametrize("where", ["id", "parameter", "key", "name", "bytes"])
def test_a_lone_surrogate_escape_is_refused_as_not_unicode(where):
    """Text no protobuf string holds: a 400 naming the body, not a 500."""
    tensor = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}
    document = {"id": {"id": "\udcff"}, "parameter": {"parameters": {"k": "a\udcff"}},
                "key": {"parameters": {"\ud800": 1}}}.get(where, {})
    if where == "name":
        tensor["name"] = "x\udcff"
    if where == "bytes":
        tensor.update(datatype="BYTES", data=["\udfff"])
    body = json.dumps({"inputs": [tensor], **document}).encode()
    with pytest.raises(errors.InvalidArgument, match="request body: a string holds a lone"):
        rest_json.infer_request("m", "", body, len(body))
    paired = json.dumps({"inputs": [tensor], "id": "\U0001f600"}).encode()  # one character
    if where not in ("name", "bytes"):
        assert rest_json.infer_request("m", "", paired, len(paired))[0].id == "\U0001f600"


@pytest.mark.parametrize("data, datatype, shape, expected", [
    ([[1, 2], [3, 4]], "INT32", [2, 2], np.array([1, 2, 3, 4], "<i4")),
    ([5, 2**64 - 1], "UINT64", [2], np.array([5, 2**64 - 1], "<u8")),
    ([True, False], "BOOL", [2], np.array([True, False])),
    ([1, 2.5], "FP64", [2], np.array([1.0, 2.5], "<f8")),
    ([], "FP32", [0, 3], np.array([], "<f4")),
])
def test_json_data_becomes_the_bytes_grpc_carries(data, datatype, shape, expected):
    assert rest_json.json_tensor_bytes(data, datatype, shape, "t") == expected.tobytes()


def test_bytes_elements_past_the_bound_are_refused_before_the_binary_data_is_read():
    count = codec.MAX_BYTES_ELEMENTS // 2 + 1  # two tensors of this: one past the bound
    header = json.dumps({"inputs": [
        {"name": name, "datatype": "BYTES", "shape": [count],
         "parameters": {"binary_data_size": 4 * count}} for name in ("a", "b")]}).encode()
    body = header + bytes(8 * count)
    with pytest.raises(errors.InvalidArgument, match="inputs: 65,538 BYTES elements"):
        rest_json.infer_request("m", "", body, len(header))
    with pytest.raises(errors.InvalidArgument, match="inputs\\[0\\] 'x': 65,537 BYTES"):
        rest_json.json_tensor_bytes([""] * 65_537, "BYTES", [65_537], "inputs[0] 'x'")


def test_json_strings_become_length_prefixed_bytes():
    assert rest_json.json_tensor_bytes(["ab", "é"], "BYTES", [2], "t") == \
        b"\x02\x00\x00\x00ab\x02\x00\x00\x00\xc3\xa9"


@pytest.mark.parametrize("data, datatype, words", [
    ([-1], "UINT8", "outside the range of UINT8"),
    ([2**70], "INT64", "outside the range of INT64"),
    ([1.5], "INT32", "expected integers for INT32"),
    ([1], "BOOL", "expected booleans for BOOL"),
    ([True], "FP32", "expected numbers for FP32"),
    ([1], "BYTES", "expected strings for BYTES"),
    ([1.0], "FP16", "FP16 has no JSON form"),
    ({"a": 1}, "FP32", "expected a list, got an object"),
])
def test_json_data_of_the_wrong_kind_names_the_tensor(data, datatype, words):
    with pytest.raises(errors.InvalidArgument) as caught:
        rest_json.json_tensor_bytes(data, datatype, [1], "inputs[0] 'x'")
    assert str(caught.value).startswith("inputs[0] 'x'.") and words in str(caught.value)


def response_with(*tensors: tuple[str, str, list[int], bytes], **parameters):
    response = pb.ModelInferResponse(model_name="m", model_version="1")
    for name, datatype, shape, raw in tensors:
        tensor = response.outputs.add(name=name, datatype=datatype, shape=shape)
        for key, value in parameters.get(name, {}).items():
            tensor.parameters[key].string_param = value
        response.raw_output_contents.append(raw)
    return response


def test_binary_outputs_follow_the_json_in_order():
    a, b = np.ones(2, "<f4").tobytes(), np.zeros(3, "<f2").tobytes()
    body, length = rest_json.infer_response(
        response_with(("a", "FP32", [2], a), ("j", "INT8", [1], b"\x05"), ("b", "FP16", [3], b)),
        rest_json.BinaryOutputs(True, {"j": False}))
    header = json.loads(body[:length])
    assert [o.get("parameters") for o in header["outputs"]] == [
        {"binary_data_size": 8}, None, {"binary_data_size": 6}]
    assert header["outputs"][1]["data"] == [5]
    assert body[length:] == a + b


def test_all_json_answers_carry_no_header_length_and_fp16_as_numbers():
    body, length = rest_json.infer_response(
        response_with(("h", "FP16", [2], np.array([0.5, -2], "<f2").tobytes())),
        rest_json.BinaryOutputs(False, {}))
    assert length is None and json.loads(body)["outputs"][0]["data"] == [0.5, -2.0]


def test_an_output_in_shared_memory_has_neither_data_nor_parameters():
    body, length = rest_json.infer_response(
        response_with(("s", "FP32", [4], b""), s={"shared_memory_region": "out"}),
        rest_json.BinaryOutputs(True, {}))
    assert length is None and json.loads(body)["outputs"] == [
        {"name": "s", "datatype": "FP32", "shape": [4]}]


def test_bytes_that_are_not_text_are_refused_as_json_and_sent_as_binary():
    raw = b"\x01\x00\x00\x00\xff"
    with pytest.raises(errors.InvalidArgument, match="not UTF-8 text"):
        rest_json.infer_response(response_with(("s", "BYTES", [1], raw)),
                                 rest_json.BinaryOutputs(False, {}))
    body, length = rest_json.infer_response(response_with(("s", "BYTES", [1], raw)),
                                            rest_json.BinaryOutputs(True, {}))
    assert body[length:] == raw


class Stalled:
    """A servicer whose ModelInfer waits until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = asyncio.Event()

    async def ModelInfer(self, request, context):
        self.entered.set()
        await self.release.wait()
        if request.model_name == "refuse":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such model")
        return pb.ModelInferResponse(model_name=request.model_name, model_version="1")


def test_requests_beyond_the_in_flight_limit_get_429_and_errors_keep_their_message():
    async def scenario():
        servicer = Stalled()
        door = rest.RestFrontDoor(servicer, max_body_bytes=1024, max_in_flight=1)
        async with TestClient(TestServer(door.application())) as client:
            body = json.dumps({"inputs": []})
            first = asyncio.ensure_future(client.post("/v2/models/m/infer", data=body))
            await servicer.entered.wait()
            second = await client.post("/v2/models/m/infer", data=body)
            assert second.status == 429 and "at most 1" in (await second.json())["error"]
            servicer.release.set()
            assert (await first).status == 200
            refused = await client.post("/v2/models/refuse/infer", data=body)
            assert (refused.status, await refused.json()) == (404, {"error": "no such model"})
            large = await client.post("/v2/models/m/infer", data=b"x" * 2048)
            assert large.status == 413 and "1024 bytes" in (await large.json())["error"]

    asyncio.run(scenario())


def test_a_body_sent_too_slowly_gets_408_and_health_is_answered_beside_a_full_door():
    class Live(Stalled):
        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

    async def scenario():
        servicer = Live()
        door = rest.RestFrontDoor(servicer, max_body_bytes=4096, max_in_flight=1)
        door.body_read_s = 0.3
        async with TestServer(door.application()) as server:
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"inputs\"")  # and no more
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            message = json.loads(await reader.readexactly(length))["error"]
            assert head.startswith(b"HTTP/1.1 408") and "within 0.3 s" in message, head
            writer.close()
            async with TestClient(server) as client:
                body = json.dumps({"inputs": []})
                held = asyncio.ensure_future(client.post("/v2/models/m/infer", data=body))
                await servicer.entered.wait()  # the one slot is taken
                assert (await client.post("/v2/models/m/infer", data=body)).status == 429
                assert (await client.get("/v2/health/live")).status == 200
                servicer.release.set()
                assert (await held).status == 200

    asyncio.run(scenario())


def test_only_the_json_part_of_a_body_is_held_to_the_json_limit():
    async def scenario():
        servicer = Stalled()
        servicer.release.set()
        door = rest.RestFrontDoor(servicer, max_body_bytes=4096, max_json_bytes=256,
                                  max_in_flight=4)
        data = np.zeros(200, "<f4").tobytes()  # 800 bytes, beyond the JSON limit
        body, length = binary_request(data, inputs=[{"name": "x", "datatype": "FP32",
                                                      "shape": [200], "parameters": {
                                                          "binary_data_size": len(data)}}])
        async with TestClient(TestServer(door.application())) as client:
            binary = await client.post("/v2/models/m/infer", data=body,
                                       headers={rest_json.HEADER_LENGTH: str(length)})
            assert binary.status == 200, await binary.text()
            as_json = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [200],
                                              "data": [0.0] * 200}]})
            refused = await client.post("/v2/models/m/infer", data=as_json)
            message = (await refused.json())["error"]
            assert refused.status == 413 and f"({len(as_json)} bytes)" in message \
                and "256 bytes" in message and rest_json.HEADER_LENGTH in message
            generate = await client.post("/v2/models/m/generate",
                                         data=json.dumps({"text_input": "x" * 300}))
            assert generate.status == 413 and "256 bytes" in (await generate.json())["error"]

    asyncio.run(scenario())


def test_a_generate_body_becomes_typed_inputs_and_parameters():
    body = json.dumps({"text_input": "hi", "max_tokens": 5, "temperature": 0.5,
                       "stop": ["a", "b"], "flag": True, "id": "r7",
                       "parameters": {"seed": 3}}).encode()
    request = rest_generate.generate_request("m", "2", body)
    assert (request.model_name, request.model_version, request.id) == ("m", "2", "r7")
    kinds = {t.name: (t.datatype, list(t.shape)) for t in request.inputs}
    assert kinds == {"text_input": ("BYTES", [1]), "max_tokens": ("INT64", [1]),
                     "temperature": ("FP64", [1]), "stop": ("BYTES", [2]),
                     "flag": ("BOOL", [1])}
    assert request.parameters["seed"].int64_param == 3
    assert len(request.raw_input_contents) == len(request.inputs)


@pytest.mark.parametrize(("body", "named"), [
    ({"text_input": []}, "text_input"),
    ({"text_input": ["a", 1]}, "text_input"),
    ({"mixed": [1, True]}, "mixed"),
    ({"text_input": None}, "text_input"),
])
def test_a_generate_input_of_no_one_kind_is_refused_by_name(body, named):
    with pytest.raises(errors.InvalidArgument, match=named):
        rest_generate.generate_request("m", "", json.dumps(body).encode())


def test_a_generate_answer_is_its_outputs_by_name():
    response = pb.ModelInferResponse(model_name="m", model_version="1", id="r")
    response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    response.outputs.add(name="token_ids", datatype="INT64", shape=[1])
    response.raw_output_contents.extend([
        len(b"ok").to_bytes(4, "little") + b"ok", np.array([7], np.int64).tobytes()])
    response.parameters["triton_final_response"].bool_param = True
    assert rest_generate.generate_json(response) == {
        "model_name": "m", "model_version": "1", "id": "r", "text_output": "ok",
        "token_ids": [7], "parameters": {"triton_final_response": True}}
