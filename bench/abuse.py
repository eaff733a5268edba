"""Benchmark: the security review's abuse cases (issue 26) replayed against a
real agent and a real router, with what each costs the server.

One `tiered agent --tier edge` (with front-end processes) and one `tiered
router` in front of it run on loopback; both require an inference token, the
agent a shared-memory token per caller (alice, bob). Each input below is
sent to each server it applies to, one after the other:

- shared memory (agent): a region registered without credentials, a region
  whose file is truncated before the inference reads it, another caller's
  unregister-all (empty name), one caller past its cap of regions;
- credentials: an inference with no token and with a wrong one (the router
  must not forward it: the agent's count of answered requests stays put);
- client errors: wrong-shape requests to the canary version (INVALID_ARGUMENT);
- big bodies over REST: one byte over the message limit (413, sent until the
  server answers), a body of that size without credentials (401 before it is
  read), the most empty BYTES elements a body of that size holds, JSON nested
  past the parser's depth, JSON with NaN and Infinity;
- slots: one gRPC connection holding more idle streams than the per-connection
  cap, and several REST bodies trickled byte by byte;
- odd text: a non-ASCII token, a token and a `tiered-key` of invalid UTF-8.

Per (input, server): the answer (gRPC status or HTTP code, and the head of its
message), the server's peak RSS while it was handled (its process and its
children, from /proc every 20 ms), the latency of health checks sent
meanwhile from another process (gRPC ServerLive and REST GET
/v2/health/live, every 20 ms), and whether the server still lived after it.

Targets: health answered (and live) within 100 ms during every input; peak memory under
the memory limits of the Helm chart (helm/tiered/values.yaml: the router's
resources.limits.memory; the chart sets none for agents, whose resources a
TieredModel gives, so the agent is held to the edge tier's limit in
examples/kubernetes/digits.yaml); 0 crashes; every answer the one expected
(a client error, never 500 or INTERNAL). Writes bench/results/abuse.json and
prints a table; the exit status is 1 when a target is missed (with
`--smoke`, which runs beside other work, every target but health latency,
which it reports: a health check unanswered within its timeout, 10 s there
and 2 s in a full run, still fails it).

Run: `.venv/bin/python bench/abuse.py` (the real sizes: 64 MiB bodies, 1,030
idle streams, 16 slow bodies; under 3 minutes), or `--smoke --out PATH` (a
1 MiB message limit and fewer streams and bodies: about 20 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import http.client
import json
import multiprocessing as mp
import os
import select
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

import grpc  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from bench import common  # noqa: E402
from tiered.agent.repository import model_file, write_config  # noqa: E402
from tiered.agent.shared_memory import MAX_REGIONS_PER_CALLER  # noqa: E402
from tiered.local.processes import AgentProcess, RouterProcess, ServerProcess  # noqa: E402
from tiered.models import zoo  # noqa: E402
from tiered.protocol import grpc_service_pb2 as pb  # noqa: E402
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc  # noqa: E402
from tiered.protocol import routing  # noqa: E402
from tiered.protocol.handlers import MAX_STREAMS_PER_CONNECTION  # noqa: E402
from tiered.settings import Quantity  # noqa: E402

TARGET_HEALTH_MS = 100.0
HEALTH_LATENCY = "health during every input"
TARGET_CRASHES = 0
CHART = REPO_ROOT / "helm" / "tiered" / "values.yaml"
EXAMPLE_MODEL = REPO_ROOT / "examples" / "kubernetes" / "digits.yaml"
EDGE_PROFILE = REPO_ROOT / "tiered" / "profiles" / "edge.yaml"
DEFAULT_MESSAGE_BYTES = 64 << 20  # the servers' default limit (tier profiles, router)
TOKEN, ALICE, BOB = "reader", "alice", "bob"
MiB = float(1 << 20)
MESSAGE_HEAD = 120  # characters of an answer's message kept
MIN_WINDOW_S = 0.12  # an input is watched at least this long: a few health polls
CALL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Settings:
    max_message_bytes: int = DEFAULT_MESSAGE_BYTES  # both servers' limit
    wrong_shape_requests: int = 100
    idle_streams: int = 1030  # on one connection; the cap is MAX_STREAMS_PER_CONNECTION
    hold_streams_s: float = 1.0  # how long they are held while health is polled
    slow_bodies: int = 16
    trickle_s: float = 3.0  # each slow body takes this long to arrive
    front_ends: int = 2  # the agent's front-end processes (children whose RSS counts)
    poll_s: float = 0.02  # health polls and memory samples
    health_timeout_s: float = 2.0  # a health check unanswered by then failed


SMOKE = Settings(max_message_bytes=1 << 20, wrong_shape_requests=20, idle_streams=300,
                 hold_streams_s=0.3, slow_bodies=4, trickle_s=0.5, front_ends=1,
                 # beside the suite's other work, 300 streams opened on one connection
                 # held a router's gRPC health for 1.7 s (50-85 ms on an idle machine)
                 health_timeout_s=10.0)


# --------------------------------------------------------------------------- limits


def memory_limits(chart: Path = CHART, example: Path = EXAMPLE_MODEL) -> dict[str, float]:
    """Bytes each server may hold: the chart's router limit, and the example
    TieredModel's edge-tier limit for the agent (the chart sets none for agents)."""
    values = yaml.safe_load(chart.read_text())
    model = yaml.safe_load(example.read_text())
    agent = model["spec"]["tiers"]["edge"]["resources"]["limits"]["memory"]
    return {"router": float(Quantity(values["router"]["resources"]["limits"]["memory"]).value()),
            "agent": float(Quantity(agent).value())}


