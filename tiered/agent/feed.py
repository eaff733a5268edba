"""The feed from an agent's front-end processes to its engine process.

With `front_ends: N`, N processes share the agent's port and take in gRPC;
one engine process holds the models, batchers and GPU. Each front end owns
an arena, a memfd whose descriptor it hands the engine once, when it
connects. Work that each request costs is done in the front ends, which run
in parallel; the engine's event loop handles frames, each carrying many
requests where it can.

- **A plain request** (raw input bytes of the shapes and datatypes its
  model's config names, no parameters, the model batched: what almost every
  client sends) is checked in the front end against the model's config
  (`ModelFacts`). It goes at once while fewer frames of its kind than the
  engine runs at once (`ModelFacts.frames_ahead`) (model, inputs, outputs) are in the engine; otherwise it joins
  the next frame, which gathers the requests of its kind until one of
  those is answered (or it holds the model's max batch size). A frame's
  input bytes are written into the arena as one batch, input by input, and
  one GROUP frame says where; the engine runs it as one request of that
  many rows and answers the outputs' bytes, which the front end splits and
  turns into each request's response. So at one request at a time nothing
  waits, and under load the engine sees a frame per several requests. Such
  a request may also have its inputs, its outputs or both in the client's
  system shared memory (as `perf_analyzer --shared-memory system` sends
  them): the front end reads those inputs and writes those outputs itself.
  Inputs and outputs in CUDA shared memory (`perf_analyzer --shared-memory
  cuda`) merge too, in frames of one caller's requests: the frame names each
  request's ranges, the engine (which alone maps CUDA regions) copies the
  rows into its batch device to device and writes those outputs, and a
  request whose output region cannot take them fails alone.
- **A streamed request to a generative model** (its text and token ids
  asked for, nothing in shared memory) goes in a STREAM frame. The engine
  answers first with what the text needs (the version, the most tokens a
  response may carry, where the version's tokenizer lies, the stop strings),
  then sends the stream's token ids as they come, all its streams' of one
  loop turn in one TOKENS notice. The front end makes the text (it
  detokenizes and applies the stop strings, with the tokenizer it opened
  once), builds each response, merging the tokens its client has not yet
  read up to that most, and sends a CANCEL frame when its client goes away
  (FINISH when a stop string ended the text: the engine ends it as done).
  So the engine's event loop does no per-token text, protobuf or gRPC work:
  the scheduler hands it a step's tokens of every stream in one call, and
  each front end's connection writes them in one frame.
- **Any other request** (parameters, BYTES, a model that does not batch,
  inputs partly in shared memory) travels alone in a ONE frame: the request without its
  raw input bytes, which lie in the arena (or inline when the arena is
  full), and the engine answers the serialized response.

The engine counts the requests and frames of each kind; the agent's
/metrics shows them (`tiered_front_end_requests_total{frame="batch"|"single"|"stream"}`).

A block of the arena is reused only once the engine has answered the frame
that used it.

Frames on a unix stream socket, little-endian; headers are `marshal`ed
tuples (both ends are one agent's processes):

    request  <IQdBI>  length of the rest, call id, seconds left (inf: none),
                      kind, header length; the header; then
             ONE      header (where: 0 arena / 1 inline, [(offset, length)]
                      per raw buffer, request bytes); the request without
                      raw_input_contents; inline raw bytes
             GROUP    header (model, version, [outputs wanted],
                      [(input, datatype, shape, arena offset, or
                      [(CUDA region, offset, byte size)] per request)],
                      [rows per request], caller of the CUDA regions or None,
                      [{output: its CUDA region's parameters}] per request or None)
             STREAM   header (); the request, raw inputs and all
             CANCEL   header (); the call id is the stream's
             FINISH   header (); as CANCEL, but a stop string ended its text
    reply    <IQHI>   length of the rest, call id, gRPC status code (0: OK),
                      header length; the header; then
             ONE      the serialized response (no header)
             GROUP    header (model, version, [(output, datatype, shape)],
                      {request index: (code, message)} for requests whose
                      outputs the engine could not write into their CUDA
                      regions); the outputs' bytes, one after another
             STREAM   header (version, most tokens a response, tokenizer backend,
                      its path, (stop string, ...)); its tokens come in notices
             error    the message (no header); it ends a stream
             notice   call id 0, header (what, news):
                      FORGET  (caller, name): a shared-memory region came or
                              went ("": all the caller's), which the front
                              end's view of the regions forgets
                      TOKENS  [(stream's call id, token id, prompt tokens,
                              finish reason: "" but on its last), ...]
                      TOKENIZERS  [(backend, path), ...]: generative
                              versions served, whose tokenizers the front
                              end opens before their first stream comes
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import math
import mmap
import os
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tiered.agent.generation import TextSide
from tiered.agent.shared_memory import (
    BYTE_SIZE,
    OFFSET,
    REGION,
    CallerRegions,
    CudaRange,
    Placed,
    RegionViews,
    not_registered,
)
from tiered.engines.base import DeviceRows
from tiered.engines.generative.text import Tokenizer, open_tokenizer
from tiered.errors import EngineError, TieredError, Unavailable
from tiered.protocol import codec, messages
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import model_config_pb2 as mc
from tiered.protocol.security import CALLER
from tiered.protocol.status import describe, status_code

if TYPE_CHECKING:
    from tiered.agent.scheduler import Piece

log = logging.getLogger(__name__)

REQUEST = struct.Struct("<IQdBI")
REPLY = struct.Struct("<IQHI")
LENGTH = struct.Struct("<I")
ONE, GROUP, STREAM, CANCEL, FINISH = 0, 1, 2, 3, 4
KINDS = {ONE: "single", GROUP: "batch", STREAM: "stream"}  # as /metrics counts them
NOTICE = 0  # the call id of a reply that answers no call
FORGET, TOKENS, TOKENIZERS = 0, 1, 2  # what a notice tells
IN_ARENA, INLINE = 0, 1
OK = 0
HELLO_BYTES = 64  # the hello message that carries the arena's descriptor
# The fewest frames of one key (model, inputs, outputs) a front end keeps in
# the engine at once; the requests that come meanwhile gather into the next.
MIN_FRAMES_AHEAD = 2
TOKENIZERS_KEPT = 16  # a front end's open tokenizers, the newest versions'

Output = tuple[str, str, list[int]]  # name, datatype, shape
# A STREAM call's first reply: the version answering, the most tokens a
# response may carry, its tokenizer's backend and path, its stop strings.
StreamHead = tuple[int, int, str, str, tuple[str, ...]]
# What `FeedClient.generate` yields: version, text, token ids, prompt tokens,
# finish reason, whether it is the last.
Chunk = tuple[int, str, list[int], int, str, bool]


class Answers(Protocol):
    """What the engine does with frames (`InferenceServicer` does it)."""

    async def answer_one(self, body: bytes, raw: list[memoryview], seconds_left: float) -> bytes:
        """A request's bytes and its raw input buffers -> the response's bytes."""

    async def answer_group(self, model: str, version: str, inputs: dict[str, np.ndarray],
                           outputs: Sequence[str], rows: Sequence[int], seconds_left: float,
                           ) -> tuple[str, str, dict[str, np.ndarray]]:
        """Requests merged row-wise -> (model, version, outputs by name)."""

    def start_generation(self, body: bytes, seconds_left: float,
                         deliver: Callable[[Piece | TieredError], None],
                         ) -> tuple[StreamHead, Callable[[bool], None]]:
        """A streamed request's bytes -> its tokens, one at a time to
        `deliver` on a later turn of the event loop, then or else the error
        that ends it; returns what the text needs and what stops it early
        (given True: a stop string ended it). Refusals are raised."""

    def regions(self, caller: str) -> CallerRegions:
        """The shared-memory regions `caller` names in its tensors."""


# -- the front end's side ----------------------------------------------------------

# Request parameters that leave a batched model's answer as it is: the
# caller (the front end handles its regions) and the decoupled models' flag.
_NO_EFFECT_ON_A_BATCH = frozenset((CALLER, messages.EMPTY_FINAL_RESPONSE))


@dataclass(frozen=True)
class ModelFacts:
    """What a front end knows of a model from its ModelConfig."""

    decoupled: bool = False
    generates_text: bool = False  # a generative model: its streams go in STREAM frames
    max_batch_size: int = 0  # 0: requests never share a frame
    # Frames of one kind a front end keeps in the engine: as many batches as
    # the model runs at once (instances on each of its devices), at least
    # MIN_FRAMES_AHEAD, so every device and instance gets work.
    frames_ahead: int = MIN_FRAMES_AHEAD
    inputs: Mapping[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    outputs: frozenset[str] = frozenset()

    @classmethod
    def of(cls, config: mc.ModelConfig) -> ModelFacts:
        batches = config.max_batch_size > 0 and config.HasField("dynamic_batching")
        instances = sum(group.count for group in config.instance_group) or 1
        devices = len(config.parameters["devices"].string_value.split(",")) \
            if "devices" in config.parameters else 1

        def datatype(tensor) -> str:
            name = mc.DataType.Name(tensor.data_type).removeprefix("TYPE_")
            return "BYTES" if name == "STRING" else name

        outputs = frozenset(t.name for t in config.output)
        decoupled = config.model_transaction_policy.decoupled
        return cls(
            decoupled=decoupled,
            generates_text=decoupled and {messages.TEXT_OUTPUT, messages.TOKEN_IDS} <= outputs,
            max_batch_size=config.max_batch_size if batches else 0,
            frames_ahead=max(MIN_FRAMES_AHEAD, instances * devices),
            inputs={t.name: (datatype(t), tuple(t.dims)) for t in config.input},
            outputs=outputs)

    def group_key(self, request: pb.ModelInferRequest,
                  buffers: Sequence[bytes | Placed | CudaRange], placed: Mapping[str, Placement] | None = None, caller: str = "",
                  ) -> tuple[tuple, int] | None:
        """(key, rows) when the request (`buffers`: its raw inputs, or the
        shared-memory ranges they lie in) may share a frame with others of its key:
        inputs the config accepts, no parameters but those of the outputs
        `placed` in shared memory; else None (it travels alone, and the
        engine checks it and answers any error). A frame that names CUDA
        ranges holds one caller's requests (the engine reads its regions)."""
        placed = placed or {}
        if (not self.max_batch_size or self.decoupled
                or any(key not in _NO_EFFECT_ON_A_BATCH for key in request.parameters)
                or len(buffers) != len(request.inputs)):
            return None
        rows, signature = None, []
        for tensor, raw in zip(request.inputs, buffers):
            expected = self.inputs.get(tensor.name)
            if (expected is None or expected[0] != tensor.datatype or tensor.datatype == "BYTES"
                    or len(tensor.parameters) or tensor.HasField("contents")):
                return None
            shape, dims = tuple(tensor.shape), expected[1]
            if len(shape) != len(dims) + 1 or any(d != -1 and s != d
                                                  for s, d in zip(shape[1:], dims)):
                return None
            if rows is None:
                rows = shape[0]
            size = _size(raw)
            if shape[0] != rows or size != math.prod(shape) * \
                    codec.DATATYPES[tensor.datatype].itemsize:
                return None
            signature.append((tensor.name, tensor.datatype, shape[1:]))
        if not rows or rows > self.max_batch_size or any(
                (o.parameters and o.name not in placed) or o.name not in self.outputs
                for o in request.outputs):
            return None
        outputs = tuple(o.name for o in request.outputs)
        on_device = any(isinstance(b, CudaRange) for b in buffers) or any(
            isinstance(p, OutputOnDevice) for p in placed.values())
        return (request.model_name, request.model_version, tuple(signature), outputs,
                caller if on_device else None), rows


