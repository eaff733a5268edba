"""KServe v2 REST on real agent and router processes, driven by the unmodified
`tritonclient.http` (and plain HTTP where a client would not send it wrong):
the same answers, statistics and error messages as gRPC, with HTTP codes."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import EITHER_AGENT, IDENTITY_DATATYPES, either_agent, wait_until_held
from tiered.local.processes import AgentError, AgentProcess, RouterProcess
from tiered.protocol import codec

rng = np.random.default_rng(0)
big = np.zeros((9, 16), np.float32)  # one row more than add_sub's max_batch_size


@pytest.fixture(scope="module", params=EITHER_AGENT)
def agent(request):
    return either_agent(request)


@pytest.fixture(scope="module")
def rest(agent):
    with httpclient.InferenceServerClient(agent.http_address) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(agent):
    with grpcclient.InferenceServerClient(agent.address) as client:
        yield client


def http_input(name: str, array: np.ndarray, binary: bool = True) -> httpclient.InferInput:
    item = httpclient.InferInput(name, list(array.shape), codec.datatype_of(array.dtype))
    item.set_data_from_numpy(array, binary_data=binary)
    return item


def grpc_input(name: str, array: np.ndarray) -> grpcclient.InferInput:
    item = grpcclient.InferInput(name, list(array.shape), codec.datatype_of(array.dtype))
    item.set_data_from_numpy(array)
    return item


def failure(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def send(address: str, method: str, path: str, body: bytes = b"",
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def error_of(address: str, method: str, path: str, body: bytes = b"",
             headers: dict[str, str] | None = None) -> tuple[int, str]:
    status, _, payload = send(address, method, path, body, headers)
    return status, json.loads(payload)["error"]


def add_sub_body(**tensor_fields) -> bytes:
    """add_sub's two inputs in JSON, the first with these fields (None: left out)."""
    inputs = [{"name": name, "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16}
              for name in ("INPUT0", "INPUT1")]
    inputs[0].update(tensor_fields)
    inputs[0] = {key: value for key, value in inputs[0].items() if value is not None}
    return json.dumps({"inputs": inputs}).encode()


BINARY_BEYOND_THE_BODY = add_sub_body(data=None, parameters={"binary_data_size": 64})


# -- health, metadata, config -------------------------------------------------------


def test_health_and_server_metadata_agree_with_grpc(rest, grpc_client):
    assert rest.is_server_live() and rest.is_server_ready()
    assert rest.get_server_metadata() == grpc_client.get_server_metadata(as_json=True)
    assert rest.is_model_ready("add_sub") and rest.is_model_ready("add_sub", "1")
    assert not rest.is_model_ready("add_sub", "7")
    assert not rest.is_model_ready("no_such_model")


def test_model_metadata_writes_shapes_as_numbers(rest):
    metadata = rest.get_model_metadata("add_sub")
    assert metadata == rest.get_model_metadata("add_sub", "1")
    assert (metadata["name"], metadata["versions"], metadata["platform"]) == \
        ("add_sub", ["1"], "onnxruntime_onnx")
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
        ("INPUT0", "FP32", [-1, 16]), ("INPUT1", "FP32", [-1, 16])]


def test_model_config_is_the_grpc_config_with_64_bit_integers_as_numbers(rest, grpc_client):
    config = rest.get_model_config("add_sub")
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"]["preferred_batch_size"] == [8]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert [i["dims"] for i in config["input"]] == [[16], [16]]
    assert config["parameters"]["tier"]["string_value"] == "edge"
    over_grpc = grpc_client.get_model_config("add_sub", as_json=True)["config"]
    assert config["name"] == over_grpc["name"] and config["platform"] == over_grpc["platform"]
    assert config["parameters"] == over_grpc["parameters"]