# --------------------------------------------------------------------------- measuring


def tree_rss_bytes(pid: int) -> int | None:
    """Resident bytes of a process and its descendants (/proc, Linux): an
    agent's front ends and engine processes are its children."""
    tree, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        for listing in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                children = [int(child) for child in listing.read_text().split()]
            except (OSError, ValueError):
                continue
            tree += children
            frontier += children
    pages = 0
    for member in tree:
        try:
            pages += int(Path(f"/proc/{member}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            if member == pid:
                return None  # the server itself is gone
    return pages * os.sysconf("SC_PAGE_SIZE")


def watch_health(grpc_address: str, http_address: str, period_s: float, timeout_s: float,
                 ready: Any, stop: Any, out: Any) -> None:
    """In a process of its own (the bench's client work must not delay it):
    ServerLive and GET /v2/health/live every `period_s`, each on a connection
    of its own; sets `ready` after the first pair, and sends [(kind, started,
    ended, ok)] to `out` when stopped."""
    channel = grpc.insecure_channel(grpc_address, options=[("grpc.use_local_subchannel_pool", 1)])
    live = pb_grpc.GRPCInferenceServiceStub(channel).ServerLive
    host, port = http_address.rsplit(":", 1)
    rest: http.client.HTTPConnection | None = None
    polls: list[tuple[str, float, float, bool]] = []
    next_at = time.monotonic()
    while not stop.is_set():
        started = time.monotonic()
        try:
            ok = live(pb.ServerLiveRequest(), timeout=timeout_s).live
        except grpc.RpcError:
            ok = False
        polls.append(("grpc", started, time.monotonic(), ok))
        started = time.monotonic()
        try:
            rest = rest or http.client.HTTPConnection(host, int(port), timeout=timeout_s)
            rest.request("GET", "/v2/health/live")
            response = rest.getresponse()
            response.read()
            ok = response.status == 200
        except (OSError, http.client.HTTPException):
            ok, rest = False, None
        polls.append(("rest", started, time.monotonic(), ok))
        ready.set()
        next_at += period_s
        stop.wait(max(0.0, next_at - time.monotonic()))
    channel.close()
    out.put(polls)


class Watch:
    """Health polled from another process, and the server's RSS sampled here,
    for the whole run; `during(start, end)` reads what fell in one input."""

    def __init__(self, server: ServerProcess, period_s: float, timeout_s: float) -> None:
        context = mp.get_context("spawn")
        self._ready, self._stop, self._out = context.Event(), context.Event(), context.Queue()
        self._poller = context.Process(target=watch_health, daemon=True, args=(
            server.address, server.http_address, period_s, timeout_s, self._ready, self._stop,
            self._out))
        self._memory = common.Sampler(lambda: tree_rss_bytes(server.pid), period_s)
        self.polls: list[tuple[str, float, float, bool]] = []

    def start(self) -> Watch:
        self._poller.start()
        self._memory.start()
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the health poller gave no answer within {timeout_s:g} s")

    def stop(self) -> None:
        self._stop.set()
        self.polls = self._out.get(timeout=30)
        self._poller.join(timeout=10)
        self._memory.stop()

    def during(self, start: float, end: float) -> dict[str, Any]:
        """Peak RSS and health latency (max, p95 per kind) of polls that
        overlapped [start, end]."""
        rss = [v for t, v in self._memory.samples if start <= t <= end and v is not None]
        figures: dict[str, Any] = {"peak_rss_mib": max(rss) / MiB if rss else None}
        every = []
        for kind in ("grpc", "rest"):
            ms = [(e - s) * 1e3 for k, s, e, _ in self.polls if k == kind and s <= end
                  and e >= start]
            every += ms
            figures[f"{kind}_health_max_ms"] = max(ms) if ms else None
            figures[f"{kind}_health_p95_ms"] = float(np.percentile(ms, 95)) if ms else None
        figures["health_max_ms"] = max(every) if every else None
        figures["health_polls"] = len(every)
        figures["health_failed"] = sum(1 for k, s, e, ok in self.polls if s <= end
                                       and e >= start and not ok)
        return figures

    def peak_rss_mib(self) -> float | None:
        rss = [v for _, v in self._memory.samples if v is not None]
        return max(rss) / MiB if rss else None


# --------------------------------------------------------------------------- answers


@dataclass(frozen=True)
class Answer:
    """What a server said: a gRPC status name or an HTTP code, and the head of its message."""

    code: str
    message: str = ""

    @classmethod
    def of(cls, code: str, message: str) -> Answer:
        return cls(code, " ".join(message.split())[:MESSAGE_HEAD])


def grpc_answer(call: Callable[[], Any]) -> Answer:
    try:
        call()
    except InferenceServerException as error:
        return Answer.of(str(error.status()).removeprefix("StatusCode."), error.message() or "")
    return Answer("OK")


def bearer(token: str | bytes) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def exchange(address: str, path: str, chunks: Iterable[bytes], headers: Mapping[str, Any],
             pause_s: float = 0.0) -> tuple[Answer, int]:
    """POST on a socket of our own: headers (values may be raw bytes), then
    the body chunk by chunk (`pause_s` between them) until it is all sent or
    the server answers early. The answer, and how many body bytes went."""
    host, port = address.rsplit(":", 1)
    head = [f"POST {path} HTTP/1.1".encode(), f"Host: {host}".encode()]
    for key, value in headers.items():
        head.append(key.encode() + b": " + (value if isinstance(value, bytes) else value.encode()))
    sent = 0
    with socket.create_connection((host, int(port)), timeout=CALL_TIMEOUT_S) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n")
        try:
            for chunk in chunks:
                if select.select([sock], [], [], 0)[0]:
                    break  # answered before the body ended
                sock.sendall(chunk)
                sent += len(chunk)
                if pause_s:
                    time.sleep(pause_s)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered and closed: read what it said
        response = http.client.HTTPResponse(sock)
        try:
            response.begin()
            payload = response.read()
        except (OSError, http.client.HTTPException) as error:
            return Answer.of("no answer", repr(error)), sent
    try:
        message = json.loads(payload).get("error", "")
    except ValueError:
        message = payload[:MESSAGE_HEAD].decode(errors="replace")
    return Answer.of(str(response.status), message or ""), sent


def chunked(total: int, size: int = 1 << 20) -> Iterable[bytes]:
    block = b"\0" * size
    while total > 0:
        yield block[:min(size, total)]
        total -= size


def mlp_json(**extra: Any) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                                   "data": [0.5] * 16}], **extra}).encode()