@dataclass(frozen=True)
class OutputInRegion:
    """An output that the front end writes into the client's system shared
    memory itself: the range its parameters name in the caller's region,
    looked up again when written (the region may have gone meanwhile)."""

    views: RegionViews
    caller: str
    parameters: Mapping[str, object]  # echoed in the response, as the engine does

    def write(self, raw: bytes, field: str) -> None:
        placed = self.views.place(self.caller, self.parameters)
        if not isinstance(placed, Placed):  # gone, or now a CUDA region of that name
            raise not_registered(field, self.parameters.get(codec.SHARED_MEMORY_REGION))
        placed.write(raw, field)


@dataclass(frozen=True)
class OutputOnDevice:
    """An output asked for in a CUDA region: the engine process writes it
    there (it alone maps the region); the front end echoes its parameters."""

    parameters: Mapping[str, object]

    def write(self, raw: bytes, field: str) -> None:
        """Written by the engine already."""


Placement = OutputInRegion | OutputOnDevice


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


@dataclass(eq=False)
class _Group:
    """Plain requests of one key, gathered in one loop turn."""

    key: tuple
    requests: list[pb.ModelInferRequest] = field(default_factory=list)
    # each request's raw inputs, or the shared-memory ranges they lie in
    buffers: list[list[bytes | Placed | CudaRange]] = field(default_factory=list)
    placed: list[Mapping[str, Placement]] = field(default_factory=list)  # its outputs'
    rows: list[int] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)
    seconds_left: float = 0.0

    @property
    def total_rows(self) -> int:
        return sum(self.rows)