# -- inference ------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_answers_what_grpc_answers(rest, grpc_client, binary):
    a = rng.standard_normal((3, 16)).astype(np.float32)
    b = rng.standard_normal((3, 16)).astype(np.float32)
    result = rest.infer("add_sub", [http_input("INPUT0", a, binary), http_input("INPUT1", b,
                                                                                 binary)],
                        outputs=[httpclient.InferRequestedOutput(name, binary_data=binary)
                                 for name in ("OUTPUT0", "OUTPUT1")], request_id="r-7")
    expected = grpc_client.infer("add_sub", [grpc_input("INPUT0", a), grpc_input("INPUT1", b)])
    for name in ("OUTPUT0", "OUTPUT1"):
        np.testing.assert_array_equal(result.as_numpy(name), expected.as_numpy(name))
        assert ("data" in result.get_output(name)) is not binary
    response = result.get_response()
    assert (response["id"], response["model_name"], response["model_version"]) == \
        ("r-7", "add_sub", "1")


def test_no_outputs_named_answers_all_of_them_binary(rest):
    a = np.ones((1, 16), np.float32)
    result = rest.infer("add_sub", [http_input("INPUT0", a), http_input("INPUT1", a)])
    assert {o["name"] for o in result.get_response()["outputs"]} == {"OUTPUT0", "OUTPUT1"}
    assert all("binary_data_size" in o["parameters"] for o in result.get_response()["outputs"])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((1, 16), np.float32))


def identity_inputs(datatype: str, array: np.ndarray, binary: bool) -> list:
    inputs = []
    for other in IDENTITY_DATATYPES:
        if other == datatype:
            inputs.append(http_input(f"in_{other}", array, binary))
            continue
        filler = np.zeros((2, 1), dtype=codec.DATATYPES[other]) if other != "BYTES" \
            else np.array([[b""], [b""]], dtype=object)
        inputs.append(http_input(f"in_{other}", filler))  # FP16 travels binary only
    return inputs


def sample(datatype: str, shape=(2, 5)) -> np.ndarray:
    if datatype == "BYTES":
        return np.array([[f"s{i}{j}é".encode() for j in range(shape[1])]
                         for i in range(shape[0])], dtype=object)
    if datatype == "BOOL":
        return rng.random(shape) > 0.5
    dtype = codec.DATATYPES[datatype]
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


# FP16 has no JSON form (test_fp16_in_json_is_refused_naming_the_input).
ROUND_TRIPS = [(datatype, binary) for datatype in IDENTITY_DATATYPES for binary in (True, False)
               if binary or datatype != "FP16"]


@pytest.mark.parametrize("datatype, binary", ROUND_TRIPS,
                         ids=[f"{d}-{'binary' if b else 'json'}" for d, b in ROUND_TRIPS])
def test_every_datatype_round_trips(rest, datatype, binary):
    array = sample(datatype)
    result = rest.infer("identity", identity_inputs(datatype, array, binary), outputs=[
        httpclient.InferRequestedOutput(f"out_{datatype}", binary_data=binary)])
    if datatype == "BYTES" and not binary:  # JSON holds text: the client reads str
        array = np.array([[v.decode() for v in row] for row in array], dtype=object)
    np.testing.assert_array_equal(result.as_numpy(f"out_{datatype}"), array)


def test_bytes_elements_with_nul_and_empty_ones_travel_binary(rest):
    array = np.array([[b"a\x00b", b""], ["ü".encode(), b"\x00"]], dtype=object)
    result = rest.infer("identity", identity_inputs("BYTES", array, True), outputs=[
        httpclient.InferRequestedOutput("out_BYTES", binary_data=True)])
    np.testing.assert_array_equal(result.as_numpy("out_BYTES"), array)


def test_fp16_in_json_is_refused_naming_the_input(agent):
    inputs = [{"name": f"in_{t}", "datatype": t, "shape": [1, 1],
               "data": [""] if t == "BYTES" else [False] if t == "BOOL" else [0]}
              for t in IDENTITY_DATATYPES]
    status, message = error_of(agent.http_address, "POST", "/v2/models/identity/infer",
                               json.dumps({"inputs": inputs}).encode())
    index = IDENTITY_DATATYPES.index("FP16")
    assert status == 400
    assert message.startswith(f"inputs[{index}] 'in_FP16'.data: FP16 has no JSON form")


