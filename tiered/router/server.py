"""The router process: a v2 gRPC server that forwards to tier agents.

A thin adapter around `policies`: read the hints, ask the policy for a
ranking, forward over pooled channels (one per agent), fail over, cascade,
shadow, count. Errors from agents come back as domain errors so that
`translate_errors` maps them once. It talks to agents over gRPC only and must
never import agent or controller modules.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import signal
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

import tiered
from tiered import errors
from tiered.protocol import codec, descriptors, security
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
from tiered.protocol.security import PLAINTEXT, TransportSecurity
from tiered.protocol.status import error_from_status, translate_errors
from tiered.protocol.streaming import answer_stream
from tiered.router import policies
from tiered.router.observations import Observer, TelemetryPoller
from tiered.router.statistics import RouterStatistics
from tiered.router.table import ModelRoute, RoutingTable, load_table

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
MAX_CONCURRENT_RPCS = 8192
MAX_STREAM_IN_FLIGHT = 256
MAX_SHADOW_IN_FLIGHT = 64  # shadow calls beyond this are skipped, never queued
MAX_CACHED_CHILDREN = 4096  # labelled Prometheus children kept at hand
READY_PROBE_S = 1.0  # RepositoryIndex: how long a model's agents get to answer ModelReady
METADATA_TIMEOUT_S = 5.0
TABLE_POLL_S = 1.0
STATS_LOG_S = 30.0
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.DEADLINE_EXCEEDED})
HINTS = ("tiered-tier", "tiered-slo-ms", "tiered-key")
PLACEMENT = ("the router does not load or unload models: placement is the controller's job "
             "(change the TieredModel, or call RepositoryModelLoad on an agent)")

def upstream_error(agent: str, error: grpc.aio.AioRpcError) -> errors.TieredError:
    return error_from_status(error.code(), f"{error.details()} (agent {agent})")


@dataclass(frozen=True)
class RouterSettings:
    routing_table: Path
    host: str = "127.0.0.1"
    port: int = 8001
    metrics_port: int | None = None  # None: off, 0: any free port
    seed: int | None = None  # rng seed for reproducible splits without keys
    security: TransportSecurity = PLAINTEXT  # the router's port and its channels to agents


def read_hints(model: str, parameters: Mapping, metadata: Sequence[tuple[str, str]] | None
               ) -> policies.RouteRequest:
    """Hints from request parameters, else gRPC metadata."""
    found: dict[str, object] = {}
    for key, value in metadata or ():
        if key in HINTS:
            found[key] = value
    if parameters:
        for key in HINTS:
            if key in parameters:
                found[key] = codec.parameter_value(parameters[key])
    slo = found.get("tiered-slo-ms")
    if slo is not None:
        try:
            slo = float(slo)
        except (TypeError, ValueError):
            raise errors.InvalidArgument(f"tiered-slo-ms: expected milliseconds, got {slo!r}"
                                         ) from None
        if not slo > 0 or math.isinf(slo):
            raise errors.InvalidArgument(f"tiered-slo-ms: expected > 0, got {slo!r}")
    tier, key = found.get("tiered-tier"), found.get("tiered-key")
    return policies.RouteRequest(model=model, tier=None if tier in (None, "") else str(tier),
                                 slo_ms=slo, key=None if key in (None, "") else str(key))


class ChannelPool:
    """One channel per agent address, reused by every call to it."""

    def __init__(self, security: TransportSecurity = PLAINTEXT) -> None:
        self.security = security  # agents are checked against its CA; mTLS with its cert
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.GRPCInferenceServiceStub] = {}

    def channel(self, agent: str) -> grpc.aio.Channel:
        channel = self._channels.get(agent)
        if channel is None:
            channel = security.channel(agent, self.security, aio=True, options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # A name that resolves to many agents (a headless Service) is
                # balanced call by call rather than pinned to its first address.
                ("grpc.lb_policy_name", "round_robin"),
            ])
            self._channels[agent] = channel
        return channel

    def stub(self, agent: str) -> pb_grpc.GRPCInferenceServiceStub:
        stub = self._stubs.get(agent)
        if stub is None:
            stub = self._stubs[agent] = pb_grpc.GRPCInferenceServiceStub(self.channel(agent))
        return stub

    async def keep_only(self, agents: frozenset[str]) -> None:
        for agent in [a for a in self._channels if a not in agents]:
            self._stubs.pop(agent, None)
            await self._channels.pop(agent).close(grace=5)

    async def close(self) -> None:
        await self.keep_only(frozenset())


class RouterMetrics:
    """Prometheus counters; also what the periodic log line summarises."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tiered_router_requests", "Requests answered, by where they went",
                                ["model", "tier", "version", "outcome"], registry=self.registry)
        self.failovers = Counter("tiered_router_failovers", "Attempts that failed over",
                                 ["model", "tier", "code"], registry=self.registry)
        self.escalations = Counter("tiered_router_escalations", "Cascade escalations",
                                   ["model", "from_tier"], registry=self.registry)
        self.shadow = Counter("tiered_router_shadow",
                              "Shadowed requests by top-1 agreement of the canary version "
                              "with the answer", ["model", "tier", "version", "result"],
                              registry=self.registry)
        self.rejected = Counter("tiered_router_saturated", "Requests refused: all saturated",
                                ["model"], registry=self.registry)
        self.table_version = Gauge("tiered_router_table_version", "Routing table in use",
                                   registry=self.registry)
        self._answered: dict[tuple[str, str, str], Counter] = {}

    def answered(self, model: str, tier: str, version: str) -> None:
        """Count one answer; the labelled child is looked up once (a hot path)."""
        child = self._answered.get((model, tier, version))
        if child is None:
            child = self.requests.labels(model, tier, version, "ok")
            if len(self._answered) < MAX_CACHED_CHILDREN:
                self._answered[(model, tier, version)] = child
        child.inc()