def mlp_inputs(shape: Sequence[int] = (1, 16)) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("input", list(shape), "FP32")
    tensor.set_data_from_numpy(np.ones(shape, np.float32))
    return [tensor]


def post(address: str, path: str, body: bytes, headers: Mapping[str, Any]) -> Answer:
    return exchange(address, path, [body], {"Content-Length": str(len(body)), **headers})[0]


# --------------------------------------------------------------------------- inputs


@dataclass
class Target:
    """A server under test, as an input sees it."""

    kind: str  # agent or router
    server: ServerProcess
    settings: Settings
    agent: ServerProcess  # the agent (itself, or the one behind the router)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKEN}"}


@dataclass(frozen=True)
class Input:
    name: str
    finding: str
    servers: tuple[str, ...]
    expected: frozenset[str]  # answers that mean the hole stays closed
    send: Callable[[Target], Answer]


@contextlib.contextmanager
def region_and_client(target: Target, byte_size: int = 64):
    """A fresh 64-byte file in /dev/shm and a client of the target: (name,
    client); the file is removed afterwards."""
    name = f"tiered-abuse-{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region(name, f"/{name}", byte_size)
    try:
        with grpcclient.InferenceServerClient(target.server.address) as client:
            yield name, client
    finally:
        shm.destroy_shared_memory_region(handle)


