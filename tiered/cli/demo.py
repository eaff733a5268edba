"""`tiered demo`: the whole system end to end on this machine, or (--protocol)
one agent through the v2 protocol. The demo is imported only when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from tiered.cli import flags


def register(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo",
        help="run the whole system locally: serve digits v1 on three tiers, promote v2, "
        "roll back a heavier v3; the same for a tiny Llama beside it; write reports",
        description="End to end on this machine (4-5 minutes on 2 cores): trains the "
        "sample digits models into build/models (once), starts an agent per tier, the "
        "router and the controller, sends traffic with tritonclient, applies "
        "examples/digits-v2.yaml (promoted) and examples/digits-v3.yaml (rolled back), "
        "prints every decision and writes OUT/report.html and OUT/report.json. Beside it "
        "a tiny Llama (examples/tinyllama.yaml) is served on three tiers, its v2 promoted "
        "and its slower v3 rolled back (OUT/tinyllama/report.html; --no-generative leaves "
        "it out). "
        "--protocol instead walks one agent through the v2 protocol.",
    )
    demo.add_argument("--out", type=Path, default=Path("build/demo"), metavar="DIR",
                      help="report and state directory (default: build/demo)")
    demo.add_argument("--protocol", action="store_true",
                      help="the short protocol tour: one agent, queried with tritonclient")
    demo.add_argument("--generative", action=argparse.BooleanOptionalAction, default=True,
                      help="the generative act, beside the digits one (default: on; "
                      "--no-generative runs the digits act alone)")
    demo.add_argument("--tier", default="edge", choices=flags.TIER_CHOICES,
                      help="--protocol: tier profile of the agent (default: edge)")
    demo.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    if args.protocol:
        from tiered.demo import tour

        return tour.run(args.tier)
    from tiered.demo import rollouts

    return rollouts.run(args.out, generative=args.generative)
