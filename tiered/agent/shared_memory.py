"""Shared-memory regions, Triton's way: tensors that name a region instead of
travelling in the message.

A client on the agent's host registers a region (a POSIX shared-memory
object under /dev/shm, or CUDA device memory by its IPC handle), then sends
tensors whose parameters name it: `shared_memory_region`,
`shared_memory_byte_size` and optionally `shared_memory_offset`. An input is
read from the region; an output is written into its region, and the
response carries its name, datatype and shape with no bytes.

Regions belong to their caller (`tiered.protocol.security.Authorizer.caller`:
its token, else its client certificate, else everyone without credentials):
only it sees them, unregisters them and names them in its tensors, each
caller's names apart from another's. Everything a client names is checked
before memory is touched: a key maps only a file directly under /dev/shm (no
path, no symlink), a range must lie inside its region, a name registers once
per caller, and the registry holds at most `max_regions`, of which at most
`max_per_caller` are one caller's. A system region is read and written through its file
(pread/pwrite), never mapped: a client that truncates the file after
registering it gets an error for its request, where a mapping would have
killed the agent with SIGBUS.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import stat
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiered.engines.base import DeviceRows
from tiered.errors import AlreadyExists, InvalidArgument, NotFound, TieredError
from tiered.protocol import codec

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
NVIDIA_DEVICE = Path("/dev/nvidiactl")  # where it exists, CUDA is loaded before serving
MAX_REGIONS = 256  # in all
MAX_REGIONS_PER_CALLER = 64
MAX_NAME_CHARS = 256
REGION, BYTE_SIZE, OFFSET = (codec.SHARED_MEMORY_REGION, codec.SHARED_MEMORY_BYTE_SIZE,
                             codec.SHARED_MEMORY_OFFSET)


@dataclass(frozen=True)
class SystemRegion:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int  # the shared-memory object, open for reading and writing

    def read(self, offset: int, byte_size: int, field: str) -> np.ndarray:
        """Bytes of the region as uint8, copied out of the file."""
        data = np.empty(byte_size, np.uint8)
        self.read_into(offset, data, field)
        return data

    def read_into(self, offset: int, target, field: str) -> None:
        """Fill `target` (a writable buffer) from the region at `offset`."""
        with memoryview(target) as view:
            size = view.nbytes
            got = os.preadv(self.fd, [view], self.offset + offset) if size else 0
        if got != size:
            raise InvalidArgument(f"{field}: region {self.name!r} ({self.key}) holds only "
                                  f"{got} of bytes {offset}..{offset + size}: its file "
                                  "shrank after it was registered")

    def write(self, offset: int, raw: bytes, field: str) -> None:
        end = self.offset + offset + len(raw)
        size = os.fstat(self.fd).st_size
        if size < end:  # writing would grow a file its owner shrank
            raise InvalidArgument(f"{field}: region {self.name!r} ({self.key}) ends at byte "
                                  f"{size} of its file, before {end}: it shrank after it was "
                                  "registered")
        os.pwrite(self.fd, raw, self.offset + offset)


@dataclass(frozen=True)
class CudaRegion:
    name: str
    device_id: int
    byte_size: int
    memory: Any  # a torch uint8 tensor over the opened IPC allocation
    # What holds the IPC mapping open (`open_cuda_handle`): the region while
    # registered, and every input read from it until its batch has run.
    owner: DeviceArray
    # `memory` viewed as each dtype read from it (`_typed`)
    typed: dict = dataclasses.field(default_factory=dict, compare=False)


def _shm_path(key: str) -> Path:
    """The file of a shared-memory object named as shm_open names it ("/name")."""
    bare = key[1:] if key.startswith("/") else key
    if not bare or "/" in bare or bare in (".", "..") or "\0" in bare:
        raise InvalidArgument(f"key {key!r}: expected a shared-memory object name such as "
                              "'/input0' (a file directly under /dev/shm)")
    return SHM_DIR / bare


def _open(key: str, end: int) -> int:
    """The object's file, open, once checked to hold `end` bytes."""
    path = _shm_path(key)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError as error:
        raise NotFound(f"key {key!r}: no shared-memory object {path}") from error
    except OSError as error:
        raise InvalidArgument(f"key {key!r}: cannot open {path}: {error.strerror}") from error
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"key {key!r}: {path} is not a shared-memory object")
        if info.st_size < end:
            raise InvalidArgument(f"key {key!r}: offset + byte_size = {end} is beyond its "
                                  f"{info.st_size} bytes")
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedMemory:
    """The agent's registered regions, by caller. Used from the server's event loop only."""

    def __init__(self, max_regions: int = MAX_REGIONS,
                 max_per_caller: int = MAX_REGIONS_PER_CALLER) -> None:
        self.max_regions = max_regions
        self.max_per_caller = max_per_caller
        self._system: dict[tuple[str, str], SystemRegion] = {}
        self._cuda: dict[tuple[str, str], CudaRegion] = {}
        # Told (caller, name) whenever a region comes or goes ("": all of the
        # caller's): the front ends' views of the regions forget it.
        self.on_change: list[Callable[[str, str], None]] = []

    # -- registration ----------------------------------------------------------

    def _check_new(self, caller: str, name: str, byte_size: int) -> None:
        if byte_size <= 0:
            raise InvalidArgument(f"region {name!r}: byte_size must be > 0")
        if not name or len(name) > MAX_NAME_CHARS:
            raise InvalidArgument(f"name: expected 1..{MAX_NAME_CHARS} characters")
        if (caller, name) in self._system or (caller, name) in self._cuda:
            raise AlreadyExists(f"shared-memory region {name!r} is already registered")
        if len(self._system) + len(self._cuda) >= self.max_regions:
            raise InvalidArgument(f"shared memory: {self.max_regions} regions are registered, "
                                  "the most this agent keeps; unregister some first")
        if sum(owner == caller for owner, _ in (*self._system, *self._cuda)) \
                >= self.max_per_caller:
            raise InvalidArgument(f"shared memory: you have {self.max_per_caller} regions "
                                  "registered, the most one caller keeps; unregister some first")

    def register_system(self, caller: str, name: str, key: str, offset: int,
                        byte_size: int) -> None:
        self._check_new(caller, name, byte_size)
        self._system[caller, name] = SystemRegion(name, key, offset, byte_size,
                                                  _open(key, offset + byte_size))
        self._changed(caller, name)

    def register_cuda(self, caller: str, name: str, raw_handle: bytes, device_id: int,
                      byte_size: int) -> None:
        self._check_new(caller, name, byte_size)
        memory, owner = open_cuda_handle(raw_handle, device_id, byte_size)
        self._cuda[caller, name] = CudaRegion(name, device_id, byte_size, memory, owner)
        self._changed(caller, name)

    def unregister_system(self, caller: str, name: str) -> None:
        """Empty name: every system region of the caller. An unknown name is not an error."""
        for region in _take(self._system, caller, name):
            os.close(region.fd)
        self._changed(caller, name)

    def _changed(self, caller: str, name: str) -> None:
        for listener in self.on_change:
            listener(caller, name)

    def unregister_cuda(self, caller: str, name: str) -> None:
        # The mapping closes once no queued input reads from it (`open_cuda_handle`).
        _take(self._cuda, caller, name)
        self._changed(caller, name)

    def system_status(self, caller: str, name: str) -> list[SystemRegion]:
        return self._status(self._system, caller, name)

    def cuda_status(self, caller: str, name: str) -> list[CudaRegion]:
        return self._status(self._cuda, caller, name)

    @staticmethod
    def _status(regions: Mapping, caller: str, name: str) -> list:
        if not name:
            return [region for (owner, _), region in regions.items() if owner == caller]
        if (caller, name) not in regions:
            raise NotFound(f"no shared-memory region {name!r} is registered")
        return [regions[caller, name]]

    def of(self, caller: str) -> CallerRegions:
        """The regions `caller` may name in its tensors."""
        return CallerRegions(self, caller)

    def find(self, caller: str, name: str) -> SystemRegion | CudaRegion | None:
        return self._system.get((caller, name)) or self._cuda.get((caller, name))


