"""`tiered router`: serve v2 gRPC in front of the tier agents. The handler
imports the router (and grpc) only when it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tiered.cli import flags
from tiered.errors import ConfigError


def register(commands: argparse._SubParsersAction) -> None:
    router = commands.add_parser(
        "router",
        help="serve v2 gRPC and REST in front of the tier agents and route each request",
        description="A v2 inference server (tritonclient and perf_analyzer work unchanged) "
        "that forwards each request to a tier agent named in the routing table: the "
        "tiered-tier hint's tier first (only it with tiered-tier-strict), else by the "
        "model's policy (slo-energy or cascade), with failover (agents without a "
        "connection held down and probed back), canary split sticky by tiered-key, "
        "shadowing and per-agent in-flight limits. The table file is reloaded when it changes; an invalid one is rejected.",
    )
    router.add_argument("--routing-table", required=True, type=Path, metavar="FILE",
                        help="routing table (YAML or JSON)")
    router.add_argument("--port", type=int, default=8001,
                        help="gRPC port (default 8001; 0 picks a free one and prints it)")
    router.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    router.add_argument("--metrics-port", type=int, default=8003,
                        help="Prometheus /metrics port (default 8003; 0 picks a free one)")
    router.add_argument("--no-metrics", action="store_true", help="serve no /metrics")
    router.add_argument("--http-port", type=int, default=8000,
                        help="KServe v2 REST port, HTTPS under --tls-cert (default 8000; "
                        "0 picks a free one and prints it)")
    router.add_argument("--no-http", action="store_true", help="serve no REST, gRPC only")
    router.add_argument("--seed", type=int, default=None,
                        help="seed of the split for requests without a tiered-key")
    router.add_argument("--workers", type=int, default=1, metavar="N",
                        help="router processes sharing the gRPC and REST ports (default 1): "
                        "the kernel spreads client connections over them, so that one "
                        "interpreter's per-message work does not cap the router. Each is a "
                        "whole router with its own health, observations and statistics, as "
                        "separate routers are; each serves its own /metrics, on "
                        "--metrics-port plus its index (or a free port with 0). Stopping "
                        "this process stops them all")
    router.add_argument("--agent-connections", type=int, metavar="N",
                        help="connections to each agent, the calls to it taking turns over "
                        "them (default 8, the datacenter profile's front ends). An agent's "
                        "front-end processes share its port and the kernel gives each a "
                        "share of the connections, not of the calls: give at least as many "
                        "as the agents have front ends")
    limits = router.add_argument_group("limits")
    limits.add_argument("--max-message-bytes", type=_positive, metavar="BYTES",
                        help="largest request or response, gRPC message or REST body "
                        "(default 67108864, 64 MiB, as Triton's HTTP input limit); a larger "
                        "one is refused: gRPC RESOURCE_EXHAUSTED, REST 413")
    limits.add_argument("--max-json-bytes", type=_positive, metavar="BYTES",
                        help="largest JSON part of a REST body (default 4194304, 4 MiB; JSON is "
                        "parsed on the event loop, binary data is not); a larger one gets 413")
    flags.add_tls_flags(router)
    group = router.add_argument_group("authorization")
    group.add_argument("--inference-token-file", type=Path, metavar="FILE",
                       help="tokens (one per line) a client must send to infer through the "
                       "router (authorization: Bearer TOKEN, gRPC and REST; default: open)")
    group.add_argument("--agent-token-file", type=Path, metavar="FILE",
                       help="the one token the router presents to its agents on every call "
                       "(for agents started with --inference-token-file); a client's own "
                       "token is not passed on")
    router.set_defaults(handler=_run_router)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 byte, got {value}")
    return value


def _run_router(args: argparse.Namespace) -> int:
    from tiered.protocol.security import Authorizer, read_token, read_tokens
    from tiered.router import server as router_server

    given = {name: value for name in ("max_message_bytes", "max_json_bytes", "agent_connections")
             if (value := getattr(args, name)) is not None}  # else the router's defaults
    try:
        transport = flags.security_from_args(args)
        tokens = read_tokens(args.inference_token_file, "--inference-token-file")
        agent_token = (read_token(args.agent_token_file, "--agent-token-file")
                       if args.agent_token_file else None)
        settings = router_server.RouterSettings(
            routing_table=args.routing_table, host=args.host, port=args.port,
            metrics_port=None if args.no_metrics else args.metrics_port,
            http_port=None if args.no_http else args.http_port, seed=args.seed,
            security=transport, authorizer=Authorizer(inference_tokens=tokens or None),
            agent_token=agent_token, workers=args.workers, **given)
    except ConfigError as error:
        print(f"tiered router: {error}", file=sys.stderr)
        return 2
    transport.warn_if_plaintext("tiered router")
    return router_server.run(settings)
