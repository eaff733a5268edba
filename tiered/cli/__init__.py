"""The `tiered` command line: one parser, each command registered by the module
that runs it.

`agent` (agent, top), `router`, `demo`, `build`, `models`, `controller` (up,
controller), `tieredmodels` (apply, get, rollout, crds) and `load` each add their parsers
and handlers with `register(commands)`; `flags` holds the flags several
commands share. Arguments are parsed in `main()`, never at import, and a
handler imports what it runs only when it runs, so `tiered --help` stays
fast. `top` is how an agent's figures read on a terminal (a rollout's
progress lines are `tiered.rollout.progress`); `watch` is what every --watch
loop shares (ending on Ctrl-C or a closed pipe).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from tiered.cli import agent, build, controller, demo, load, models, router, tieredmodels
from tiered.local.processes import follow_parent, take_sigint

__all__ = ["build_parser", "kubectl_main", "main"]

# In the order `tiered --help` lists the commands.
_COMMANDS = (agent, router, demo, build, models, controller, tieredmodels, load)
# The commands that act on a cluster with --kubernetes (as `kubectl tiered` does).
CLUSTER_VERBS = ("apply", "get", "rollout")
_COMMAND_NAMES = frozenset(("agent", "top", "router", "demo", "build", "models", "up",
                            "controller", *CLUSTER_VERBS, "crds", "load"))


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
    for module in _COMMANDS:
        module.register(commands)
    return parser


def kubectl_main() -> int:
    """`kubectl tiered ...` (kubectl runs `kubectl-tiered` from PATH): the same
    commands, acting on the cluster kubectl points at."""
    argv = sys.argv[1:]
    verb = next((a for a in argv if a in _COMMAND_NAMES), None)
    if verb in CLUSTER_VERBS and not {"--kubernetes", "-k"} & set(argv):
        argv = [*argv, "--kubernetes"]
    return main(argv)


def quiet_idle_threads(environ=os.environ) -> None:
    """torch's CPU threads (OpenMP) wait for work by spinning unless told to
    sleep: on the small models a CPU tier runs, spinning nearly doubled the
    CPU a tiny Llama's token cost on two cores (2.46 ms against 1.42 ms) and
    took it from the processes beside it, as ONNX Runtime's spinning did
    (`allow_spinning`). Set before torch loads; a value the environment gives
    (OMP_WAIT_POLICY=ACTIVE) is kept."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: Sequence[str] | None = None) -> int:
    quiet_idle_threads()
    take_sigint()
    follow_parent()
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return args.handler(args)