def test_nested_json_data_is_read_row_major_and_compressed_bodies_are_read(agent):
    rows = [[float(i * 16 + j) for j in range(16)] for i in range(2)]
    body = json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": [2, 16], "data": rows},
        {"name": "INPUT1", "datatype": "FP32", "shape": [2, 16], "data": sum(rows, [])}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}]}).encode()
    for payload, headers in ((body, {}), (gzip.compress(body), {"Content-Encoding": "gzip"})):
        status, _, answer = send(agent.http_address, "POST", "/v2/models/add_sub/infer",
                                 payload, headers)
        assert status == 200, answer
        (output,) = json.loads(answer)["outputs"]
        assert output["shape"] == [2, 16] and output["data"] == [2 * v for v in sum(rows, [])]


def test_asked_for_compression_the_answer_is_compressed(rest):
    a = np.ones((2, 16), np.float32)
    for algorithm in ("gzip", "deflate"):
        result = rest.infer("add_sub", [http_input("INPUT0", a), http_input("INPUT1", a)],
                            request_compression_algorithm=algorithm,
                            response_compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)


def test_rest_requests_count_in_the_agents_statistics(rest, grpc_client):
    def success() -> int:
        stats = grpc_client.get_inference_statistics("mlp").model_stats[0]
        return stats.inference_stats.success.count

    before = success()
    rows = rng.standard_normal((5, 16)).astype(np.float32)
    for i in range(5):
        rest.infer("mlp", [http_input("input", rows[i:i + 1], binary=i % 2 == 0)])
    assert success() == before + 5
    stats = rest.get_inference_statistics("mlp")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == before + 5  # a number, not a string
    assert stats == rest.get_inference_statistics("mlp", "1")["model_stats"][0]
    everything = rest.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in everything} >= {"add_sub", "identity", "mlp", "slow"}


def test_repository_index_and_shared_memory_status(rest):
    index = {m["name"]: m for m in rest.get_model_repository_index()}
    assert index["add_sub"]["state"] == "READY" and index["add_sub"]["version"] == "1"
    assert rest.get_system_shared_memory_status() == []
    assert rest.get_cuda_shared_memory_status() == []


# -- errors: gRPC's messages, HTTP's codes -------------------------------------------

CASES = [  # the last column: Triton's text, at the start of the message
    ("unknown model", "nope", ["INPUT0"], None, "404", "NOT_FOUND",
     "Request for unknown model: 'nope' is not found"),
    ("unknown version", "add_sub", ["INPUT0", "INPUT1"], "3", "404", "NOT_FOUND",
     "Request for unknown model: 'add_sub' version 3 is not found"),
    ("missing input", "add_sub", ["INPUT0"], None, "400", "INVALID_ARGUMENT",
     "expected 2 inputs but got 1 inputs for model 'add_sub'"),
    ("unknown input", "add_sub", ["INPUT0", "INPUT1", "INPUT9"], None, "400",
     "INVALID_ARGUMENT", "unexpected inference input 'INPUT9' for model 'add_sub'"),
    ("wrong datatype", "add_sub", ["INPUT0:f8", "INPUT1"], None, "400", "INVALID_ARGUMENT",
     "inference input 'INPUT0' data-type is 'FP64', but model 'add_sub' expects 'FP32'"),
    ("wrong shape", "add_sub", ["INPUT0:narrow", "INPUT1:narrow"], None, "400",
     "INVALID_ARGUMENT",
     "unexpected shape for input 'INPUT0' for model 'add_sub'. Expected [-1,16], got [2,8]"),
    ("batch above max_batch_size", "add_sub", ["INPUT0:big", "INPUT1:big"], None, "400",
     "INVALID_ARGUMENT", "inference request batch-size must be <= 8 for 'add_sub'"),
]


def case_arrays(names: list[str]) -> list[tuple[str, np.ndarray]]:
    arrays = []
    for spec in names:
        name, _, variant = spec.partition(":")
        array = np.full((2, 16), 0.5, np.float32)
        if variant == "f8":
            array = array.astype(np.float64)
        elif variant == "narrow":
            array = array[:, :8].copy()
        elif variant == "big":
            array = big
        arrays.append((name, array))
    return arrays


@pytest.mark.parametrize("case, model, names, version, http_code, grpc_code, triton", CASES,
                         ids=[c[0] for c in CASES])