class FeedClient(asyncio.Protocol):
    """A front end's connection to the engine process."""

    def __init__(self, arena: Arena,
                 on_forget: Callable[[str, str], None] = lambda caller, name: None) -> None:
        self.arena = arena
        self.on_forget = on_forget  # a notice: the engine's region (caller, name) changed
        self.closed = asyncio.Event()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        # call id -> (the group's requests and futures, one future, or a
        # stream's replies; its block)
        self._calls: dict[int, tuple[_Group | asyncio.Future | _Replies, Block | None]] = {}
        self._tokenizers: dict[tuple[str, str], asyncio.Future] = {}  # (backend, path) ->
        self._next_id = 0
        self._in_flight: dict[tuple, int] = {}  # GROUP frames unanswered, by key
        self._gathering: dict[tuple, _Group] = {}  # the next frame of a key with enough

    @classmethod
    async def connect(cls, path: str, arena: Arena,
                      on_forget: Callable[[str, str], None] = lambda caller, name: None,
                      ) -> FeedClient:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        socket.send_fds(sock, [arena.size.to_bytes(8, "little").ljust(HELLO_BYTES, b"\0")],
                        [arena.fd])
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        _, client = await loop.create_connection(lambda: cls(arena, on_forget), sock=sock)
        return client

    def connection_made(self, transport) -> None:
        self._transport = transport

    def connection_lost(self, exc) -> None:
        gone = Unavailable("the agent's engine process is gone")
        waiting = [w for w, _ in self._calls.values()] + list(self._gathering.values())
        for each in waiting:
            if isinstance(each, _Replies):
                each.put(FedError(status_code(gone).value[0], str(gone)))
                continue
            for future in each.futures if isinstance(each, _Group) else [each]:
                if not future.done():
                    future.set_exception(gone)
        self._calls.clear()
        self._gathering.clear()
        self.closed.set()

    @property
    def _open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    async def infer(self, request: pb.ModelInferRequest, seconds_left: float,
                    facts: ModelFacts | None = None,
                    buffers: list[bytes | Placed | CudaRange] | None = None,
                    placed: Mapping[str, Placement] | None = None, caller: str = "") -> bytes:
        """Answer a ModelInferRequest through the engine: with others of its
        kind when `facts` (its model's) say it may share a frame, else alone.
        Its raw inputs (`buffers` when they were read elsewhere, such as from
        shared memory) are moved into the arena (the message loses them).
        Outputs `placed` are written into their regions here when it shares
        a frame; alone, the request keeps their parameters and the engine
        writes them."""
        if not self._open:
            raise Unavailable("the agent's engine process is gone")
        if buffers is None:
            buffers = list(request.raw_input_contents)
        del request.raw_input_contents[:]
        placed = placed or {}
        grouped = facts.group_key(request, buffers, placed, caller) \
            if facts is not None else None
        if grouped is None:
            return await self._answer(self._send_one(request, buffers, seconds_left))
        key, rows = grouped
        group = self._gathering.get(key)
        if group is not None and group.total_rows + rows > facts.max_batch_size:
            self._send_group(self._gathering.pop(key))  # full: it goes now
            group = None
        if group is None:
            group = _Group(key)
            if self._in_flight.get(key, 0) >= facts.frames_ahead:
                self._gathering[key] = group  # goes when a frame of its key is answered
        future = asyncio.get_running_loop().create_future()
        group.requests.append(request)
        group.buffers.append(buffers)
        group.placed.append(placed)
        group.rows.append(rows)
        group.futures.append(future)
        group.seconds_left = max(group.seconds_left, seconds_left)
        if key not in self._gathering:
            self._send_group(group)
        return await self._answer(future)

    async def generate(self, request: pb.ModelInferRequest, seconds_left: float,
                       ) -> AsyncIterator[Chunk]:
        """A streamed request to a generative model: the engine sends its
        token ids, which become text here (with the tokenizer and the stop
        strings its first reply names); the tokens that came while the caller
        was not reading go in one chunk, up to the most a response may carry.
        Closing this early cancels the request in the engine; a stop string
        ends it there as done."""
        if not self._open:
            raise Unavailable("the agent's engine process is gone")
        replies = _Replies()
        call_id = self._call(replies, None)
        self._write(call_id, seconds_left, STREAM, _NO_HEADER, [request.SerializeToString()])
        told = CANCEL  # what the engine hears if this ends before the engine ends it
        try:
            version, most, backend, path, stops = _taken(await replies.next())
            text = TextSide((await self._tokenizer(backend, path)).decode, stops)
            last = False
            while not last:
                texts, ids = [], []
                token, prompt_tokens, finish = _taken(await replies.next())
                while True:
                    words, last = text.add(token, bool(finish))
                    texts.append(words)
                    ids.append(token)
                    if last or len(ids) == most or not replies.has_token():
                        break
                    token, prompt_tokens, finish = replies.take()
                if finish:
                    told = None
                elif last:  # a stop string, before the engine's last token
                    told = FINISH
                yield (version, "".join(texts), ids, prompt_tokens,
                       "stop" if text.stopped else finish, last)
        finally:
            self._calls.pop(call_id, None)
            if told is not None and self._open:
                self._write(call_id, 0.0, told, _NO_HEADER, [])

    async def _tokenizer(self, backend: str, path: str) -> Tokenizer:
        """The tokenizer of the version at `path` (see `_open_tokenizer`)."""
        opening = self._open_tokenizer(backend, path)
        try:
            return await asyncio.shield(opening)  # a stream closed meanwhile is not its end
        except Exception as error:  # noqa: BLE001 -- the stream's error says it
            if self._tokenizers.get((backend, path)) is opening:
                del self._tokenizers[(backend, path)]  # the next stream tries again
            raise Unavailable(f"the front end cannot open the model's tokenizer: "
                              f"{error}") from error

    def _open_tokenizer(self, backend: str, path: str) -> asyncio.Future:
        """A tokenizer opened once, off the event loop (the engine names each
        served version's as it loads, before its first stream), and kept
        while its version is among the newest."""
        key = (backend, path)
        opening = self._tokenizers.get(key)
        if opening is None:
            if len(self._tokenizers) >= TOKENIZERS_KEPT:
                del self._tokenizers[next(iter(self._tokenizers))]
            opening = self._tokenizers[key] = asyncio.ensure_future(
                asyncio.to_thread(open_tokenizer, backend, Path(path)))
            opening.add_done_callback(_seen)
        return opening

    @staticmethod
    async def _answer(future: asyncio.Future) -> bytes:
        code, payload = await future
        if code != OK:
            raise FedError(code, payload.decode(errors="replace"))
        return payload

    def _call(self, waiting, block: Block | None) -> int:
        call_id = self._next_id = self._next_id + 1
        self._calls[call_id] = (waiting, block)
        return call_id

    def _write(self, call_id: int, seconds_left: float, kind: int, header: bytes,
               parts: Sequence[bytes]) -> None:
        length = REQUEST.size - LENGTH.size + len(header) + sum(map(len, parts))
        self._transport.writelines([
            REQUEST.pack(length, call_id, seconds_left, kind, len(header)), header, *parts])

    def _send_one(self, request: pb.ModelInferRequest, buffers: list[bytes | Placed | CudaRange],
                  seconds_left: float) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if any(isinstance(b, CudaRange) for b in buffers):  # the engine reads its regions
            for tensor, where in zip(request.inputs, buffers):
                for key, value in ((REGION, where.name), (OFFSET, where.offset),
                                   (BYTE_SIZE, where.byte_size)):
                    codec.set_parameter(tensor.parameters[key], value)
            buffers = []
        try:
            buffers = [b.read(f"input {t.name!r}") if isinstance(b, Placed) else b
                       for b, t in zip(buffers, request.inputs)]
        except TieredError as error:
            future.set_exception(error)
            return future
        total = sum(map(len, buffers))
        block = self.arena.allocate(total) if total else None
        spans, position = [], block.start if block else 0
        for buffer in buffers:
            if block is not None:
                self.arena.memory[position:position + len(buffer)] = buffer
            spans.append((position, len(buffer)))
            position += len(buffer)
        body = request.SerializeToString()
        where = IN_ARENA if block is not None or not buffers else INLINE
        self._write(self._call(future, block), seconds_left, ONE,
                    marshal.dumps((where, spans, len(body))),
                    [body, *(buffers if where == INLINE else [])])
        return future

    def _send_group(self, group: _Group) -> None:
        if not self._open:
            for future in group.futures:
                if not future.done():
                    future.set_exception(Unavailable("the agent's engine process is gone"))
            return
        total = sum(_size(b) for buffers in group.buffers for b in buffers
                    if not isinstance(b, CudaRange))
        block = self.arena.allocate(total) if total else None
        if total and block is None:  # no room for them together: each travels alone, inline
            for request, buffers, future in zip(group.requests, group.buffers, group.futures):
                _chain(self._send_one(request, buffers, group.seconds_left), future)
            return
        model, version, signature, outputs, caller = group.key
        inputs, position, memory = [], block.start if block else 0, self.arena.memory
        for index, (name, datatype, shape) in enumerate(signature):
            parts = [buffers[index] for buffers in group.buffers]
            if isinstance(parts[0], CudaRange):  # the engine copies them on the device
                inputs.append((name, datatype, [group.total_rows, *shape],
                               [(r.name, r.offset, r.byte_size) for r in parts]))
                continue
            inputs.append((name, datatype, [group.total_rows, *shape], position))
            for buffer, future in zip(parts, group.futures):
                try:
                    _fill(memory, position, buffer, f"input {name!r}")
                except TieredError as error:  # its region shrank: it fails alone
                    if not future.done():
                        future.set_exception(error)
                position += _size(buffer)
        on_device = [{name: dict(where.parameters) for name, where in placed.items()
                      if isinstance(where, OutputOnDevice)} for placed in group.placed]
        self._in_flight[group.key] = self._in_flight.get(group.key, 0) + 1
        self._write(self._call(group, block), group.seconds_left, GROUP,
                    marshal.dumps((model, version, list(outputs), inputs, group.rows, caller,
                                   on_device if caller is not None else None)), [])

    def _answered(self, key: tuple) -> None:
        """A frame of `key` came back: the requests gathered meanwhile go."""
        left = self._in_flight.pop(key) - 1
        if left:
            self._in_flight[key] = left
        gathered = self._gathering.pop(key, None)
        if gathered is not None:
            self._send_group(gathered)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        buffer, used = self._buffer, 0
        while len(buffer) - used >= REPLY.size:
            length, call_id, code, header_length = REPLY.unpack_from(buffer, used)
            end = used + LENGTH.size + length
            if len(buffer) < end:
                break
            start = used + REPLY.size + header_length
            header = bytes(buffer[used + REPLY.size:start]) if header_length else None
            payload = bytes(memoryview(buffer)[start:end])  # one copy, not two
            used = end
            if call_id == NOTICE:
                self._noticed(*marshal.loads(header))
                continue
            stream, _ = self._calls.get(call_id, (None, None))
            if isinstance(stream, _Replies):  # its head, or its error; its reader ends it
                stream.put(marshal.loads(header) if code == OK and header is not None
                           else FedError(code, payload.decode(errors="replace")))
                continue
            waiting, block = self._calls.pop(call_id, (None, None))
            if block is not None:
                self.arena.free(block)
            if isinstance(waiting, _Group):
                self._answered(waiting.key)
                _answer_group(waiting, code, header, payload)
            elif waiting is not None and not waiting.done():
                waiting.set_result((code, payload))
        del buffer[:used]


    def _noticed(self, what: int, news) -> None:
        if what == FORGET:
            self.on_forget(*news)
            return
        if what == TOKENIZERS:
            for backend, path in news:
                self._open_tokenizer(backend, path)
            return
        for call_id, token, prompt_tokens, finish in news:  # TOKENS
            stream, _ = self._calls.get(call_id, (None, None))
            if stream is not None:  # else its reader has gone
                stream.put((token, prompt_tokens, finish))


