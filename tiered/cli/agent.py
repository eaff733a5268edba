"""`tiered agent` (serve a model repository on one tier) and `tiered top`
(a live table of agents' telemetry). Handlers import the agent and grpc only
when they run, so building the parser stays cheap."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from tiered.cli import flags
from tiered.errors import ConfigError


def register(commands: argparse._SubParsersAction) -> None:
    agent = commands.add_parser(
        "agent",
        help="serve a model repository over v2 gRPC and REST on one tier",
        description="Serve every model in a repository over the v2 inference protocol "
        "(tritonclient, perf_analyzer and KServe v2 clients work unchanged). Layout: "
        "DIR/<model>/config.yaml and DIR/<model>/<version>/model.onnx. The tier's profile "
        "(tiered/profiles/<tier>.yaml) supplies engine and batching defaults.",
    )
    agent.add_argument("--tier", required=True, choices=flags.TIER_CHOICES,
                       help="the tier this agent runs on")
    agent.add_argument(
        "--model-repository", required=True, type=Path, metavar="DIR",
        help="directory of models: DIR/<model>/config.yaml, DIR/<model>/<version>/model.onnx",
    )
    agent.add_argument("--port", type=int, default=8001,
                       help="gRPC port (default 8001; 0 picks a free one and prints it)")
    agent.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    agent.add_argument("--profile", type=Path, metavar="FILE",
                       help="tier profile YAML (default: tiered/profiles/<tier>.yaml)")
    agent.add_argument("--metrics-port", type=int, default=8002,
                       help="Prometheus /metrics port (default 8002; 0 picks a free one)")
    agent.add_argument("--no-metrics", action="store_true", help="serve no /metrics")
    agent.add_argument("--http-port", type=int, default=8000,
                       help="KServe v2 REST port, HTTPS under --tls-cert (default 8000; "
                       "0 picks a free one and prints it)")
    agent.add_argument("--no-http", action="store_true", help="serve no REST, gRPC only")
    agent.add_argument("--no-telemetry", action="store_true",
                       help="keep only Triton's cumulative statistics: no latency windows, "
                       "energy attribution or tiered.v1.Telemetry figures")
    agent.add_argument("--otlp-endpoint", default="", metavar="HOST:PORT",
                       help="export traces over OTLP/gRPC to this collector (default: off)")
    agent.add_argument("--trace-base-rate", type=float, default=0.01,
                       help="share of fast, successful requests whose traces are kept; failed "
                       "ones always are, slow ones by latency (default 0.01)")
    agent.add_argument("--front-ends", type=int, metavar="N",
                       help="gRPC front-end processes sharing the port and feeding this "
                       "process's engines through shared memory; 0 serves gRPC in this "
                       "process (default: the tier profile's front_ends, at most half "
                       "the usable cores, none below 4)")
    agent.add_argument("--devices", metavar="LIST",
                       help="one engine process per device: 'auto' (every visible GPU, when "
                       "two or more), a comma-separated list of GPU indices or UUIDs, 'cpu' "
                       "entries (CPU engine processes standing in for devices, e.g. cpu,cpu), "
                       "or 'none' (engines in the agent's process) (default: the tier "
                       "profile's devices)")
    agent.add_argument("--allow-failed-models", action="store_true",
                       help="start even if some models fail to load (they show as UNAVAILABLE)")
    flags.add_tls_flags(agent, dials=False)
    flags.add_auth_flags(agent)
    agent.set_defaults(handler=_run_agent)

    top = commands.add_parser(
        "top",
        help="live table of agents' model versions: rates, latency, energy per inference",
        description="Poll each agent's tiered.v1.Telemetry service and show, per model "
        "version, requests/s, error rate, latency quantiles, queueing and joules per "
        "inference (with the energy source: nvml, rapl or model) since the last refresh. "
        "With no address, the agents of the local system in --state (as `tiered up` "
        "recorded them).",
    )
    top.add_argument("agents", nargs="*", metavar="HOST:PORT",
                     help="agent gRPC addresses (default: the local system's agents)")
    top.add_argument("--state", type=Path, default=Path(".tiered"), metavar="DIR",
                     help=f"{flags.STATE_HELP}; where the agents are found when no "
                     "address is given (plaintext, as `tiered up` runs them, unless "
                     "--tls-* flags say otherwise)")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true",
                     help="print the whole window once and exit (no screen clearing)")
    top.add_argument("--model", default="", help="only this model")
    flags.add_tls_flags(top, server=False)
    top.set_defaults(handler=_run_top)


def _run_agent(args: argparse.Namespace) -> int:
    from tiered.engines import AGENT_EXTRA

    try:
        from tiered.agent import server
    except ModuleNotFoundError as error:  # a base install: no OpenTelemetry, no engines
        print(f"tiered agent: needs the agent's packages ({AGENT_EXTRA}): {error}",
              file=sys.stderr)
        return 2
    from tiered.profiles import MAX_FRONT_ENDS, load_profile, parse_devices
    from tiered.telemetry.tracing import TracingSettings

    try:
        profile = load_profile(args.tier, args.profile)
        if args.devices is not None:
            listed = args.devices.strip()
            devices = (listed if listed == "auto" else [] if listed == "none"
                       else [e.strip() for e in listed.split(",")])
            parse_devices(devices, "--devices")  # an error names the flag, not the profile
            profile = dataclasses.replace(profile, devices=devices)
        if args.front_ends is not None and not 0 <= args.front_ends <= MAX_FRONT_ENDS:
            raise ConfigError(f"--front-ends: must be in 0..{MAX_FRONT_ENDS}, "
                              f"got {args.front_ends}")
        security = flags.security_from_args(args)
        authorizer = flags.authorizer_from_args(args)
    except ConfigError as error:
        print(f"tiered agent: {error}", file=sys.stderr)
        return 2
    security.warn_if_plaintext("tiered agent")
    settings = server.AgentSettings(
        profile=profile,
        repository=args.model_repository,
        host=args.host,
        port=args.port,
        metrics_port=None if args.no_metrics else args.metrics_port,
        http_port=None if args.no_http else args.http_port,
        telemetry=not args.no_telemetry,
        tracing=TracingSettings(base_rate=args.trace_base_rate, otlp_endpoint=args.otlp_endpoint),
        allow_failed_models=args.allow_failed_models,
        security=security, authorizer=authorizer, front_ends=args.front_ends,
    )
    return server.run(settings)


def _run_top(args: argparse.Namespace) -> int:
    from tiered.cli import top
    from tiered.protocol.security import PLAINTEXT

    try:
        agents = args.agents or top.local_agents(args.state)
        tls = args.tls_cert or args.tls_key or args.tls_ca or args.insecure
        # The local system's agents speak plaintext on loopback, as `tiered up` runs them.
        transport = (flags.security_from_args(args) if args.agents or tls
                     else PLAINTEXT)
    except ConfigError as error:
        print(f"tiered top: {error}", file=sys.stderr)
        return 2
    try:
        return top.run(agents, args.interval, args.once, args.model, transport,
                       "" if args.agents else f"no agent of the local system in {args.state} "
                       "answered: is it running? (`tiered up -f FILE` starts it)")
    except KeyboardInterrupt:
        return 0
