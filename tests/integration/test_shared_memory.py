"""Triton's system shared-memory extension on a real agent, driven by the
real tritonclient and its `tritonclient.utils.shared_memory` helpers, as a
Triton user on the same host drives it; the router refuses region
references it could not honour.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.conftest import EITHER_AGENT, either_agent  # noqa: E402
from tiered.agent.shared_memory import MAX_REGIONS_PER_CALLER  # noqa: E402
from tiered.local.processes import AgentProcess, RouterProcess  # noqa: E402

BYTES = 16 * 4  # one FP32 [1, 16] tensor



@pytest.fixture(scope="module", params=EITHER_AGENT)
def agent(request):
    return either_agent(request)

@pytest.fixture
def regions():
    """Shared-memory objects made by the client, destroyed afterwards."""
    made = []

    def make(byte_size: int = 2 * BYTES):
        name = f"tiered-test-{uuid.uuid4().hex[:8]}"
        handle = shm.create_shared_memory_region(name, f"/{name}", byte_size)
        made.append(handle)
        return name, handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def status_code(caught) -> str:
    return caught.value.status()


def add_sub_from_region(client, name: str) -> np.ndarray:
    """add_sub's OUTPUT0 for INPUT0 and INPUT1 read one after the other from region `name`."""
    inputs = []
    for index, input_name in enumerate(("INPUT0", "INPUT1")):
        tensor = grpcclient.InferInput(input_name, [1, 16], "FP32")
        tensor.set_shared_memory(name, BYTES, offset=index * BYTES)
        inputs.append(tensor)
    return client.infer("add_sub", inputs).as_numpy("OUTPUT0")


def add_sub_request(client, regions, offset: int = 0):
    """INPUT0 and OUTPUT0 in shared memory, INPUT1 and OUTPUT1 on the wire."""
    a, b = np.arange(16, dtype=np.float32)[None], np.full((1, 16), 2, np.float32)
    inputs_name, inputs = regions(offset + BYTES)
    outputs_name, outputs = regions(BYTES)
    shm.set_shared_memory_region(inputs, [a], offset=offset)
    client.register_system_shared_memory(inputs_name, f"/{inputs_name}", offset + BYTES)
    client.register_system_shared_memory(outputs_name, f"/{outputs_name}", BYTES)
    first = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    first.set_shared_memory(inputs_name, BYTES, offset=offset)
    second = grpcclient.InferInput("INPUT1", [1, 16], "FP32")
    second.set_data_from_numpy(b)
    total = grpcclient.InferRequestedOutput("OUTPUT0")
    total.set_shared_memory(outputs_name, BYTES)
    return (a, b), [first, second], [total, grpcclient.InferRequestedOutput("OUTPUT1")], \
        outputs, outputs_name


def test_inputs_and_outputs_in_shared_memory_beside_tensors_on_the_wire(agent, regions):
    with grpcclient.InferenceServerClient(agent.address) as client:
        assert "system_shared_memory" in client.get_server_metadata().extensions
        (a, b), inputs, outputs, out_region, out_name = add_sub_request(client, regions,
                                                                         offset=BYTES)
        result = client.infer("add_sub", inputs, outputs=outputs)
        answer = result.get_output("OUTPUT0")
        assert answer.parameters["shared_memory_region"].string_param == out_name
        written = shm.get_contents_as_numpy(out_region, np.float32, list(answer.shape))
        np.testing.assert_array_equal(written, a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)  # on the wire
        client.unregister_system_shared_memory()


def test_status_register_and_unregister(agent, regions):
    with grpcclient.InferenceServerClient(agent.address) as client:
        client.unregister_system_shared_memory()
        first, _ = regions()
        second, _ = regions()
        client.register_system_shared_memory(first, f"/{first}", BYTES, offset=BYTES)
        client.register_system_shared_memory(second, f"/{second}", 2 * BYTES)
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert status[first] == {"name": first, "key": f"/{first}", "offset": str(BYTES),
                                 "byte_size": str(BYTES)}
        assert set(status) == {first, second}
        with pytest.raises(InferenceServerException) as caught:
            client.register_system_shared_memory(first, f"/{second}", BYTES)
        assert status_code(caught) == "StatusCode.ALREADY_EXISTS"
        client.unregister_system_shared_memory(first)
        assert set(client.get_system_shared_memory_status(as_json=True)["regions"]) == {second}
        with pytest.raises(InferenceServerException) as caught:
            client.get_system_shared_memory_status(first)
        assert status_code(caught) == "StatusCode.NOT_FOUND"
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}


