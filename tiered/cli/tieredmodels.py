"""`tiered apply`, `get` and `rollout` (the verbs on TieredModels, on the local
system's store or on a cluster) and `tiered crds`. Domain errors become one
line on stderr and exit code 1. The controller's modules and the kubernetes
client are imported only when a verb runs."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tiered import names
from tiered.cli import flags
from tiered.cli.watch import EXIT_INTERRUPTED, until_closed, wait
from tiered.errors import ConfigError, TieredError

if TYPE_CHECKING:
    from tiered.rollout.spec import TieredModel
    from tiered.rollout.status import TieredModelStatus

WATCH_INTERVAL_S = 1.0
ENDING_STEP_POLLS = 8  # looks, WATCH_INTERVAL_S / 4 apart, for the step that ended a watch
STILL_EVERY_S = 30.0  # rollout status --watch: a line at least this often while a stage holds
MAX_CELL = 80  # `tiered get`'s columns, MESSAGE above all
# Beside 1 (an error, as for every verb) and 2 (a usage error):
EXIT_DEGRADED = 3  # rolled back or aborted
EXIT_TIMED_OUT = 4  # --timeout passed while the rollout was still going
EXIT_PAUSED = 5  # paused, by hand or by the rollout: it waits for a person
_ENDED = {names.Phase.PROMOTED: 0, names.Phase.ROLLED_BACK: EXIT_DEGRADED,
          names.Phase.ABORTED: EXIT_DEGRADED, names.Phase.PAUSED: EXIT_PAUSED}


def register(commands: argparse._SubParsersAction) -> None:
    apply_cmd = commands.add_parser(
        "apply", help="create or update TieredModels from a YAML file",
        description="Validate every TieredModel in FILE (--- separated), pin each "
        "artifact's path and sha256, and store them; a changed artifact starts a rollout. "
        "Relative artifact paths (artifact.uri, artifact.calibration, artifact.eval) are "
        "taken relative to FILE's folder, not the working directory.")
    apply_cmd.add_argument("-f", "--file", required=True, type=Path, metavar="FILE")
    flags.add_backend_flags(apply_cmd)
    apply_cmd.set_defaults(handler=_verb("apply", _apply))

    get = commands.add_parser("get", help="list TieredModels and where their rollouts stand")
    get.add_argument("name", nargs="?", help="one model (default: all)")
    get.add_argument("-o", "--output", choices=("table", "yaml", "json"), default="table",
                     help="table (default), or the whole record as yaml or json")
    get.add_argument("--watch", "-w", action="store_true",
                     help="keep looking: print the table again whenever it changes (looked "
                     "at every --interval seconds); Ctrl-C ends it (exit code "
                     f"{EXIT_INTERRUPTED}), and so does closing its pipe (`| head -1`: exit "
                     "code 0)")
    get.add_argument("--interval", type=float, default=WATCH_INTERVAL_S, metavar="S",
                     help=f"--watch: seconds between looks (default {WATCH_INTERVAL_S:g})")
    flags.add_backend_flags(get)
    get.set_defaults(handler=_verb("get", _get))

    rollout = commands.add_parser(
        "rollout",
        help="show or steer a rollout: status, pause, resume, promote, abort, retry, undo",
        description="status: the rollout's stage, weights and the latest decisions with "
        "their numbers (--watch follows them). pause: hold at the current stage. resume: go "
        "on (the stage's clock restarts). promote: skip to the next stage (--full: make "
        "the canary stable now). abort: send all traffic back to the stable version. "
        "retry: roll a rolled-back or aborted canary out again from stage 1 (once its "
        "agents are up again). undo: point the spec back at an earlier version's artifact "
        "(the status keeps every artifact with its version): during a rollout, the stable "
        "version, which aborts the canary at once; otherwise the stable version before the "
        "current one, or --to-version N, which is rolled out in stages and judged like any "
        "new version (calibration and eval data stay the spec's). "
        "report: write report.html (self-contained, opens offline) and report.json: "
        "p95 and J/inference per tier with the canary's limits drawn, energy with its "
        "source, canary weights, agreement, every decision with its numbers, a table per "
        "tier and version, and (local) the tier builds' accuracy. "
        "A verb already in effect (pause when paused, abort when aborted, ...) changes "
        "nothing, says so and exits 0. "
        f"status exits 0 when the rollout of the spec's version is promoted (or, without "
        f"--watch, still going), {EXIT_DEGRADED} when it was rolled back or aborted, "
        f"{EXIT_TIMED_OUT} when --timeout passed first, {EXIT_PAUSED} when it is paused (by "
        "hand, or by the rollout itself: a stage undecided at its maxDurationSeconds "
        "(onUndecided: pause, the default), a failed one under onFailure: pause), "
        f"{EXIT_INTERRUPTED} on Ctrl-C; a closed pipe (`| head`) ends a watch with 0.")
    rollout.add_argument("verb", choices=("status", "pause", "resume", "promote", "abort",
                                          "retry", "undo", "report"))
    rollout.add_argument("name", help="the TieredModel")
    rollout.add_argument("--full", action="store_true", help="promote: all the way")
    rollout.add_argument("--to-version", type=int, metavar="N",
                         help="undo: go back to version N (default: the previous stable)")
    rollout.add_argument("--out", type=Path, metavar="DIR",
                         help="report: where to write it (default: NAME-report)")
    rollout.add_argument("--watch", "-w", action="store_true",
                         help="status: follow the rollout until it is promoted, rolled back, "
                         "aborted or paused")
    rollout.add_argument("--timeout", type=float, metavar="S",
                         help="status: follow (as --watch) for at most S seconds; still going "
                         f"then: exit code {EXIT_TIMED_OUT}")
    rollout.add_argument("--still-every", type=float, default=STILL_EVERY_S, metavar="S",
                         help="status --watch: while nothing new is decided (a stage holds, "
                         "a version is built), say every S seconds what it waits for and "
                         f"for how long (default {STILL_EVERY_S:g})")
    flags.add_backend_flags(rollout)
    rollout.set_defaults(handler=_verb("rollout", _rollout))

    crds = commands.add_parser(
        "crds", help="write the TieredModel CustomResourceDefinition (for the Helm chart)",
        description="Write tieredmodels.tiered.dev.yaml, made from the same schema that "
        "validates TieredModel YAML locally, into DIR.")
    crds.add_argument("--out", type=Path, default=Path("helm/tiered/crds"), metavar="DIR",
                      help="directory (default: helm/tiered/crds)")
    crds.set_defaults(handler=_crds)


def _models(args: argparse.Namespace, verb: str | None = None):
    """Where the verbs find the models, as a context manager: the cluster's
    resources with --kubernetes, else the local system's store; with `verb`,
    a line on stderr when no local controller runs on it (nothing would act
    on what the verb writes, and the status it shows is as last written)."""
    if args.kubernetes:
        from tiered.controller.kube.cluster import ClusterStore, api_client, current_namespace

        namespace = args.namespace or current_namespace(args.kubeconfig, args.context)
        return contextlib.nullcontext(ClusterStore(api_client(args.kubeconfig, args.context),
                                                   namespace))
    from tiered.controller.host.state import StateLayout, controller_running
    from tiered.controller.store import StateStore

    layout = StateLayout(args.state)
    if not layout.store.is_file():
        raise ConfigError(f"no local system state in {args.state} (start one with "
                          "`tiered up -f FILE`, or pass --state DIR)")
    if verb is not None and not controller_running(layout):
        print(no_controller(verb, args.state), file=sys.stderr, flush=True)
    return StateStore(layout.store)


def no_controller(verb: str, state: Path) -> str:
    return (f"tiered {verb}: no controller is running on {state}, so nothing acts on what "
            "is applied and statuses are as last written; `tiered up -f FILE` starts it")


def _verb(name: str, body) -> Callable[[argparse.Namespace], int]:
    """Run a verb; domain errors become one line on stderr and exit code 1."""
    def handler(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except TieredError as error:
            print(f"tiered {name}: {error}", file=sys.stderr)
            return 1
    return handler


def _apply(args: argparse.Namespace) -> int:
    from tiered.controller.verbs import apply_file

    with _models(args, "apply") as models:
        results = apply_file(models, args.file)
    for name, result in results:
        print(f"tieredmodel/{name} {result}")
    return 0


def _get(args: argparse.Namespace) -> int:
    import json

    import yaml

    from tiered.cli.model_lines import describe, summary_row
    from tiered.tables import render

    def look() -> str:
        records = [models.get(args.name)] if args.name else models.list()
        if args.output != "table":
            documents = [describe(r) for r in records]
            return (json.dumps(documents, indent=2) + "\n" if args.output == "json"
                    else yaml.safe_dump_all(documents, sort_keys=False))
        if not records:
            return "no TieredModels applied\n"
        rows = [summary_row(r) for r in records]
        return render(list(rows[0]), [[_cell(v) for v in r.values()] for r in rows]) + "\n"

    with _models(args, "get") as models:
        if not args.watch:
            print(look(), end="")
            return 0

        def watch() -> int:
            shown = None
            while True:
                text = look()
                if text != shown:
                    if shown is not None:
                        print()
                    print(text, end="", flush=True)
                    shown = text
                wait(max(args.interval, 0.1))

        return until_closed(watch)


def _cell(value: str) -> str:
    """A table cell no wider than MAX_CELL (the whole text: -o yaml, rollout status)."""
    return value if len(value) <= MAX_CELL else value[:MAX_CELL - 3] + "..."


def _rollout(args: argparse.Namespace) -> int:
    from tiered.controller import verbs

    if args.verb == "status":
        return _rollout_status(args)
    if args.verb == "report":
        return _rollout_report(args)
    with _models(args, "rollout") as models:
        if args.verb == "undo":
            found = verbs.rollout_undo(models, args.name, args.to_version)
            print(f"{args.name}: {'unchanged' if found.unchanged else 'undo'}: {found.reason}"
                  + ("; nothing to do" if found.unchanged else ""))
            return 0
        decision = verbs.rollout_verb(models, args.name, args.verb, full=args.full)
    print(f"{args.name}: {decision.action}: {decision.reason}")
    return 0


def _rollout_report(args: argparse.Namespace) -> int:
    """The rollout report from the steps the backend keeps (the local store's
    snapshot of every pass, the steps a TieredModel's status keeps on
    Kubernetes) and, locally, the tier builds' reports."""
    import time

    from tiered.controller import verbs
    from tiered.controller.reconciler import decode_status
    from tiered.demo.report import write_report
    from tiered.rollout.snapshot import from_record

    with _models(args) as models:
        record = models.get(args.name)
        history = [(t, from_record(kept)) for _, t, kept in models.history(args.name)]
    spec, status = verbs.spec_of(record), decode_status(args.name, record.status)
    if args.kubernetes:
        builds, where = [], f"Kubernetes, namespace {record.spec['metadata'].get('namespace')}"
    else:
        builds, where = _build_reports(args.state, spec, status), f"local, {args.state}"
    rollout = status.rollout
    extra = {"backend": where, "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
             "phase": rollout.phase if rollout else "Pending",
             "stable version": rollout.stable_version if rollout else None,
             "steps": len(history)}
    t0 = history[0][0] if history else 0.0
    html, data = write_report([(t - t0, snap) for t, snap in history],
                              args.out or Path(f"{args.name}-report"),
                              f"Rollouts of {args.name}", extra,
                              verbs.report_thresholds(spec), builds)
    print(f"{args.name}: wrote {html} and {data}")
    return 0