def test_errors_carry_tritons_text_with_the_matching_http_code(
        rest, grpc_client, case, model, names, version, http_code, grpc_code, triton):
    arrays = case_arrays(names)
    over_grpc = failure(lambda: grpc_client.infer(
        model, [grpc_input(n, a) for n, a in arrays], model_version=version or ""))
    assert over_grpc.status() == f"StatusCode.{grpc_code}", case
    assert over_grpc.message().startswith(triton), over_grpc.message()
    for binary in (True, False):
        over_http = failure(lambda: rest.infer(
            model, [http_input(n, a, binary) for n, a in arrays], model_version=version or ""))
        assert (over_http.status(), over_http.message()) == (http_code, over_grpc.message())
    assert rest.is_server_ready(), "the agent must keep serving"


def test_deadline_and_full_queue_answer_504_and_429(agent, rest):
    a = np.ones((2, 16), np.float32)
    error = failure(lambda: rest.infer("add_sub", [http_input("INPUT0", a),
                                                   http_input("INPUT1", a)], timeout=1))
    assert error.status() == "504"
    image = rng.standard_normal((1, 3, 96, 96)).astype(np.float32)

    async def burst():
        async with aiohttpclient.InferenceServerClient(agent.http_address) as client:
            return await asyncio.gather(
                *(client.infer("slow", [http_input("input", image)]) for _ in range(24)),
                return_exceptions=True)

    outcomes = asyncio.run(burst())
    refused = [o for o in outcomes if isinstance(o, InferenceServerException)]
    answered = [o for o in outcomes if not isinstance(o, Exception)]
    assert refused and answered, outcomes
    assert {o.status() for o in refused} == {"429"}
    assert "max_queue_size 1" in refused[0].message()


BAD_BODIES = [
    ("not JSON", b"{inputs", {}, "request body: not valid JSON"),
    ("not an object", b"[1, 2]", {}, "request body: expected a JSON object, got a list"),
    ("no inputs", b"{}", {}, "inputs: expected a list of tensors, got null"),
    ("shape of strings", add_sub_body(shape=["1", "16"]), {},
     "inputs[0] 'INPUT0'.shape: expected a list of integers"),
    ("datatype a number", add_sub_body(datatype=5), {},
     "inputs[0] 'INPUT0'.datatype: expected a string, got a number"),
    ("unknown datatype", add_sub_body(datatype="FP128"), {},
     "inputs[0] 'INPUT0'.datatype: unknown datatype 'FP128'"),
    ("strings for FP32", add_sub_body(data=["a"] * 16), {},
     "inputs[0] 'INPUT0'.data: expected numbers for FP32"),
    ("too few values", add_sub_body(data=[1.0] * 15), {},
     "inputs[0] 'INPUT0'.data: 15 values for shape [1, 16], expected 16"),
    ("ragged nesting", add_sub_body(data=[[1.0] * 8, [1.0] * 7]), {},
     "inputs[0] 'INPUT0'.data: nested lists of unequal lengths"),
    ("floats for INT64", json.dumps({"inputs": [{"name": "x", "datatype": "INT64",
                                                 "shape": [2], "data": [1, 2.5]}]}).encode(),
     {}, "inputs[0] 'x'.data: expected integers for INT64"),
    ("out of range for INT8", json.dumps({"inputs": [{"name": "x", "datatype": "INT8",
                                                      "shape": [1], "data": [300]}]}).encode(),
     {}, "inputs[0] 'x'.data: values outside the range of INT8"),
    ("no data", add_sub_body(data=None), {}, "inputs[0] 'INPUT0': give exactly one of data"),
    ("data and binary data", add_sub_body(parameters={"binary_data_size": 64}), {},
     "inputs[0] 'INPUT0': give exactly one of data"),
    ("binary beyond the body", BINARY_BEYOND_THE_BODY,
     {"Inference-Header-Content-Length": str(len(BINARY_BEYOND_THE_BODY))},
     "inputs[0] 'INPUT0'.parameters.binary_data_size: 64 bytes, but only 0 bytes"),
    ("bad header length", add_sub_body(), {"Inference-Header-Content-Length": "x"},
     "Inference-Header-Content-Length: expected a byte count"),
    ("a list as a parameter", json.dumps({"inputs": [], "parameters": {"p": [1]}}).encode(),
     {}, "parameters.p: expected a string, number or boolean, got a list"),
    ("nested past the parser's depth", b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     {}, "request body: JSON nested too deeply"),
]