def shm_register_without_token(target: Target) -> Answer:
    with region_and_client(target) as (name, client):
        return grpc_answer(lambda: client.register_system_shared_memory(name, f"/{name}", 64))


def shm_truncated_region(target: Target) -> Answer:
    """Alice registers add_sub's INPUT0 region, then shrinks its file to 0 bytes."""
    with region_and_client(target) as (name, client):
        client.register_system_shared_memory(name, f"/{name}", 64, headers=bearer(ALICE))
        os.truncate(f"/dev/shm/{name}", 0)
        first = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        first.set_shared_memory(name, 64)
        second = grpcclient.InferInput("INPUT1", [1, 16], "FP32")
        second.set_data_from_numpy(np.ones((1, 16), np.float32))
        answer = grpc_answer(lambda: client.infer("add_sub", [first, second],
                                                  headers=bearer(ALICE)))
        client.unregister_system_shared_memory(headers=bearer(ALICE))
        return answer


def shm_unregister_all_as_another_caller(target: Target) -> Answer:
    """Bob's unregister with an empty name; Alice's region must survive it."""
    with region_and_client(target) as (name, client):
        client.register_system_shared_memory(name, f"/{name}", 64, headers=bearer(ALICE))
        answer = grpc_answer(lambda: client.unregister_system_shared_memory(
            "", headers=bearer(BOB)))
        kept = client.get_system_shared_memory_status(headers=bearer(ALICE),
                                                      as_json=True).get("regions", {})
        client.unregister_system_shared_memory(headers=bearer(ALICE))
        if name not in kept:
            return Answer("REMOVED", f"bob's unregister removed alice's region {name}")
        return Answer(answer.code, f"alice's region kept; {answer.message}".strip("; "))


def shm_past_the_callers_cap(target: Target) -> Answer:
    with region_and_client(target) as (name, client):
        for index in range(MAX_REGIONS_PER_CALLER):
            client.register_system_shared_memory(f"r{index}", f"/{name}", 64,
                                                 headers=bearer(ALICE))
        answer = grpc_answer(lambda: client.register_system_shared_memory(
            "one-too-many", f"/{name}", 64, headers=bearer(ALICE)))
        client.unregister_system_shared_memory(headers=bearer(ALICE))
        return answer


def answered_by_agent(agent: ServerProcess) -> int:
    """Requests for mlp the agent has answered (its statistics)."""
    with grpcclient.InferenceServerClient(agent.address) as client:
        stats = client.get_inference_statistics("mlp", headers=bearer(TOKEN), as_json=True)
    return common.stats_totals(stats, "mlp")["success_count"]


