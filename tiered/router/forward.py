"""The router's calls to its agents: pooled channels, failover, the cascade's
escalation, shadow calls and the metadata and readiness probes.

ModelInfer travels as bytes: the client's request goes to the agent as it
came (a different `model_version` is appended, see `with_version`) and the
agent's answer goes back to the client as it came, with a `tiered-tier`
parameter appended that names the tier that answered (`served_by`); the
router parses both to read them, never to rebuild them. Errors from agents
come back as domain errors (`upstream_error`), so that `translate_errors`
maps them once. Which
agents to try, and in what order, is decided before these calls
(`policies`); this module only follows the order it is given, passing over
at once an agent it finds without a connection (marked down in `health`).
It talks to agents over gRPC only and never imports agent or controller code.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from tiered import errors, names
from tiered.protocol import codec, descriptors, messages, routing, security
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
from tiered.protocol.status import error_from_status
from tiered.router import counters, health, observations, policies

log = logging.getLogger(__name__)

# Requests and responses above this are refused (Triton's HTTP default input
# limit); `tiered router --max-message-bytes` sets another.
MAX_MESSAGE_BYTES = 64 << 20
MAX_SHADOW_IN_FLIGHT = 64  # shadow calls beyond this are skipped, never queued
READY_PROBE_S = 1.0  # RepositoryIndex: how long a model's agents get to answer ModelReady
METADATA_TIMEOUT_S = 5.0
SERVER_READY_TIMEOUT_S = 1.0
# An agent whose channel is not connected gets this long (at most half the
# request's time left) to connect while another candidate is left to ask.
CONNECT_BUDGET_S = 1.0
MAX_RECONNECT_BACKOFF_S = 1.0  # a channel to a dead agent retries at least this often
# HTTP/2 keepalive on every agent channel: a hung agent (stopped, its socket
# open) answers no ping, and its connection is closed within about
# KEEPALIVE_S + KEEPALIVE_TIMEOUT_S, so the calls waiting on it fail over
# (UNAVAILABLE) long before their deadline. Agents allow pings this often
# (tiered.protocol.handlers.SERVER_OPTIONS).
KEEPALIVE_S = 1.0
KEEPALIVE_TIMEOUT_S = 2.0
# Connections to each agent, the calls taking turns: an agent with front ends
# (processes sharing its port) needs at least one for each to take a share.
AGENT_CONNECTIONS = 8  # the datacenter profile's front ends
SERVED_TIER = "tiered-tier"  # the response parameter naming the tier that answered
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.DEADLINE_EXCEEDED})
GENERATION_TEMPERATURE = "temperature"  # a generation request's; 0 or unset: greedy
INFER_METHOD = descriptors.method_path(descriptors.INFERENCE_SERVICE, "ModelInfer")
STREAM_METHOD = descriptors.method_path(descriptors.INFERENCE_SERVICE, "ModelStreamInfer")
_READY = grpc.ChannelConnectivity.READY
_CONNECTING = (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING)

# Bytes in, bytes out: a ModelInfer call that neither serializes nor parses.
RawInfer = Callable[..., grpc.aio.UnaryUnaryCall]
# Request bytes in, parsed ModelStreamInferResponses out.
RawStream = Callable[..., grpc.aio.StreamStreamCall]
T = TypeVar("T")


class Answer(NamedTuple):
    """An agent's answer, `served_by` appended: parsed (for the router to read)
    and its bytes (for the client)."""

    response: pb.ModelInferResponse
    raw: bytes
    candidate: policies.Candidate


def upstream_error(agent: str, error: grpc.aio.AioRpcError) -> errors.TieredError:
    return error_from_status(error.code(), f"{error.details()} (agent {agent})")


def with_version(request: pb.ModelInferRequest, raw: bytes, version: int) -> bytes:
    """`raw` (the bytes of `request`) asking for `version` (0: the agent's latest).

    On the wire the last value of a field wins, so a different version is
    appended rather than the request rebuilt; only clearing a version the
    client named needs a new serialization (an empty string is not written).
    """
    wanted = str(version) if version else ""
    if wanted == request.model_version:
        return raw
    if wanted:
        return raw + _version_field(version)
    cleared = pb.ModelInferRequest()
    cleared.CopyFrom(request)
    cleared.model_version = ""
    return cleared.SerializeToString()


@functools.lru_cache(maxsize=256)
def _version_field(version: int) -> bytes:
    return pb.ModelInferRequest(model_version=str(version)).SerializeToString()


@functools.lru_cache(maxsize=len(names.TIERS))
def served_by(tier: str) -> bytes:
    """The bytes of a response parameter naming the tier that answered, to
    append to an agent's answer (on the wire the last entry of a map key wins)."""
    return pb.ModelInferResponse(parameters={
        SERVED_TIER: pb.InferParameter(string_param=tier)}).SerializeToString()


def parse_response(raw: bytes, agent: str) -> pb.ModelInferResponse:
    try:
        return pb.ModelInferResponse.FromString(raw)
    except DecodeError:
        raise error_from_status(grpc.StatusCode.INTERNAL, f"agent {agent} answered bytes "
                                f"that are not a ModelInferResponse") from None


class ChannelPool:
    """Channels to each agent address, reused by every call to it:
    `connections` of them, each a connection of its own, the calls taking
    turns over them. An agent's front-end processes share its port and the
    kernel gives each a share of the connections, not of the calls: over one
    connection, every call the router sends would meet one front end."""

    def __init__(self, transport: security.TransportSecurity = security.PLAINTEXT,
                 token: str | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 connections: int = AGENT_CONNECTIONS) -> None:
        self.transport = transport  # agents are checked against its CA; mTLS with its cert
        self.token = token  # presented to agents on every call, where they require one
        self.max_message_bytes = max_message_bytes
        self.connections = connections
        self._channels: dict[str, list[grpc.aio.Channel]] = {}
        self._stubs: dict[str, pb_grpc.GRPCInferenceServiceStub] = {}
        self._infers: dict[str, list[RawInfer]] = {}
        self._streams: dict[str, list[RawStream]] = {}
        self._turns = itertools.count()

    def channel(self, agent: str) -> grpc.aio.Channel:
        """The agent's first channel: its health and state, its other calls."""
        return self._channels_to(agent)[0]

    def _channels_to(self, agent: str) -> list[grpc.aio.Channel]:
        channels = self._channels.get(agent)
        if channels is None:
            channels = self._channels[agent] = [self.dial(agent)
                                                for _ in range(self.connections)]
        return channels

    def _turn(self, agent: str, calls: list):
        """The next connected channel's call, those not connected asked to
        connect. While the first (whose state the router's health and
        failover follow) is not connected, its call alone: the others are
        not dialled to an agent that may hang, nor waited on."""
        channels = self._channels[agent]
        if channels[0].get_state() is not _READY:
            return calls[0]
        first = next(self._turns)
        for step in range(len(calls)):
            index = (first + step) % len(calls)
            if channels[index].get_state(try_to_connect=True) is _READY:
                return calls[index]
        return calls[0]

    def dial(self, agent: str) -> grpc.aio.Channel:
        """A new channel on a connection of its own (the telemetry poller's,
        to one pod, is not kept here)."""
        return security.channel(agent, self.transport, aio=True, token=self.token, options=[
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            # gRPC shares one connection among a process's channels to one
            # address unless each keeps its own.
            ("grpc.use_local_subchannel_pool", 1),
            # A name that resolves to many agents (a headless Service) is
            # balanced call by call rather than pinned to its first address.
            ("grpc.lb_policy_name", "round_robin"),
            # gRPC's default backoff grows to 120 s; an agent restarted on its
            # address is reconnected to (and probed back) within about a second.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(MAX_RECONNECT_BACKOFF_S * 1000)),
            ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
            ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
            # Idle connections too, without limit: each of an agent's
            # connections finds it hung within the same seconds, not only the
            # one a call waits on.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # gRPC core waits this long for any ping's ack (keepalive's too): 60 s by default.
            ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
        ])

    def stub(self, agent: str) -> pb_grpc.GRPCInferenceServiceStub:
        stub = self._stubs.get(agent)
        if stub is None:
            stub = self._stubs[agent] = pb_grpc.GRPCInferenceServiceStub(self.channel(agent))
        return stub

    def infer(self, agent: str) -> RawInfer:
        """ModelInfer to the agent, bytes in and out, on its connections in turn."""
        return self._next_call(self._infers, agent, lambda channel: channel.unary_unary(
            INFER_METHOD, _registered_method=True))

    def stream(self, agent: str) -> RawStream:
        """ModelStreamInfer to the agent, request bytes in, responses parsed,
        on its connections in turn."""
        return self._next_call(self._streams, agent, lambda channel: channel.stream_stream(
            STREAM_METHOD, response_deserializer=pb.ModelStreamInferResponse.FromString,
            _registered_method=True))

    def _next_call(self, made: dict[str, list], agent: str,
                   make: Callable[[grpc.aio.Channel], Any]):
        """The method on the agent's next connected channel (`_turn`), made
        once per channel: registered like the generated stubs' methods, core
        resolves the path once per channel, not per call."""
        calls = made.get(agent)
        if calls is None:
            calls = made[agent] = [make(channel) for channel in self._channels_to(agent)]
        return self._turn(agent, calls)

    async def keep_only(self, agents: frozenset[str]) -> None:
        for agent in [a for a in self._channels if a not in agents]:
            self._stubs.pop(agent, None)
            self._infers.pop(agent, None)
            self._streams.pop(agent, None)
            await asyncio.gather(*(channel.close(grace=5)
                                   for channel in self._channels.pop(agent)))

    async def close(self) -> None:
        await self.keep_only(frozenset())


def outputs_of(response: pb.ModelInferResponse, only: str = "") -> dict:
    """The response's outputs as arrays (just `only` when named)."""
    arrays = {}
    for index, tensor in enumerate(response.outputs):
        if only and tensor.name != only:
            continue
        arrays[tensor.name] = codec.from_raw(
            response.raw_output_contents[index], tensor.datatype, tuple(tensor.shape),
            field=f"outputs[{index}]")
    return arrays


def unsure(response: pb.ModelInferResponse, settings: routing.CascadeSettings) -> bool:
    """Whether the cascade escalates past this answer: a generation's (it
    carries `mean_logprob`) by its tokens' mean log-probability, any other
    by the confidence of its judged output (`policies`)."""
    mean_logprob = response.parameters.get(messages.MEAN_LOGPROB)
    if mean_logprob is not None:
        return policies.should_escalate_generation(mean_logprob.double_param,
                                                   settings.threshold)
    return policies.should_escalate(outputs_of(response, settings.output), settings.threshold,
                                    settings.output)


class Forwarder:
    """Inference and metadata calls, in the order given, within a deadline."""

    def __init__(self, pool: ChannelPool, observer: observations.Observer,
                 metrics: counters.RouterMetrics, clock: Callable[[], float],
                 agent_health: health.AgentHealth | None = None) -> None:
        self.pool = pool
        self.observer = observer  # in-flight limits and the latency of each call
        self.metrics = metrics
        self.clock = clock
        self.health = agent_health or health.AgentHealth(clock)  # who is held down

    async def forward(self, request: pb.ModelInferRequest, raw: bytes,
                      candidates: Sequence[policies.Candidate], route: routing.ModelRoute,
                      deadline: float, *, more_after: bool = False) -> Answer:
        """The first candidate that answers, failing over on retryable codes.

        An agent held down is passed over at once unless its channel is
        connected again (it may be back before a probe says so). An agent
        found without a connection is marked down and, while another
        candidate is left (here, or `more_after` this call), passed over: in
        TRANSIENT_FAILURE at once, while connecting after at most
        `CONNECT_BUDGET_S`. The last one is called as it is (no
        wait_for_ready: a channel in TRANSIENT_FAILURE fails the call at once)."""

        async def infer(candidate: policies.Candidate, remaining: float) -> Answer:
            reply = await self.pool.infer(candidate.agent)(
                with_version(request, raw, candidate.version), timeout=remaining,
                wait_for_ready=False)
            answered = reply + served_by(candidate.tier)
            return Answer(parse_response(answered, candidate.agent), answered, candidate)

        return await self.first_to_answer(request.model_name, candidates, route, deadline,
                                          infer, more_after=more_after)

    async def first_to_answer(self, model: str, candidates: Sequence[policies.Candidate],
                              route: routing.ModelRoute, deadline: float,
                              call: Callable[[policies.Candidate, float], Awaitable[T]], *,
                              more_after: bool = False, hold: bool = False) -> T:
        """`call` on each candidate in turn, with `forward`'s failover rules,
        until one returns (its value is returned). `hold`: the answering
        agent's in-flight slot stays taken, for the caller to release (a
        stream holds it until its last response)."""
        attempts, saturated, last = 0, 0, None
        final = len(candidates) - 1
        for index, candidate in enumerate(candidates):
            if attempts >= route.failover_attempts:
                break
            now = self.clock()
            remaining = deadline - now
            if remaining <= 0:
                raise errors.DeadlineExceeded(
                    f"the request's deadline passed after {attempts} attempt(s)")
            agent = candidate.agent
            channel = self.pool.channel(agent)
            connected = channel.get_state() is _READY
            if not connected and agent in self.health.down:  # still dead: no wait, no call
                self.metrics.failed_over(model, candidate.tier, counters.DOWN)
                last = errors.Unavailable(f"agent {agent} is {self.health.why(agent)}")
                continue
            if not self.observer.try_acquire(agent, route.max_in_flight):
                saturated += 1
                self.metrics.failed_over(model, candidate.tier, counters.SATURATED)
                continue
            attempts += 1
            answered = False
            try:
                if not connected and (more_after or index < final):
                    last = await self._connect(channel, agent, remaining)
                    if last is not None:
                        self.metrics.failed_over(model, candidate.tier, counters.DOWN)
                        continue
                value = await call(candidate, remaining)
                answered = True
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRYABLE:
                    raise upstream_error(agent, error) from None
                if channel.get_state() is not _READY:  # no connection, not the agent's answer
                    self.health.mark_down(agent, f"{error.code().name}: {error.details()}")
                self.metrics.failed_over(model, candidate.tier, error.code().name.lower())
                last = upstream_error(agent, error)
                continue
            finally:
                if not (answered and hold):
                    self.observer.release(agent)
            self.observer.record_latency(agent, model, self.clock() - now)
            if agent in self.health.down:  # asked as the last resort, and it answered
                self.health.mark_up(agent)
            return value
        if last is None:
            if saturated:
                self.metrics.rejected.labels(model).inc()
                raise errors.ResourceExhausted(
                    f"model {model!r}: every agent is at its in-flight limit "
                    f"({route.max_in_flight}); retry later")
            raise errors.Unavailable(f"model {model!r}: no agent to send to")
        raise last

    async def _connect(self, channel: grpc.aio.Channel, agent: str, remaining: float
                       ) -> errors.Unavailable | None:
        """None once the channel is READY within the connect budget; else the
        agent is marked down and the error says why."""
        budget = min(CONNECT_BUDGET_S, remaining / 2)
        end = self.clock() + budget
        state = channel.get_state(try_to_connect=True)
        while state in _CONNECTING and (left := end - self.clock()) > 0:
            try:
                await asyncio.wait_for(channel.wait_for_state_change(state), left)
            except TimeoutError:
                break
            state = channel.get_state(try_to_connect=True)
        if state is _READY:
            return None
        reason = (f"no connection within {budget:.2f} s" if state in _CONNECTING
                  else f"no connection ({state.name})")
        self.health.mark_down(agent, reason)
        return errors.Unavailable(f"{reason} (agent {agent})")

    async def cascade(self, request: pb.ModelInferRequest, raw: bytes,
                      candidates: Sequence[policies.Candidate], route: routing.ModelRoute,
                      deadline: float) -> Answer:
        """Tier by tier in the ranking's order, while the answer is unsure: the
        cascade's order, with tiers whose agents are all down last."""
        settings = route.cascade
        by_tier: dict[str, list[policies.Candidate]] = {}
        for candidate in candidates:
            by_tier.setdefault(candidate.tier, []).append(candidate)
        tiers = list(by_tier)
        answer: Answer | None = None
        for index, tier in enumerate(tiers):
            if answer is not None and all(c.agent in self.health.down for c in by_tier[tier]):
                return answer  # never escalate to a tier that cannot answer
            try:
                answer = await self.forward(request, raw, by_tier[tier], route, deadline,
                                            more_after=index + 1 < len(tiers))
            except (errors.Unavailable, errors.ResourceExhausted, errors.DeadlineExceeded):
                if answer is not None:
                    return answer  # an unsure answer beats none
                if index + 1 < len(tiers) and deadline > self.clock():
                    continue  # the tier is down: the next one answers
                raise
            if index + 1 == len(tiers) or deadline <= self.clock():
                return answer
            if not unsure(answer.response, settings):
                return answer
            self.metrics.escalations.labels(request.model_name, tier).inc()
        assert answer is not None
        return answer

    async def first_answer(self, route: routing.ModelRoute, method: str, message):
        """ModelReady/Metadata/Config from the first agent of the model that answers."""
        last: tuple[str, grpc.aio.AioRpcError] | None = None
        for agent in self._up_first(route):
            try:
                return await getattr(self.pool.stub(agent), method)(
                    message, timeout=METADATA_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRYABLE:
                    raise upstream_error(agent, error) from None
                last = (agent, error)
        assert last is not None
        raise upstream_error(*last)

    def _up_first(self, route: routing.ModelRoute) -> list[str]:
        """The model's agents in tier order, those held down last."""
        agents = [a for tier in route.ordered_tiers() for a in route.tiers[tier].agents]
        return sorted(agents, key=lambda agent: agent in self.health.down)  # stable

    async def model_ready(self, model: str, route: routing.ModelRoute) -> bool:
        """Whether an agent of the model answers ModelReady true within READY_PROBE_S
        (agents asked in tier order, those held down last; the probe's whole
        budget is bounded)."""
        deadline = self.clock() + READY_PROBE_S
        for agent in self._up_first(route):
            remaining = deadline - self.clock()
            if remaining <= 0:
                return False
            try:
                answer = await self.pool.stub(agent).ModelReady(
                    pb.ModelReadyRequest(name=model), timeout=remaining)
            except grpc.aio.AioRpcError:
                continue
            if answer.ready:
                return True
        return False

    async def any_agent_ready(self, agents: Iterable[str]) -> bool:
        for agent in sorted(agents):
            try:
                answer = await self.pool.stub(agent).ServerReady(
                    pb.ServerReadyRequest(), timeout=SERVER_READY_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                continue
            if answer.ready:
                return True
        return False


def token_ids(response: pb.ModelInferResponse) -> tuple[int, ...]:
    """A generation's token ids (empty when it has none)."""
    return tuple(outputs_of(response, messages.TOKEN_IDS).get(
        messages.TOKEN_IDS, np.empty(0, np.int64)).tolist())


def greedy(request: pb.ModelInferRequest) -> bool:
    """Whether a generation request decodes greedily: its `temperature`
    (a request parameter, or an input tensor of that name) is 0 or unset."""
    if GENERATION_TEMPERATURE in request.parameters:
        value = codec.parameter_value(request.parameters[GENERATION_TEMPERATURE])
    elif any(tensor.name == GENERATION_TEMPERATURE for tensor in request.inputs):
        try:
            value = codec.decode_inputs(request)[GENERATION_TEMPERATURE].reshape(-1)[0].item()
        except (errors.TieredError, IndexError):
            return False  # the agent refuses it: nothing to compare
    else:
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


class Shadows:
    """Copies of stable requests sent to the canary, their answers compared with
    the client's and tallied; a shadow never touches the answer.

    A classifier's answers agree when their top-1 classes do; a generation's
    (a whole answer, which carries `mean_logprob`, or a stream the router
    relayed to its end) when its token ids are the same, for greedy requests
    only: a sampled one is counted incomparable and not
    sent, since two samples need not agree however alike the versions are."""

    def __init__(self, pool: ChannelPool, agreement: counters.ShadowAgreement,
                 rng: random.Random) -> None:
        self.pool = pool
        self.agreement = agreement
        self.rng = rng
        self._tasks: set[asyncio.Task] = set()

    def send(self, request: pb.ModelInferRequest, raw: bytes, answer: Answer,
             route: routing.ModelRoute, timeout_s: float) -> None:
        """Shadow a whole answer: a classifier's top-1 class, or a greedy
        generation's token ids (an answer that carries `mean_logprob`)."""
        if messages.MEAN_LOGPROB in answer.response.parameters:
            self.send_generation(request, raw, lambda: token_ids(answer.response),
                                 answer.candidate, route, timeout_s)
            return
        output = route.cascade.output

        def top1(response: pb.ModelInferResponse) -> tuple[int, ...] | None:
            return policies.top1(outputs_of(response, output), output)

        self._start(request, raw, answer.candidate, route, timeout_s,
                    lambda: top1(answer.response), top1)

    def send_generation(self, request: pb.ModelInferRequest, raw: bytes,
                        tokens: Callable[[], tuple[int, ...]], chosen: policies.Candidate,
                        route: routing.ModelRoute, timeout_s: float) -> None:
        """Shadow a generation, whole or streamed (`tokens`: the ids the client
        got): the canary's token ids for the same greedy request must be the
        same."""
        if not greedy(request):
            canary = route.tiers[chosen.tier].canary
            if canary is not None:
                self.agreement.record(request.model_name, str(canary), chosen.tier,
                                      counters.INCOMPARABLE)
            return
        self._start(request, raw, chosen, route, timeout_s, tokens, token_ids)

    def _start(self, request: pb.ModelInferRequest, raw: bytes, chosen: policies.Candidate,
               route: routing.ModelRoute, timeout_s: float, expected: Callable[[], Any],
               seen: Callable[[pb.ModelInferResponse], Any]) -> None:
        """Compare, in a task, what the client got (`expected()`) with what
        `seen` reads from the canary's answer to the same request."""
        canary = route.tiers[chosen.tier].canary
        if canary is None or len(self._tasks) >= MAX_SHADOW_IN_FLIGHT:
            return
        agents = route.tiers[chosen.tier].agents_for(canary)
        agent = chosen.agent if chosen.agent in agents else self.rng.choice(agents)
        task = asyncio.create_task(self._compare(
            request.model_name, str(canary), with_version(request, raw, canary), expected,
            seen, chosen.tier, agent, timeout_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _compare(self, model: str, version: str, request: bytes,
                       expected: Callable[[], Any], seen: Callable[[pb.ModelInferResponse], Any],
                       tier: str, agent: str, timeout_s: float) -> None:
        try:
            shadow = seen(parse_response(
                await self.pool.infer(agent)(request, timeout=timeout_s), agent))
            client = expected()
            if not client or not shadow:
                result = counters.INCOMPARABLE  # no class scores or tokens: never agreement
            else:
                result = counters.AGREE if client == shadow else counters.DISAGREE
        except Exception as error:  # noqa: BLE001 -- a shadow never touches the answer
            log.debug("shadow call failed: %s", error)
            result = counters.ERROR
        self.agreement.record(model, version, tier, result)

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