@dataclass(frozen=True)
class CallerRegions:
    """One caller's regions, as its tensors read and write them."""

    registry: SharedMemory
    caller: str

    def reference(self, parameters: Mapping[str, Any], field: str
                  ) -> tuple[SystemRegion | CudaRegion, int, int] | None:
        """The region, offset and byte size a tensor's parameters name; None
        for a tensor without them."""
        name = parameters.get(REGION)
        if name is None:
            return None
        size, offset = parameters.get(BYTE_SIZE), parameters.get(OFFSET, 0)
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{field}: {REGION} must name a region")
        for key, value in ((BYTE_SIZE, size), (OFFSET, offset)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"{field}: {key} must be an integer >= 0, got {value!r}")
        region = self.registry.find(self.caller, name)
        if region is None:
            raise not_registered(field, name)
        if offset + size > region.byte_size:
            raise InvalidArgument(
                f"{field}: bytes {offset}..{offset + size} are outside region {name!r} "
                f"of {region.byte_size} bytes")
        return region, offset, size

    def read(self, parameters: Mapping[str, Any], datatype: str, shape, field: str
             ) -> np.ndarray | None:
        """An input tensor from its region; None if it names none."""
        found = self.reference(parameters, field)
        if found is None:
            return None
        region, offset, size = found
        if isinstance(region, SystemRegion):
            return codec.from_raw(region.read(offset, size, field).data, datatype, shape,
                                  field=field)
        return device_rows(region, offset, size, datatype, shape, field)

    def write_rows(self, wanted: Sequence[Mapping[str, Mapping[str, Any]]],
                   rows: Sequence[int], outputs: Mapping[str, np.ndarray],
                   ) -> dict[int, TieredError | RuntimeError]:
        """Each request's rows of a merged batch's `outputs` (`rows` each)
        into the ranges `wanted[i]` names for request i's outputs;
        {request index: error} for those whose ranges could not take them,
        each failing alone. An output goes to the GPU once, and all its
        ranges in one device's CUDA regions are filled from there in one
        grouped copy (`_grouped_copy`), waited for once."""
        failed: dict[int, TieredError | RuntimeError] = {}
        on_gpu: dict[tuple[str, Any], Any] = {}  # (output, device): its bytes there
        copies: dict[Any, _Copies] = {}  # device: what goes into its regions
        row = 0
        for index, (names, count) in enumerate(zip(wanted, rows)):
            try:
                for name, parameters in names.items():
                    array, where = outputs[name], f"output {name!r}"
                    row_bytes = array.nbytes // array.shape[0] if array.shape[0] else 0
                    start, size = row * row_bytes, count * row_bytes
                    whole = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                    found = self.reference(parameters, where)
                    if found is None:
                        raise not_registered(where, None)
                    region, offset, room = found
                    _check_fits(whole[start:start + size], room, where)
                    if isinstance(region, SystemRegion):
                        region.write(offset, whole[start:start + size], where)
                        continue
                    device = region.memory.device
                    group = copies.get(device) or copies.setdefault(device, _Copies(device))
                    source = on_gpu.get((name, device))
                    if source is None:
                        source = on_gpu[name, device] = group.upload(whole)
                    group.add(index, region.memory[offset:offset + size],
                              source[start:start + size])
            except (TieredError, RuntimeError) as error:
                failed[index] = error
            row += count
        for group in copies.values():  # the client reads its outputs once it is answered
            error = group.run()
            if error is not None:
                failed.update(dict.fromkeys(group.requests, error))
        return failed

    def write(self, parameters: Mapping[str, Any], raw: bytes, field: str) -> bool:
        """Write an output's bytes into the region its parameters name; False if none."""
        found = self.reference(parameters, field)
        if found is None:
            return False
        region, offset, size = found
        if isinstance(region, SystemRegion):
            Placed(region, offset, size).write(raw, field)
            return True
        _check_fits(raw, size, field)
        import torch

        writable = isinstance(raw, memoryview) and not raw.readonly
        source = torch.frombuffer(raw if writable else bytearray(raw), dtype=torch.uint8)
        region.memory[offset:offset + len(raw)].copy_(source)
        return True