class Router:
    """The data plane: table, observations, pool and the forwarding logic."""

    def __init__(self, table: RoutingTable, *, rng: random.Random | None = None,
                 clock=time.monotonic, transport: TransportSecurity = PLAINTEXT) -> None:
        self.table = table
        self.rng = rng or random.Random()
        self.clock = clock
        self.observer = Observer(clock)
        self.pool = ChannelPool(transport)
        self.metrics = RouterMetrics()
        self.metrics.table_version.set(table.version)
        self.statistics = RouterStatistics()
        self._shadows: set[asyncio.Task] = set()
        # Candidates per (model, version of each tier): built once per table.
        self._candidates: dict[tuple[str, tuple[int, ...]], list[policies.Candidate]] = {}

    async def use_table(self, table: RoutingTable) -> None:
        self.table = table  # one assignment: a request sees the old table or the new one
        self._candidates = {}
        self.metrics.table_version.set(table.version)
        self.statistics.keep_only(table.models)
        agents = table.agents()
        self.observer.forget(agents)
        await self.pool.keep_only(agents)

    def route_of(self, model: str) -> ModelRoute:
        route = self.table.models.get(model)
        if route is None:
            raise errors.NotFound(f"model_name: {model!r} is not in the routing table")
        return route

    def deadline_of(self, parameters: Mapping, time_remaining: float | None,
                    now: float) -> float:
        budget = self.table.timeout_s
        if time_remaining is not None:
            budget = min(budget, time_remaining)
        if parameters and "timeout" in parameters:
            timeout = codec.parameter_value(parameters["timeout"])
            if isinstance(timeout, int) and not isinstance(timeout, bool) and timeout > 0:
                budget = min(budget, timeout / 1e6)
        return now + budget

    async def infer(self, request: pb.ModelInferRequest,
                    metadata: Sequence[tuple[str, str]] | None, time_remaining: float | None
                    ) -> pb.ModelInferResponse:
        """Route, forward, count; a model outside the table is NOT_FOUND and
        counted nowhere, any other failure counts in the model's statistics."""
        started = self.clock()
        model = request.model_name
        route = self.route_of(model)
        try:
            deadline = self.deadline_of(request.parameters, time_remaining, started)
            response, chosen, choice = await self._route(request, route, metadata, deadline)
        except Exception:
            now = self.clock()
            self.statistics.failed(model, now - started, now)
            raise
        now = self.clock()
        self.statistics.succeeded(model, response.model_version, now - started, now)
        self.metrics.answered(model, chosen.tier, response.model_version)
        tier_route = route.tiers[chosen.tier]
        if policies.should_shadow(tier_route, choice, self.rng):
            self._shadow(request, response, chosen, tier_route.canary, route)
        return response

    async def _route(self, request: pb.ModelInferRequest, route: ModelRoute,
                     metadata: Sequence[tuple[str, str]] | None, deadline: float
                     ) -> tuple[pb.ModelInferResponse, policies.Candidate,
                                policies.VersionChoice]:
        model = request.model_name
        hints = read_hints(model, request.parameters, metadata)
        choices = {tier: policies.pick_version(tier_route, hints.key, self.rng)
                   for tier, tier_route in route.tiers.items()}
        candidates = self.candidates(model, route, choices)
        policy = policies.policy_for(route, hints)
        observations = self.observer.snapshot((c.agent for c in candidates), model)
        ranking = policy.choose(candidates, hints, observations, self.rng)
        if isinstance(policy, policies.Cascade):
            response, chosen = await self._cascade(request, ranking, route, deadline)
        else:
            response, chosen = await self.forward(request, ranking.candidates, route, deadline)
        return response, chosen, choices[chosen.tier]

    def candidates(self, model: str, route: ModelRoute,
                   choices: Mapping[str, policies.VersionChoice]) -> list[policies.Candidate]:
        key = (model, tuple(c.version for c in choices.values()))
        candidates = self._candidates.get(key)
        if candidates is None:  # at most 2^tiers per model: stable or canary on each
            candidates = self._candidates[key] = policies.candidates_of(
                route, {tier: choice.version for tier, choice in choices.items()})
        return candidates

    async def forward(self, request: pb.ModelInferRequest,
                      candidates: Sequence[policies.Candidate], route: ModelRoute,
                      deadline: float) -> tuple[pb.ModelInferResponse, policies.Candidate]:
        """The first candidate that answers, failing over on retryable codes."""
        attempts, saturated, last = 0, 0, None
        for candidate in candidates:
            if attempts >= route.failover_attempts:
                break
            now = self.clock()
            remaining = deadline - now
            if remaining <= 0:
                raise errors.DeadlineExceeded(
                    f"the request's deadline passed after {attempts} attempt(s)")
            if not self.observer.try_acquire(candidate.agent, route.max_in_flight):
                saturated += 1
                continue
            attempts += 1
            request.model_version = str(candidate.version) if candidate.version else ""
            started = now
            try:
                response = await self.pool.stub(candidate.agent).ModelInfer(
                    request, timeout=remaining)
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRYABLE:
                    raise upstream_error(candidate.agent, error) from None
                self.metrics.failovers.labels(request.model_name, candidate.tier,
                                              error.code().name).inc()
                last = (candidate.agent, error)
                continue
            finally:
                self.observer.release(candidate.agent)
            self.observer.record_latency(candidate.agent, request.model_name,
                                         self.clock() - started)
            return response, candidate
        if last is None:
            if saturated:
                self.metrics.rejected.labels(request.model_name).inc()
                raise errors.ResourceExhausted(
                    f"model {request.model_name!r}: every agent is at its in-flight limit "
                    f"({route.max_in_flight}); retry later")
            raise errors.Unavailable(f"model {request.model_name!r}: no agent to send to")
        raise upstream_error(*last)

    async def _cascade(self, request: pb.ModelInferRequest, ranking: policies.Ranking,
                       route: ModelRoute, deadline: float
                       ) -> tuple[pb.ModelInferResponse, policies.Candidate]:
        settings = route.cascade
        by_tier: dict[str, list[policies.Candidate]] = {}
        for candidate in ranking.candidates:
            by_tier.setdefault(candidate.tier, []).append(candidate)
        tiers = [t for t in settings.tiers if t in by_tier]
        answer: tuple[pb.ModelInferResponse, policies.Candidate] | None = None
        for index, tier in enumerate(tiers):
            try:
                answer = await self.forward(request, by_tier[tier], route, deadline)
            except (errors.Unavailable, errors.ResourceExhausted, errors.DeadlineExceeded):
                if answer is not None:
                    return answer  # an unsure answer beats none
                if index + 1 < len(tiers) and deadline > self.clock():
                    continue  # the tier is down: the next one answers
                raise
            if index + 1 == len(tiers) or deadline <= self.clock():
                return answer
            if not policies.should_escalate(outputs_of(answer[0], settings.output),
                                            settings.threshold, settings.output):
                return answer
            self.metrics.escalations.labels(request.model_name, tier).inc()
        assert answer is not None
        return answer

    def _shadow(self, request: pb.ModelInferRequest, response: pb.ModelInferResponse,
                chosen: policies.Candidate, canary: int | None, route: ModelRoute) -> None:
        if canary is None or len(self._shadows) >= MAX_SHADOW_IN_FLIGHT:
            return
        copy = pb.ModelInferRequest()
        copy.CopyFrom(request)
        copy.model_version = str(canary)
        agents = route.tiers[chosen.tier].agents_for(canary)
        agent = chosen.agent if chosen.agent in agents else self.rng.choice(agents)
        task = asyncio.create_task(self._compare(copy, response, chosen.tier, agent, route))
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    async def _compare(self, request: pb.ModelInferRequest, stable: pb.ModelInferResponse,
                       tier: str, agent: str, route: ModelRoute) -> None:
        model, output = request.model_name, route.cascade.output
        try:
            shadow = await self.pool.stub(agent).ModelInfer(
                request, timeout=self.table.timeout_s)
            expected = policies.top1(outputs_of(stable, output), output)
            seen = policies.top1(outputs_of(shadow, output), output)
            if expected is None or seen is None:
                result = "incomparable"  # no class scores to compare: never an agreement
            else:
                result = "agree" if expected == seen else "disagree"
        except Exception as error:  # noqa: BLE001 -- a shadow never touches the answer
            log.debug("shadow call failed: %s", error)
            result = "error"
        self.metrics.shadow.labels(model, tier, request.model_version, result).inc()

    async def metadata_call(self, model: str, method: str, message):
        """ModelReady/Metadata/Config from the first agent of the model that answers."""
        route = self.route_of(model)
        last: tuple[str, grpc.aio.AioRpcError] | None = None
        for tier in route.ordered_tiers():
            for agent in route.tiers[tier].agents:
                try:
                    return await getattr(self.pool.stub(agent), method)(
                        message, timeout=METADATA_TIMEOUT_S)
                except grpc.aio.AioRpcError as error:
                    if error.code() not in RETRYABLE:
                        raise upstream_error(agent, error) from None
                    last = (agent, error)
        assert last is not None
        raise upstream_error(*last)

    async def model_ready(self, model: str) -> bool:
        """Whether an agent of the model answers ModelReady true within READY_PROBE_S
        (agents asked in tier order; the probe's whole budget is bounded)."""
        route = self.table.models.get(model)
        if route is None:
            return False
        deadline = self.clock() + READY_PROBE_S
        for tier in route.ordered_tiers():
            for agent in route.tiers[tier].agents:
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

    async def any_agent_ready(self) -> bool:
        for agent in sorted(self.table.agents()):
            try:
                answer = await self.pool.stub(agent).ServerReady(
                    pb.ServerReadyRequest(), timeout=1.0)
            except grpc.aio.AioRpcError:
                continue
            if answer.ready:
                return True
        return False

    async def close(self) -> None:
        for task in list(self._shadows):
            task.cancel()
        await self.pool.close()


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


class RouterServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Convert, call the router, convert. Unlisted Triton methods: UNIMPLEMENTED."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.serving = True

    @translate_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @translate_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.serving and await self.router.any_agent_ready())

    @translate_errors
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="tiered-router", version=tiered.__version__,
                                         extensions=("model_configuration", "statistics",
                                                     "parameters"))

    @translate_errors
    async def ModelReady(self, request, context):
        if request.name not in self.router.table.models:
            return pb.ModelReadyResponse(ready=False)
        return await self.router.metadata_call(request.name, "ModelReady", request)

    @translate_errors
    async def ModelMetadata(self, request, context):
        return await self.router.metadata_call(request.name, "ModelMetadata", request)

    @translate_errors
    async def ModelConfig(self, request, context):
        return await self.router.metadata_call(request.name, "ModelConfig", request)

    @translate_errors
    async def ModelInfer(self, request, context):
        return await self.router.infer(request, context.invocation_metadata(),
                                       context.time_remaining())

    @translate_errors
    async def ModelStatistics(self, request, context):
        models = self.router.table.models
        if request.name and request.name not in models:
            raise errors.NotFound(f"name: {request.name!r} is not in the routing table")
        return pb.ModelStatisticsResponse(model_stats=self.router.statistics.messages(
            [request.name] if request.name else models, request.version,
            self.router.clock(), time.time()))

    @translate_errors
    async def RepositoryIndex(self, request, context):
        models = sorted(self.router.table.models)
        ready = await asyncio.gather(*(self.router.model_ready(m) for m in models))
        rows = [pb.RepositoryIndexResponse.ModelIndex(
            name=model, state="READY" if up else "UNAVAILABLE",
            reason="" if up else f"no agent of the model answered ModelReady true within "
                                 f"{READY_PROBE_S:g} s")
            for model, up in zip(models, ready, strict=True) if up or not request.ready]
        return pb.RepositoryIndexResponse(models=rows)

    async def RepositoryModelLoad(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, PLACEMENT)

    async def RepositoryModelUnload(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, PLACEMENT)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest],
                               context) -> AsyncIterator[pb.ModelStreamInferResponse]:
        # Each streamed request is forwarded on its own (unary), so nothing is
        # ever retried after part of an answer went out; one failure is one
        # error message in the stream, which goes on.
        metadata = context.invocation_metadata()

        async def infer(request: pb.ModelInferRequest) -> pb.ModelInferResponse:
            return await self.router.infer(request, metadata, context.time_remaining())

        async for response in answer_stream(request_iterator, infer, MAX_STREAM_IN_FLIGHT):
            yield response


