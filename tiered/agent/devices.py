"""Engine processes: one per device of a node, behind one agent.

A datacenter node carries several GPUs. With the tier profile's `devices:`
(or `auto` and two or more GPUs visible), each model version runs in one
engine process per device instead of in the agent's process: the process
sees only its device (`CUDA_VISIBLE_DEVICES`), so its CUDA graphs, pinned
buffers and streams are its own. The agent keeps the front ends, the
batchers (one per device), statistics and telemetry; `model.py` sends each
request to the device with the least queued work and, when a device's
process dies, fails its requests over to the others while it restarts.

`DeviceEngine` is the agent's side: an `Engine` whose `stage` writes a
batch into an arena (a memfd both processes map) and whose `run` sends a
small frame and waits for the outputs. `main` is the engine process
(`python -m tiered.agent.devices`, its spec pickled on stdin).

Frames on a socket pair, little-endian:

    <IQBI>  length of the rest, call id, kind, header length;
            the header (pickled); the payload (raw bytes).

    agent -> engine  RUN     header (where, [(name, dtype, shape, offset, bytes)],
                             outputs wanted or None): inputs in the arena, or
                             inline after the header
    engine -> agent  HELLO   header EngineFacts (call id 0), once it is warm
                     DONE    header [(name, dtype, shape, bytes)], outputs inline
                     FAILED  header (error class name, message)

A device that never comes back (a GPU that fell off the bus) keeps failing
to start; its lanes stay down, with the reason, in health and status.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import mmap
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiered import errors
from tiered.agent.feed import IN_ARENA, INLINE, Arena, Block
from tiered.engines.base import Engine, TensorSpec
from tiered.errors import ConfigError, EngineError, TieredError, Unavailable
from tiered.profiles import CPU, parse_devices

log = logging.getLogger(__name__)

FRAME = struct.Struct("<IQBI")
LENGTH = struct.Struct("<I")
RUN, HELLO, DONE, FAILED = range(4)
START_TIMEOUT_S = 600.0  # loading, converting and capturing CUDA graphs takes a while
STOP_TIMEOUT_S = 30.0


class EngineLost(Unavailable):
    """The engine process of a device died; its requests go to another device."""


# -- which devices ---------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    name: str  # its label in telemetry, metrics and health: "cuda:0", "cpu:1"
    visible: str  # CUDA_VISIBLE_DEVICES of its engine processes ("": none, a CPU stand-in)

    @property
    def gpu(self) -> bool:
        return bool(self.visible)


def resolve_devices(setting: Any, environ: Mapping[str, str],
                    gpu_count: Callable[[], int]) -> tuple[Device, ...]:
    """The devices that get engine processes; () runs engines in the agent's process.

    `auto`: every GPU the agent sees (`CUDA_VISIBLE_DEVICES`, else NVML's
    count), and () when fewer than two: one device gains nothing from a
    process of its own. A list is taken as it is, even of one.
    """
    entries = parse_devices(setting)
    if entries is None:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            entries = tuple(e.strip() for e in visible.split(",") if e.strip())
            entries = entries[:next((i for i, e in enumerate(entries) if e == "-1"),
                                    len(entries))]  # CUDA stops at the first invalid entry
        else:
            entries = tuple(str(i) for i in range(gpu_count()))
        if len(entries) < 2:
            return ()
    return tuple(Device(f"{CPU}:{i}", "") if entry == CPU
                 else Device(f"cuda:{entry if entry.isdigit() else i}", entry)
                 for i, entry in enumerate(entries))


def device_environment(device: Device) -> dict[str, str]:
    """What an engine process of `device` sees of the GPUs, and its name."""
    return {"CUDA_VISIBLE_DEVICES": device.visible,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # GPU indices as NVML counts them
            "TIERED_DEVICE": device.name}


def nvml_gpu_count() -> int:
    """GPUs NVML sees; 0 without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:  # no pynvml, no driver: no GPUs
        return 0