def _build_reports(state: Path, spec, status) -> list[dict]:
    """The tier builds' reports (build.json) of every version still in the
    local tier repositories."""
    import json

    from tiered.controller.host.state import StateLayout
    from tiered.engines.build.report import REPORT_FILE

    found = []
    for tier in (t for t in names.TIERS if t in spec.tiers):
        for artifact in status.artifacts:
            path = (StateLayout(state).repository(tier) / spec.name / str(artifact.version)
                    / REPORT_FILE)
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
    return found


def _rollout_status(args: argparse.Namespace) -> int:
    """Print where the rollout stands; with --watch or --timeout, follow its
    steps until it ends or pauses, saying what a long hold waits for. The
    exit code says how it ended (see --help)."""
    import time

    from tiered.cli.live import LiveLines
    from tiered.cli.model_lines import still
    from tiered.controller import verbs

    follow = args.watch or args.timeout is not None
    deadline = time.monotonic() + args.timeout if args.timeout is not None else None
    # Followed on a terminal, a hold is one live line, redrawn in place
    # (its reason cut short: the first look's analysis has it whole).
    terminal = LiveLines(in_place=follow and sys.stdout.isatty())
    with _models(args, "rollout status") as models:
        poll = _steps(models, args.name)

        def steps() -> int:
            said = new = time.monotonic()  # when a line was printed; a new one
            while True:
                look = poll()
                for line, hold in look.lines:
                    if not (hold and terminal.in_place):
                        terminal.say(line)
                if look.holding is not None and terminal.in_place:
                    terminal.live(args.name, look.holding)
                now = time.monotonic()
                if look.lines:
                    said = new = now
                end = verbs.watch_end(look.spec, look.status, look.generation)
                if end is not None and follow and not look.lines:
                    # A step is recorded just after the status it wrote (two
                    # commits): the step that ended the rollout is worth a moment.
                    for _ in range(ENDING_STEP_POLLS):
                        wait(WATCH_INTERVAL_S / 4)
                        later = poll().lines
                        for line, _ in later:
                            terminal.say(line)
                        if later:
                            break
                if end is not None or not follow:
                    if end == names.Phase.PAUSED:
                        print(f"{args.name}: paused: `tiered rollout resume {args.name}` goes "
                              "on, promote or abort ends it", file=sys.stderr)
                    return _ENDED.get(end, 0)
                if deadline is not None and now >= deadline:
                    phase = look.status.rollout.phase if look.status.rollout else "Pending"
                    print(f"{args.name}: still {phase} after {args.timeout:g} s",
                          file=sys.stderr)
                    return EXIT_TIMED_OUT
                if now - said >= args.still_every:
                    if terminal.in_place:
                        terminal.live(args.name, still(look, time.time(), now - new))
                    else:
                        terminal.say(still(look, time.time(), now - new))
                    said = now
                wait(WATCH_INTERVAL_S)

        return until_closed(steps)