def device_rows(region: CudaRegion, offset: int, size: int, datatype: str, shape,
                field: str) -> np.ndarray | DeviceRows:
    """A tensor in a range of a CUDA region: left on the device as
    `DeviceRows`, so that no copy to the host holds the event loop and a GPU
    engine gathers it into its batch there; read back to the host only where
    it cannot be viewed as its type (BYTES, a misaligned offset)."""
    dtype = codec.dtype_of(datatype, field=f"{field}.datatype")
    count = codec.element_count(shape, field=field)
    typed = _typed(region, dtype) if datatype != "BYTES" and offset % dtype.itemsize == 0 \
        and size == count * dtype.itemsize else None
    if typed is not None:
        start = offset // dtype.itemsize
        return DeviceRows([typed[start:start + count].view(tuple(shape))], dtype,
                          keep=[region.owner])
    host = region.memory[offset:offset + size].cpu().numpy()  # device to host
    return codec.from_raw(host.data, datatype, shape, field=field)


def _typed(region: CudaRegion, dtype: np.dtype):
    """The region's memory as `dtype`'s torch type (viewed once per type), or
    None where torch has no such type or the region's size is not a whole
    number of them."""
    if dtype not in region.typed:
        import torch

        whole = region.byte_size // dtype.itemsize * dtype.itemsize
        try:
            region.typed[dtype] = region.memory[:whole].view(
                torch.from_numpy(np.empty(0, dtype)).dtype)
        except (RuntimeError, TypeError):
            region.typed[dtype] = None
    return region.typed[dtype]