@pytest.mark.parametrize("case, body, headers, words", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_malformed_bodies_get_400_naming_the_field(agent, case, body, headers, words):
    status, message = error_of(agent.http_address, "POST", "/v2/models/add_sub/infer", body,
                               headers)
    assert status == 400, (case, message)
    assert words in message, message


def test_binary_data_must_add_up_to_the_body(agent):
    data = np.ones(16, np.float32).tobytes()
    header = json.dumps({"inputs": [
        {"name": n, "datatype": "FP32", "shape": [1, 16],
         "parameters": {"binary_data_size": 64}} for n in ("INPUT0", "INPUT1")]}).encode()
    length = {"Inference-Header-Content-Length": str(len(header))}
    status, _, answer = send(agent.http_address, "POST", "/v2/models/add_sub/infer",
                             header + data + data, length)
    assert status == 200, answer
    status, message = error_of(agent.http_address, "POST", "/v2/models/add_sub/infer",
                               header + data + data + b"extra", length)
    assert status == 400 and "133 bytes of binary data" in message \
        and "add up to 128" in message


def test_unknown_endpoints_and_methods_answer_in_tritons_error_body(agent, rest):
    assert error_of(agent.http_address, "GET", "/v2/nothing") == \
        (404, "no such endpoint: GET /v2/nothing")
    status, message = error_of(agent.http_address, "DELETE", "/v2/models/add_sub")
    assert status == 405 and "DELETE" in message
    assert failure(rest.get_trace_settings).status() == "501"
    assert failure(rest.get_log_settings).status() == "501"
    assert rest.is_server_live()


@pytest.mark.skipif(shutil.which("perf_analyzer") is None,
                    reason="Triton's perf_analyzer is not on PATH (it ships in tritonclient "
                    "2.51's wheel and needs libb64)")
@pytest.mark.parametrize("memory", ["none", "system"])
def test_perf_analyzer_runs_over_http(agent, tmp_path, memory):
    report = tmp_path / "report.csv"
    run = subprocess.run(
        ["perf_analyzer", "-m", "add_sub", "-u", agent.http_address, "-i", "http",
         "--shared-memory", memory, "--concurrency-range", "2",
         "--measurement-interval", "1000", "--stability-percentage", "100",  # a busy host
         "-f", str(report)],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    header, row = report.read_text().splitlines()[:2]
    assert float(dict(zip(header.split(","), row.split(",")))["Inferences/Second"]) > 0


# -- bounds and credentials: an agent with small limits and tokens ----------------------


@pytest.fixture(scope="module")
def guarded_agent(shared_repository, tmp_path_factory):
    """Inference needs a token, load an admin's; messages above 64 KiB are refused,
    and JSON above 4 KiB; one front end, so REST's checks are the engine process's own."""
    directory = tmp_path_factory.mktemp("guarded")
    profile = directory / "edge.yaml"
    edge = Path(__file__).resolve().parents[2] / "tiered" / "profiles" / "edge.yaml"
    text = edge.read_text()
    limited = text.replace("max_message_bytes: 67108864", "max_message_bytes: 65536") \
        .replace("max_json_bytes: 4194304", "max_json_bytes: 4096")
    assert limited.count("65536") == text.count("65536") + 1 and "4096 " in limited
    profile.write_text(limited)
    (directory / "inference").write_text("reader-token\n")
    (directory / "admin").write_text("admin-token\n")
    with AgentProcess("edge", shared_repository, admin_token_file=directory / "admin",
                      extra_args=["--profile", str(profile), "--front-ends", "1",
                                  "--inference-token-file", str(directory / "inference")]
                      ) as process:
        yield process


def mlp_inputs(binary: bool = True) -> list:
    return [http_input("input", np.ones((1, 16), np.float32), binary)]


def test_tokens_are_checked_over_http_as_over_grpc(guarded_agent):
    with httpclient.InferenceServerClient(guarded_agent.http_address) as client, \
            grpcclient.InferenceServerClient(guarded_agent.address) as over_grpc:
        assert client.is_server_ready()  # health needs no token
        grpc_error = failure(lambda: over_grpc.infer("mlp", [grpc_input(
            "input", np.ones((1, 16), np.float32))]))
        none = failure(lambda: client.infer("mlp", mlp_inputs()))
        assert (none.status(), none.message()) == ("401", grpc_error.message())
        wrong = failure(lambda: client.infer("mlp", mlp_inputs(),
                                             headers={"Authorization": "Bearer nope"}))
        assert wrong.status() == "403" and "not allowed" in wrong.message()
        answer = client.infer("mlp", mlp_inputs(),
                              headers={"Authorization": "Bearer reader-token"})
        assert answer.as_numpy("probabilities").shape == (1, 4)
        refused = failure(lambda: client.load_model(
            "mlp", headers={"Authorization": "Bearer reader-token"}))
        assert refused.status() == "403" and "admin" in refused.message()
        client.load_model("mlp", headers={"Authorization": "Bearer admin-token"})
        assert client.is_model_ready("mlp")


def test_a_body_above_the_message_limit_is_refused_and_the_agent_serves_on(guarded_agent):
    body = add_sub_body().replace(b"}]}", b"}], \"pad\": \"" + b"x" * 70_000 + b"\"}")
    auth = {"Authorization": "Bearer reader-token"}
    status, message = error_of(guarded_agent.http_address, "POST",
                               "/v2/models/add_sub/infer", body, auth)
    assert status == 413 and "65536" in message

    def chunks():  # no Content-Length: the limit holds as the body is read
        for start in range(0, len(body), 8192):
            yield body[start:start + 8192]

    host, port = guarded_agent.http_address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v2/models/add_sub/infer", body=chunks(),
                       headers=auth, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413 and "65536" in json.loads(response.read())["error"]
    connection.close()
    with httpclient.InferenceServerClient(guarded_agent.http_address) as client:
        assert client.infer("mlp", mlp_inputs(), headers=auth).as_numpy("probabilities") \
            is not None


def json_beyond_the_limit(server, auth: dict[str, str]) -> None:
    """A tensor whose JSON is above the server's 4 KiB JSON limit is refused
    with 413 naming the binary extension; as binary data it is answered."""
    rows = np.full((8, 16), 0.123456789, np.float32)  # ~19 characters a number in JSON
    body = json.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": list(rows.shape),
                                   "data": rows.ravel().tolist()}
                                  for n in ("INPUT0", "INPUT1")]}).encode()
    assert 4096 < len(body) < 65536
    status, message = error_of(server.http_address, "POST", "/v2/models/add_sub/infer", body,
                               auth)
    assert status == 413 and "request JSON" in message and "4096" in message \
        and "binary" in message, message
    generate = json.dumps({"text_input": "x" * 5000}).encode()
    status, message = error_of(server.http_address, "POST", "/v2/models/add_sub/generate",
                               generate, auth)
    assert status == 413 and "4096" in message, message
    with httpclient.InferenceServerClient(server.http_address) as client:
        answer = client.infer("add_sub", [http_input("INPUT0", rows), http_input("INPUT1", rows)],
                              headers=auth)
        np.testing.assert_allclose(answer.as_numpy("OUTPUT0"), rows + rows)


