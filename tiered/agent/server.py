"""The agent process: load the repository, serve v2 gRPC, drain on shutdown.

On one port: the v2 inference service, `tiered.v1.Telemetry`,
`grpc.health.v1` (SERVING once the repository is loaded, NOT_SERVING while
shutting down) and server reflection; KServe v2 REST (`tiered.protocol.rest`) on a second port and
Prometheus `/metrics` on a third.
Tracing is set up here when an OTLP endpoint is configured. With the
profile's `front_ends: N`, this process keeps the engines and serves those
services on a private unix socket, and N front-end processes share the port
(`front_end.py`); REST is served by this process.
On SIGTERM the agent answers every call it has received, within the
profile's `drain_timeout_s`: the front ends drain first (their calls are
answered here), then this process's own server (`drain.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from tiered.agent.devices import DevicePool, nvml_gpu_count, resolve_devices
from tiered.agent.feed import FeedServer
from tiered.agent.front_end import (
    FrontEnds,
    FrontEndSettings,
    front_end_count,
    reserve_port,
)
from tiered.agent.generative import GenerativeVersion
from tiered.agent.metrics import serve_metrics
from tiered.agent.repository import ModelRepository
from tiered.agent.servicer import InferenceServicer
from tiered.agent.shared_memory import pin_host_memory, preload_cuda
from tiered.agent.telemetry import TelemetryHub, TelemetryServicer
from tiered.errors import ConfigError
from tiered.profiles import MiB, TierProfile
from tiered.protocol import descriptors, drain, rest
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc
from tiered.protocol.handlers import SERVER_OPTIONS, GenericOnly
from tiered.protocol.security import (
    PLAINTEXT,
    TRUST_FRONT_ENDS,
    Authorizer,
    TransportSecurity,
    add_port,
)
from tiered.telemetry import tracing
from tiered.telemetry.tracing import TracingSettings

log = logging.getLogger(__name__)

FEED_FRAME_SLACK = 1 << 20  # a feed frame carries a request's bytes and a little more


@dataclass(frozen=True)
class AgentSettings:
    profile: TierProfile
    repository: Path
    host: str = "127.0.0.1"
    port: int = 8001
    metrics_port: int | None = 8002  # Prometheus /metrics; None: off, 0: any free port
    http_port: int | None = 8000  # KServe v2 REST; None: off, 0: any free port
    telemetry: bool = True  # per-version windows and energy (tiered.v1.Telemetry)
    tracing: TracingSettings = TracingSettings()  # off unless an OTLP endpoint is set
    allow_failed_models: bool = False  # else a model that fails to load stops start-up
    security: TransportSecurity = PLAINTEXT
    authorizer: Authorizer = Authorizer()  # with no admin credentials, load/unload are refused
    # gRPC front-end processes; None: the profile's, as many as the cores allow
    front_ends: int | None = None


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second agent on a taken port must fail, not share it
        *SERVER_OPTIONS,
    ]


def _grpc_server(limits, servicer: InferenceServicer, hub: TelemetryHub,
                 health_servicer: health.aio.HealthServicer) -> grpc.aio.Server:
    """Every service of the agent on one (not yet bound) server."""
    server = grpc.aio.server(
        options=grpc_options(limits.max_message_bytes),
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
    )
    services = GenericOnly(server)  # a cheaper lookup per call
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, services)
    tpb_grpc.add_TelemetryServicer_to_server(TelemetryServicer(hub), services)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, services)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(
        descriptors.reflection_service_names(), pool=descriptors.reflection_pool()), services)
    server.add_generic_rpc_handlers([drain.Marker()])
    return server


async def serve(settings: AgentSettings) -> None:
    """Run until SIGTERM or SIGINT, then drain and return."""
    # Unix sockets of this agent alone: its front ends reach it through them,
    # and it reaches its own gRPC server through one to drain it (`drain.stop`).
    private = Path(tempfile.mkdtemp(prefix="tiered-agent-"))
    log.info("private sockets in %s", private)
    try:
        await _serve(settings, private)
    finally:
        shutil.rmtree(private, ignore_errors=True)


async def _serve(settings: AgentSettings, private: Path) -> None:
    profile = settings.profile
    limits = profile.limits
    sys.setswitchinterval(limits.gil_switch_interval_ms / 1000)
    pool = DevicePool(resolve_devices(profile.devices, os.environ, nvml_gpu_count))
    if pool.devices:
        log.info("one engine process per device: %s", ", ".join(d.name for d in pool.devices))
    repository = ModelRepository(settings.repository, profile, telemetry=settings.telemetry,
                                 devices=pool)
    failed = await repository.load_all()
    if failed and not settings.allow_failed_models:
        await repository.close()
        raise ConfigError(
            f"models failed to load: {', '.join(failed)} (see the log above; "
            "--allow-failed-models serves the rest)"
        )

    if await asyncio.to_thread(preload_cuda):
        log.info("CUDA loaded before serving, for CUDA shared-memory regions")
    tracer = tracing.configure(f"tiered-agent-{profile.tier}", settings.tracing)
    processes = settings.front_ends
    if processes is None:
        processes = front_end_count(profile.front_ends)
        if processes < profile.front_ends:
            log.info("%d front-end processes, not the profile's %d: this machine lets the "
                     "agent use %d cores", processes, profile.front_ends,
                     len(os.sched_getaffinity(0)))
    # With front ends, they check credentials; this process's socket trusts them.
    authorizer = TRUST_FRONT_ENDS if processes else settings.authorizer
    servicer = InferenceServicer(repository, tracer, authorizer)
    # REST callers reach this process directly, front ends or not: their
    # credentials are checked here, by a servicer over the same models.
    http_servicer = servicer if not processes else InferenceServicer(
        repository, tracer, settings.authorizer, servicer.shared_memory)
    hub = TelemetryHub.for_this_machine(repository)
    health_servicer = health.aio.HealthServicer()
    server = _grpc_server(limits, servicer, hub, health_servicer)
    own = f"unix:{private / 'grpc.sock'}"
    server.add_insecure_port(own)
    front_ends = None
    address = f"{settings.host}:{settings.port}"
    if processes:
        try:
            held = reserve_port(settings.host, settings.port)
        except ConfigError:
            await repository.close()
            raise
        port = held.getsockname()[1]
        await server.start()
        feed = FeedServer(str(private / "feed.sock"), servicer,
                          limits.max_message_bytes + FEED_FRAME_SLACK, pin_host_memory,
                          lambda: {v.tokenizer for v in repository.all_versions()
                                   if isinstance(v, GenerativeVersion)})
        servicer.shared_memory.on_change.append(feed.forget)
        repository.on_load.append(feed.announce)
        front_ends = FrontEnds(processes, FrontEndSettings(
            host=settings.host, port=port, security=settings.security,
            authorizer=settings.authorizer, feed=feed.path,
            engine=own,
            max_message_bytes=limits.max_message_bytes,
            max_concurrent_rpcs=limits.max_concurrent_rpcs,
            drain_timeout_s=limits.drain_timeout_s,
            arena_bytes=limits.front_end_arena_mib * MiB))
        try:
            await front_ends.start()
        except ConfigError:
            await _close_feed(feed, held)
            await server.stop(0)
            await repository.close()
            raise
    else:
        try:
            port = add_port(server, address, settings.security)
        except RuntimeError as error:
            raise ConfigError(f"cannot listen on {address}: {error}") from error
        await server.start()
    rest_server = None
    if settings.http_port is not None:
        door = rest.RestFrontDoor(http_servicer, max_body_bytes=limits.max_message_bytes,
                                  max_json_bytes=limits.max_json_bytes,
                                  max_in_flight=limits.max_concurrent_rpcs,
                                  authorizer=settings.authorizer)
        try:
            rest_server = await rest.serve(door, settings.host, settings.http_port,
                                           settings.security.server_ssl_context(),
                                           limits.drain_timeout_s)
        except ConfigError:
            if front_ends is not None:
                await front_ends.stop()
                await _close_feed(feed, held)
            await server.stop(0)
            await repository.close()
            raise
    hub.start()
    metrics = ""
    if settings.metrics_port is not None:
        try:
            bound = serve_metrics(hub, settings.host, settings.metrics_port,
                                  feed if front_ends is not None else None)
        except OSError as error:
            if front_ends is not None:
                await front_ends.stop()
                await _close_feed(feed, held)
            if rest_server is not None:
                await rest_server.stop()
            await server.stop(0)
            raise ConfigError(
                f"cannot serve /metrics on {settings.host}:{settings.metrics_port}: {error}"
            ) from error
        metrics = f"; metrics on http://{settings.host}:{bound}/metrics"

    servicer.ready = http_servicer.ready = True
    for service in ("", descriptors.INFERENCE_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    watching = (asyncio.get_running_loop().create_task(_watch_devices(repository, health_servicer))
                if pool.devices else None)
    models = ", ".join(sorted({v.config.name for v in repository.all_versions()})) or "none"
    fronted = f"; {processes} front-end processes" if processes else ""
    if rest_server is not None:
        metrics = f"; REST on {rest_server.scheme}://{settings.host}:{rest_server.port}{metrics}"
    # Tests and supervisors read this line to learn the port when --port 0.
    print(
        f"tiered agent ({profile.tier}) listening on {settings.host}:{port}; "
        f"models: {models}{metrics}{fronted}",
        flush=True,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()

    log.info("shutting down: refusing new requests, draining in-flight ones")
    if watching is not None:
        watching.cancel()
    servicer.ready = http_servicer.ready = False
    await health_servicer.enter_graceful_shutdown()
    # REST drains beside gRPC: both answer their in-flight calls from here.
    rest_stopped = asyncio.ensure_future(rest_server.stop()) if rest_server else None
    if front_ends is not None:
        await front_ends.stop()  # each drains its calls, answered from here
        await _close_feed(feed, held)
    await drain.stop(server, own, limits.drain_timeout_s)
    if rest_stopped is not None:
        await rest_stopped
    await hub.stop()
    await repository.close()
    log.info("stopped")


DEVICE_CHECK_S = 1.0


async def _watch_devices(repository: ModelRepository,
                         health_servicer: health.aio.HealthServicer) -> None:
    """Health says NOT_SERVING while some model has no device up (its engine
    processes all down: their GPUs gone, say), so probes and routers see it."""
    serving = True
    while True:
        await asyncio.sleep(DEVICE_CHECK_S)
        stranded = sorted({v.config.name for v in repository.all_versions()
                           if v.devices and not v.ready})
        if serving != (not stranded):
            serving = not stranded
            if stranded:
                log.error("no device takes requests for %s: health is NOT_SERVING",
                          ", ".join(stranded))
            status = (health_pb2.HealthCheckResponse.SERVING if serving
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for service in ("", descriptors.INFERENCE_SERVICE):
                await health_servicer.set(service, status)


async def _close_feed(feed: FeedServer, held: socket.socket) -> None:
    await feed.close()
    held.close()


def run(settings: AgentSettings) -> int:
    try:
        asyncio.run(serve(settings))
    except ConfigError as error:
        print(f"tiered agent: {error}", file=sys.stderr)
        return 2
    return 0