class DevicePool:
    """The agent's devices, and the CPU time of their engine processes (what
    a CPU stand-in's modeled energy counts)."""

    def __init__(self, devices: Sequence[Device] = ()) -> None:
        self.devices = tuple(devices)
        self._live: dict[str, dict[int, float]] = {d.name: {} for d in self.devices}
        self._retired_s: dict[str, float] = {d.name: 0.0 for d in self.devices}
        self._lock = threading.Lock()

    def label(self, engine_device: str) -> str:
        """An in-process engine's device as the ledger knows it: its CUDA work
        runs on the first visible GPU."""
        gpus = [d for d in self.devices if d.gpu]
        return gpus[0].name if engine_device == "cuda" and gpus else engine_device

    def started(self, device: str, pid: int) -> None:
        with self._lock:
            self._live[device][pid] = 0.0

    def exited(self, device: str, pid: int, cpu_s: float) -> None:
        with self._lock:
            self._live[device].pop(pid, None)
            self._retired_s[device] += cpu_s

    def cpu_seconds(self, device: str) -> float:
        """CPU seconds used by the device's engine processes, the exited included."""
        with self._lock:
            live = self._live[device]
            for pid in live:
                live[pid] = max(live[pid], _process_cpu_s(pid))  # keep the last seen when gone
            return self._retired_s[device] + sum(live.values())


def _process_cpu_s(pid: int) -> float:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the wire --------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineSpec:
    """What an engine process loads, and how many batches it runs at once."""

    name: str  # the model version, for logs: "resnet v3"
    backend: str
    path: Path
    settings: Mapping[str, Any]
    where: str
    instances: int
    socket_fd: int = -1
    arena_fd: int = -1
    arena_bytes: int = 0


