"""Triton's CUDA shared-memory extension on a real agent (needs a CUDA GPU).

The test process allocates device memory with torch and hands the agent
its CUDA IPC handle through `tritonclient`'s
`register_cuda_shared_memory`, as `tritonclient.utils.cuda_shared_memory`
does; the agent reads an input from that memory and writes an output into
it. Skipped where torch sees no GPU (CI).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tritonclient.grpc")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)

import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

BYTES = 16 * 4  # one FP32 [1, 16] tensor


def ipc_region(tensor) -> tuple[bytes, int]:
    """The IPC handle of a CUDA tensor's allocation, and the tensor's byte
    offset in it (torch's caching allocator hands out parts of blocks)."""
    shared = tensor.untyped_storage()._share_cuda_()
    handle, offset = shared[1], shared[3]
    return handle, offset + tensor.storage_offset() * tensor.element_size()


def test_inputs_and_outputs_in_cuda_shared_memory(agent):
    a = torch.arange(16, dtype=torch.float32, device="cuda").reshape(1, 16)
    b = np.full((1, 16), 2, np.float32)
    out = torch.zeros((1, 16), dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    with grpcclient.InferenceServerClient(agent.address) as client:
        client.unregister_cuda_shared_memory()
        for name, tensor in (("in", a), ("out", out)):
            handle, offset = ipc_region(tensor)
            client.register_cuda_shared_memory(name, handle, 0, offset + BYTES)
            tensor.region_offset = offset
        status = client.get_cuda_shared_memory_status(as_json=True)["regions"]
        assert set(status) == {"in", "out"}
        first = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        first.set_shared_memory("in", BYTES, offset=a.region_offset)
        second = grpcclient.InferInput("INPUT1", [1, 16], "FP32")
        second.set_data_from_numpy(b)
        total = grpcclient.InferRequestedOutput("OUTPUT0")
        total.set_shared_memory("out", BYTES, offset=out.region_offset)
        result = client.infer("add_sub", [first, second],
                              outputs=[total, grpcclient.InferRequestedOutput("OUTPUT1")])
        torch.cuda.synchronize()
        np.testing.assert_array_equal(out.cpu().numpy(), a.cpu().numpy() + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a.cpu().numpy() - b)
        with pytest.raises(InferenceServerException) as caught:
            client.register_cuda_shared_memory("bad", b"\0" * 10, 0, BYTES)
        assert "64-byte" in caught.value.message()
        client.unregister_cuda_shared_memory()
        assert client.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}