_COPY_STREAMS: dict = {}  # device: the stream outputs are copied into CUDA regions on


class _Copies:
    """The ranges of one device's CUDA regions a batch's outputs go to, filled
    together on a stream of their own: one grouped copy (`_foreach_copy_`,
    one kernel where the ranges allow) rather than a call per range."""

    def __init__(self, device) -> None:
        import torch

        self.stream = _COPY_STREAMS.get(device)
        if self.stream is None:
            self.stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
        self.requests: list[int] = []  # the request each copy answers
        self.targets: list = []
        self.sources: list = []

    def upload(self, whole: np.ndarray):
        """An output's bytes on this device, to copy ranges of."""
        import torch

        with torch.cuda.stream(self.stream):
            return torch.from_numpy(whole).to(self.stream.device)

    def add(self, request: int, target, source) -> None:
        self.requests.append(request)
        self.targets.append(target)
        self.sources.append(source)

    def run(self) -> RuntimeError | None:
        """Make the copies and wait for them; the error that failed them, if any."""
        import torch

        try:
            with torch.cuda.stream(self.stream):
                torch._foreach_copy_(self.targets, self.sources, non_blocking=True)
            self.stream.synchronize()
        except RuntimeError as error:
            return error
        return None


def not_registered(field: str, name: object) -> InvalidArgument:
    return InvalidArgument(f"{field}: no shared-memory region {name!r} is registered")


def _check_fits(raw: bytes, size: int, field: str) -> None:
    if len(raw) > size:
        raise InvalidArgument(f"{field}: the output has {len(raw)} bytes, more than the "
                              f"{size} of its shared-memory range")


@dataclass(frozen=True)
class Placed:
    """A range of a system region that a tensor's parameters name."""

    region: SystemRegion
    offset: int
    byte_size: int

    def read(self, field: str) -> bytes:
        """The range's bytes (an error if the region's file shrank since)."""
        data = bytearray(self.byte_size)
        self.region.read_into(self.offset, data, field)
        return bytes(data)

    def read_into(self, target, field: str) -> None:
        """The range's bytes into `target`, a writable buffer of its size: one copy."""
        self.region.read_into(self.offset, target, field)

    def write(self, raw: bytes, field: str) -> None:
        """An output's bytes at the range's start (an error if they overflow it)."""
        _check_fits(raw, self.byte_size, field)
        self.region.write(self.offset, raw, field)