_NO_HEADER = marshal.dumps(())


def _seen(opening: asyncio.Future) -> None:
    """A tokenizer opened ahead with nobody waiting: its error is the stream's
    to tell, not the loop's."""
    if not opening.cancelled():
        opening.exception()


class _Replies:
    """A STREAM call's replies as they come, for its reader: its head, then
    its tokens (token id, prompt tokens, finish reason), or an error."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self._came = asyncio.Event()

    def put(self, item) -> None:
        self._items.append(item)
        self._came.set()

    async def next(self):
        while not self._items:
            self._came.clear()
            await self._came.wait()
        return self._items.popleft()

    def has_token(self) -> bool:
        """Whether a token waits (not an error: what came before goes first)."""
        return bool(self._items) and not isinstance(self._items[0], FedError)

    def take(self):
        return self._items.popleft()


def _taken(item):
    """A stream's reply; its error raised."""
    if isinstance(item, FedError):
        raise item
    return item


def _answer_group(group: _Group, code: int, header: bytes | None, payload: bytes) -> None:
    """Each request of a group its own response, cut from the group's outputs."""
    results = [(code, payload)] * len(group.futures)
    if code == OK:
        try:
            results = _cut(group, marshal.loads(header), payload)
        except Exception as error:  # a reply this front end cannot read fails its requests
            log.exception("a group's reply could not be cut into responses")
            results = [(status_code(error).value[0], describe(error).encode())] * len(results)
    for future, result in zip(group.futures, results):
        if not future.done():
            future.set_result(result)