def test_json_above_the_json_limit_is_refused_and_binary_data_is_not(guarded_agent):
    json_beyond_the_limit(guarded_agent, {"Authorization": "Bearer reader-token"})


# -- the router -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def router(agent_in_one_process, tmp_path_factory):
    table = tmp_path_factory.mktemp("rest-router") / "table.json"
    table.write_text(json.dumps({"version": 1, "models": {
        model: {"tiers": {"edge": {"agents": [agent_in_one_process.address]}}}
        for model in ("add_sub", "mlp")}}))
    with RouterProcess(table, metrics_port=None) as process:
        yield process


@pytest.fixture(scope="module")
def limited_router(agent_in_one_process, tmp_path_factory):
    """A router that takes messages up to 64 KiB and JSON up to 4 KiB."""
    table = tmp_path_factory.mktemp("limited-router") / "table.json"
    table.write_text(json.dumps({"version": 1, "models": {"add_sub": {"tiers": {"edge": {
        "agents": [agent_in_one_process.address]}}}}}))
    with RouterProcess(table, metrics_port=None, extra_args=[
            "--max-message-bytes", "65536", "--max-json-bytes", "4096"]) as process:
        yield process


def test_the_routers_limits_refuse_larger_requests_and_it_serves_on(limited_router):
    json_beyond_the_limit(limited_router, {})
    large = np.ones((1100, 16), np.float32)  # 70 kB a tensor
    with grpcclient.InferenceServerClient(limited_router.address) as client:
        refused = failure(lambda: client.infer("add_sub", [grpc_input("INPUT0", large),
                                                           grpc_input("INPUT1", large)]))
        assert refused.status() == "StatusCode.RESOURCE_EXHAUSTED", refused
        small = np.ones((1, 16), np.float32)
        answer = client.infer("add_sub", [grpc_input("INPUT0", small), grpc_input("INPUT1", small)])
        np.testing.assert_allclose(answer.as_numpy("OUTPUT0"), small + small)
    status, message = error_of(limited_router.http_address, "POST",
                               "/v2/models/add_sub/infer", b"x" * 70_000)
    assert status == 413 and "65536" in message, message


