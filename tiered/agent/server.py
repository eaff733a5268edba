"""The agent process: load the repository, serve v2 gRPC, drain on shutdown.

On one port: the v2 inference service, `tiered.v1.Telemetry`,
`grpc.health.v1` (SERVING once the repository is loaded, NOT_SERVING while
shutting down) and server reflection; Prometheus `/metrics` on another.
Tracing is set up here when an OTLP endpoint is configured.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tiered.agent.metrics import serve_metrics
from tiered.agent.repository import ModelRepository
from tiered.agent.servicer import InferenceServicer
from tiered.agent.telemetry import TelemetryHub, TelemetryServicer
from tiered.errors import ConfigError
from tiered.profiles import TierProfile
from tiered.protocol import descriptors
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc
from tiered.protocol.security import PLAINTEXT, Authorizer, TransportSecurity, add_port
from tiered.telemetry import tracing
from tiered.telemetry.tracing import TracingSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentSettings:
    profile: TierProfile
    repository: Path
    host: str = "127.0.0.1"
    port: int = 8001
    metrics_port: int | None = 8002  # Prometheus /metrics; None: off, 0: any free port
    telemetry: bool = True  # per-version windows and energy (tiered.v1.Telemetry)
    tracing: TracingSettings = TracingSettings()  # off unless an OTLP endpoint is set
    allow_failed_models: bool = False  # else a model that fails to load stops start-up
    security: TransportSecurity = PLAINTEXT
    authorizer: Authorizer = Authorizer()  # with no admin credentials, load/unload are refused


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second agent on a taken port must fail, not share it
    ]


async def serve(settings: AgentSettings) -> None:
    """Run until SIGTERM or SIGINT, then drain and return."""
    limits = settings.profile.limits
    sys.setswitchinterval(limits.gil_switch_interval_ms / 1000)
    repository = ModelRepository(settings.repository, settings.profile,
                                 telemetry=settings.telemetry)
    failed = await repository.load_all()
    if failed and not settings.allow_failed_models:
        await repository.close()
        raise ConfigError(
            f"models failed to load: {', '.join(failed)} (see the log above; "
            "--allow-failed-models serves the rest)"
        )

    server = grpc.aio.server(
        options=grpc_options(limits.max_message_bytes),
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
    )
    tracer = tracing.configure(f"tiered-agent-{settings.profile.tier}", settings.tracing)
    servicer = InferenceServicer(repository, tracer, settings.authorizer)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    hub = TelemetryHub.for_this_machine(repository)
    tpb_grpc.add_TelemetryServicer_to_server(TelemetryServicer(hub), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        descriptors.reflection_service_names(), server, pool=descriptors.reflection_pool()
    )
    address = f"{settings.host}:{settings.port}"
    try:
        port = add_port(server, address, settings.security)
    except RuntimeError as error:
        raise ConfigError(f"cannot listen on {address}: {error}") from error
    await server.start()
    hub.start()
    metrics = ""
    if settings.metrics_port is not None:
        try:
            bound = serve_metrics(hub, settings.host, settings.metrics_port)
        except OSError as error:
            await server.stop(0)
            raise ConfigError(
                f"cannot serve /metrics on {settings.host}:{settings.metrics_port}: {error}"
            ) from error
        metrics = f"; metrics on http://{settings.host}:{bound}/metrics"

    servicer.ready = True
    for service in ("", descriptors.INFERENCE_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    models = ", ".join(sorted({v.config.name for v in repository.all_versions()})) or "none"
    # Tests and supervisors read this line to learn the port when --port 0.
    print(
        f"tiered agent ({settings.profile.tier}) listening on {settings.host}:{port}; "
        f"models: {models}{metrics}",
        flush=True,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()

    log.info("shutting down: refusing new requests, draining in-flight ones")
    servicer.ready = False
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=limits.drain_timeout_s)
    await hub.stop()
    await repository.close()
    log.info("stopped")


def run(settings: AgentSettings) -> int:
    try:
        asyncio.run(serve(settings))
    except ConfigError as error:
        print(f"tiered agent: {error}", file=sys.stderr)
        return 2
    return 0
