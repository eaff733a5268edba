"""The feed from an agent's front-end processes to its engine process.

With `front_ends: N`, N processes share the agent's port and take in gRPC;
one engine process holds the models, batchers and GPU. Each front end owns
an arena, a memfd whose descriptor it hands the engine once, when it
connects. For every ModelInfer it copies the request's raw input bytes into
its arena and sends a small frame: the request without those bytes, where
they lie, and the seconds left. The engine reads the tensors in place (never
pickled, no copy before the batch is merged) and answers with the response's
serialized bytes, which the front end gives gRPC untouched. A block of the
arena is reused only once the engine has answered the request that used it.

Frames on a unix stream socket, little-endian:

    request  <IQdBHI>  length of the rest, call id, seconds left (inf: none),
                       where (0: arena, 1: inline), raw buffers, request bytes;
             <QQ>      (offset, length) per raw buffer: in the arena, or
                       after the request bytes when inline;
             the request without raw_input_contents; inline raw bytes.
    reply    <IQH>     length of the rest, call id, gRPC status code (0: OK);
             the serialized response, or the error message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import socket
import struct
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from tiered.errors import TieredError, Unavailable
from tiered.protocol.status import describe, status_code

log = logging.getLogger(__name__)

REQUEST = struct.Struct("<IQdBHI")
SPAN = struct.Struct("<QQ")
REPLY = struct.Struct("<IQH")
LENGTH = struct.Struct("<I")
IN_ARENA, INLINE = 0, 1
OK = 0
HELLO_BYTES = 64  # the hello message that carries the arena's descriptor

# The engine's handler: (request bytes, raw input buffers, seconds left) -> response bytes.
Answer = Callable[[bytes, list[memoryview], float], Awaitable[bytes]]


# -- the front end's side ----------------------------------------------------------

@dataclass(eq=False)
class Block:
    start: int
    end: int
    done: bool = False


class Arena:
    """A ring of variable-sized blocks in a memfd, freed in any order (space
    comes back when the oldest live block is freed). Bounded: a request that
    does not fit travels inline instead of waiting."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create("tiered-feed", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            os.posix_fallocate(self.fd, 0, size)  # fail now, not with SIGBUS on a write
            self.memory = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self._live: deque[Block] = deque()
        self._head = 0

    def allocate(self, size: int) -> Block | None:
        live = self._live
        if not live:
            self._head = 0
        wrapped = len(live) > 1 and live[-1].start < live[0].start
        tail = live[0].start if live else self.size
        if wrapped:  # free: [head, tail)
            start = self._head if tail - self._head >= size else None
        elif self.size - self._head >= size:  # free: [head, size) and [0, tail)
            start = self._head
        else:
            start = 0 if tail >= size else None
        if start is None:
            return None
        block = Block(start, start + size)
        live.append(block)
        self._head = block.end
        return block

    def free(self, block: Block) -> None:
        block.done = True
        while self._live and self._live[0].done:
            self._live.popleft()

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.memory.close()
        os.close(self.fd)


class FeedClient(asyncio.Protocol):
    """A front end's connection to the engine process."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.closed = asyncio.Event()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._calls: dict[int, tuple[asyncio.Future, Block | None]] = {}
        self._next_id = 0

    @classmethod
    async def connect(cls, path: str, arena: Arena) -> FeedClient:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        socket.send_fds(sock, [arena.size.to_bytes(8, "little").ljust(HELLO_BYTES, b"\0")],
                        [arena.fd])
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        _, client = await loop.create_connection(lambda: cls(arena), sock=sock)
        return client

    def connection_made(self, transport) -> None:
        self._transport = transport

    def connection_lost(self, exc) -> None:
        for future, _ in self._calls.values():
            if not future.done():
                future.set_exception(Unavailable("the agent's engine process is gone"))
        self._calls.clear()
        self.closed.set()

    async def infer(self, request, seconds_left: float) -> bytes:
        """Answer a ModelInferRequest through the engine; its raw inputs are
        moved into the arena (the message loses them)."""
        if self._transport is None or self._transport.is_closing():
            raise Unavailable("the agent's engine process is gone")
        buffers = list(request.raw_input_contents)
        total = sum(map(len, buffers))
        block = self.arena.allocate(total) if total else None
        spans, position = [], block.start if block else 0
        for buffer in buffers:
            if block is not None:
                self.arena.memory[position:position + len(buffer)] = buffer
            spans.append(SPAN.pack(position, len(buffer)))
            position += len(buffer)
        del request.raw_input_contents[:]
        body = request.SerializeToString()
        where = IN_ARENA if block is not None or not buffers else INLINE
        tail = buffers if where == INLINE else []
        length = (REQUEST.size - LENGTH.size + SPAN.size * len(spans) + len(body)
                  + (total if where == INLINE else 0))
        call_id = self._next_id = self._next_id + 1
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (future, block)
        self._transport.writelines([
            REQUEST.pack(length, call_id, seconds_left, where, len(spans), len(body)),
            *spans, body, *tail,
        ])
        code, payload = await future
        if code != OK:
            raise FedError(code, payload.decode(errors="replace"))
        return payload

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        buffer, used = self._buffer, 0
        while len(buffer) - used >= REPLY.size:
            length, call_id, code = REPLY.unpack_from(buffer, used)
            end = used + LENGTH.size + length
            if len(buffer) < end:
                break
            payload = bytes(memoryview(buffer)[used + REPLY.size:end])  # one copy, not two
            used = end
            future, block = self._calls.pop(call_id, (None, None))
            if block is not None:
                self.arena.free(block)
            if future is not None and not future.done():
                future.set_result((code, payload))
        del buffer[:used]


class FedError(TieredError):
    """An error the engine process answered, with its gRPC status code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- the engine's side -------------------------------------------------------------