@pytest.mark.parametrize("key, byte_size, why", [
    ("/../../etc/passwd", BYTES, "directly under /dev/shm"),
    ("/nested/name", BYTES, "directly under /dev/shm"),
    ("/tiered-test-no-such-object", BYTES, "no shared-memory object"),
    ("REGION", 4 * BYTES, "beyond its"),  # larger than the object
    ("REGION", 0, "byte_size must be > 0"),
])
def test_registration_checks_the_key_and_the_size(agent, regions, key, byte_size, why):
    name, _ = regions()
    with grpcclient.InferenceServerClient(agent.address) as client, \
            pytest.raises(InferenceServerException) as caught:
        client.register_system_shared_memory("r", key.replace("REGION", name), byte_size)
    assert status_code(caught) in ("StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND")
    assert why in caught.value.message()


def test_a_range_outside_its_region_or_an_unknown_region_is_refused(agent, regions):
    with grpcclient.InferenceServerClient(agent.address) as client:
        name, _ = regions()
        client.register_system_shared_memory(name, f"/{name}", 2 * BYTES)
        for region, size, offset, why in ((name, BYTES, 2 * BYTES, "outside region"),
                                          (name, BYTES // 2, 0, "expected 64 bytes"),
                                          ("never-registered", BYTES, 0, "is registered")):
            tensor = grpcclient.InferInput("input", [1, 16], "FP32")
            tensor.set_shared_memory(region, size, offset=offset)
            with pytest.raises(InferenceServerException) as caught:
                client.infer("mlp", [tensor])
            assert status_code(caught) == "StatusCode.INVALID_ARGUMENT"
            assert why in caught.value.message()
        tensor = grpcclient.InferInput("input", [1, 16], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
        assert client.infer("mlp", [tensor]).as_numpy("probabilities").shape == (1, 4)
        client.unregister_system_shared_memory()


def test_inputs_are_read_from_a_region_as_it_is_now_and_from_the_region_now_registered(
        agent, regions):
    """Every input in shared memory (with front ends, read there): new
    contents are seen at once, and a name registered again for another
    object is read from that object."""
    with grpcclient.InferenceServerClient(agent.address) as client:
        client.unregister_system_shared_memory()
        first, first_handle = regions()
        second, second_handle = regions()
        a, b = np.arange(16, dtype=np.float32)[None], np.full((1, 16), 2, np.float32)
        shm.set_shared_memory_region(first_handle, [a, b])
        shm.set_shared_memory_region(second_handle, [10 * a, b])
        client.register_system_shared_memory("inputs", f"/{first}", 2 * BYTES)
        np.testing.assert_array_equal(add_sub_from_region(client, "inputs"), a + b)
        shm.set_shared_memory_region(first_handle, [3 * a])
        np.testing.assert_array_equal(add_sub_from_region(client, "inputs"), 3 * a + b)
        client.unregister_system_shared_memory("inputs")
        client.register_system_shared_memory("inputs", f"/{second}", 2 * BYTES)
        np.testing.assert_array_equal(add_sub_from_region(client, "inputs"), 10 * a + b)
        client.unregister_system_shared_memory()
        with pytest.raises(InferenceServerException) as caught:
            add_sub_from_region(client, "inputs")
        assert "no shared-memory region 'inputs' is registered" in caught.value.message()


def test_a_region_unregistered_is_not_read_by_the_request_right_after(agent, regions):
    """Register, infer, unregister, infer at once, 100 times on one
    connection: every request after the unregister is refused. With front
    ends, the engine's notice that the region went can reach the front end
    after its answer to the unregister did (beside a busy loop, one round in
    three once read the old view), so the front end forgets the region as
    it passes the answer on."""
    name, handle = regions()
    shm.set_shared_memory_region(handle, [np.ones((1, 16), np.float32)] * 2)
    with grpcclient.InferenceServerClient(agent.address) as client:
        client.unregister_system_shared_memory()
        refused = 0
        for _ in range(100):
            client.register_system_shared_memory("inputs", f"/{name}", 2 * BYTES)
            np.testing.assert_array_equal(add_sub_from_region(client, "inputs"),
                                          np.full((1, 16), 2, np.float32))
            client.unregister_system_shared_memory()
            try:
                add_sub_from_region(client, "inputs")
            except InferenceServerException as error:
                refused += "no shared-memory region 'inputs' is registered" in error.message()
        assert refused == 100


def test_a_region_whose_file_shrank_is_an_error_for_its_request_not_a_crash(agent, regions):
    """A client truncates the objects it registered: a mapping would have
    raised SIGBUS in the agent on the next read or write; the agent answers
    INVALID_ARGUMENT saying the file shrank, and goes on serving."""
    import os

    with grpcclient.InferenceServerClient(agent.address) as client:
        client.unregister_system_shared_memory()
        _, inputs, outputs, _, out_name = add_sub_request(client, regions)
        in_name = inputs[0]._get_tensor().parameters["shared_memory_region"].string_param
        os.truncate(f"/dev/shm/{in_name}", 0)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("add_sub", inputs, outputs=outputs)
        assert status_code(caught) == "StatusCode.INVALID_ARGUMENT"
        assert f"region {in_name!r}" in caught.value.message()
        assert "shrank after it was registered" in caught.value.message()

        inputs[0].set_data_from_numpy(np.ones((1, 16), np.float32))  # now on the wire
        os.truncate(f"/dev/shm/{out_name}", 8)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("add_sub", inputs, outputs=outputs)
        assert status_code(caught) == "StatusCode.INVALID_ARGUMENT"
        assert f"region {out_name!r}" in caught.value.message()
        assert os.stat(f"/dev/shm/{out_name}").st_size == 8  # not grown by a write
        assert client.is_server_live() and agent.alive()
        answer = client.infer("add_sub", inputs)
        np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), np.full((1, 16), 3.0))
        client.unregister_system_shared_memory()