@dataclasses.dataclass(frozen=True)
class Look:
    """One look of `rollout status` at the models: the model and the lines
    that are new since the last look."""

    name: str
    spec: TieredModel
    status: TieredModelStatus
    generation: int
    lines: tuple[tuple[str, bool], ...]  # (line, whether it is a hold)
    holding: str | None = None  # the last step, a hold: its short line


def _steps(models, name: str) -> Callable[[], Look]:
    """A poll of the models: the first look prints the summary, the analysis
    and the last steps, later ones new steps (a hold only when its reason
    changed); `holding` is the last hold's short line, for a live view."""
    from tiered.cli.model_lines import analysis_lines, summary_line, summary_row
    from tiered.controller import verbs
    from tiered.controller.reconciler import decode_status
    from tiered.rollout.progress import ProgressLines, progress_line
    from tiered.rollout.snapshot import from_record

    last = None
    shown = ProgressLines()

    def poll() -> Look:
        nonlocal last
        record = models.get(name)
        status = decode_status(name, record.status)
        lines: list[tuple[str, bool]] = []
        holding = None
        if last is None:
            lines.append((summary_line(summary_row(record)), False))
            lines += [(line, False) for line in analysis_lines(status.rollout)]
            history = models.history(name)[-10:]
            last = 0
        else:
            history = models.history(name, after_id=last)
        for entry_id, t, kept in history:
            snap = from_record(kept)
            hold = snap.action == names.Action.HOLD
            holding = progress_line(t, snap, short=True) if hold else None
            line = shown.line(t, snap)
            if line is not None:
                lines.append((line, hold))
            last = entry_id
        return Look(name, verbs.spec_of(record), status, record.generation, tuple(lines),
                    holding)

    return poll


def _crds(args: argparse.Namespace) -> int:
    from tiered.controller.crd import write_crds

    print(f"wrote {write_crds(args.out)}")
    return 0
