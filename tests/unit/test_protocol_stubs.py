"""The wire contracts: stubs are fresh, Triton-compatible, coexist with
tritonclient in one process, and are described by server reflection."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent import futures
from importlib import metadata
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format
from google.protobuf.descriptor import (
    Descriptor,
    EnumDescriptor,
    FieldDescriptor,
    FileDescriptor,
)
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from tritonclient.grpc import model_config_pb2 as triton_model_config_pb2
from tritonclient.grpc import service_pb2 as triton_service_pb2

from tiered.protocol import descriptors, grpc_service_pb2, grpc_service_pb2_grpc, model_config_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTOCOL_DIR = REPO_ROOT / "tiered" / "protocol"
GENERATED_PATTERNS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")

# The methods the design says we serve; everything else is UNIMPLEMENTED.
SERVED_METHODS = {
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    "ModelStreamInfer",
    "ModelConfig",
    "ModelStatistics",
    "RepositoryIndex",
    "RepositoryModelLoad",
    "RepositoryModelUnload",
    *(f"{memory}SharedMemory{verb}" for memory in ("System", "Cuda")
      for verb in ("Status", "Register", "Unregister")),
}


def _subprocess_env(**extra: str) -> dict[str, str]:
    # Children must import this checkout's `tiered` whether or not it is
    # installed into the virtualenv.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


# ------------------------------------------------------------ stale stubs


def test_committed_stubs_match_generator_output(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "proto" / "generate.py"), "--out", str(tmp_path)],
        check=False,
        cwd=REPO_ROOT,
        env=_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    def generated(directory: Path) -> set[str]:
        return {p.name for pattern in GENERATED_PATTERNS for p in directory.glob(pattern)}

    hint = (
        "Generated stubs in tiered/protocol/ are stale: run `make proto` and commit the result "
        f"(grpcio-tools here: {metadata.version('grpcio-tools')}; pyproject pins the one used)."
    )
    fresh = generated(tmp_path)
    assert fresh, "generator wrote nothing"
    assert generated(PROTOCOL_DIR) == fresh, hint
    for name in sorted(fresh):
        committed = (PROTOCOL_DIR / name).read_bytes()
        assert committed == (tmp_path / name).read_bytes(), f"{name}: {hint}"


# ----------------------------------------------------- wire compatibility

TRITON_POOL = triton_service_pb2.DESCRIPTOR.pool
OUR_FILES: tuple[FileDescriptor, ...] = (model_config_pb2.DESCRIPTOR, grpc_service_pb2.DESCRIPTOR)


def _messages(container: FileDescriptor | Descriptor) -> Iterator[Descriptor]:
    top = (
        container.message_types_by_name.values()
        if isinstance(container, FileDescriptor)
        else container.nested_types
    )
    for message in top:
        yield message
        yield from _messages(message)


def _enums(file: FileDescriptor) -> Iterator[EnumDescriptor]:
    yield from file.enum_types_by_name.values()
    for message in _messages(file):
        yield from message.enum_types


def _type_name(field: FieldDescriptor) -> str | None:
    if field.message_type is not None:
        return field.message_type.full_name
    if field.enum_type is not None:
        return field.enum_type.full_name
    return None


def _field_facts(field: FieldDescriptor) -> dict[str, object]:
    oneof = field.containing_oneof
    return {
        "name": field.name,
        "number": field.number,
        "type": field.type,
        "repeated": field.is_repeated,
        "type_name": _type_name(field),
        "oneof": oneof.name if oneof is not None else None,
        "has_presence": field.has_presence,
    }


def test_our_descriptors_live_in_the_private_pool() -> None:
    for file in OUR_FILES:
        assert file.pool is descriptors.POOL
        assert file.package == "inference"
    assert grpc_service_pb2.ModelInferRequest.__module__ == "tiered.protocol.grpc_service_pb2"


@pytest.mark.parametrize("file", OUR_FILES, ids=lambda f: f.name)
def test_every_message_field_matches_triton(file: FileDescriptor) -> None:
    messages = list(_messages(file))
    assert messages
    for ours in messages:
        theirs = TRITON_POOL.FindMessageTypeByName(ours.full_name)  # KeyError: no counterpart
        assert ours.GetOptions().map_entry == theirs.GetOptions().map_entry, ours.full_name
        for field in ours.fields:
            assert field.name in theirs.fields_by_name, f"{field.full_name} not in Triton's"
            counterpart = theirs.fields_by_name[field.name]
            assert _field_facts(field) == _field_facts(counterpart), field.full_name
        for oneof in ours.oneofs:
            assert oneof.name in theirs.oneofs_by_name, f"{ours.full_name}.{oneof.name}"


def test_every_enum_matches_triton() -> None:
    enums = [enum for file in OUR_FILES for enum in _enums(file)]
    assert enums
    for ours in enums:
        theirs = TRITON_POOL.FindEnumTypeByName(ours.full_name)
        # We carry every value of each enum we define, not a subset: a value we
        # lacked would read back as a bare number.
        assert {v.name: v.number for v in ours.values} == {
            v.name: v.number for v in theirs.values
        }, ours.full_name


def test_messages_of_served_methods_are_complete() -> None:
    # Everything in grpc_service.proto belongs to a served method and must
    # carry all of Triton's fields (model_config.proto is a deliberate subset).
    for ours in _messages(grpc_service_pb2.DESCRIPTOR):
        theirs = TRITON_POOL.FindMessageTypeByName(ours.full_name)
        assert set(ours.fields_by_number) == set(theirs.fields_by_number), ours.full_name


def test_service_methods_match_triton() -> None:
    ours = descriptors.POOL.FindServiceByName(descriptors.INFERENCE_SERVICE)
    theirs = TRITON_POOL.FindServiceByName(descriptors.INFERENCE_SERVICE)
    assert {m.name for m in ours.methods} == SERVED_METHODS
    for method in ours.methods:
        counterpart = theirs.methods_by_name[method.name]
        assert method.input_type.full_name == counterpart.input_type.full_name
        assert method.output_type.full_name == counterpart.output_type.full_name
        assert method.client_streaming == counterpart.client_streaming, method.name
        assert method.server_streaming == counterpart.server_streaming, method.name
    stream = ours.methods_by_name["ModelStreamInfer"]
    assert stream.client_streaming and stream.server_streaming


# ------------------------------------------------------------ coexistence


def _full_request() -> grpc_service_pb2.ModelInferRequest:
    request = grpc_service_pb2.ModelInferRequest(model_name="resnet", model_version="2", id="r-1")
    request.parameters["tiered-tier"].string_param = "edge"
    request.parameters["tiered-slo-ms"].double_param = 12.5
    request.parameters["priority"].int64_param = -3
    request.parameters["sequence_id"].uint64_param = 2**64 - 1
    request.parameters["binary_data_output"].bool_param = True
    raw = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 2])
    raw.parameters["binary_data_size"].int64_param = 8
    typed = request.inputs.add(name="INPUT1", datatype="BYTES", shape=[2])
    typed.contents.bytes_contents.extend([b"a", b"\x00\xff"])
    out = request.outputs.add(name="OUTPUT0")
    out.parameters["classification"].int64_param = 3
    request.raw_input_contents.append(b"\x00\x00\x80\x3f\x00\x00\x00\x40")
    return request


def test_request_round_trips_through_tritonclient_classes() -> None:
    ours = _full_request()
    theirs = triton_service_pb2.ModelInferRequest.FromString(ours.SerializeToString())
    assert json_format.MessageToDict(theirs) == json_format.MessageToDict(ours)
    assert theirs.parameters["sequence_id"].uint64_param == 2**64 - 1
    kinds = {k: v.WhichOneof("parameter_choice") for k, v in theirs.parameters.items()}
    assert kinds == {
        "tiered-tier": "string_param",
        "tiered-slo-ms": "double_param",
        "priority": "int64_param",
        "sequence_id": "uint64_param",
        "binary_data_output": "bool_param",
    }
    assert list(theirs.raw_input_contents) == list(ours.raw_input_contents)
    assert list(theirs.inputs[1].contents.bytes_contents) == [b"a", b"\x00\xff"]
    back = grpc_service_pb2.ModelInferRequest.FromString(theirs.SerializeToString())
    assert back == ours


def test_config_and_statistics_round_trip_through_tritonclient_classes() -> None:
    config = model_config_pb2.ModelConfig(name="m", backend="onnxruntime", max_batch_size=8)
    config.input.add(name="x", data_type=model_config_pb2.TYPE_FP32, dims=[3, -1])
    config.output.add(name="y", data_type=model_config_pb2.TYPE_STRING, dims=[10])
    config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_CPU, count=2)
    config.version_policy.latest.num_versions = 1
    config.dynamic_batching.preferred_batch_size.extend([4, 8])
    config.dynamic_batching.priority_queue_policy[1].timeout_action = (
        model_config_pb2.ModelQueuePolicy.DELAY
    )
    config.parameters["intra_op_threads"].string_value = "2"
    response = grpc_service_pb2.ModelConfigResponse(config=config)
    theirs = triton_service_pb2.ModelConfigResponse.FromString(response.SerializeToString())
    assert theirs.config.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert theirs.config.version_policy.WhichOneof("policy_choice") == "latest"
    assert theirs.config.output[0].data_type == triton_model_config_pb2.TYPE_STRING
    assert json_format.MessageToDict(theirs) == json_format.MessageToDict(response)

    stats = grpc_service_pb2.ModelStatisticsResponse()
    entry = stats.model_stats.add(name="m", version="1", inference_count=5, execution_count=2)
    entry.inference_stats.queue.count = 5
    entry.batch_stats.add(batch_size=4).compute_infer.ns = 1000
    entry.response_stats["0"].success.count = 5
    theirs_stats = triton_service_pb2.ModelStatisticsResponse.FromString(stats.SerializeToString())
    assert json_format.MessageToDict(theirs_stats) == json_format.MessageToDict(stats)


_REVERSE_ORDER_SCRIPT = textwrap.dedent(
    """
    import sys
    from google.protobuf import descriptor_pool
    if sys.argv[1] == "ours-first":
        from tiered.protocol import grpc_service_pb2 as ours
        # Nothing of ours leaked into the process-wide pool.
        for name in ("grpc_service.proto", "model_config.proto"):
            try:
                descriptor_pool.Default().FindFileByName(name)
            except KeyError:
                pass
            else:
                raise SystemExit(name + " found in the default pool")
        from tritonclient.grpc import service_pb2 as theirs
    else:
        from tritonclient.grpc import service_pb2 as theirs
        from tiered.protocol import grpc_service_pb2 as ours
    request = ours.ModelInferRequest(model_name="m", raw_input_contents=[b"abc"])
    request.parameters["k"].uint64_param = 7
    request.inputs.add(name="x", datatype="UINT8", shape=[3])
    parsed = theirs.ModelInferRequest.FromString(request.SerializeToString())
    assert parsed.parameters["k"].uint64_param == 7 and parsed.inputs[0].shape == [3]
    assert ours.ModelInferRequest.FromString(parsed.SerializeToString()) == request
    # tritonclient's own classes are still tritonclient's.
    assert "max_batch_size" in theirs.ModelConfigResponse().config.DESCRIPTOR.fields_by_name
    assert "optimization" in theirs.ModelConfigResponse().config.DESCRIPTOR.fields_by_name
    print("ok")
    """
)


@pytest.mark.parametrize("backend", ["upb", "python"])
@pytest.mark.parametrize("order", ["ours-first", "theirs-first"])
def test_import_order_and_backend_do_not_matter(order: str, backend: str) -> None:
    # A fresh interpreter per case: import order is process state.
    result = subprocess.run(
        [sys.executable, "-c", _REVERSE_ORDER_SCRIPT, order],
        check=False,
        cwd=REPO_ROOT,
        env=_subprocess_env(PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=backend),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# ------------------------------------------------------------- reflection


class _LiveOnly(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers ServerLive; every other served method keeps the generated
    base class's UNIMPLEMENTED."""

    def ServerLive(
        self, request: grpc_service_pb2.ServerLiveRequest, context: grpc.ServicerContext
    ) -> grpc_service_pb2.ServerLiveResponse:
        return grpc_service_pb2.ServerLiveResponse(live=True)