def this_hosts_outside_address() -> str | None:
    """An address of this host that is not loopback (the interface a route
    out would use; nothing is sent), or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("serving", [[], ["--front-ends", "2"]], ids=EITHER_AGENT)
def test_regions_are_registered_only_from_this_host_and_with_a_role(shared_repository,
                                                                    regions, tmp_path,
                                                                    serving):
    """Over an outside address the agent refuses every shared-memory call,
    whatever the credentials; over loopback, with tokens configured, an
    inference token may not register a region and a shared-memory token may."""
    outside = this_hosts_outside_address()
    if outside is None:
        pytest.skip("this host has no address but loopback")
    tokens = {role: tmp_path / role for role in ("inference", "shm")}
    for role, path in tokens.items():
        path.write_text(f"{role}-token\n")
    name, _ = regions()
    with AgentProcess("edge", shared_repository, extra_args=[
            "--host", "0.0.0.0", "--inference-token-file", str(tokens["inference"]),
            "--shared-memory-token-file", str(tokens["shm"]), *serving]) as agent:
        as_shm = {"authorization": "Bearer shm-token"}
        with grpcclient.InferenceServerClient(f"{outside}:{agent.port}") as remote:
            for call in (lambda: remote.register_system_shared_memory(
                             name, f"/{name}", BYTES, headers=as_shm),
                         lambda: remote.get_system_shared_memory_status(headers=as_shm),
                         lambda: remote.unregister_system_shared_memory(headers=as_shm)):
                with pytest.raises(InferenceServerException) as caught:
                    call()
                assert status_code(caught) == "StatusCode.PERMISSION_DENIED"
                assert "only from the agent's own host" in caught.value.message()
        with grpcclient.InferenceServerClient(agent.address) as local:
            with pytest.raises(InferenceServerException) as caught:
                local.register_system_shared_memory(
                    name, f"/{name}", BYTES, headers={"authorization": "Bearer inference-token"})
            assert status_code(caught) == "StatusCode.PERMISSION_DENIED"
            local.register_system_shared_memory(name, f"/{name}", BYTES, headers=as_shm)
            assert name in local.get_system_shared_memory_status(
                headers=as_shm, as_json=True)["regions"]
            local.unregister_system_shared_memory(headers=as_shm)


@pytest.fixture(scope="module", params=[[], ["--front-ends", "2"]], ids=EITHER_AGENT)
def agent_with_tokens(shared_repository, tmp_path_factory, request):
    """An agent whose shared memory needs one of two tokens (two callers),
    and whose inference needs a third."""
    directory = tmp_path_factory.mktemp("shm-tokens")
    (directory / "shm").write_text("alice\nbob\n")
    (directory / "inference").write_text("carol\n")
    with AgentProcess("edge", shared_repository, extra_args=[
            "--shared-memory-token-file", str(directory / "shm"),
            "--inference-token-file", str(directory / "inference"), *request.param]) as agent:
        yield agent


def as_(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_a_region_is_seen_removed_and_named_by_its_caller_only(agent_with_tokens, regions):
    with grpcclient.InferenceServerClient(agent_with_tokens.address) as client:
        # Both register "r" (each its own); each sees only its own.
        file_a, _ = regions()
        file_b, _ = regions()
        client.register_system_shared_memory("r", f"/{file_a}", BYTES, headers=as_("alice"))
        client.register_system_shared_memory("r", f"/{file_b}", BYTES, headers=as_("bob"))
        client.register_system_shared_memory("only-alice", f"/{file_a}", BYTES,
                                             headers=as_("alice"))
        seen = client.get_system_shared_memory_status(headers=as_("bob"), as_json=True)
        assert list(seen["regions"]) == ["r"] and seen["regions"]["r"]["key"] == f"/{file_b}"
        with pytest.raises(InferenceServerException) as caught:
            client.get_system_shared_memory_status("only-alice", headers=as_("bob"))
        assert status_code(caught) == "StatusCode.NOT_FOUND"
        # Bob names Alice's region in a tensor: as if it did not exist.
        first = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        first.set_shared_memory("only-alice", BYTES)
        second = grpcclient.InferInput("INPUT1", [1, 16], "FP32")
        second.set_data_from_numpy(np.ones((1, 16), np.float32))
        for token in ("bob", "carol"):  # a shared-memory token, an inference token
            with pytest.raises(InferenceServerException) as caught:
                client.infer("add_sub", [first, second], headers=as_(token))
            assert status_code(caught) == "StatusCode.INVALID_ARGUMENT"
            assert "no shared-memory region 'only-alice'" in caught.value.message()
        # Alice names it: read from her file, which holds zeros.
        answer = client.infer("add_sub", [first, second], headers=as_("alice"))
        np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), np.ones((1, 16), np.float32))
        # Bob's "unregister every region" leaves Alice's.
        client.unregister_system_shared_memory(headers=as_("bob"))
        assert client.get_system_shared_memory_status(headers=as_("bob"), as_json=True) \
            .get("regions", {}) == {}
        assert set(client.get_system_shared_memory_status(
            headers=as_("alice"), as_json=True)["regions"]) == {"r", "only-alice"}
        client.unregister_system_shared_memory(headers=as_("alice"))


def test_one_caller_fills_only_its_own_share_of_the_registry(agent_with_tokens, regions):
    name, _ = regions()
    with grpcclient.InferenceServerClient(agent_with_tokens.address) as client:
        for index in range(MAX_REGIONS_PER_CALLER):
            client.register_system_shared_memory(f"r{index}", f"/{name}", BYTES,
                                                 headers=as_("alice"))
        with pytest.raises(InferenceServerException) as caught:
            client.register_system_shared_memory("one-too-many", f"/{name}", BYTES,
                                                 headers=as_("alice"))
        assert status_code(caught) == "StatusCode.INVALID_ARGUMENT"
        assert "the most one caller keeps" in caught.value.message()
        client.register_system_shared_memory("r0", f"/{name}", BYTES, headers=as_("bob"))
        client.unregister_system_shared_memory(headers=as_("alice"))
        client.unregister_system_shared_memory(headers=as_("bob"))


def test_the_registry_is_bounded(agent, regions):
    """Without credentials every client is one caller, bounded by its share
    (the bound on all callers together: tests/unit/test_shared_memory.py)."""
    name, _ = regions()
    with grpcclient.InferenceServerClient(agent.address) as client:
        client.unregister_system_shared_memory()
        for index in range(MAX_REGIONS_PER_CALLER):
            client.register_system_shared_memory(f"r{index}", f"/{name}", BYTES)
        with pytest.raises(InferenceServerException) as caught:
            client.register_system_shared_memory("one-too-many", f"/{name}", BYTES)
        assert status_code(caught) == "StatusCode.INVALID_ARGUMENT"
        assert "unregister some first" in caught.value.message()
        client.unregister_system_shared_memory()


def test_the_router_refuses_region_references_with_a_clear_error(agent, regions, tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"version": 1, "models": {
        "mlp": {"tiers": {"edge": {"agents": [agent.address]}}}}}))
    with RouterProcess(table) as router, \
            grpcclient.InferenceServerClient(router.address) as client:
        name, _ = regions()
        with pytest.raises(InferenceServerException) as caught:
            client.register_system_shared_memory(name, f"/{name}", BYTES)
        assert status_code(caught) == "StatusCode.UNIMPLEMENTED"
        tensor = grpcclient.InferInput("input", [1, 16], "FP32")
        tensor.set_shared_memory(name, BYTES)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("mlp", [tensor])
        assert status_code(caught) == "StatusCode.INVALID_ARGUMENT"
        assert "send such requests to that agent" in caught.value.message()


@pytest.mark.skipif(shutil.which("perf_analyzer") is None,
                    reason="Triton's perf_analyzer is not on PATH (it ships in tritonclient "
                    "2.51's wheel and needs libb64)")
def test_perf_analyzer_runs_with_system_shared_memory(agent, tmp_path):
    report = tmp_path / "report.csv"
    run = subprocess.run(
        ["perf_analyzer", "-m", "add_sub", "-u", agent.address, "-i", "grpc",
         "--shared-memory", "system", "--concurrency-range", "2",
         "--measurement-interval", "1000", "--stability-percentage", "100",  # a busy host
         "-f", str(report)],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    header, row = report.read_text().splitlines()[:2]
    assert float(dict(zip(header.split(","), row.split(",")))["Inferences/Second"]) > 0