def _cut(group: _Group, header, payload: bytes) -> list[tuple[int, bytes]]:
    model, version, outputs, failed = header
    total, cuts, position = group.total_rows, [], 0
    for name, datatype, shape in outputs:
        if not shape or shape[0] != total:
            raise EngineError(f"output {name!r} of shape {shape} does not have the "
                              f"{total} rows of the requests merged")
        size = math.prod(shape) * codec.DATATYPES[datatype].itemsize
        cuts.append((name, datatype, shape[1:], size // total, position))
        position += size
    results, row = [], 0
    for index, (request, rows, placed) in enumerate(zip(group.requests, group.rows,
                                                        group.placed)):
        if index in failed:  # the engine could not write its outputs into its CUDA regions
            code, message = failed[index]
            results.append((code, message.encode()))
            row += rows
            continue
        if group.futures[index].done():  # failed already, as its inputs were read
            results.append((OK, b""))
            row += rows
            continue
        response = pb.ModelInferResponse(model_name=model, model_version=version, id=request.id)
        try:
            for name, datatype, shape, row_bytes, start in cuts:
                tensor = response.outputs.add(name=name, datatype=datatype, shape=[rows, *shape])
                begin = start + row * row_bytes
                data = payload[begin:begin + rows * row_bytes]
                where = placed.get(name)
                if where is not None:  # as the engine answers it: the region, no bytes
                    where.write(data, f"output {name!r}")
                    for key, value in where.parameters.items():
                        codec.set_parameter(tensor.parameters[key], value)
                    data = b""
                response.raw_output_contents.append(data)
            results.append((OK, response.SerializeToString()))
        except (TieredError, OSError) as error:  # this request's region only
            results.append((status_code(error).value[0], describe(error).encode()))
        row += rows
    return results


def _size(buffer: bytes | Placed | CudaRange) -> int:
    return buffer.byte_size if isinstance(buffer, Placed | CudaRange) else len(buffer)


def _fill(memory: mmap.mmap, position: int, buffer: bytes | Placed, field: str) -> None:
    """An input's bytes into the arena at `position`: a region's range is read
    straight there (one copy)."""
    if not isinstance(buffer, Placed):
        memory[position:position + len(buffer)] = buffer
        return
    with memoryview(memory) as view, view[position:position + buffer.byte_size] as target:
        buffer.read_into(target, field)


def _chain(source: asyncio.Future, target: asyncio.Future) -> None:
    def copy(done: asyncio.Future) -> None:
        if target.done():
            return
        if done.exception() is not None:
            target.set_exception(done.exception())
        else:
            target.set_result(done.result())
    source.add_done_callback(copy)


class FedError(TieredError):
    """An error the engine process answered, with its gRPC status code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- the engine's side -------------------------------------------------------------

class FeedServer:
    """Listens on a unix socket for front ends and answers their frames."""

    def __init__(self, path: str, answers: Answers, max_frame_bytes: int,
                 pin: Callable[[mmap.mmap], Callable[[], None] | None] = lambda _: None,
                 tokenizers: Callable[[], set[tuple[str, str]]] = set) -> None:
        self.path = path
        self.answers = answers
        self.tokenizers = tokenizers  # (backend, path) of each generative version served
        self.pin = pin  # page-locks an arena for the GPU; returns what unpins it
        self.max_frame_bytes = max_frame_bytes
        self.connected = asyncio.Condition()
        self.connections: set[_FeedConnection] = set()
        # Requests and frames taken in, by kind: "batch" (GROUP frames: the
        # front ends' path), "single" (ONE frames: the engine's) or "stream"
        # (a generative model's streamed requests).
        self.requests = dict.fromkeys(KINDS.values(), 0)
        self.frames = dict.fromkeys(KINDS.values(), 0)
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
                try:  # writable only so that CUDA can page-lock it; never written here
                    memory = mmap.mmap(fds[0], size)
                finally:
                    os.close(fds[0])
                sock.setblocking(False)
            except OSError as error:
                log.warning("refused a front end: %s", error)
                sock.close()
                continue
            await loop.create_connection(lambda: _FeedConnection(self, memory), sock=sock)

    def announce(self) -> None:
        """Name the served generative versions' tokenizers to every front end
        (each hears of a version once), which opens them ahead of their
        first stream."""
        served = self.tokenizers()
        for connection in self.connections:
            connection.announce(served)

    def forget(self, caller: str, name: str) -> None:
        """Tell every front end that the system region (caller, name) came or went."""
        notice = _notice(FORGET, (caller, name))
        for connection in self.connections:
            connection.write(notice)

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
        self._unpin = server.pin(arena)
        self.arena = memoryview(arena)
        self._memory = arena
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._tasks: set[asyncio.Task] = set()
        self._streams: dict[int, Callable[[bool], None]] = {}  # call id -> what stops it
        self._unsent: list[bytes] = []  # replies of this loop turn, written together
        self._tokens: list[tuple] = []  # streams' tokens since the last reply, one notice
        self._announced: set[tuple[str, str]] = set()  # tokenizers named to the front end
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self.announce(self.server.tokenizers())
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.server.connected:
            self.server.connected.notify_all()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        streams, self._streams = list(self._streams.values()), {}
        for stop in streams:  # nobody is left to read them
            stop()
        with contextlib.suppress(BufferError):  # a request still reads it: closes with it
            self.arena.release()
            if self._unpin is not None:
                self._unpin()
            self._memory.close()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        buffer, used = self._buffer, 0
        while len(buffer) - used >= REQUEST.size:
            length, call_id, seconds_left, kind, header_length = REQUEST.unpack_from(
                buffer, used)
            if length > self.server.max_frame_bytes:
                log.error("a front end sent a frame of %d bytes; closing it", length)
                self.transport.close()
                return
            end = used + LENGTH.size + length
            if len(buffer) < end:
                break
            start = used + REQUEST.size
            header = marshal.loads(memoryview(buffer)[start:start + header_length])
            rest = bytes(memoryview(buffer)[start + header_length:end])
            used = end
            if kind in (CANCEL, FINISH):
                stop = self._streams.pop(call_id, None)
                if stop is not None:
                    stop(kind == FINISH)
                continue
            self.server.frames[KINDS[kind]] += 1
            self.server.requests[KINDS[kind]] += len(header[4]) if kind == GROUP else 1
            if kind == STREAM:
                self._stream(call_id, rest, seconds_left)
                continue
            serve = self._one(header, rest, seconds_left) if kind == ONE \
                else self._group(header, seconds_left)
            task = asyncio.get_running_loop().create_task(self._reply(call_id, serve))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        del buffer[:used]

    async def _one(self, header, rest: bytes, seconds_left: float) -> tuple[bytes, list]:
        where, spans, body_length = header
        if where == IN_ARENA:
            raw = [self.arena[offset:offset + size] for offset, size in spans]
        else:
            inline = memoryview(rest)[body_length:]
            raw = [inline[offset:offset + size] for offset, size in spans]
        return b"", [await self.server.answers.answer_one(rest[:body_length], raw,
                                                          seconds_left)]

    async def _group(self, header, seconds_left: float) -> tuple[bytes, list]:
        model, version, outputs, inputs, rows, caller, on_device = header
        regions = self.server.answers.regions(caller) if caller is not None else None
        arrays = {}
        for name, datatype, shape, where in inputs:
            if isinstance(where, int):  # an offset in the arena
                dtype = codec.DATATYPES[datatype]
                arrays[name] = np.frombuffer(self.arena, dtype, math.prod(shape), where) \
                    .reshape(shape)
            else:  # CUDA ranges, a request's rows each (one caller's: an error fails them all)
                arrays[name] = _joined([
                    regions.read({REGION: region, OFFSET: offset, BYTE_SIZE: size}, datatype,
                                 [count, *shape[1:]], f"input {name!r}")
                    for (region, offset, size), count in zip(where, rows)])
        model, version, results = await self.server.answers.answer_group(
            model, version, arrays, outputs, rows, seconds_left)
        failed = {}
        if on_device and any(on_device):  # copies to the GPU, waited for: off the event loop
            written = await asyncio.to_thread(regions.write_rows, on_device, rows, results)
            failed = {index: (status_code(error).value[0], describe(error))
                      for index, error in written.items()}
        described, payload = [], []
        for name, array in results.items():
            datatype, shape, raw = codec.to_raw(array)
            described.append((name, datatype, shape))
            payload.append(raw)
        return marshal.dumps((model, version, described, failed)), payload

    async def _reply(self, call_id: int, serve: Awaitable[tuple[bytes, list]]) -> None:
        try:
            (header, payload), code = await serve, OK
        except Exception as error:  # answered to the client; the engine goes on
            header, payload, code = b"", [describe(error).encode()], status_code(error).value[0]
        self._send(call_id, code, header, payload)

    def _stream(self, call_id: int, body: bytes, seconds_left: float) -> None:
        """A generative request: a reply saying what its text needs, then its
        tokens as they come (all the streams' of a loop turn in one notice);
        an error ends it. A CANCEL frame (its client went away) stops it, a
        FINISH frame (its stop string) ends it as done."""
        def deliver(event: Piece | TieredError) -> None:
            if isinstance(event, TieredError):
                self._streams.pop(call_id, None)
                self._send(call_id, status_code(event).value[0], b"", [describe(event).encode()])
                return
            if event.last:
                self._streams.pop(call_id, None)
            self._flush_soon()
            self._tokens.append((call_id, event.token_id, event.prompt_tokens, event.finish))

        try:
            head, self._streams[call_id] = self.server.answers.start_generation(
                body, seconds_left, deliver)
        except Exception as error:  # answered to the client; the engine goes on
            self._send(call_id, status_code(error).value[0], b"", [describe(error).encode()])
            return
        self._send(call_id, OK, marshal.dumps(head), ())

    def announce(self, served: set[tuple[str, str]]) -> None:
        new = served - self._announced
        self._announced = set(served)
        if new:
            self.write(_notice(TOKENIZERS, sorted(new)))

    def _send(self, call_id: int, code: int, header: bytes, payload: Sequence[bytes]) -> None:
        length = REPLY.size - LENGTH.size + len(header) + sum(map(len, payload))
        self.write([REPLY.pack(length, call_id, code, len(header)), header, *payload])

    def write(self, parts: Sequence[bytes]) -> None:
        """Bytes for the front end, written at the end of this loop turn with
        the turn's other replies (after the tokens that came before them):
        one system call for a step's tokens of every stream, not one a stream."""
        self._flush_soon()
        self._tokens_out()
        self._unsent += parts

    def _flush_soon(self) -> None:
        """The first bytes of this loop turn: written at its end."""
        if not self._unsent and not self._tokens:
            self._loop.call_soon(self._flush)

    def _tokens_out(self) -> None:
        if self._tokens:
            self._unsent += _notice(TOKENS, self._tokens)
            self._tokens = []

    def _flush(self) -> None:
        self._tokens_out()
        unsent, self._unsent = self._unsent, []
        if not self.transport.is_closing():
            self.transport.writelines(unsent)


def _notice(what: int, news) -> list[bytes]:
    header = marshal.dumps((what, news))
    return [REPLY.pack(REPLY.size - LENGTH.size + len(header), NOTICE, OK, len(header)), header]


def _joined(parts: list) -> np.ndarray | DeviceRows:
    """Requests' rows read from CUDA regions as one input: left on the device
    where every part is, else one host array."""
    if all(isinstance(part, DeviceRows) for part in parts):
        return DeviceRows.joined(parts)
    return np.concatenate([np.asarray(part) for part in parts])