@dataclass(frozen=True)
class EngineFacts:
    """What a started engine process tells the agent of its engine."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    device: str
    facts: Mapping[str, str] = field(default_factory=dict)


def send_frame(sock: socket.socket, lock: threading.Lock, call_id: int, kind: int,
               header: Any, payload: Sequence[memoryview | bytes] = ()) -> None:
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    length = FRAME.size - LENGTH.size + len(head) + sum(len(memoryview(p).cast("B"))
                                                         for p in payload)
    parts = [FRAME.pack(length, call_id, kind, len(head)), head, *payload]
    with lock:
        for part in parts:
            sock.sendall(part)


def read_frame(sock: socket.socket) -> tuple[int, int, Any, memoryview] | None:
    """(call id, kind, header, payload), or None at the end of the stream."""
    start = _read_exact(sock, FRAME.size)
    if start is None:
        return None
    length, call_id, kind, head_length = FRAME.unpack(start)
    rest = _read_exact(sock, length - (FRAME.size - LENGTH.size))
    if rest is None:
        return None
    view = memoryview(rest)
    return call_id, kind, pickle.loads(view[:head_length]), view[head_length:]


def _read_exact(sock: socket.socket, size: int) -> bytearray | None:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = sock.recv_into(view[got:])
        if not count:
            return None
        got += count
    return buffer


def _arrays(described, payload: memoryview) -> dict[str, np.ndarray]:
    """Arrays laid out one after another in `payload`, as `_described` tells."""
    arrays, at = {}, 0
    for name, dtype, shape, size in described:
        arrays[name] = np.frombuffer(payload[at:at + size], dtype=dtype).reshape(shape)
        at += size
    return arrays


def _described(arrays: Mapping[str, np.ndarray]) -> tuple[list, list[memoryview]]:
    contiguous = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    return ([(name, a.dtype.str, a.shape, a.nbytes) for name, a in contiguous.items()],
            [memoryview(a).cast("B") for a in contiguous.values()])


def _error_of(header: tuple[str, str]) -> TieredError:
    name, message = header
    kind = getattr(errors, name, None)
    if not (isinstance(kind, type) and issubclass(kind, TieredError)):
        kind = EngineError
    return kind(message)


def spawn(module: str, spec_for: Callable[[int], Any], env: Mapping[str, str], what: str,
          fds: Sequence[int] = (), started: Callable[[int], None] | None = None,
          reap: Callable[[subprocess.Popen], Any] = subprocess.Popen.wait
          ) -> tuple[subprocess.Popen, socket.socket, Any]:
    """Start `python -m module` on a socket pair, its spec (`spec_for` the
    child's socket fd) pickled on stdin, and wait for its HELLO: (the process,
    our socket, the hello's header). When it says FAILED, exits or is silent
    for START_TIMEOUT_S, it is killed and reaped, and a ConfigError says why
    `what` did not start."""
    ours, theirs = socket.socketpair()
    spec = spec_for(theirs.fileno())
    try:
        process = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                                   env=dict(env), pass_fds=(theirs.fileno(), *fds))
    except OSError:
        ours.close()
        raise
    finally:
        theirs.close()
    if started is not None:
        started(process.pid)
    process.stdin.write(pickle.dumps(spec))
    process.stdin.close()
    ours.settimeout(START_TIMEOUT_S)
    try:
        hello = read_frame(ours)
    except (OSError, pickle.UnpicklingError):
        hello = None
    if hello is None or hello[1] != HELLO:
        why = (str(_error_of(hello[2])) if hello and hello[1] == FAILED
               else f"no answer in {START_TIMEOUT_S:.0f} s or it exited; its log is above")
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        reap(process)
        ours.close()
        raise ConfigError(f"{what} did not start: {why}")
    ours.settimeout(None)
    return process, ours, hello[2]


# -- the agent's side ------------------------------------------------------------------

async def in_thread(call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)` on a thread of its own. Engine processes start, stop and are
    waited for this way, not on asyncio's default executor: a few long waits
    there would leave no thread for anything else."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: Any, failed: bool) -> None:
        if not future.done():
            (future.set_exception if failed else future.set_result)(outcome)

    def run() -> None:
        try:
            outcome, failed = call(*args), False
        except BaseException as error:  # handed to the awaiting task
            outcome, failed = error, True
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, outcome, failed)

    threading.Thread(target=run, daemon=True, name=getattr(call, "__name__", "call")).start()
    return await future


class _InArena(dict):
    """A batch staged in the arena: its arrays, the block that holds them and
    where each array begins in the arena."""

    def __init__(self, arena: Arena, block: Block) -> None:
        super().__init__()
        self.arena, self.block = arena, block
        self.offsets: dict[str, int] = {}


class DeviceEngine(Engine):
    """An engine in a process of its own on one device. `start` and `run`
    block: call them from worker threads (the batcher's executor does)."""

    def __init__(self, device: Device, spec: EngineSpec, pool: DevicePool,
                 arena_bytes: int, batch_timeout_s: float = 300.0) -> None:
        self.label = device.name
        self._batch_timeout_s = batch_timeout_s
        self._device = device
        self._spec = spec
        self._pool = pool
        self._arena_bytes = arena_bytes
        self._arena: Arena | None = None
        self._arena_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._calls_lock = threading.Lock()
        self._next_id = 0
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._lost = "not started"
        self._facts = EngineFacts((), (), "cpu")

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self._facts.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._facts.outputs

    @property
    def device(self) -> str:
        return self._facts.device

    @property
    def up(self) -> bool:
        return not self._lost

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        """Start the engine process and wait until its engine is loaded and warm."""
        arena = Arena(self._arena_bytes)
        env = {**os.environ, **device_environment(self._device),
               "TIERED_ENGINE": self._spec.name}
        try:
            process, ours, hello = spawn(
                "tiered.agent.devices", lambda fd: EngineSpec(**{
                    **self._spec.__dict__, "socket_fd": fd, "arena_fd": arena.fd,
                    "arena_bytes": arena.size}),
                env, f"{self.label}: the engine process", (arena.fd,),
                lambda pid: self._pool.started(self.label, pid), self._reap)
        except (OSError, ConfigError):
            arena.close()
            raise
        previous = self._socket, self._arena
        with self._calls_lock:
            self._facts, self._process, self._socket, self._arena = hello, process, ours, arena
            self._lost = ""
        for old in previous:
            if old is not None:
                old.close()
        threading.Thread(target=self._read_replies, args=(ours, arena), daemon=True,
                         name=f"{self.label}-replies").start()

    def stage(self, requests: Sequence[Mapping[str, np.ndarray]]) -> Mapping[str, np.ndarray]:
        """Merge the requests straight into the arena (inline when it is full)."""
        arena = self._arena
        parts = {name: [np.asarray(r[name]) for r in requests] for name in requests[0]}
        sizes = {name: sum(p.nbytes for p in ps) for name, ps in parts.items()}
        if arena is None or any(p.dtype.hasobject for ps in parts.values() for p in ps):
            return super().stage(requests)
        with self._arena_lock:
            block = arena.allocate(sum(sizes.values()))
        if block is None:
            return super().stage(requests)
        staged, at = _InArena(arena, block), block.start
        for name, ps in parts.items():
            shape = (sum(p.shape[0] for p in ps), *ps[0].shape[1:])
            out = np.frombuffer(arena.memory, ps[0].dtype, sizes[name] // ps[0].itemsize,
                                at).reshape(shape)
            # numpy lets the GIL go while it copies: the batches of several
            # devices (and instances) merge on as many cores at once
            staged[name] = np.concatenate(ps, out=out)
            staged.offsets[name] = at
            at += sizes[name]
        return staged

    def run(self, inputs: Mapping[str, np.ndarray],
            outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        staged = inputs if isinstance(inputs, _InArena) else None
        try:
            future: concurrent.futures.Future = concurrent.futures.Future()
            with self._calls_lock:
                if self._lost:
                    raise EngineLost(f"{self.label}: {self._lost}")
                self._next_id += 1
                call_id = self._next_id
                self._calls[call_id] = future
                sock = self._socket
            wanted = list(outputs) if outputs else None
            if staged is not None:
                header = (IN_ARENA, [(n, a.dtype.str, a.shape, inputs.offsets[n], a.nbytes)
                                     for n, a in inputs.items()], wanted)
                payload = []
            else:
                described, payload = _described(inputs)
                header = (INLINE, [(n, d, s, 0, b) for n, d, s, b in described], wanted)
            try:
                send_frame(sock, self._send_lock, call_id, RUN, header, payload)
            except OSError as error:
                self._lose(f"the engine process is gone ({error})", sock)
            try:
                result = future.result(self._batch_timeout_s)
            except concurrent.futures.TimeoutError:
                log.error("%s: a batch took over %.0f s; the engine process is taken for hung "
                          "and killed", self.label, self._batch_timeout_s)
                self._kill(sock)
                raise EngineLost(f"{self.label}: the engine process hung (no answer in "
                                 f"{self._batch_timeout_s:.0f} s); restarting it") from None
        finally:
            if staged is not None:
                with self._arena_lock:
                    staged.arena.free(staged.block)
        return result

    def _read_replies(self, sock: socket.socket, arena: Arena) -> None:
        try:
            while (frame := read_frame(sock)) is not None:
                call_id, kind, header, payload = frame
                with self._calls_lock:
                    future = self._calls.pop(call_id, None)
                if future is None:
                    continue
                if kind == DONE:
                    future.set_result(_arrays(header, payload))
                else:
                    future.set_exception(_error_of(header))
        except OSError:
            pass
        self._lose("the engine process exited", sock)

    def _lose(self, why: str, sock: socket.socket | None) -> None:
        """Fail every call waiting on `sock`'s process (not a newer one's)."""
        with self._calls_lock:
            if sock is not self._socket:
                return
            self._lost = self._lost or why
            calls, self._calls = self._calls, {}
        for future in calls.values():
            future.set_exception(EngineLost(f"{self.label}: {why}"))

    def wait(self) -> int:
        """Block until the engine process exits; its exit code."""
        process = self._process
        if process is None:
            return 0
        code = self._reap(process)
        self._lose(f"the engine process exited with code {code}", self._socket)
        return code

    def _reap(self, process: subprocess.Popen) -> int:
        """Wait for the process; count its CPU time toward the device's."""
        try:
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
            self._pool.exited(self.label, process.pid, usage.ru_utime + usage.ru_stime)
        except ChildProcessError:  # reaped already
            self._pool.exited(self.label, process.pid, 0.0)
        return process.returncode if process.returncode is not None else -1

    def _kill(self, sock: socket.socket | None) -> None:
        """End the engine process that `sock` leads to (not a newer one)."""
        with self._calls_lock:
            process = self._process if sock is self._socket else None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    def describe(self) -> dict[str, str]:
        return dict(self._facts.facts)

    def close(self) -> None:
        """Ask the engine process to finish (end of its stream) and wait for it."""
        process, self._process = self._process, None
        self._lose("closed", self._socket)
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_WR)
        if process is not None and process.returncode is None:
            waiter = threading.Thread(target=self._reap, args=(process,), daemon=True)
            waiter.start()
            waiter.join(STOP_TIMEOUT_S)
            if waiter.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                waiter.join()
        if self._socket is not None:
            self._socket.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None


# -- the engine process ----------------------------------------------------------------

def main() -> int:
    """An engine process: load the engine on the one device it sees, say hello,
    then run batches until the agent closes its end."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    spec: EngineSpec = pickle.load(sys.stdin.buffer)
    sock = socket.socket(fileno=spec.socket_fd)
    send_lock = threading.Lock()
    from tiered.engines import open_engine
    from tiered.engines.base import warm_up

    try:
        engine = open_engine(spec.backend, spec.path, spec.settings, spec.where)
        warm_up(engine)
    except Exception as error:  # told to the agent, which reports it
        log.exception("engine did not load")
        send_frame(sock, send_lock, 0, FAILED, (type(error).__name__, str(error)))
        return 1
    arena = mmap.mmap(spec.arena_fd, spec.arena_bytes, access=mmap.ACCESS_READ)
    os.close(spec.arena_fd)
    send_frame(sock, send_lock, 0, HELLO,
               EngineFacts(engine.inputs, engine.outputs, engine.device, engine.describe()))
    log.info("%s on %s ready (pid %d)", spec.name, os.environ.get("TIERED_DEVICE", "?"),
             os.getpid())

    def serve(call_id: int, header, payload: memoryview) -> None:
        where, described, wanted = header
        try:
            if where == IN_ARENA:
                inputs = {name: np.frombuffer(arena, dtype, size // np.dtype(dtype).itemsize,
                                              offset).reshape(shape)
                          for name, dtype, shape, offset, size in described}
            else:
                inputs = _arrays([(n, d, s, b) for n, d, s, _, b in described], payload)
            outputs = engine.run(engine.accept(inputs), wanted)
            reply, data = _described(outputs)
            send_frame(sock, send_lock, call_id, DONE, reply, data)
        except OSError:
            pass  # the agent is gone: nothing to answer
        except Exception as error:  # answered to the batch's requests; the engine goes on
            if not isinstance(error, TieredError):
                log.exception("batch failed")
            with contextlib.suppress(OSError):
                send_frame(sock, send_lock, call_id, FAILED, (type(error).__name__, str(error)))

    with ThreadPoolExecutor(spec.instances, thread_name_prefix="batch") as workers:
        while (frame := read_frame(sock)) is not None:
            call_id, _, header, payload = frame
            workers.submit(serve, call_id, header, payload)
    engine.close()
    return 0


if __name__ == "__main__":
    from tiered.agent import devices  # what it pickles must name this module, not __main__

    sys.exit(devices.main())
