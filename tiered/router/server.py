"""The router process: settings, the routing table's reload loop, and the
gRPC server (the v2 inference service, tiered.v1.Telemetry, health and
reflection) with KServe v2 REST over the same servicer and its /metrics
endpoint.

Everything per request lives below it (`servicer`, `dataplane`, `forward`).
The one place that reads the table file and starts and stops the process
(and, with `workers`, the router processes that share its ports: `python -m
tiered.router.server`, their settings pickled on stdin); it must never
import agent or controller modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import random
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from prometheus_client import start_http_server

from tiered import errors
from tiered.protocol import descriptors, drain, rest, rest_json, routing, security
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc
from tiered.protocol.handlers import SERVER_OPTIONS, GenericOnly
from tiered.protocol.security import PLAINTEXT, Authorizer, TransportSecurity
from tiered.router import dataplane, forward, observations, servicer

log = logging.getLogger(__name__)

MAX_CONCURRENT_RPCS = 8192
TABLE_POLL_S = 1.0
STATS_LOG_S = 30.0
DRAIN_S = 10.0  # on shutdown, in-flight calls get this long to finish


@dataclass(frozen=True)
class RouterSettings:
    routing_table: Path
    host: str = "127.0.0.1"
    port: int = 8001
    metrics_port: int | None = None  # None: off, 0: any free port
    http_port: int | None = None  # KServe v2 REST; None: off, 0: any free port
    seed: int | None = None  # rng seed for reproducible splits without keys
    security: TransportSecurity = PLAINTEXT  # the router's port and its channels to agents
    authorizer: Authorizer = Authorizer()  # who may infer through it (default: open)
    agent_token: str | None = None  # presented to agents that require a token
    max_message_bytes: int = forward.MAX_MESSAGE_BYTES  # gRPC messages and REST bodies
    max_json_bytes: int = rest_json.MAX_JSON_BYTES  # a REST body's JSON part
    agent_connections: int = forward.AGENT_CONNECTIONS  # to each agent, its calls in turn
    # Router processes sharing the gRPC and REST ports (SO_REUSEPORT: the
    # kernel spreads connections over them), each a whole router with its own
    # health, observations, statistics and /metrics; this one is `worker` 0,
    # which starts the others and stops them with itself.
    workers: int = 1
    worker: int = 0
    first_pid: int = 0  # a worker's first router, without which it stops

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise errors.ConfigError(f"--workers: at least 1, got {self.workers}")
        if self.agent_connections < 1:
            raise errors.ConfigError(
                f"--agent-connections: at least 1, got {self.agent_connections}")

    def of_worker(self, worker: int, port: int, http_port: int | None) -> RouterSettings:
        """Worker `worker`'s settings, on the ports the first one listens on;
        its /metrics on the next port up (or a free one, or none)."""
        metrics = self.metrics_port
        if metrics:
            metrics += worker
        return replace(self, port=port, http_port=http_port, metrics_port=metrics, worker=worker,
                       first_pid=os.getpid())


async def watch_table(router: dataplane.Router, path: Path, seen: tuple[int, int] | None,
                      interval_s: float = TABLE_POLL_S) -> None:
    """Reload the table when the file changes from `seen` (its stamp when the
    router's table was read); a bad one is logged and skipped."""
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


def read_table(path: Path) -> routing.RoutingTable:
    """load_table, with a file that is not text (binary garbage) a ConfigError too."""
    try:
        return routing.load_table(path)
    except UnicodeDecodeError as error:
        raise errors.ConfigError(f"{path}: not UTF-8 text ({error.reason} at byte "
                                 f"{error.start})") from None


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


async def log_statistics(router: dataplane.Router, interval_s: float = STATS_LOG_S) -> None:
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
    """Run until SIGTERM or SIGINT, then drain and return."""
    # A unix socket of its own, to drain itself through (`drain.stop`).
    with tempfile.TemporaryDirectory(prefix="tiered-router-") as private:
        await _serve(settings, f"unix:{Path(private) / 'grpc.sock'}")


async def _serve(settings: RouterSettings, own: str) -> None:
    # Stamped before it is read: a table written from then on is a change,
    # even one written before the watcher first looks.
    stamp = _stamp(settings.routing_table)
    table = read_table(settings.routing_table)
    router = dataplane.Router(table, rng=random.Random(settings.seed),
                              transport=settings.security, agent_token=settings.agent_token,
                              max_message_bytes=settings.max_message_bytes,
                              agent_connections=settings.agent_connections)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", int(settings.workers > 1)),
        *SERVER_OPTIONS,
    ], maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
    inference = servicer.RouterServicer(router, settings.authorizer)
    servicer.add_to_server(inference, server)
    services = GenericOnly(server)
    tpb_grpc.add_TelemetryServicer_to_server(servicer.TelemetryServicer(router), services)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, services)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(
        descriptors.reflection_service_names(), pool=descriptors.reflection_pool()), services)
    server.add_generic_rpc_handlers([drain.Marker()])
    address = f"{settings.host}:{settings.port}"
    try:
        port = security.add_port(server, address, settings.security)
    except RuntimeError as error:
        raise errors.ConfigError(f"cannot listen on {address}: {error}") from error
    server.add_insecure_port(own)
    await server.start()
    rest_server = None
    if settings.http_port is not None:
        door = rest.RestFrontDoor(inference, max_body_bytes=settings.max_message_bytes,
                                  max_json_bytes=settings.max_json_bytes,
                                  max_in_flight=MAX_CONCURRENT_RPCS,
                                  infer=rest.over_bytes(inference.ModelInfer),
                                  # loads and shared memory: answered 501 by the router
                                  authorizer=settings.authorizer, roles=("inference",))
        try:
            rest_server = await rest.serve(door, settings.host, settings.http_port,
                                           settings.security.server_ssl_context(), DRAIN_S,
                                           reuse_port=settings.workers > 1)
        except errors.ConfigError:
            await server.stop(0)
            raise
    metrics = ""
    if settings.metrics_port is not None:
        try:
            http, _ = start_http_server(settings.metrics_port, settings.host,
                                        registry=router.metrics.registry)
        except OSError as error:
            if rest_server is not None:
                await rest_server.stop()
            await server.stop(0)
            raise errors.ConfigError(f"cannot serve /metrics on port {settings.metrics_port}: "
                                     f"{error}") from error
        metrics = f"; metrics on http://{settings.host}:{http.server_port}/metrics"
    workers: list[Worker] = []
    if settings.workers > 1 and not settings.worker:
        try:
            workers = await asyncio.to_thread(
                start_workers, settings, port, rest_server.port if rest_server else None)
        except errors.ConfigError:
            if rest_server is not None:
                await rest_server.stop()
            await server.stop(0)
            raise
    if rest_server is not None:
        metrics = f"; REST on {rest_server.scheme}://{settings.host}:{rest_server.port}{metrics}"
    poller = observations.TelemetryPoller(router.observer, router.pool.dial,
                                          lambda: router.table.agents())
    background = [asyncio.create_task(poller.run()), asyncio.create_task(router.prober.run()),
                  asyncio.create_task(watch_table(router, settings.routing_table, stamp)),
                  asyncio.create_task(log_statistics(router))]
    for service in ("", descriptors.INFERENCE_SERVICE, descriptors.TELEMETRY_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if settings.worker:
        background.append(asyncio.create_task(_stop_without(settings.first_pid, stop)))
        print(f"tiered router worker {settings.worker} of {settings.workers} on "
              f"{settings.host}:{port}{metrics}", flush=True)
    else:
        print(f"tiered router listening on {settings.host}:{port}; routing table version "
              f"{table.version} ({len(table.models)} models){metrics}"
              + "".join(f"\n  {worker.said}" for worker in workers), flush=True)
    await stop.wait()
    inference.serving = False
    await health_servicer.enter_graceful_shutdown()
    await asyncio.gather(drain.stop(server, own, DRAIN_S),
                         *([rest_server.stop()] if rest_server else []),
                         *([asyncio.to_thread(stop_workers, workers)] if workers else []))
    for task in background:
        task.cancel()
    await poller.close()
    await router.close()


# -- worker processes --------------------------------------------------------------------

WORKER_START_S = 60.0
ORPHAN_POLL_S = 1.0


@dataclass(frozen=True)
class Worker:
    process: subprocess.Popen
    said: str  # its first line: where it listens and serves /metrics


def start_workers(settings: RouterSettings, port: int, http_port: int | None) -> list[Worker]:
    """Workers 1.. of `settings.workers`, each on the first one's ports, each
    started when it has said where it listens (its settings pickled on stdin,
    `python -m tiered.router.server`); a ConfigError, with the others
    stopped, when one does not start."""
    workers: list[Worker] = []
    for index in range(1, settings.workers):
        process = subprocess.Popen([sys.executable, "-m", "tiered.router.server"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False)
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(pickle.dumps(settings.of_worker(index, port, http_port)))
        process.stdin.close()
        ready, _, _ = select.select([process.stdout], [], [], WORKER_START_S)
        said = process.stdout.readline().decode(errors="replace").strip() if ready else ""
        process.stdout.close()  # "" above: it exited, or said nothing in time
        if not said.startswith("tiered router worker"):
            stop_workers([*workers, Worker(process, said)])
            raise errors.ConfigError(f"router worker {index} did not start (its log is above)")
        workers.append(Worker(process, said))
    return workers


def stop_workers(workers: list[Worker]) -> None:
    """Ask each to drain and stop (SIGTERM), and wait for it."""
    for worker in workers:
        with contextlib.suppress(ProcessLookupError):
            worker.process.terminate()
    for worker in workers:
        try:
            worker.process.wait(DRAIN_S + 5)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()


async def _stop_without(first: int, stop: asyncio.Event) -> None:
    """A worker whose first router is gone (killed, not stopped) stops too."""
    while os.getppid() == first:
        await asyncio.sleep(ORPHAN_POLL_S)
    log.error("the first router process is gone; this worker stops")
    stop.set()


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (a cheaper hop), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(settings: RouterSettings) -> int:
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(serve(settings))
    except errors.ConfigError as error:
        print(f"tiered router: {error}", file=sys.stderr)
        return 2
    return 0


def _worker() -> int:
    """A worker (`start_workers`): its settings from stdin, then a router."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s router worker %(levelname)s %(message)s")
    return run(pickle.load(sys.stdin.buffer))


if __name__ == "__main__":
    from tiered.router import server  # what it unpickles must name this module

    sys.exit(server._worker())