async def watch_table(router: Router, path: Path, interval_s: float = TABLE_POLL_S) -> None:
    """Reload the table when the file changes; a bad one is logged and skipped."""
    seen = _stamp(path)
    while True:
        await asyncio.sleep(interval_s)
        stamp = _stamp(path)
        if stamp == seen:
            continue
        seen = stamp
        try:
            table = read_table(path)
        except errors.ConfigError as error:
            log.error("routing table rejected, still serving version %d: %s",
                      router.table.version, error)
            continue
        except Exception:  # noqa: BLE001 -- the watcher must outlive any file it is given
            log.exception("routing table rejected, still serving version %d: %s could not be "
                          "read", router.table.version, path)
            continue
        await router.use_table(table)
        log.info("routing table version %d loaded from %s", table.version, path)


def read_table(path: Path) -> RoutingTable:
    """load_table, with a file that is not text (binary garbage) a ConfigError too."""
    try:
        return load_table(path)
    except UnicodeDecodeError as error:
        raise errors.ConfigError(f"{path}: not UTF-8 text ({error.reason} at byte "
                                 f"{error.start})") from None


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


async def log_statistics(router: Router, interval_s: float = STATS_LOG_S) -> None:
    while True:
        await asyncio.sleep(interval_s)
        parts = []
        for metric in router.metrics.registry.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.value:
                    labels = ",".join(f"{v}" for v in sample.labels.values())
                    parts.append(f"{sample.name[len('tiered_router_'):-6]}[{labels}]="
                                 f"{sample.value:g}")
        if parts:
            log.info("router statistics: %s", " ".join(parts))