def _take(regions: dict, caller: str, name: str) -> list:
    """Remove and return the caller's named region (none if unknown), or every one of its."""
    keys = [(caller, name)] if name else [key for key in regions if key[0] == caller]
    return [regions.pop(key) for key in keys if key in regions]


# -- CUDA IPC --------------------------------------------------------------------

class DeviceArray:
    """Device memory by address, for torch.as_tensor (CUDA array interface)."""

    def __init__(self, pointer: int, byte_size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (byte_size,), "typestr": "|u1",
                                         "data": (pointer, False), "version": 3}


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]  # cudaIpcMemHandle_t, passed by value


def open_cuda_handle(raw_handle: bytes, device_id: int, byte_size: int):
    """The memory a cudaIpcMemHandle_t names, as a torch uint8 tensor, and
    the object whose life holds the mapping open: it closes once nothing
    refers to that object (the region, unregistered, and the inputs still
    queued that were read from it), so an input unregistered while its batch
    waits is never read from unmapped memory."""
    try:
        import torch
    except ImportError as error:
        raise InvalidArgument("CUDA shared memory: this agent has no torch") from error
    if not torch.cuda.is_available():
        raise InvalidArgument("CUDA shared memory: this agent sees no CUDA device")
    if not 0 <= device_id < torch.cuda.device_count():
        raise InvalidArgument(f"device_id {device_id}: this agent sees "
                              f"{torch.cuda.device_count()} CUDA devices")
    if len(raw_handle) != ctypes.sizeof(IpcHandle):
        raise InvalidArgument(f"raw_handle: expected a 64-byte cudaIpcMemHandle_t, got "
                              f"{len(raw_handle)} bytes")
    runtime = cuda_runtime()
    pointer = ctypes.c_void_p()
    with torch.cuda.device(device_id):
        torch.cuda.init()
        code = runtime.cudaIpcOpenMemHandle(ctypes.byref(pointer),
                                            IpcHandle.from_buffer_copy(raw_handle), 1)
    if code != 0:
        raise InvalidArgument(f"raw_handle: cudaIpcOpenMemHandle failed (CUDA error {code})")
    held = allocation_bytes(pointer.value)
    if held is None or byte_size > held:
        runtime.cudaIpcCloseMemHandle(pointer)
        raise InvalidArgument(
            f"byte_size {byte_size}: the memory the handle names holds "
            + ("a size CUDA would not tell" if held is None else f"{held} bytes"))
    owner = DeviceArray(pointer.value, byte_size)
    closing = weakref.finalize(owner, runtime.cudaIpcCloseMemHandle,
                               ctypes.c_void_p(pointer.value))
    closing.atexit = False  # the process's end unmaps it anyway
    return torch.as_tensor(owner, device=f"cuda:{device_id}"), owner


