"""Triton's CUDA shared-memory extension on a real agent (needs a CUDA GPU).

The test process allocates device memory with cudaMalloc and hands the
agent its CUDA IPC handle through `tritonclient`'s
`register_cuda_shared_memory`, as `tritonclient.utils.cuda_shared_memory`
does; the agent reads an input from that memory and writes an output into
it. Skipped where torch sees no GPU (CI).
"""

from __future__ import annotations

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
from tritonclient.utils import InferenceServerException  # noqa: E402

from tiered.agent import shared_memory  # noqa: E402
from tiered.local.processes import AgentProcess  # noqa: E402

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