async def serve(settings: RouterSettings) -> None:
    table = read_table(settings.routing_table)
    router = Router(table, rng=random.Random(settings.seed), transport=settings.security)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ], maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
    servicer = RouterServicer(router)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        descriptors.reflection_service_names(), server, pool=descriptors.reflection_pool())
    address = f"{settings.host}:{settings.port}"
    try:
        port = security.add_port(server, address, settings.security)
    except RuntimeError as error:
        raise errors.ConfigError(f"cannot listen on {address}: {error}") from error
    await server.start()
    metrics = ""
    if settings.metrics_port is not None:
        try:
            http, _ = start_http_server(settings.metrics_port, settings.host,
                                        registry=router.metrics.registry)
        except OSError as error:
            await server.stop(0)
            raise errors.ConfigError(f"cannot serve /metrics on port {settings.metrics_port}: "
                                     f"{error}") from error
        metrics = f"; metrics on http://{settings.host}:{http.server_port}/metrics"
    poller = TelemetryPoller(router.observer, router.pool.channel, lambda: router.table.agents())
    background = [asyncio.create_task(poller.run()),
                  asyncio.create_task(watch_table(router, settings.routing_table)),
                  asyncio.create_task(log_statistics(router))]
    for service in ("", descriptors.INFERENCE_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"tiered router listening on {settings.host}:{port}; routing table version "
          f"{table.version} ({len(table.models)} models){metrics}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    servicer.serving = False
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=10)
    for task in background:
        task.cancel()
    await router.close()


def run(settings: RouterSettings) -> int:
    try:
        asyncio.run(serve(settings))
    except errors.ConfigError as error:
        print(f"tiered router: {error}", file=sys.stderr)
        return 2
    return 0