@pytest.fixture(scope="module")
def server_address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_LiveOnly(), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        descriptors.reflection_service_names(), server, pool=descriptors.reflection_pool()
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def _reflect(
    address: str, requests: list[reflection_pb2.ServerReflectionRequest]
) -> list[reflection_pb2.ServerReflectionResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        return list(stub.ServerReflectionInfo(iter(requests), timeout=5))


def _pool_from(response: reflection_pb2.ServerReflectionResponse) -> descriptor_pool.DescriptorPool:
    assert response.HasField("file_descriptor_response"), response
    files = {}
    for blob in response.file_descriptor_response.file_descriptor_proto:
        proto = descriptor_pb2.FileDescriptorProto.FromString(blob)
        files[proto.name] = proto
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(name: str) -> None:  # dependencies first
        if name in added:
            return
        for dependency in files[name].dependency:
            add(dependency)
        pool.Add(files[name])
        added.add(name)

    for name in files:
        add(name)
    return pool


def test_reflection_describes_inference_and_health(server_address: str) -> None:
    listed, inference, health_file = _reflect(
        server_address,
        [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol=descriptors.INFERENCE_SERVICE
            ),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=health.SERVICE_NAME),
        ],
    )
    names = {s.name for s in listed.list_services_response.service}
    assert names == {descriptors.INFERENCE_SERVICE, descriptors.TELEMETRY_SERVICE,
                     health.SERVICE_NAME, reflection.SERVICE_NAME}

    # A client rebuilds the service from what reflection sent (the file and
    # its import model_config.proto) and sees what tritonclient would.
    service = _pool_from(inference).FindServiceByName(descriptors.INFERENCE_SERVICE)
    assert {m.name for m in service.methods} == SERVED_METHODS
    config = service.methods_by_name["ModelConfig"].output_type.fields_by_name["config"]
    assert config.message_type.full_name == "inference.ModelConfig"

    check = _pool_from(health_file).FindServiceByName(health.SERVICE_NAME)
    assert "Check" in check.methods_by_name


def test_reflection_describes_itself(server_address: str) -> None:
    (response,) = _reflect(
        server_address,
        [reflection_pb2.ServerReflectionRequest(file_containing_symbol=reflection.SERVICE_NAME)],
    )
    assert _pool_from(response).FindServiceByName(reflection.SERVICE_NAME)


def test_reflection_pool_is_idempotent() -> None:
    assert descriptors.reflection_pool() is descriptors.reflection_pool() is descriptors.POOL


def test_tritonclient_talks_to_the_generated_servicer(server_address: str) -> None:
    import tritonclient.grpc as triton_grpc

    client = triton_grpc.InferenceServerClient(server_address)
    try:
        assert client.is_server_live()
    finally:
        client.close()


def test_omitted_triton_methods_are_unimplemented(server_address: str) -> None:
    with grpc.insecure_channel(server_address) as channel:
        for method in ("SystemSharedMemoryStatus", "CudaSharedMemoryRegister", "LogSettings"):
            call = channel.unary_unary(f"/{descriptors.INFERENCE_SERVICE}/{method}")
            with pytest.raises(grpc.RpcError) as caught:
                call(b"", timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED, method


def test_health_check_serves(server_address: str) -> None:
    with grpc.insecure_channel(server_address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