def grpc_with_token(token: str | None) -> Callable[[Target], Answer]:
    def send(target: Target) -> Answer:
        before = answered_by_agent(target.agent)
        with grpcclient.InferenceServerClient(target.server.address) as client:
            answer = grpc_answer(lambda: client.infer(
                "mlp", mlp_inputs(), headers=bearer(token) if token else None))
        if answered_by_agent(target.agent) != before:
            return Answer("FORWARDED", f"the agent answered it; {answer.code}")
        return answer
    return send


def wrong_shape_to_the_canary(target: Target) -> Answer:
    """mlp version 2 (the router's canary) asked with 15 features, not 16."""
    codes: Counter[str] = Counter()
    messages = []
    with grpcclient.InferenceServerClient(target.server.address) as client:
        for _ in range(target.settings.wrong_shape_requests):
            answer = grpc_answer(lambda: client.infer(
                "mlp", mlp_inputs((1, 15)), model_version="2", headers=bearer(TOKEN)))
            codes[answer.code] += 1
            messages.append(answer.message)
    code = "+".join(sorted(codes))
    return Answer.of(code, f"{dict(codes)}: {messages[0]}")


def big_body(over_limit_by: int, credentials: bool) -> Callable[[Target], Answer]:
    """A REST body `over_limit_by` bytes past the message limit, sent until the
    server answers; with the token or without it."""

    def send(target: Target) -> Answer:
        size = target.settings.max_message_bytes + over_limit_by
        auth = target.auth if credentials else {}
        answer, sent = exchange(target.server.http_address, "/v2/models/mlp/infer",
                                chunked(size), {"Content-Length": str(size), **auth})
        return Answer.of(answer.code, f"after {sent / MiB:.1f} of {size / MiB:.1f} MiB sent: "
                         f"{answer.message}")
    return send


def empty_bytes_elements(target: Target) -> Answer:
    """As many empty BYTES elements (4 bytes each, a zero length) as a body
    within the limit holds, as binary data for the strings model."""
    count = (target.settings.max_message_bytes - 1024) // 4
    header = json.dumps({"inputs": [{"name": "in_BYTES", "datatype": "BYTES",
                                     "shape": [1, count],
                                     "parameters": {"binary_data_size": 4 * count}}],
                         "outputs": [{"name": "out_BYTES",
                                      "parameters": {"binary_data": True}}]}).encode()
    size = len(header) + 4 * count
    answer, _ = exchange(target.server.http_address, "/v2/models/strings/infer",
                         [header, *chunked(4 * count)],
                         {"Content-Length": str(size),
                          "Inference-Header-Content-Length": str(len(header)), **target.auth})
    return Answer.of(answer.code, f"{count} elements: {answer.message}")


def json_nested_too_deep(target: Target) -> Answer:
    body = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return post(target.server.http_address, "/v2/models/mlp/infer", body, target.auth)


def json_nan_and_infinity(target: Target) -> Answer:
    body = mlp_json().replace(b"0.5, 0.5, 0.5", b"NaN, Infinity, -Infinity", 1)
    return post(target.server.http_address, "/v2/models/mlp/infer", body, target.auth)


def idle_streams_on_one_connection(target: Target) -> Answer:
    """More idle ModelStreamInfer streams than the cap on one connection,
    held while health is polled on another; then let go."""
    held, hold_s = target.settings.idle_streams, target.settings.hold_streams_s

    async def hold() -> Counter[str]:
        apart = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(target.server.address, options=apart) as channel:
            quiet = asyncio.Event()

            async def nothing():
                await quiet.wait()
                return
                yield  # an async generator that sends no request

            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            calls = [stub.ModelStreamInfer(nothing(), metadata=(("authorization",
                                                                  f"Bearer {TOKEN}"),))
                     for _ in range(held)]
            # Those past the cap never connect: they wait on the client's side.
            waits = [asyncio.ensure_future(call.wait_for_connection()) for call in calls]
            await asyncio.wait(waits, timeout=hold_s)
            await asyncio.sleep(hold_s)
            quiet.set()
            codes = await asyncio.wait_for(asyncio.gather(*(c.code() for c in calls)), 30)
            for wait in waits:
                wait.cancel()
            return Counter(code.name for code in codes)

    codes = asyncio.run(hold())
    return Answer.of("+".join(sorted(codes)), f"{held} streams: {dict(codes)}")


