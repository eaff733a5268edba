"""Agents' Telemetry services played by small gRPC servers, for a
controller run against the Kubernetes API test double: the addresses file
its `--agent-addresses` reads maps each agent Service to one of them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from concurrent import futures
from pathlib import Path

import grpc

from tiered.protocol import telemetry_pb2_grpc as tpb_grpc


@contextlib.contextmanager
def telemetry_servers(services: Mapping[str, tpb_grpc.TelemetryServicer],
                      path: Path) -> Iterator[Path]:
    """Serve each Service's telemetry on a loopback port while inside; the
    addresses file (Service -> HOST:PORT) is written to `path`."""
    servers, addresses = [], {}
    try:
        for service, servicer in services.items():
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            tpb_grpc.add_TelemetryServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            servers.append(server)
            addresses[service] = f"127.0.0.1:{port}"
        path.write_text(json.dumps(addresses))
        yield path
    finally:
        for server in servers:
            server.stop(0)