def test_the_router_forwards_rest_requests_to_agents(router, shared_repository):
    with httpclient.InferenceServerClient(router.http_address) as client:
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_server_metadata()["name"] == "tiered-router"
        assert client.is_model_ready("add_sub") and not client.is_model_ready("nope")
        assert client.get_model_metadata("add_sub")["inputs"][0]["shape"] == [-1, 16]
        assert client.get_model_config("add_sub")["max_batch_size"] == 8
        a = rng.standard_normal((2, 16)).astype(np.float32)
        b = rng.standard_normal((2, 16)).astype(np.float32)
        for binary in (True, False):
            result = client.infer(
                "add_sub", [http_input("INPUT0", a, binary), http_input("INPUT1", b, binary)],
                outputs=[httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary)],
                headers={"tiered-tier": "edge"})
            np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b)
        stats = client.get_inference_statistics("add_sub")["model_stats"]
        assert sum(s["inference_stats"]["success"]["count"] for s in stats) >= 2
        assert [m["name"] for m in client.get_model_repository_index()] == ["add_sub", "mlp"]


def test_the_routers_errors_match_its_grpc_errors(router):
    a = np.ones((1, 16), np.float32)
    with httpclient.InferenceServerClient(router.http_address) as client, \
            grpcclient.InferenceServerClient(router.address) as over_grpc:
        pairs = [
            (lambda: client.infer("nope", [http_input("INPUT0", a)]),
             lambda: over_grpc.infer("nope", [grpc_input("INPUT0", a)]), "404"),
            (lambda: client.infer("add_sub", [http_input("INPUT0", a)]),
             lambda: over_grpc.infer("add_sub", [grpc_input("INPUT0", a)]), "400"),
            (lambda: client.load_model("mlp"), lambda: over_grpc.load_model("mlp"), "501"),
            (lambda: client.register_system_shared_memory("r", "/r", 64),
             lambda: over_grpc.register_system_shared_memory("r", "/r", 64), "501"),
        ]
        for over_http, grpc_call, code in pairs:
            error, expected = failure(over_http), failure(grpc_call)
            assert (error.status(), error.message()) == (code, expected.message())


# -- HTTPS with the gRPC port's certificate --------------------------------------------


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl for certificates")
def test_tls_serves_https_with_the_same_certificate(shared_repository, tmp_path):
    import ssl

    from tests.integration.test_security import make_ca, make_cert

    make_ca(tmp_path, "ca")
    make_cert(tmp_path, "agent", "ca", server=True)
    security = ["--tls-cert", str(tmp_path / "agent.crt"), "--tls-key",
                str(tmp_path / "agent.key")]
    with AgentProcess("edge", shared_repository, security_args=security) as process:
        assert "REST on https://" in process.log()
        with httpclient.InferenceServerClient(
                process.http_address, ssl=True,
                ssl_context_factory=lambda: ssl.create_default_context(
                    cafile=str(tmp_path / "ca.crt"))) as client:
            assert client.is_server_ready()
            assert client.infer("mlp", mlp_inputs()).as_numpy("probabilities").shape == (1, 4)