def slow_bodies(target: Target) -> Answer:
    """Several valid mlp bodies, each trickled over `trickle_s` on its own connection."""
    body = mlp_json()
    host, port = target.server.http_address.rsplit(":", 1)
    head = (f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sockets = [socket.create_connection((host, int(port)), timeout=CALL_TIMEOUT_S)
               for _ in range(target.settings.slow_bodies)]
    try:
        for sock in sockets:
            sock.sendall(head)
        pieces = 20
        step = -(-len(body) // pieces)
        for start in range(0, len(body), step):
            for sock in sockets:
                sock.sendall(body[start:start + step])
            time.sleep(target.settings.trickle_s / pieces)
        codes: Counter[str] = Counter()
        for sock in sockets:
            response = http.client.HTTPResponse(sock)
            response.begin()
            response.read()
            codes[str(response.status)] += 1
    finally:
        for sock in sockets:
            sock.close()
    return Answer.of("+".join(sorted(codes)), f"{len(sockets)} bodies over "
                     f"{target.settings.trickle_s:g} s each: {dict(codes)}")


def rest_with_headers(headers: Mapping[str, Any], body: bytes | None = None
                      ) -> Callable[[Target], Answer]:
    def send(target: Target) -> Answer:
        return post(target.server.http_address, "/v2/models/mlp/infer", body or mlp_json(),
                    headers)
    return send


BOTH, AGENT = ("agent", "router"), ("agent",)
GRPC_REFUSED = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED"})
INPUTS = (
    Input("shm_register_without_token", "1 shared memory", AGENT, GRPC_REFUSED,
          shm_register_without_token),
    Input("shm_truncated_region", "1 shared memory", AGENT, frozenset({"INVALID_ARGUMENT"}),
          shm_truncated_region),
    Input("shm_unregister_all_as_bob", "1 shared memory", AGENT, frozenset({"OK"}),
          shm_unregister_all_as_another_caller),
    Input("shm_past_the_callers_cap", "1 shared memory", AGENT,
          frozenset({"INVALID_ARGUMENT"}), shm_past_the_callers_cap),
    Input("grpc_no_token", "2 credentials", BOTH, frozenset({"UNAUTHENTICATED"}),
          grpc_with_token(None)),
    Input("grpc_wrong_token", "2 credentials", BOTH, frozenset({"PERMISSION_DENIED"}),
          grpc_with_token("wrong")),
    Input("wrong_shape_to_the_canary", "3 client errors", BOTH,
          frozenset({"INVALID_ARGUMENT"}), wrong_shape_to_the_canary),
    Input("rest_body_over_the_limit", "4 big bodies", BOTH, frozenset({"413"}),
          big_body(1, credentials=True)),
    Input("rest_big_body_without_token", "4 big bodies", BOTH, frozenset({"401"}),
          big_body(0, credentials=False)),
    Input("rest_empty_bytes_elements", "4 big bodies", BOTH, frozenset({"400"}),
          empty_bytes_elements),
    Input("rest_json_nested_too_deep", "4 big bodies", BOTH, frozenset({"400"}),
          json_nested_too_deep),
    Input("rest_json_nan_infinity", "4 big bodies", BOTH, frozenset({"200", "400"}),
          json_nan_and_infinity),
    Input("grpc_idle_streams_one_connection", "5 slots", BOTH,
          frozenset({"OK", "OK+UNAVAILABLE"}), idle_streams_on_one_connection),
    Input("rest_slow_bodies", "5 slots", BOTH, frozenset({"200"}), slow_bodies),
    Input("rest_token_non_ascii", "6 odd text", BOTH, frozenset({"403"}),
          rest_with_headers({"Authorization": "Bearer r\u00e9ader".encode()})),
    Input("rest_token_invalid_utf8", "6 odd text", BOTH, frozenset({"403"}),
          rest_with_headers({"Authorization": b"Bearer \xff\xfereader"})),
    Input("rest_key_invalid_utf8", "6 odd text", BOTH, frozenset({"200"}),
          rest_with_headers({"Authorization": f"Bearer {TOKEN}", "tiered-key": b"\xff\xfe"})),
    # Routed on its hashed key, or refused as not Unicode text: never a 500.
    Input("rest_key_lone_surrogate_json", "6 odd text", BOTH, frozenset({"200", "400"}),
          rest_with_headers({"Authorization": f"Bearer {TOKEN}"},
                            mlp_json(parameters={"tiered-key": "\udcff"}))),
)


# --------------------------------------------------------------------------- servers


def build_repository(root: Path) -> Path:
    zoo.add_sub(model_file(root, "add_sub", 1))
    write_config(root, "add_sub", {"max_batch_size": 8})
    zoo.mlp(model_file(root, "mlp", 1), seed=1)
    zoo.mlp(model_file(root, "mlp", 2), seed=2)  # the canary
    write_config(root, "mlp", {"max_batch_size": 16, "version_policy": {"specific": [1, 2]}})
    zoo.identity(model_file(root, "strings", 1), ["BYTES"])
    write_config(root, "strings", {"max_batch_size": 4})
    return root


def servers(work: Path, settings: Settings) -> tuple[AgentProcess, Callable[[str], RouterProcess]]:
    """The agent, and how to make the router in front of it once it has an address."""
    (work / "tokens").write_text(f"{TOKEN}\n")
    (work / "shm-tokens").write_text(f"{ALICE}\n{BOB}\n")
    profile = work / "edge.yaml"
    text = EDGE_PROFILE.read_text()
    limit = f"max_message_bytes: {DEFAULT_MESSAGE_BYTES}"
    if limit not in text:
        raise RuntimeError(f"{EDGE_PROFILE} no longer says {limit!r}")
    profile.write_text(text.replace(limit, f"max_message_bytes: {settings.max_message_bytes}"))
    agent = AgentProcess("edge", build_repository(work / "models"), extra_args=[
        "--profile", str(profile), "--front-ends", str(settings.front_ends),
        "--inference-token-file", str(work / "tokens"),
        "--shared-memory-token-file", str(work / "shm-tokens")])

    def router(agent_address: str) -> RouterProcess:
        table = work / "routing.yaml"
        edge = routing.TierRoute((agent_address,), stable=1, canary=2, canary_weight=0.5)
        table.write_text(routing.dump_table(routing.RoutingTable(1, {
            model: routing.ModelRoute({"edge": edge if model == "mlp" else
                                       routing.TierRoute((agent_address,))})
            for model in ("mlp", "strings")})))
        return RouterProcess(table, metrics_port=None, extra_args=[
            "--max-message-bytes", str(settings.max_message_bytes),
            "--inference-token-file", str(work / "tokens"),
            "--agent-token-file", str(work / "tokens")])

    return agent, router


def alive(server: ServerProcess) -> bool:
    if not server.alive():
        return False
    try:
        with grpcclient.InferenceServerClient(server.address) as client:
            return client.is_server_live(client_timeout=5)
    except InferenceServerException:
        return False


def replay(target: Target, watch: Watch) -> list[dict[str, Any]]:
    rows = []
    for item in INPUTS:
        if target.kind not in item.servers:
            continue
        started = time.monotonic()
        try:
            answer = item.send(target)
        except Exception as error:  # noqa: BLE001 -- an odd reply is a row, not the end
            answer = Answer.of("bench error", f"{type(error).__name__}: {error}")
        seconds = time.monotonic() - started
        common.sleep_until(started + MIN_WINDOW_S)
        ended = time.monotonic()
        survived = alive(target.server)
        rows.append({"input": item.name, "finding": item.finding, "server": target.kind,
                     "code": answer.code, "message": answer.message,
                     "expected": sorted(item.expected),
                     "as_expected": answer.code in item.expected, "seconds": seconds,
                     "window": (started, ended), "alive_after": survived})
        common.progress(f"{target.kind} {item.name}: {answer.code} ({seconds:.2f} s) "
                        f"{answer.message[:60]}")
    return rows


def run(settings: Settings, work: Path) -> tuple[list[dict[str, Any]], dict[str, float | None]]:
    agent, make_router = servers(work, settings)
    with common.serving([agent]):
        router = make_router(agent.address)
        with common.serving([router]):
            targets = {"agent": Target("agent", agent, settings, agent),
                       "router": Target("router", router, settings, agent)}
            watches = {kind: Watch(t.server, settings.poll_s, settings.health_timeout_s).start()
                       for kind, t in targets.items()}
            rows = []
            try:
                for watch in watches.values():
                    watch.wait_ready()
                for kind, target in targets.items():
                    rows += replay(target, watches[kind])
            finally:
                for watch in watches.values():
                    watch.stop()
            for row in rows:
                row.update(watches[row["server"]].during(*row.pop("window")))
            peaks = {kind: watch.peak_rss_mib() for kind, watch in watches.items()}
    return rows, peaks


# --------------------------------------------------------------------------- report


def targets(rows: Sequence[Mapping[str, Any]], peaks: Mapping[str, float | None],
            limits: Mapping[str, float]) -> list[common.Target]:
    health = [r["health_max_ms"] for r in rows]
    found = [common.judge(HEALTH_LATENCY, "max ms of any health check",
                          None if None in health or not health else max(health), "<=",
                          TARGET_HEALTH_MS)]
    found.append(common.judge("failed health checks", "unanswered or not live, in any input",
                              sum(r["health_failed"] for r in rows) if rows else None, "<=", 0))
    for kind in ("agent", "router"):
        found.append(common.judge(f"{kind} peak memory", "MiB, process and children",
                                  peaks.get(kind), "<=", limits[kind] / MiB))
    found.append(common.judge("crashes", "inputs after which a server was dead",
                              sum(not r["alive_after"] for r in rows) if rows else None,
                              "<=", TARGET_CRASHES))
    found.append(common.judge("unexpected answers", "inputs answered otherwise than expected",
                              sum(not r["as_expected"] for r in rows) if rows else None,
                              "<=", 0))
    return found


def report(rows: Sequence[Mapping[str, Any]], found: Sequence[common.Target]) -> str:
    table = common.table(
        ["input", "server", "answer", "peak MiB", "health max ms", "health p95 ms", "alive",
         "seconds", "message"],
        [[r["input"], r["server"], r["code"], r["peak_rss_mib"], r["health_max_ms"],
          max(filter(None, (r["grpc_health_p95_ms"], r["rest_health_p95_ms"])), default=None),
          "yes" if r["alive_after"] else "NO", r["seconds"], r["message"][:48]]
         for r in rows],
        ["PASS" if r["as_expected"] and r["alive_after"]
         and (r["health_max_ms"] or 1e9) <= TARGET_HEALTH_MS else "FAIL" for r in rows])
    return f"{table}\n\nTargets\n{common.targets_table(found)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_arguments(parser, "abuse")
    args = common.parse(parser, argv, "abuse")
    settings = SMOKE if args.smoke else Settings()
    result = common.record("abuse", args.smoke)
    limits = memory_limits()
    with tempfile.TemporaryDirectory(prefix="tiered-bench-abuse-") as work:
        rows, peaks = run(settings, Path(work))
    found = targets(rows, peaks, limits)
    result.update({"settings": dataclasses.asdict(settings),
                   "memory_limits_mib": {k: v / MiB for k, v in limits.items()},
                   "max_streams_per_connection": MAX_STREAMS_PER_CONNECTION,
                   "peak_rss_mib": peaks, "rows": rows, "targets": found})
    print(report(rows, found))
    common.write(result, args.out)
    if args.smoke:  # timed beside other work (CI): a health check's latency is reported,
        # not judged; one unanswered within its timeout still fails the smoke
        judged = [t for t in found if t.name != HEALTH_LATENCY]
        return common.smoke_exit({"rows": (rows, ("peak_rss_mib", "health_max_ms",
                                                  "health_polls"))}) \
            or int(common.overall(judged) != "PASS")
    return int(common.overall(found) != "PASS")


if __name__ == "__main__":
    sys.exit(main())
