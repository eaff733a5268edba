"""An agent process on loopback, driven by the unmodified tritonclient."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import EITHER_AGENT, IDENTITY_DATATYPES, either_agent
from tiered.protocol import codec

rng = np.random.default_rng(0)
big = np.zeros((9, 16), np.float32)  # one row more than add_sub's max_batch_size



@pytest.fixture(scope="module", params=EITHER_AGENT)
def agent(request):
    return either_agent(request)

@pytest.fixture(scope="module")
def client(agent):
    with grpcclient.InferenceServerClient(agent.address) as c:
        yield c


def reference(repository, model: str, feeds: dict) -> dict:
    session = ort.InferenceSession(str(repository / model / "1" / "model.onnx"))
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    item = grpcclient.InferInput(name, list(array.shape), codec.datatype_of(array.dtype))
    item.set_data_from_numpy(array)
    return item


def add_sub_inputs(batch: int = 2) -> tuple[np.ndarray, np.ndarray, list]:
    a = rng.standard_normal((batch, 16)).astype(np.float32)
    b = rng.standard_normal((batch, 16)).astype(np.float32)
    return a, b, [tensor("INPUT0", a), tensor("INPUT1", b)]


def status_of(call) -> str:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value.status()


def test_server_is_live_ready_and_describes_itself(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata.name == "tiered"
    assert {"model_repository", "statistics", "model_configuration"} <= set(metadata.extensions)


def test_model_readiness_by_name_and_version(client):
    assert client.is_model_ready("add_sub")
    assert client.is_model_ready("add_sub", "1")
    assert not client.is_model_ready("add_sub", "7")
    assert not client.is_model_ready("no_such_model")


def test_model_metadata_leads_shapes_with_the_batch_dimension(client):
    metadata = client.get_model_metadata("add_sub")
    assert metadata.versions == ["1"]
    assert metadata.platform == "onnxruntime_onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("INPUT0", "FP32", [-1, 16]), ("INPUT1", "FP32", [-1, 16])
    ]


def test_model_config_reports_batching_and_the_engine_in_use(client):
    config = client.get_model_config("add_sub", as_json=True)["config"]
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"]["preferred_batch_size"] == [8]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "2000"
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    assert config["parameters"]["providers"]["string_value"] == "CPUExecutionProvider"
    assert config["parameters"]["tier"]["string_value"] == "edge"


def test_infer_matches_in_process_onnxruntime(client, shared_repository):
    a, b, inputs = add_sub_inputs(batch=3)
    result = client.infer("add_sub", inputs, request_id="r-1")
    expected = reference(shared_repository, "add_sub", {"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected["OUTPUT0"])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), expected["OUTPUT1"])
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == ("r-1", "add_sub", "1")


def test_infer_returns_only_the_requested_outputs(client):
    a, b, inputs = add_sub_inputs()
    result = client.infer("add_sub", inputs, outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT1"]
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b)


@pytest.mark.parametrize("datatype", IDENTITY_DATATYPES)
def test_every_datatype_round_trips(client, datatype):
    shape = (2, 5)
    if datatype == "BYTES":
        array = np.array([[f"s{i}{j}\x00é".encode() for j in range(5)] for i in range(2)],
                         dtype=object)
    elif datatype == "BOOL":
        array = rng.random(shape) > 0.5
    else:
        dtype = codec.DATATYPES[datatype]
        if dtype.kind == "f":
            array = rng.standard_normal(shape).astype(dtype)
        else:
            info = np.iinfo(dtype)
            array = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    # Every input must be present; the others carry one row of zeros.
    inputs = []
    for other in IDENTITY_DATATYPES:
        if other == datatype:
            inputs.append(tensor(f"in_{other}", array))
            continue
        filler = np.zeros((2, 1), dtype=codec.DATATYPES[other]) if other != "BYTES" \
            else np.array([[b""], [b""]], dtype=object)
        inputs.append(tensor(f"in_{other}", filler))
    result = client.infer("identity", inputs,
                          outputs=[grpcclient.InferRequestedOutput(f"out_{datatype}")])
    np.testing.assert_array_equal(result.as_numpy(f"out_{datatype}"), array)


def test_typed_contents_are_accepted_beside_raw(agent):
    """tritonclient always sends raw bytes; other v2 clients send typed fields."""
    from tiered.protocol import grpc_service_pb2 as pb
    from tiered.protocol import grpc_service_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name="add_sub")
    for name, values in (("INPUT0", [1.5] * 16), ("INPUT1", [0.5] * 16)):
        item = request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        item.contents.fp32_contents.extend(values)
    with grpc.insecure_channel(agent.address) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)
    outputs = {o.name: i for i, o in enumerate(response.outputs)}
    added = np.frombuffer(response.raw_output_contents[outputs["OUTPUT0"]], np.float32)
    np.testing.assert_array_equal(added, np.full(16, 2.0, np.float32))
    assert not response.outputs[0].HasField("contents"), "outputs travel raw only"


def test_async_infer_with_callbacks(client):
    done = threading.Event()
    results = []

    def callback(result, error):
        results.append((result, error))
        if len(results) == 8:
            done.set()

    expected = []
    for _ in range(8):
        a, b, inputs = add_sub_inputs(batch=1)
        expected.append(a + b)
        client.async_infer("add_sub", inputs, callback)
    assert done.wait(30)
    assert all(error is None for _, error in results)
    got = sorted(r.as_numpy("OUTPUT0").tobytes() for r, _ in results)
    assert got == sorted(e.tobytes() for e in expected)


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(agent, client):
    before = client.get_inference_statistics("add_sub").model_stats[0]
    rows = rng.standard_normal((64, 16)).astype(np.float32)

    async def send():
        async with aioclient.InferenceServerClient(agent.address) as aio:
            return await asyncio.gather(*(
                aio.infer("add_sub", [tensor("INPUT0", rows[i:i + 1]),
                                      tensor("INPUT1", rows[i:i + 1])])
                for i in range(64)
            ))

    results = asyncio.run(send())
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * rows[i:i + 1])
    after = client.get_inference_statistics("add_sub").model_stats[0]
    inferences = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    assert inferences == 64
    assert executions < 64, "the batcher merged nothing"


def test_stream_answers_every_request_and_reports_errors_in_band(client):
    answers, errors = {}, {}
    finished = threading.Event()

    def callback(result, error):
        if error is not None:
            errors[len(errors)] = str(error)
        else:
            answers[result.get_response().id] = result
        if len(answers) + len(errors) == 20:
            finished.set()

    client.start_stream(callback)
    sent = {}
    for i in range(20):
        a, b, inputs = add_sub_inputs(batch=1)
        if i == 7:  # a bad request in the middle must not end the stream
            inputs = [tensor("INPUT0", a)]
        sent[str(i)] = a + b
        client.async_stream_infer("add_sub", inputs, request_id=str(i))
    assert finished.wait(30)
    client.stop_stream()
    assert len(errors) == 1 and "missing 'INPUT1'" in errors[0]
    assert set(answers) == set(sent) - {"7"}
    for key, result in answers.items():
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), sent[key])


@pytest.mark.parametrize(
    "case, build, status, words",
    [
        ("unknown model", lambda a, b: ("nope", [tensor("INPUT0", a)]), "NOT_FOUND", "nope"),
        ("missing input", lambda a, b: ("add_sub", [tensor("INPUT0", a)]),
         "INVALID_ARGUMENT", "missing 'INPUT1'"),
        ("unknown input", lambda a, b: ("add_sub", [tensor("INPUT0", a), tensor("INPUT1", b),
                                                    tensor("INPUT9", a)]),
         "INVALID_ARGUMENT", "unexpected inference input 'INPUT9'"),
        ("wrong datatype", lambda a, b: ("add_sub", [tensor("INPUT0", a.astype(np.float64)),
                                                     tensor("INPUT1", b)]),
         "INVALID_ARGUMENT", "data-type is 'FP64'"),
        ("wrong shape", lambda a, b: ("add_sub", [tensor("INPUT0", a[:, :8].copy()),
                                                  tensor("INPUT1", b[:, :8].copy())]),
         "INVALID_ARGUMENT", "got [2,8]"),
        ("batch above max_batch_size", lambda a, b: ("add_sub", [tensor("INPUT0", big),
                                                                 tensor("INPUT1", big)]),
         "INVALID_ARGUMENT", "max_batch_size"),
    ],
)
def test_bad_requests_get_clear_errors_and_are_counted(client, case, build, status, words):
    a = rng.standard_normal((2, 16)).astype(np.float32)
    b = rng.standard_normal((2, 16)).astype(np.float32)
    model, inputs = build(a, b)
    before = client.get_inference_statistics("add_sub").model_stats[0].inference_stats.fail.count
    with pytest.raises(InferenceServerException) as caught:
        client.infer(model, inputs)
    assert caught.value.status() == f"StatusCode.{status}", case
    assert words in caught.value.message(), caught.value.message()
    after = client.get_inference_statistics("add_sub").model_stats[0].inference_stats.fail.count
    assert after == before + (model == "add_sub")
    assert client.is_server_ready(), "the agent must keep serving"


def test_unknown_version_is_not_found(client):
    _, _, inputs = add_sub_inputs()
    assert status_of(lambda: client.infer("add_sub", inputs, model_version="3")) \
        == "StatusCode.NOT_FOUND"


def test_raw_byte_size_mismatch_names_the_input(agent):
    from tiered.protocol import grpc_service_pb2 as pb
    from tiered.protocol import grpc_service_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name="add_sub")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.inputs.add(name="INPUT1", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.extend([b"\0" * 64, b"\0" * 63])
    with grpc.insecure_channel(agent.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'INPUT1'" in caught.value.details() and "got 63" in caught.value.details()


def test_timeout_parameter_expires_in_the_queue(client):
    _, _, inputs = add_sub_inputs()
    assert status_of(lambda: client.infer("add_sub", inputs, timeout=1)) \
        == "StatusCode.DEADLINE_EXCEEDED"
    result = client.infer("add_sub", inputs, timeout=10_000_000, priority=3)
    assert result.as_numpy("OUTPUT0").shape == (2, 16)


def test_full_queue_answers_resource_exhausted_at_once(agent):
    image = rng.standard_normal((1, 3, 96, 96)).astype(np.float32)

    async def burst():
        async with aioclient.InferenceServerClient(agent.address) as aio:
            return await asyncio.gather(
                *(aio.infer("slow", [tensor("input", image)]) for _ in range(24)),
                return_exceptions=True,
            )

    outcomes = asyncio.run(burst())
    refused = [o for o in outcomes if isinstance(o, InferenceServerException)]
    answered = [o for o in outcomes if not isinstance(o, Exception)]
    assert refused and answered, outcomes
    assert {o.status() for o in refused} == {"StatusCode.RESOURCE_EXHAUSTED"}
    assert "max_queue_size 1" in refused[0].message()


def test_statistics_have_triton_shape(client):
    stats = client.get_inference_statistics("add_sub", as_json=True)["model_stats"][0]
    inference = stats["inference_stats"]
    for phase in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert int(inference[phase]["count"]) > 0 and int(inference[phase]["ns"]) > 0, phase
    assert int(stats["inference_count"]) >= int(stats["execution_count"]) > 0
    assert stats["batch_stats"] and all(int(b["batch_size"]) >= 1 for b in stats["batch_stats"])
    everything = client.get_inference_statistics(as_json=True)["model_stats"]
    assert {s["name"] for s in everything} >= {"add_sub", "identity", "mlp", "slow"}


def test_repository_index_lists_models_with_state(client):
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert index["add_sub"].state == "READY" and index["add_sub"].version == "1"


def test_unimplemented_methods_say_so(client):
    assert status_of(client.get_trace_settings) == "StatusCode.UNIMPLEMENTED"
    assert status_of(client.get_log_settings) == "StatusCode.UNIMPLEMENTED"


def test_grpc_health_reports_serving(agent):
    with grpc.insecure_channel(agent.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