def test_a_taken_rest_port_stops_the_agent_and_its_front_ends(agent_in_one_process,
                                                                shared_repository):
    taken = agent_in_one_process.http_port
    second = AgentProcess("edge", shared_repository,
                          extra_args=["--front-ends", "1", "--http-port", str(taken)])
    with pytest.raises(AgentError):
        second.start(timeout_s=60)
    assert second.stop() == 2
    assert f"cannot serve REST on 127.0.0.1:{taken}" in second.log()


def test_sigterm_drains_rest_requests_in_flight(tmp_path):
    from tiered.agent.repository import model_file, write_config
    from tiered.models import zoo

    zoo.resnet18(model_file(tmp_path, "slow", 1), image_size=224, num_classes=10)
    write_config(tmp_path, "slow", {"max_batch_size": 1})
    image = np.zeros((1, 3, 224, 224), np.float32)
    agent = AgentProcess("edge", tmp_path).start()
    outcomes: list = []

    async def many() -> None:
        async with aiohttpclient.InferenceServerClient(agent.http_address) as client:
            outcomes.extend(await asyncio.gather(
                *(client.infer("slow", [http_input("input", image)]) for _ in range(24)),
                return_exceptions=True))

    sender = threading.Thread(target=asyncio.run, args=(many(),))
    sender.start()
    # The signal once the agent holds every request (one not yet received
    # could rightly be refused: on a busy machine the client may take a while
    # to send them all), while one model run at a time keeps most waiting.
    answered, in_flight = wait_until_held(agent, "slow", 24)
    code = agent.stop()
    sender.join(30)
    assert answered + in_flight == 24 and in_flight > 0, (answered, in_flight)
    assert code == 0, agent.log_tail()
    assert len(outcomes) == 24 and not [o for o in outcomes if isinstance(o, Exception)], outcomes


def test_the_local_systems_router_serves_rest_and_comes_back_on_its_port(tmp_path):
    from tiered.local.supervisor import LocalSystem, LocalUp, RouterPorts

    lines: list[str] = []
    local = LocalUp(LocalSystem(state_dir=str(tmp_path / "state"), tiers=("edge",),
                                router=RouterPorts(port=0, http_port=0)),
                    tmp_path, progress=lines.append)
    try:
        local.start()
        router = local.router
        port = router.http_port
        assert any(f"router: pid {router.pid}, {router.address}, REST http://127.0.0.1:{port}"
                   in line for line in lines), lines
        router.kill()
        deadline = time.monotonic() + 30
        while not router.alive() and time.monotonic() < deadline:
            local.restart_dead()
            time.sleep(0.2)
        assert router.http_port == port
        with httpclient.InferenceServerClient(router.http_address) as client:
            assert client.is_server_live()
    finally:
        local.stop()


def test_credentials_are_checked_before_a_body_is_read(shared_repository, tmp_path):
    """An agent that requires tokens answers a call without one 401 (with a
    wrong one 403) before it reads the body: a malformed body is never
    parsed (it would be a 400), and a body of 8 MiB is refused as fast as
    a small one."""
    tokens = tmp_path / "tokens"
    tokens.write_text("right\n")
    admin = tmp_path / "admin"
    admin.write_text("boss\n")
    with AgentProcess("edge", shared_repository, extra_args=[
            "--inference-token-file", str(tokens)], admin_token_file=admin) as agent:
        address = agent.http_address
        calls = [("/v2/models/add_sub/infer", b"{not json", {}),
                 ("/v2/models/add_sub/infer", b"[" * (8 << 20), {}),
                 ("/v2/models/add_sub/generate", b"{not json", {}),
                 ("/v2/repository/index", b"{not json", {}),
                 ("/v2/repository/models/add_sub/load", b"{not json", {}),
                 ("/v2/systemsharedmemory/region/r/register", b"{not json", {})]
        for path, body, headers in calls:
            status, message = error_of(address, "POST", path, body, headers)
            assert status == 401, (path, status, message)
            status, _ = error_of(address, "POST", path, body,
                                 {"Authorization": "Bearer wrong"})
            assert status == 403, (path, status)
        status, _ = error_of(address, "POST", "/v2/models/add_sub/infer", b"{not json",
                             {"Authorization": "Bearer right"})
        assert status == 400  # with the credential, the body is read and refused
        assert send(address, "POST", "/v2/models/add_sub/infer", add_sub_body(),
                    {"Authorization": "Bearer right"})[0] == 200