def allocation_bytes(pointer: int) -> int | None:
    """The bytes of device memory from `pointer` to the end of its allocation
    (cuMemGetAddressRange); None where CUDA cannot say."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    code = cuda_driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                 ctypes.c_uint64(pointer))
    return None if code != 0 else base.value + size.value - pointer


def preload_cuda() -> bool:
    """Load torch and the CUDA libraries now, where the host has an NVIDIA
    device, so the first CUDA registration does not hold the event loop for
    seconds importing them; False where there is none (nothing is loaded)."""
    if not NVIDIA_DEVICE.exists():
        return False
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    cuda_runtime()
    cuda_driver()
    return True


@dataclass(frozen=True)
class CudaRange:
    """A range of a CUDA region, as a front end names it to the engine process
    (which alone maps the region) for the rows of a request it merged."""

    name: str
    offset: int
    byte_size: int


class RegionViews:
    """A front end's view of the regions its callers registered with the
    engine process: each system region opened here once, so the front end
    reads a request's inputs itself, and each CUDA region's size, so it can
    name a request's ranges in a merged frame. The engine says when a region
    comes or goes (`forget`); what was looked up while that happened is used
    once, not kept."""

    def __init__(self, max_regions: int = MAX_REGIONS) -> None:
        self.max_regions = max_regions
        self._views: dict[tuple[str, str], SystemRegion] = {}
        self._cuda: dict[tuple[str, str], int] = {}  # a CUDA region's byte size
        self.generation = 0  # counts what was forgotten

    def get(self, caller: str, name: str) -> SystemRegion | None:
        return self._views.get((caller, name))

    def keep(self, caller: str, region: SystemRegion, generation: int) -> None:
        """Keep a view looked up at `generation`, unless something changed since."""
        if generation != self.generation or len(self._views) >= self.max_regions:
            os.close(region.fd)
            return
        self._views[caller, region.name] = region

    def knows(self, caller: str, name: str) -> bool:
        return (caller, name) in self._views or (caller, name) in self._cuda

    def keep_cuda(self, caller: str, name: str, byte_size: int, generation: int) -> None:
        """Keep a CUDA region's size looked up at `generation`, unless something changed since."""
        if generation == self.generation and len(self._cuda) < self.max_regions:
            self._cuda[caller, name] = byte_size

    def forget(self, caller: str, name: str) -> None:
        self.generation += 1
        for region in _take(self._views, caller, name):
            os.close(region.fd)
        _take(self._cuda, caller, name)

    def place(self, caller: str, parameters: Mapping[str, Any]) -> Placed | CudaRange | None:
        """The range of a known region that a tensor's parameters name; None
        where this view cannot say (unknown here, out of range): then the
        engine reads or writes it, and answers any error."""
        key = (caller, parameters.get(REGION))
        region, cuda_size = self._views.get(key), self._cuda.get(key)
        size, offset = parameters.get(BYTE_SIZE), parameters.get(OFFSET, 0)
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (size, offset)):
            return None
        if region is not None and offset + size <= region.byte_size:
            return Placed(region, offset, size)
        if cuda_size is not None and offset + size <= cuda_size:
            return CudaRange(key[1], offset, size)
        return None

    def close(self) -> None:
        self.generation += 1
        for region in self._views.values():
            os.close(region.fd)
        self._views.clear()
        self._cuda.clear()


def open_view(name: str, key: str, offset: int, byte_size: int) -> SystemRegion:
    """A region as the engine registered it, opened here (the key checked again)."""
    return SystemRegion(name, key, offset, byte_size, _open(key, offset + byte_size))


def pin_host_memory(buffer) -> Callable[[], None] | None:
    """Page-lock `buffer` (a writable mapping) for CUDA, so the GPU copies
    from it by DMA without a staging copy; returns what unpins it, or None
    where nothing was pinned (no CUDA in this process, or CUDA refused)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None  # no CUDA engine here: nothing would copy from it
    view = np.frombuffer(buffer, np.uint8)
    address, size = view.ctypes.data, view.nbytes
    del view  # the mapping must stay closable
    runtime = cuda_runtime()
    code = runtime.cudaHostRegister(ctypes.c_void_p(address), size, 0)  # cudaHostRegisterDefault
    if code != 0:
        runtime.cudaGetLastError()  # clear it, or the next CUDA call reports it
        log.warning("could not pin %d bytes of host memory for the GPU (CUDA error %d); "
                    "batches are copied through staging buffers instead", size, code)
        return None
    return lambda: runtime.cudaHostUnregister(ctypes.c_void_p(address))


@functools.cache
def cuda_driver():
    """The CUDA driver library, with the calls used here typed."""
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                              ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    return driver


@functools.cache
def cuda_runtime():
    """The CUDA runtime library torch loaded, with the IPC calls typed."""
    import torch

    for name in (f"libcudart.so.{torch.version.cuda.split('.')[0]}", "libcudart.so"):
        try:
            runtime = ctypes.CDLL(name)
        except OSError:
            continue
        runtime.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcHandle,
                                                 ctypes.c_uint]
        runtime.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        runtime.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        runtime.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        return runtime
    raise InvalidArgument("CUDA shared memory: the CUDA runtime library is not loadable")
