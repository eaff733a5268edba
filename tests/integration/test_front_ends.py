"""An agent whose gRPC front ends are separate processes feeding one engine
process: connections spread over them, batches form across them, a dead one
is replaced, shutdown drains them, and credentials are checked where the
client is seen. (The whole v2 protocol and shared-memory suites also run
against such an agent: `test_agent_protocol.py`, `test_shared_memory.py`.)
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.utils.shared_memory as shm
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import children, frames_fed, sigterm_with_calls_in_flight
from tiered.agent.repository import model_file, write_config
from tiered.local.processes import AgentError, AgentProcess, RouterProcess
from tiered.models import zoo
from tiered.protocol import grpc_service_pb2 as pb

rng = np.random.default_rng(7)


def sockets(pid: int) -> int:
    """Open sockets of process `pid`: each connection it accepted adds one."""
    return sum(os.readlink(fd).startswith("socket:") for fd in Path(f"/proc/{pid}/fd").iterdir())


def add_sub(rows: np.ndarray):
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        item = grpcclient.InferInput(name, list(rows.shape), "FP32")
        item.set_data_from_numpy(rows)
        inputs.append(item)
    return inputs


def add_sub_in_region(name: str, a: np.ndarray, output_bytes: int):
    """add_sub's inputs and outputs for rows `a`, all in region `name`, laid
    out [INPUT0, INPUT1, OUTPUT0, OUTPUT1] (`output_bytes` named for each output)."""
    inputs, outputs = [], []
    for slot, tensor in enumerate(("INPUT0", "INPUT1")):
        inputs.append(aioclient.InferInput(tensor, list(a.shape), "FP32"))
        inputs[-1].set_shared_memory(name, a.nbytes, offset=slot * a.nbytes)
    for slot, tensor in enumerate(("OUTPUT0", "OUTPUT1"), start=2):
        outputs.append(aioclient.InferRequestedOutput(tensor))
        outputs[-1].set_shared_memory(name, output_bytes, offset=slot * a.nbytes)
    return inputs, outputs


TOO_SMALL = 5  # of those requests, the one whose output ranges are 4 bytes short


def answered_in_region(index: int, a: np.ndarray, name: str, answer) -> bool:
    """The answer to request `index` (rows `a`, outputs asked for in region
    `name`): the output named there with no bytes on the wire; or, for the
    one whose ranges were too small, its own error (False: nothing written)."""
    if index == TOO_SMALL:
        assert isinstance(answer, InferenceServerException), answer
        assert f"the output has {a.nbytes} bytes, more than the {a.nbytes - 4}" \
            in str(answer), answer
        return False
    assert not isinstance(answer, Exception), answer
    assert answer.get_output("OUTPUT0").parameters["shared_memory_region"].string_param == name
    assert answer.get_response().raw_output_contents[0] == b""  # no bytes on the wire
    return True


def test_connections_spread_over_front_ends_and_batch_together(agent_with_front_ends):
    agent = agent_with_front_ends
    front_ends = children(agent.pid)
    assert len(front_ends) == 2, front_ends
    idle = {pid: sockets(pid) for pid in front_ends}
    rows = rng.standard_normal((64, 16)).astype(np.float32)
    with grpcclient.InferenceServerClient(agent.address) as client:
        before = client.get_inference_statistics("add_sub").model_stats[0]

    async def send():
        # A connection each (channels in one process share one by default).
        clients = [aioclient.InferenceServerClient(
            agent.address, channel_args=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(16)]
        try:
            results = await asyncio.gather(*(
                clients[i % 16].infer("add_sub", add_sub(rows[i:i + 1]))
                for i in range(64)))
            spread = {pid: sockets(pid) - idle[pid] for pid in front_ends}
            return results, spread
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    results, spread = asyncio.run(send())
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * rows[i:i + 1])
    assert all(count >= 1 for count in spread.values()), spread  # each took connections
    with grpcclient.InferenceServerClient(agent.address) as client:
        after = client.get_inference_statistics("add_sub").model_stats[0]
    assert after.inference_count - before.inference_count == 64  # one engine counts all
    assert after.execution_count - before.execution_count < 64, "nothing was merged"


def test_a_router_reaches_every_front_end(agent_with_front_ends, tmp_path):
    """A router's calls to an agent take turns over connections of their own,
    which the kernel spreads over the front ends as it does any client's:
    each front end holds some of them (24 connections all on one of two
    front ends would come once in 8 million runs)."""
    agent = agent_with_front_ends
    front_ends = children(agent.pid)
    idle = {pid: sockets(pid) for pid in front_ends}
    table = tmp_path / "routing.json"
    table.write_text(json.dumps({"version": 1, "models": {"add_sub": {"tiers": {
        "edge": {"agents": [agent.address]}}}}}))
    rows = rng.standard_normal((32, 16)).astype(np.float32)
    with RouterProcess(table, metrics_port=None, http_port=None,
                       extra_args=["--agent-connections", "24"]) as router, \
            grpcclient.InferenceServerClient(router.address) as client:
        for i in range(len(rows)):
            result = client.infer("add_sub", add_sub(rows[i:i + 1]))
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * rows[i:i + 1])
        spread = {pid: sockets(pid) - idle[pid] for pid in front_ends}
    assert sum(spread.values()) >= 24, spread  # the router's, and its health checks'
    assert all(count >= 1 for count in spread.values()), spread


def test_requests_merged_in_a_front_end_each_get_their_rows_and_bad_ones_their_own_error(
        agent_with_front_ends):
    """Requests sent at once on one connection reach one front end, which
    merges the plain ones into frames; each answer is its own rows, and a bad
    request next to them fails alone with the error it would get anyway."""
    good = [rng.standard_normal((rows, 16)).astype(np.float32) for rows in (1, 3, 2, 1, 1, 4)]

    def request(client, a: np.ndarray, b: np.ndarray, datatype: str = "FP32", only=None):
        inputs = []
        for name, data in (("INPUT0", a), ("INPUT1", b)):
            item = aioclient.InferInput(name, list(data.shape), datatype)
            item.set_data_from_numpy(data)
            inputs.append(item)
        outputs = None if only is None else [aioclient.InferRequestedOutput(only)]
        return client.infer("add_sub", inputs, outputs=outputs)

    async def send():
        async with aioclient.InferenceServerClient(agent_with_front_ends.address) as client:
            before = await client.get_inference_statistics("add_sub")
            wide = rng.standard_normal((1, 15)).astype(np.float32)
            big = rng.standard_normal((9, 16)).astype(np.float32)
            double = good[0].astype(np.float64)
            outcomes = await asyncio.gather(
                *(request(client, a, 2 * a, only="OUTPUT1" if i == 3 else None)
                  for i, a in enumerate(good)),
                request(client, wide, wide), request(client, big, big),
                request(client, double, double, "FP64"), return_exceptions=True)
            after = await client.get_inference_statistics("add_sub")
            return outcomes, before.model_stats[0], after.model_stats[0]

    outcomes, before, after = asyncio.run(send())
    for i, (a, answer) in enumerate(zip(good, outcomes)):
        assert not isinstance(answer, Exception), answer
        np.testing.assert_allclose(answer.as_numpy("OUTPUT1"), -a, rtol=1e-6)
        if i == 3:
            assert answer.as_numpy("OUTPUT0") is None  # not asked for
        else:
            np.testing.assert_allclose(answer.as_numpy("OUTPUT0"), 3 * a, rtol=1e-6)
    wide, big, double = (str(o) for o in outcomes[len(good):])
    assert "input 'INPUT0' for model 'add_sub'. Expected [-1,16], got [1,15]" in wide
    assert "batch-size must be <= 8 for 'add_sub'" in big
    assert "data-type is 'FP64', but model 'add_sub' expects 'FP32'" in double
    stats = (after.inference_stats, before.inference_stats)
    assert stats[0].success.count - stats[1].success.count == len(good)
    assert stats[0].fail.count - stats[1].fail.count == 3
    assert after.inference_count - before.inference_count == sum(len(a) for a in good)


def test_requests_in_shared_memory_merge_and_the_front_end_writes_their_outputs(
        agent_with_front_ends):
    """Requests whose inputs and outputs all lie in system shared memory
    merge in a front end like plain ones; each output lands in its own
    region, answered as the engine answers it (the region named, no bytes),
    and one whose output range is too small fails alone."""
    count, handles = 24, []
    rows = [rng.standard_normal((1 + i % 3, 16)).astype(np.float32) for i in range(count)]

    def request(index: int, a: np.ndarray, output_bytes: int):
        name = f"tiered-fe-{os.getpid()}-{index}"
        handle = shm.create_shared_memory_region(name, f"/{name}", 4 * a.nbytes)
        handles.append(handle)
        shm.set_shared_memory_region(handle, [a, 2 * a])
        return name, handle, *add_sub_in_region(name, a, output_bytes)

    async def send():
        async with aioclient.InferenceServerClient(agent_with_front_ends.address) as client:
            made = [request(i, a, a.nbytes - (4 if i == TOO_SMALL else 0))
                    for i, a in enumerate(rows)]
            for (name, _, _, _), a in zip(made, rows):
                await client.register_system_shared_memory(name, f"/{name}", 4 * a.nbytes)
            before = frames_fed(agent_with_front_ends)
            outcomes = await asyncio.gather(
                *(client.infer("add_sub", inputs, outputs=outputs)
                  for _, _, inputs, outputs in made), return_exceptions=True)
            after = frames_fed(agent_with_front_ends)
            await client.unregister_system_shared_memory()
            return made, outcomes, before, after

    try:
        made, outcomes, before, after = asyncio.run(send())
        for i, (a, (name, handle, _, _), answer) in enumerate(zip(rows, made, outcomes)):
            if not answered_in_region(i, a, name, answer):
                continue
            total, difference = (shm.get_contents_as_numpy(handle, np.float32, a.shape,
                                                           offset=slot * a.nbytes)
                                 for slot in (2, 3))
            np.testing.assert_allclose(total, 3 * a, rtol=1e-6)
            np.testing.assert_allclose(difference, -a, rtol=1e-6)
    finally:
        for handle in handles:
            shm.destroy_shared_memory_region(handle)
    # Every one took the front end's path: none was handed to the engine whole.
    assert {kind: after[kind] - before[kind] for kind in after} == \
        {"batch": count, "single": 0, "stream": 0}, (before, after)


def test_a_request_flagged_as_perf_analyzer_flags_it_takes_the_batch_path(agent_with_front_ends):
    """perf_analyzer asks every request for an empty final response, a flag
    that only decoupled models read: such requests still merge in the front
    end, and each gets its own answer."""
    rows = rng.standard_normal((4, 16)).astype(np.float32)

    def request(row: np.ndarray) -> pb.ModelInferRequest:
        message = pb.ModelInferRequest(model_name="add_sub")
        message.parameters["triton_enable_empty_final_response"].bool_param = True
        for name in ("INPUT0", "INPUT1"):
            message.inputs.add(name=name, datatype="FP32", shape=[1, 16])
            message.raw_input_contents.append(row[None].tobytes())
        return message

    before = frames_fed(agent_with_front_ends)
    with grpc.insecure_channel(agent_with_front_ends.address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelInferResponse.FromString)
        answers = [infer(request(row), timeout=30) for row in rows]
    after = frames_fed(agent_with_front_ends)
    for row, answer in zip(rows, answers):
        total = np.frombuffer(answer.raw_output_contents[0], np.float32)
        np.testing.assert_allclose(total, 2 * row, rtol=1e-6)
    assert {kind: after[kind] - before[kind] for kind in after} == \
        {"batch": len(rows), "single": 0, "stream": 0}, (before, after)


@pytest.fixture
def slow_repository(tmp_path) -> Path:
    zoo.resnet18(model_file(tmp_path, "slow", 1), image_size=64, num_classes=10)
    write_config(tmp_path, "slow", {"max_batch_size": 1, "max_queue_size": 128})
    zoo.identity(model_file(tmp_path, "identity", 1), ["FP32"])
    write_config(tmp_path, "identity", {"max_batch_size": 4})
    return tmp_path


@pytest.mark.parametrize("front_ends", [0, 2], ids=["one process", "front ends"])
def test_shutdown_drains_calls_in_flight_and_leaves_nothing_behind(slow_repository, front_ends):
    """Every call sent before SIGTERM is answered, however many wait unread in
    gRPC's queue (run it beside a busy loop to see them pile up), and the
    agent leaves no process and no socket behind."""
    agent = AgentProcess("edge", slow_repository,
                         extra_args=["--front-ends", str(front_ends)]).start()
    processes = children(agent.pid)
    assert len(processes) == front_ends, processes
    private = Path(re.search(r"private sockets in (\S+)", agent.log()).group(1))
    assert (private / "grpc.sock").exists()
    image = grpcclient.InferInput("input", [1, 3, 64, 64], "FP32")
    image.set_data_from_numpy(rng.standard_normal((1, 3, 64, 64)).astype(np.float32))

    in_flight, outcomes, code = sigterm_with_calls_in_flight(agent, "slow", [image])
    assert in_flight > 0, "every call was answered before the signal: nothing was drained"
    failed = [str(o) for o in outcomes if isinstance(o, Exception)]
    assert not failed, f"{len(failed)} of {in_flight} calls in flight failed: {failed[:3]}"
    assert code == 0, agent.log_tail()
    assert not any(Path(f"/proc/{pid}").exists() for pid in processes)
    assert not private.exists()
    assert "starting another" not in agent.log()  # stopped front ends are not replaced


def test_a_dead_front_end_is_replaced(slow_repository):
    with AgentProcess("edge", slow_repository, extra_args=["--front-ends", "2"]) as agent:
        first = children(agent.pid)
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = children(agent.pid)
            if len(now) == 2 and victim not in now:
                break
            time.sleep(0.2)
        assert len(now) == 2 and victim not in now, (first, now, agent.log_tail())
        assert "exited with code -9; starting another" in agent.log()
        for _ in range(12):  # new connections, spread over both again
            with grpcclient.InferenceServerClient(agent.address) as client:
                item = grpcclient.InferInput("in_FP32", [1, 3], "FP32")
                item.set_data_from_numpy(np.ones((1, 3), np.float32))
                out = client.infer("identity", [item]).as_numpy("out_FP32")
                np.testing.assert_array_equal(out, np.ones((1, 3), np.float32))


def test_a_request_larger_than_the_arena_travels_inline(slow_repository, tmp_path):
    profile = tmp_path / "edge.yaml"
    profile.write_text("tier: edge\nlimits:\n  front_end_arena_mib: 1\n")
    with AgentProcess("edge", slow_repository,
                      extra_args=["--profile", str(profile), "--front-ends", "1"]) as agent:
        assert "1 front-end processes" in agent.log()
        with grpcclient.InferenceServerClient(agent.address) as client:
            for columns in (1000, 600_000):  # 4 kB: in the arena; 2.4 MB: inline
                data = rng.standard_normal((1, columns)).astype(np.float32)
                item = grpcclient.InferInput("in_FP32", list(data.shape), "FP32")
                item.set_data_from_numpy(data)
                out = client.infer("identity", [item]).as_numpy("out_FP32")
                np.testing.assert_array_equal(out, data)


def test_a_taken_port_is_refused(agent_with_front_ends, slow_repository):
    port = int(agent_with_front_ends.address.rsplit(":", 1)[1])
    second = AgentProcess("edge", slow_repository, port=port,
                          extra_args=["--front-ends", "2"])
    with pytest.raises(AgentError):
        second.start(timeout_s=60)
    assert second.stop() == 2
    assert f"cannot listen on 127.0.0.1:{port}" in second.log()


def test_the_front_end_checks_credentials(slow_repository, tmp_path):
    tokens = tmp_path / "admin.tokens"
    tokens.write_text("sesame\n")
    inference = tmp_path / "inference.tokens"
    inference.write_text("open-up\n")
    with AgentProcess("edge", slow_repository, admin_token_file=tokens,
                      extra_args=["--front-ends", "1", "--inference-token-file",
                                  str(inference)]) as agent:
        with grpcclient.InferenceServerClient(agent.address) as client:
            item = grpcclient.InferInput("in_FP32", [1, 2], "FP32")
            item.set_data_from_numpy(np.ones((1, 2), np.float32))
            for call in (lambda: client.load_model("identity"),
                         lambda: client.infer("identity", [item])):
                with pytest.raises(InferenceServerException) as caught:
                    call()
                assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
            client.load_model("identity", headers={"authorization": "Bearer sesame"})
            answer = client.infer("identity", [item],
                                  headers={"authorization": "Bearer open-up"})
            np.testing.assert_array_equal(answer.as_numpy("out_FP32"), np.ones((1, 2)))


def test_streaming_calls_pass_through_to_the_engine_process(agent_with_front_ends):
    with grpc.insecure_channel(agent_with_front_ends.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING  # unary-stream
        watch.cancel()
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        (answer,) = reflection.ServerReflectionInfo(  # stream-stream
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        listed = {s.name for s in answer.list_services_response.service}
        assert {"inference.GRPCInferenceService", "tiered.v1.Telemetry"} <= listed