class FeedServer:
    """Listens on a unix socket for front ends and answers their requests."""

    def __init__(self, path: str, answer: Answer, max_frame_bytes: int) -> None:
        self.path = path
        self._answer = answer
        self._max_frame_bytes = max_frame_bytes
        self.connected = asyncio.Condition()
        self.connections: set[_FeedConnection] = set()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            try:
                sock.setblocking(True)
                sock.settimeout(5.0)
                message, fds, _, _ = await loop.run_in_executor(
                    None, socket.recv_fds, sock, HELLO_BYTES, 1)
                if len(message) != HELLO_BYTES or len(fds) != 1:
                    raise OSError("a front end's hello carried no arena")
                size = int.from_bytes(message[:8], "little")
                try:
                    memory = mmap.mmap(fds[0], size, access=mmap.ACCESS_READ)
                finally:
                    os.close(fds[0])
                sock.setblocking(False)
            except OSError as error:
                log.warning("refused a front end: %s", error)
                sock.close()
                continue
            await loop.create_connection(lambda: _FeedConnection(self, memory), sock=sock)

    async def wait_for(self, count: int, timeout_s: float) -> None:
        async with self.connected:
            await asyncio.wait_for(
                self.connected.wait_for(lambda: len(self.connections) >= count), timeout_s)

    async def close(self) -> None:
        self._accepting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._accepting
        self._listener.close()
        for connection in list(self.connections):
            connection.transport.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class _FeedConnection(asyncio.Protocol):
    def __init__(self, server: FeedServer, arena: mmap.mmap) -> None:
        self.server = server
        self.arena = memoryview(arena)
        self._memory = arena
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._tasks: set[asyncio.Task] = set()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.server.connected:
            self.server.connected.notify_all()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        with contextlib.suppress(BufferError):  # a request still reads it: closes with it
            self.arena.release()
            self._memory.close()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        buffer, used = self._buffer, 0
        while len(buffer) - used >= REQUEST.size:
            length, call_id, seconds_left, where, count, body_length = REQUEST.unpack_from(
                buffer, used)
            if length > self.server._max_frame_bytes:
                log.error("a front end sent a frame of %d bytes; closing it", length)
                self.transport.close()
                return
            end = used + LENGTH.size + length
            if len(buffer) < end:
                break
            frame = bytes(memoryview(buffer)[used + REQUEST.size:end])
            used = end
            spans = [SPAN.unpack_from(frame, i * SPAN.size) for i in range(count)]
            body_start = count * SPAN.size
            body = frame[body_start:body_start + body_length]
            if where == IN_ARENA:
                raw = [self.arena[offset:offset + size] for offset, size in spans]
            else:
                inline = memoryview(frame)[body_start + body_length:]
                raw = [inline[offset:offset + size] for offset, size in spans]
            task = asyncio.get_running_loop().create_task(
                self._serve(call_id, body, raw, seconds_left))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        del buffer[:used]

    async def _serve(self, call_id: int, body: bytes, raw: Sequence[memoryview],
                     seconds_left: float) -> None:
        try:
            payload, code = await self.server._answer(body, list(raw), seconds_left), OK
        except Exception as error:  # answered to the client; the engine goes on
            payload, code = describe(error).encode(), status_code(error).value[0]
        if not self.transport.is_closing():
            self.transport.writelines([REPLY.pack(REPLY.size - LENGTH.size + len(payload),
                                                  call_id, code), payload])
