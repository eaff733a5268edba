"""Triton's CUDA shared-memory extension on a real agent (needs a CUDA GPU).

The test process allocates device memory with cudaMalloc and hands the
agent its CUDA IPC handle through `tritonclient`'s
`register_cuda_shared_memory`, as `tritonclient.utils.cuda_shared_memory`
does; the agent reads an input from that memory and writes an output into
it. With front ends and the torch engine on the GPU, such requests merge
into frames of ranges and the engine gathers their rows device to device.
Skipped where torch sees no GPU (CI).
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tritonclient.grpc")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.grpc.aio as aioclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.integration.test_front_ends import (  # noqa: E402
    TOO_SMALL,
    add_sub_in_region,
    answered_in_region,
    frames_fed,
)
from tiered.agent import shared_memory  # noqa: E402
from tiered.agent.repository import model_file, write_config  # noqa: E402
from tiered.local.processes import AgentProcess  # noqa: E402
from tiered.models import zoo  # noqa: E402

BYTES = 16 * 4  # one FP32 [1, 16] tensor


def device_region(byte_size: int):
    """Device memory of its own allocation (cudaMalloc), as a torch float32
    tensor, and its 64-byte CUDA IPC handle, as a client process makes them."""
    runtime = shared_memory.cuda_runtime()
    runtime.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    runtime.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(shared_memory.IpcHandle),
                                            ctypes.c_void_p]
    pointer, handle = ctypes.c_void_p(), shared_memory.IpcHandle()
    assert runtime.cudaMalloc(ctypes.byref(pointer), byte_size) == 0
    assert runtime.cudaIpcGetMemHandle(ctypes.byref(handle), pointer) == 0
    memory = torch.as_tensor(shared_memory.DeviceArray(pointer.value, byte_size),
                             device="cuda")
    # tritonclient takes the handle base64-encoded, as its get_raw_handle gives it.
    return memory.view(torch.float32), base64.b64encode(bytes(handle))


def test_inputs_and_outputs_in_cuda_shared_memory(agent):
    torch.cuda.init()
    inputs, in_handle = device_region(2 * BYTES)
    outputs, out_handle = device_region(BYTES)
    a = torch.arange(16, dtype=torch.float32, device="cuda")
    inputs[16:].copy_(a)  # the input at offset BYTES
    b = np.full((1, 16), 2, np.float32)
    torch.cuda.synchronize()
    with grpcclient.InferenceServerClient(agent.address) as client:
        client.unregister_cuda_shared_memory()
        client.register_cuda_shared_memory("in", in_handle, 0, 2 * BYTES)
        client.register_cuda_shared_memory("out", out_handle, 0, BYTES)
        status = client.get_cuda_shared_memory_status(as_json=True)["regions"]
        assert set(status) == {"in", "out"}
        first = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        first.set_shared_memory("in", BYTES, offset=BYTES)
        second = grpcclient.InferInput("INPUT1", [1, 16], "FP32")
        second.set_data_from_numpy(b)
        total = grpcclient.InferRequestedOutput("OUTPUT0")
        total.set_shared_memory("out", BYTES)
        result = client.infer("add_sub", [first, second],
                              outputs=[total, grpcclient.InferRequestedOutput("OUTPUT1")])
        torch.cuda.synchronize()
        np.testing.assert_array_equal(outputs.cpu().numpy(), a.cpu().numpy() + b[0])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a.cpu().numpy()[None] - b)
        with pytest.raises(InferenceServerException) as caught:
            client.register_cuda_shared_memory("bad", base64.b64encode(b"\0" * 10), 0, BYTES)
        assert "64-byte" in caught.value.message()
        client.unregister_cuda_shared_memory()
        assert client.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}


def test_a_byte_size_beyond_the_allocation_is_refused(agent):
    torch.cuda.init()
    _, handle = device_region(BYTES)
    with grpcclient.InferenceServerClient(agent.address) as client:
        with pytest.raises(InferenceServerException) as caught:
            client.register_cuda_shared_memory("too-big", handle, 0, 64 * BYTES)
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert f"byte_size {64 * BYTES}: the memory the handle names holds" in \
            caught.value.message()
        client.register_cuda_shared_memory("fits", handle, 0, BYTES)
        client.unregister_cuda_shared_memory()


def test_cuda_is_loaded_before_the_agent_serves(shared_repository):
    """A fresh agent's first registration finds CUDA loaded: no import of
    torch on its event loop (seconds) while it serves."""
    torch.cuda.init()
    _, handle = device_region(BYTES)
    with AgentProcess("edge", shared_repository) as fresh, \
            grpcclient.InferenceServerClient(fresh.address) as client:
        assert "CUDA loaded before serving" in fresh.log()
        started = time.monotonic()
        client.register_cuda_shared_memory("first", handle, 0, BYTES)
        assert time.monotonic() - started < 1.0
        client.unregister_cuda_shared_memory()


def test_requests_in_cuda_regions_merge_and_are_gathered_on_the_device(tmp_path):
    """A datacenter agent with front ends and the torch engine on the GPU:
    requests whose inputs and outputs all lie in CUDA regions take the
    front ends' batch path (none goes to the engine whole); the engine copies
    each request's rows into the batch on the device and writes each output
    into its own region, and one whose output range is too small fails alone."""
    zoo.add_sub(model_file(tmp_path, "add_sub", 1))
    write_config(tmp_path, "add_sub", {"backend": "torch", "max_batch_size": 8,
                                       "dynamic_batching": {"max_queue_delay_us": 2000}})
    torch.cuda.init()
    rng = np.random.default_rng(3)
    count = 24
    rows = [rng.standard_normal((1 + i % 3, 16)).astype(np.float32) for i in range(count)]
    regions = []
    for i, a in enumerate(rows):
        memory, handle = device_region(4 * a.nbytes)  # [a, 2a, a + 2a, a - 2a]
        memory[:2 * a.size].copy_(torch.from_numpy(np.concatenate([a, 2 * a]).ravel()))
        regions.append((f"cuda-{i}", memory, handle))
    torch.cuda.synchronize()

    async def send(agent: AgentProcess):
        async with aioclient.InferenceServerClient(agent.address) as client:
            for (name, _, handle), a in zip(regions, rows):
                await client.register_cuda_shared_memory(name, handle, 0, 4 * a.nbytes)
            before = frames_fed(agent)
            made = [add_sub_in_region(regions[i][0], a, a.nbytes - (4 if i == TOO_SMALL else 0))
                    for i, a in enumerate(rows)]
            outcomes = await asyncio.gather(
                *(client.infer("add_sub", inputs, outputs=outputs) for inputs, outputs in made),
                return_exceptions=True)
            after = frames_fed(agent)
            await client.unregister_cuda_shared_memory()
            return outcomes, before, after

    with AgentProcess("datacenter", tmp_path, extra_args=["--front-ends", "2"]) as agent:
        outcomes, before, after = asyncio.run(send(agent))
        assert agent.alive(), agent.log_tail()
    torch.cuda.synchronize()
    for i, (a, (name, memory, _), answer) in enumerate(zip(rows, regions, outcomes)):
        if not answered_in_region(i, a, name, answer):
            continue
        written = memory[2 * a.size:].cpu().numpy().reshape(2, *a.shape)
        np.testing.assert_allclose(written[0], 3 * a, rtol=2e-3, atol=2e-3)  # computed in FP16
        np.testing.assert_allclose(written[1], -a, rtol=2e-3, atol=2e-3)
    assert {kind: after[kind] - before[kind] for kind in after} == \
        {"batch": count, "single": 0, "stream": 0}, (before, after)
