"""The `tiered` command line. Arguments are parsed in `main()`, never at import."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from tiered.errors import ConfigError
from tiered.profiles import TIERS


def _agent(args: argparse.Namespace) -> int:
    from tiered.agent import server
    from tiered.profiles import load_profile

    try:
        profile = load_profile(args.tier, args.profile)
    except ConfigError as error:
        print(f"tiered agent: {error}", file=sys.stderr)
        return 2
    settings = server.AgentSettings(
        profile=profile,
        repository=args.model_repository,
        host=args.host,
        port=args.port,
        allow_failed_models=args.allow_failed_models,
    )
    return server.run(settings)


def _demo(args: argparse.Namespace) -> int:
    from tiered import demo

    return demo.run(args.tier)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiered",
        description="Edge-to-cloud tiered deployment of ML inference: agents serve models "
        "over the Open Inference Protocol (KServe v2 / Triton gRPC) on edge, regional and "
        "datacenter tiers.",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity (default: INFO)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    agent = commands.add_parser(
        "agent",
        help="serve a model repository over v2 gRPC on one tier",
        description="Serve every model in a repository over the v2 inference protocol "
        "(tritonclient, perf_analyzer and KServe v2 clients work unchanged). Layout: "
        "DIR/<model>/config.yaml and DIR/<model>/<version>/model.onnx. The tier's profile "
        "(agents/<tier>.yaml) supplies engine and batching defaults.",
    )
    agent.add_argument("--tier", required=True, choices=TIERS, help="the tier this agent runs on")
    agent.add_argument(
        "--model-repository", required=True, type=Path, metavar="DIR",
        help="directory of models: DIR/<model>/config.yaml, DIR/<model>/<version>/model.onnx",
    )
    agent.add_argument("--port", type=int, default=8001,
                       help="gRPC port (default 8001; 0 picks a free one and prints it)")
    agent.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    agent.add_argument("--profile", type=Path, metavar="FILE",
                       help="tier profile YAML (default: agents/<tier>.yaml)")
    agent.add_argument("--allow-failed-models", action="store_true",
                       help="start even if some models fail to load (they show as UNAVAILABLE)")
    agent.set_defaults(handler=_agent)

    demo = commands.add_parser(
        "demo",
        help="run the local demo: build a sample model, serve it, query it with tritonclient",
    )
    demo.add_argument("--tier", default="edge", choices=TIERS,
                      help="tier profile for the demo agent (default: edge)")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return args.handler(args)
