"""The `tiered` command line. Arguments are parsed in `main()`, never at import."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tiered.errors import ConfigError, TieredError
from tiered.processes import AgentError
from tiered.profiles import TIERS
from tiered.protocol.security import add_tls_flags, security_from_args


def _agent(args: argparse.Namespace) -> int:
    from tiered.agent import server
    from tiered.profiles import load_profile
    from tiered.telemetry.tracing import TracingSettings

    try:
        profile = load_profile(args.tier, args.profile)
        security = security_from_args(args)
        authorizer = authorizer_from_args(args)
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
        telemetry=not args.no_telemetry,
        tracing=TracingSettings(base_rate=args.trace_base_rate, otlp_endpoint=args.otlp_endpoint),
        allow_failed_models=args.allow_failed_models,
        security=security, authorizer=authorizer,
    )
    return server.run(settings)


def authorizer_from_args(args: argparse.Namespace):
    from tiered.protocol.security import Authorizer, read_tokens

    inference = read_tokens(args.inference_token_file, "--inference-token-file")
    return Authorizer(admin_tokens=read_tokens(args.admin_token_file, "--admin-token-file"),
                      admin_names=frozenset(args.admin_cn or ()),
                      inference_tokens=inference or None)


def _add_auth_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("authorization")
    group.add_argument("--admin-token-file", type=Path, metavar="FILE",
                       help="tokens (one per line) allowed to load and unload models; "
                       "without admin credentials load and unload are refused")
    group.add_argument("--admin-cn", action="append", metavar="NAME",
                       help="a client-certificate common name allowed to load and unload "
                       "(mTLS; repeatable)")
    group.add_argument("--inference-token-file", type=Path, metavar="FILE",
                       help="tokens (one per line) inference requires (default: open)")


def _top(args: argparse.Namespace) -> int:
    from tiered import top

    try:
        transport = security_from_args(args)
    except ConfigError as error:
        print(f"tiered top: {error}", file=sys.stderr)
        return 2
    try:
        return top.run(args.agents, args.interval, args.once, args.model, transport)
    except KeyboardInterrupt:
        return 0


def _demo(args: argparse.Namespace) -> int:
    if args.protocol:
        from tiered import tour

        return tour.run(args.tier)
    from tiered import demo

    return demo.run(args.out)


def _build(args: argparse.Namespace) -> int:
    """Exit 0 built, 1 rejected by the gate, 2 refused, 3 failed; on every path
    the last stderr line is the verdict as JSON (tiered.protocol.verdict), which
    the controller reads, and --termination-log gets the same line."""
    import datetime
    import json
    import tempfile
    import traceback

    from tiered.agent.config import check_model_name
    from tiered.engines import build
    from tiered.errors import TieredError
    from tiered.profiles import load_profile
    from tiered.protocol import verdict as verdicts

    def verdict(code: int, reason: str, installed: Path | None = None) -> verdicts.BuildVerdict:
        return verdicts.BuildVerdict(
            built=code == verdicts.BUILT, model=args.model, version=args.version,
            tier=args.tier, reason=reason, exit_code=code,
            installed=None if installed is None else str(installed),
        )

    flags = {
        "backend": args.backend, "precision": args.precision,
        "calibration_method": args.calibration_method,
        "calibration_samples": args.calibration_samples,
        "min_agreement": args.min_agreement, "max_batch_size": args.max_batch_size,
        "max_queue_delay_us": args.max_queue_delay_us,
    }
    try:
        check_model_name(args.model)
        profile = load_profile(args.tier, args.profile)
        settings = build.choose_settings(profile, flags, f"{args.tier} profile build (and flags)")
        with tempfile.TemporaryDirectory(prefix="tiered-fetch-") as work:
            def data(uri: str | None, name: str) -> Path | None:
                return build.fetch_artifact(uri, None, Path(work), name) if uri else None

            request = build.BuildRequest(
                source=build.fetch_artifact(args.artifact, args.sha256, Path(work)),
                repository=args.repository, model=args.model, version=args.version,
                calibration=data(args.calibration, "calibration.npz"),
                evaluation=data(args.eval, "eval.npz"), force=args.force,
                allow_accuracy_drop=args.allow_accuracy_drop,
            )
            outcome = build.build(
                request, profile, settings, now=datetime.datetime.now(datetime.timezone.utc),
                verdict=lambda decision, target: verdict(
                    verdicts.BUILT, decision.reason, target).to_dict(),
            )
    except TieredError as error:
        said, told = f"tiered build: {error}", verdict(verdicts.REFUSED, str(error))
    except Exception as error:  # a bug still owes the controller a verdict
        traceback.print_exc()
        why = f"{type(error).__name__}: {error}"
        said, told = f"tiered build: failed: {why}", verdict(verdicts.FAILED, why)
    else:
        if outcome.installed is None:
            said = (f"tiered build: rejected, nothing written. {outcome.decision.reason} "
                    "(--allow-accuracy-drop writes it anyway)")
            told = verdict(verdicts.REJECTED, outcome.decision.reason)
        else:
            said = f"tiered build: wrote {outcome.installed}. {outcome.decision.reason}"
            told = verdict(verdicts.BUILT, outcome.decision.reason, outcome.installed)
        # The numbers, whatever the gate decided; the verdict as build.json holds it.
        print(json.dumps({**outcome.report, "verdict": told.to_dict()}, indent=2))
    line = told.to_json()
    if args.termination_log is not None:
        try:
            args.termination_log.write_text(line + "\n")
        except OSError as error:
            print(f"tiered build: cannot write --termination-log: {error}", file=sys.stderr)
    print(said, file=sys.stderr)
    print(line, file=sys.stderr, flush=True)
    return told.exit_code


# Kept in step with tiered.models.digits.VARIANTS (a test compares them): the
# choices are spelled out so that `--help` does not have to import torch.
DIGITS_VARIANTS = ("v1", "v2", "heavy")


def _models_digits(args: argparse.Namespace) -> int:
    try:
        from tiered.models import digits  # torch: imported only when training is asked for
    except ImportError as error:
        print(f"tiered models digits: needs the torch extra (pip install 'tiered[torch]'): "
              f"{error}", file=sys.stderr)
        return 2
    names = DIGITS_VARIANTS if args.variant == "all" else (args.variant,)
    for name in names:
        model = digits.write_digits(
            args.out, name, progress=lambda line: print(line, file=sys.stderr, flush=True)
        )
        print(model.summary(), flush=True)
    print(f"data: {model.calibration_path} (calibration inputs), {model.eval_path} "
          "(held-out inputs and labels)", flush=True)
    return 0


def _models_resnet18(args: argparse.Namespace) -> int:
    from tiered.models import zoo

    try:
        path = zoo.resnet18(args.out / "resnet18.onnx", seed=args.seed, image_size=args.image_size)
    except ValueError as error:
        print(f"tiered models resnet18: --image-size: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}: ResNet-18, random weights (seed {args.seed}), input `input` FP32 "
          f"[batch, 3, {args.image_size}, {args.image_size}], output `logits` FP32 [batch, 1000]")
    return 0


# -- the local system and its verbs ---------------------------------------------------------

STATE_HELP = "state directory of the local system (default: .tiered)"


def _up(args: argparse.Namespace) -> int:
    import signal
    import threading

    from tiered.controller import up

    try:
        system = up.load_system(args.file)
        if args.state is not None:
            system = dataclasses.replace(system, state_dir=str(args.state))
        local = up.LocalUp(system, args.file.parent,
                           progress=lambda line: print(line, flush=True))
    except ConfigError as error:
        print(f"tiered up: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        running = local.start()
        print(f"up: router on {running.router}; state in {local.layout.root}. "
              "Ctrl-C stops everything.", flush=True)
        local.supervise(stop)
    except (TieredError, AgentError) as error:
        print(f"tiered up: {error}", file=sys.stderr)
        return 1
    finally:
        local.stop()
    return 0


def _controller(args: argparse.Namespace) -> int:
    import signal
    import threading

    from tiered.controller.local import LocalController

    if args.log_level == "INFO":  # progress is printed; builds' library chatter is not
        logging.getLogger().setLevel(logging.WARNING)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    if args.kubernetes:
        return _kube_controller(args, stop)
    try:
        controller = LocalController(args.state, interval_s=args.interval,
                                     retire_grace_s=args.retire_grace,
                                     progress=lambda line: print(line, flush=True))
    except TieredError as error:
        print(f"tiered controller: {error}", file=sys.stderr)
        return 2
    try:
        controller.run(stop)
    finally:
        controller.close()
    return 0


def _kube_controller(args: argparse.Namespace, stop) -> int:
    import json
    import socket

    from prometheus_client import start_http_server

    from tiered.controller.kube.controller import ControllerOptions, KubeController
    from tiered.controller.kube.render import ClusterSettings
    from tiered.controller.kube.verbs import api_client

    try:
        addresses = json.loads(args.agent_addresses.read_text()) if args.agent_addresses else {}
        transport = security_from_args(args)
        settings = ClusterSettings(
            namespace=args.namespace, agent_image=args.agent_image,
            agent_gpu_image=args.agent_gpu_image, routing_configmap=args.routing_configmap,
            router=args.router, tls_secret=args.agent_tls_secret)
        options = ControllerOptions(
            identity=args.identity or socket.gethostname(), leader_elect=args.leader_elect,
            lease_name=args.lease_name, lease_duration_s=args.lease_duration,
            retire_grace_s=args.retire_grace, agent_addresses=addresses, transport=transport)
        client = api_client(args.kubeconfig, args.context)
    except (OSError, ValueError, TieredError) as error:
        print(f"tiered controller: {error}", file=sys.stderr)
        return 2
    if args.metrics_port is not None:  # also what the liveness probe connects to
        start_http_server(args.metrics_port)
    print(f"tiered controller: namespace {args.namespace}, identity {options.identity}"
          f"{', leader election on' if args.leader_elect else ''}", flush=True)
    KubeController(settings, client, options=options,
                   progress=lambda line: print(line, flush=True)).run(stop)
    return 0


def _cluster(args: argparse.Namespace):
    from tiered.controller.kube.verbs import ClusterVerbs, api_client

    return ClusterVerbs(api_client(args.kubeconfig, args.context), args.namespace)


def _store(args: argparse.Namespace):
    from tiered.controller.local import StateLayout
    from tiered.controller.store import StateStore

    layout = StateLayout(args.state)
    if not layout.store.is_file():
        raise ConfigError(f"no local system state in {args.state} (start one with "
                          "`tiered up -f FILE`, or pass --state DIR)")
    return StateStore(layout.store)


def _verb(name: str, body) -> Callable[[argparse.Namespace], int]:
    """Run a store verb; domain errors become one line on stderr and exit code 1."""
    def handler(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except TieredError as error:
            print(f"tiered {name}: {error}", file=sys.stderr)
            return 1
    return handler


def _apply(args: argparse.Namespace) -> int:
    from tiered.controller.verbs import apply_file

    if args.kubernetes:
        results = _cluster(args).apply_file(args.file)
    else:
        with _store(args) as store:
            results = apply_file(store, args.file)
    for name, result in results:
        print(f"tieredmodel/{name} {result}")
    return 0


def _get(args: argparse.Namespace) -> int:
    import json

    import yaml

    from tiered.controller import verbs
    from tiered.tables import render

    if args.kubernetes:
        cluster = _cluster(args)
        rows = cluster.rows(args.name)
        documents = ([cluster.get(args.name)] if args.name else
                     [cluster.get(row["NAME"]) for row in rows])
    else:
        with _store(args) as store:
            records = [store.get(args.name)] if args.name else store.list()
        rows = [verbs.summary_row(r) for r in records]
        documents = [verbs.describe(r) for r in records]
    if args.output == "table":
        if rows:
            print(render(list(rows[0]), [list(r.values()) for r in rows]))
        else:
            print("no TieredModels applied")
    else:
        print(json.dumps(documents, indent=2) if args.output == "json"
              else yaml.safe_dump_all(documents, sort_keys=False), end="")
    return 0


def _rollout(args: argparse.Namespace) -> int:
    from tiered.controller import verbs

    if args.kubernetes:
        cluster = _cluster(args)
        if args.verb == "status":
            from tiered.controller.reconciler import decode_status

            row = cluster.rows(args.name)[0]
            print("  ".join(f"{k.lower()}: {v}" for k, v in row.items() if v not in ("", "-")))
            status = decode_status(args.name, cluster.get(args.name).get("status"))
            for line in verbs.analysis_lines(status.rollout):
                print(line)
            return 0
        decision = cluster.rollout_verb(args.name, args.verb, full=args.full)
        print(f"{args.name}: {decision.action}: {decision.reason}")
        return 0
    with _store(args) as store:
        if args.verb == "status":
            return _rollout_status(store, args.name, args.watch)
        decision = verbs.rollout_verb(store, args.name, args.verb, full=args.full)
    print(f"{args.name}: {decision.action}: {decision.reason}")
    return 0


def _rollout_status(store, name: str, watch: bool) -> int:
    import time

    from tiered.controller import verbs
    from tiered.controller.progress import progress_line
    from tiered.controller.reconciler import decode_status

    record = store.get(name)
    row = verbs.summary_row(record)
    print("  ".join(f"{k.lower()}: {v}" for k, v in row.items() if v not in ("", "-")))
    for line in verbs.analysis_lines(decode_status(name, record.status).rollout):
        print(line)
    history = store.history(name)
    for _, t, snap in history[-10:]:
        print(progress_line(t, snap))
    last = history[-1][0] if history else 0
    while watch:
        time.sleep(1.0)
        for entry_id, t, snap in store.history(name, after_id=last):
            print(progress_line(t, snap), flush=True)
            last = entry_id
    return 0


def _crds(args: argparse.Namespace) -> int:
    from tiered.controller.crd import write_crds

    print(f"wrote {write_crds(args.out)}")
    return 0


def _backend_flags(parser: argparse.ArgumentParser) -> None:
    """Where a command acts: the local system's state directory, or a cluster."""
    parser.add_argument("--state", type=Path, default=Path(".tiered"), metavar="DIR",
                        help=STATE_HELP)
    parser.add_argument("--kubernetes", "-k", action="store_true",
                        help="act on a cluster (the kubeconfig's current context, or "
                        "in-cluster) instead of the local system")
    parser.add_argument("--namespace", "-n", default="default",
                        help="Kubernetes namespace (default: default)")
    parser.add_argument("--kubeconfig", type=Path, metavar="FILE",
                        help="Kubernetes: kubeconfig file (default: ~/.kube/config)")
    parser.add_argument("--context", help="Kubernetes: kubeconfig context")


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
    agent.add_argument("--metrics-port", type=int, default=8002,
                       help="Prometheus /metrics port (default 8002; 0 picks a free one)")
    agent.add_argument("--no-metrics", action="store_true", help="serve no /metrics")
    agent.add_argument("--no-telemetry", action="store_true",
                       help="keep only Triton's cumulative statistics: no latency windows, "
                       "energy attribution or tiered.v1.Telemetry figures")
    agent.add_argument("--otlp-endpoint", default="", metavar="HOST:PORT",
                       help="export traces over OTLP/gRPC to this collector (default: off)")
    agent.add_argument("--trace-base-rate", type=float, default=0.01,
                       help="share of fast, successful requests whose traces are kept; failed "
                       "ones always are, slow ones by latency (default 0.01)")
    agent.add_argument("--allow-failed-models", action="store_true",
                       help="start even if some models fail to load (they show as UNAVAILABLE)")
    add_tls_flags(agent)
    _add_auth_flags(agent)
    agent.set_defaults(handler=_agent)

    top = commands.add_parser(
        "top",
        help="live table of agents' model versions: rates, latency, energy per inference",
        description="Poll each agent's tiered.v1.Telemetry service and show, per model "
        "version, requests/s, error rate, latency quantiles, queueing and joules per "
        "inference (with the energy source: nvml, rapl or model) since the last refresh.",
    )
    top.add_argument("agents", nargs="+", metavar="HOST:PORT", help="agent gRPC addresses")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true",
                     help="print the whole window once and exit (no screen clearing)")
    top.add_argument("--model", default="", help="only this model")
    add_tls_flags(top, server=False)
    top.set_defaults(handler=_top)

    def _router(args: argparse.Namespace) -> int:
        from tiered.router import server as router_server

        try:
            transport = security_from_args(args)
        except ConfigError as error:
            print(f"tiered router: {error}", file=sys.stderr)
            return 2
        transport.warn_if_plaintext("tiered router")
        return router_server.run(router_server.RouterSettings(
            routing_table=args.routing_table, host=args.host, port=args.port,
            metrics_port=None if args.no_metrics else args.metrics_port, seed=args.seed,
            security=transport,
        ))

    router = commands.add_parser(
        "router",
        help="serve v2 gRPC in front of the tier agents and route each request",
        description="A v2 inference server (tritonclient and perf_analyzer work unchanged) "
        "that forwards each request to a tier agent named in the routing table: pinned by "
        "the tiered-tier hint, else by the model's policy (slo-energy or cascade), with "
        "failover, canary split sticky by tiered-key, shadowing and per-agent in-flight "
        "limits. The table file is reloaded when it changes; an invalid one is rejected.",
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
    router.add_argument("--seed", type=int, default=None,
                        help="seed of the split for requests without a tiered-key")
    add_tls_flags(router)
    router.set_defaults(handler=_router)

    demo = commands.add_parser(
        "demo",
        help="run the whole system locally: serve digits v1 on three tiers, promote v2, "
        "roll back a heavier v3, write a report",
        description="End to end on this machine (about 3 minutes on 2 cores): trains the "
        "sample digits models into build/models (once), starts an agent per tier, the "
        "router and the controller, sends traffic with tritonclient, applies "
        "examples/digits-v2.yaml (promoted) and examples/digits-v3.yaml (rolled back), "
        "prints every decision and writes OUT/report.html and OUT/report.json. "
        "--protocol instead walks one agent through the v2 protocol.",
    )
    demo.add_argument("--out", type=Path, default=Path("build/demo"), metavar="DIR",
                      help="report and state directory (default: build/demo)")
    demo.add_argument("--protocol", action="store_true",
                      help="the short protocol tour: one agent, queried with tritonclient")
    demo.add_argument("--tier", default="edge", choices=TIERS,
                      help="--protocol: tier profile of the agent (default: edge)")
    demo.set_defaults(handler=_demo)

    build = commands.add_parser(
        "build",
        help="build a tier's version of an ONNX model into a model repository",
        description="Make a tier's version of an FP32 ONNX artifact (edge: INT8 static QDQ; "
        "regional: FP16 with FP32 inputs/outputs; datacenter: FP32 ONNX for the torch engine), "
        "compare it with the artifact on eval data (top-1 agreement, errors, accuracy where "
        "the data has labels), time it, and write DIR/NAME/V/model.onnx, build.json and, when "
        "absent, DIR/NAME/config.yaml. A build below the tier's agreement threshold writes "
        "nothing. The report goes to stdout as JSON either way. Defaults come from the tier "
        "profile's build: mapping.",
    )
    build.add_argument("artifact", metavar="ARTIFACT.onnx",
                       help="the FP32 ONNX model: a path, or an http(s) URI to fetch")
    build.add_argument("--sha256", metavar="HEX",
                       help="refuse to build unless the artifact has this SHA-256")
    build.add_argument("--tier", required=True, choices=TIERS, help="the tier to build for")
    build.add_argument("--repository", required=True, type=Path, metavar="DIR",
                       help="model repository to write the version into")
    build.add_argument("--model", required=True, metavar="NAME", help="model name (directory)")
    build.add_argument("--version", required=True, type=int, metavar="V",
                       help="version to write (a positive integer)")
    build.add_argument("--calibration", metavar="DATA.npz",
                       help="INT8 calibration inputs (a path or http(s) URI): one array per model input, keyed by its "
                       "name (default: random inputs)")
    build.add_argument("--eval", metavar="DATA.npz",
                       help="eval inputs like --calibration, plus optional integer `labels` "
                       "(default: random inputs: agreement only, no accuracy)")
    build.add_argument("--calibration-method", metavar="METHOD",
                       help="INT8 calibration: minmax, entropy or percentile")
    build.add_argument("--calibration-samples", type=int, metavar="N",
                       help="use at most N calibration samples")
    build.add_argument("--precision", help="override the tier's precision (onnxruntime: int8, "
                       "fp16, fp32; torch: fp32, fp16, bf16, fp8)")
    build.add_argument("--backend", help="override the tier's backend (onnxruntime or torch)")
    build.add_argument("--min-agreement", type=float, metavar="FRACTION",
                       help="top-1 agreement with FP32 the gate asks for (profile default 0.99)")
    build.add_argument("--max-batch-size", type=int, metavar="N",
                       help="max_batch_size of a config.yaml the build creates")
    build.add_argument("--max-queue-delay-us", type=int, metavar="US",
                       help="dynamic_batching.max_queue_delay_us of a config.yaml the build "
                       "creates (default: the tier profile's)")
    build.add_argument("--allow-accuracy-drop", action="store_true",
                       help="write the version even when the accuracy gate rejects it")
    build.add_argument("--force", action="store_true", help="replace an existing version")
    build.add_argument("--profile", type=Path, metavar="FILE",
                       help="tier profile YAML (default: agents/<tier>.yaml)")
    build.add_argument("--termination-log", type=Path, metavar="PATH",
                       help="also write the verdict (one JSON line) to PATH; on Kubernetes the "
                       "container's terminationMessagePath, /dev/termination-log (default: none)")
    build.set_defaults(handler=_build)

    models = commands.add_parser(
        "models",
        help="write sample models: trained digits classifiers, a random-weight ResNet-18",
        description="Write sample ONNX models built on this machine (nothing is downloaded).",
    )
    model_kinds = models.add_subparsers(dest="model", required=True, metavar="MODEL")
    digits = model_kinds.add_parser(
        "digits",
        help="train small CNNs on scikit-learn's digits and export them (needs tiered[torch])",
        description="Train a small CNN on scikit-learn's bundled 8x8 handwritten digits "
        "(CPU, seconds) and write DIR/digits-<variant>.onnx (input `input` FP32 "
        "[batch, 1, 8, 8], pixels in [0, 1]; output `logits` FP32 [batch, 10]), "
        "DIR/digits-calibration.npz (`input`: training images for INT8 calibration) and "
        "DIR/digits-eval.npz (`input`, `label`: the held-out test split). Variants: v1 the "
        "base model; v2 v1's network retrained with another seed (a new version, as "
        "costly, that answers a little differently); heavy, many times the compute of v1 "
        "for latency-regression demos. "
        "Prints per-epoch progress to stderr and a summary per model.",
    )
    digits.add_argument("--variant", default="v1", choices=(*DIGITS_VARIANTS, "all"),
                        help="which model to train (default: v1)")
    digits.add_argument("--out", type=Path, default=Path("build/models"), metavar="DIR",
                        help="output directory (default: build/models)")
    digits.set_defaults(handler=_models_digits)
    resnet18 = model_kinds.add_parser(
        "resnet18",
        help="write a ResNet-18-shaped classifier with random weights",
        description="Write DIR/resnet18.onnx: ResNet-18 with random (seeded) weights and "
        "BatchNorm folded into the convs; input `input` FP32 [batch, 3, N, N], output "
        "`logits` FP32 [batch, 1000]. For measuring serving, not for its answers.",
    )
    resnet18.add_argument("--out", type=Path, default=Path("build/models"), metavar="DIR",
                          help="output directory (default: build/models)")
    resnet18.add_argument("--image-size", type=int, default=224, metavar="N",
                          help="input height and width, at least 32 (default: 224)")
    resnet18.add_argument("--seed", type=int, default=0, metavar="S",
                          help="weight seed; the same seed writes the same file (default: 0)")
    resnet18.set_defaults(handler=_models_resnet18)

    up_cmd = commands.add_parser(
        "up",
        help="run the whole system on this machine: agents per tier, router, controller",
        description="Start one agent per tier, the router and the controller as child "
        "processes (restarted when they die), apply the TieredModels the system file lists, "
        "and echo the controller's progress. State (store, model repositories, routing "
        "table, logs) lives in the state directory, so a restart resumes rollouts. "
        "Ctrl-C stops everything. See examples/local.yaml.",
    )
    up_cmd.add_argument("-f", "--file", required=True, type=Path, metavar="FILE",
                        help="local system YAML (examples/local.yaml)")
    up_cmd.add_argument("--state", type=Path, metavar="DIR",
                        help="state directory (default: the file's state_dir)")
    up_cmd.set_defaults(handler=_up)

    controller = commands.add_parser(
        "controller",
        help="reconcile TieredModels of a local system (`tiered up` starts it)",
        description="The controller loop over a local system's state directory: builds "
        "versions for each tier, starts, judges, promotes and rolls back rollouts, and "
        "writes the routing table. Safe to kill and restart: progress lives in the store.",
    )
    controller.add_argument("--interval", type=float, default=2.0, metavar="S",
                            help="local: seconds between reconcile passes (default 2)")
    _backend_flags(controller)
    add_tls_flags(controller, server=False)
    controller.add_argument("--routing-configmap", default="tiered-routing", metavar="NAME",
                            help="Kubernetes: the router's ConfigMap (default tiered-routing)")
    controller.add_argument("--router", metavar="HOST:PORT",
                            help="Kubernetes: the router's gRPC address, where the "
                            "canary's shadow agreement is read")
    controller.add_argument("--agent-image", default="tiered-agent:latest",
                            help="Kubernetes: agent image for CPU tiers")
    controller.add_argument("--agent-gpu-image", default="tiered-agent-cuda:latest",
                            help="Kubernetes: agent image for GPU tiers")
    controller.add_argument("--leader-elect", action="store_true",
                            help="Kubernetes: reconcile only while holding the Lease")
    controller.add_argument("--lease-name", default="tiered-controller",
                            help="Kubernetes: the Lease (default tiered-controller)")
    controller.add_argument("--lease-duration", type=int, default=15, metavar="S",
                            help="Kubernetes: seconds a Lease holds without renewal "
                            "(default 15)")
    controller.add_argument("--retire-grace", type=float, default=120.0, metavar="S",
                            help="seconds a version's agents outlive the last routing table "
                            "that named them (default 120; on Kubernetes routers read a "
                            "mounted ConfigMap within about a minute)")
    controller.add_argument("--identity", help="Kubernetes: this candidate's name in the "
                            "Lease (default: the host name, the pod's name in a cluster)")
    controller.add_argument("--metrics-port", type=int, metavar="PORT",
                            help="Kubernetes: serve Prometheus /metrics (and a probe) here")
    controller.add_argument("--agent-tls-secret", metavar="SECRET",
                            help="Kubernetes: a kubernetes.io/tls Secret (with ca.crt) the "
                            "agents serve mTLS with; the controller then needs --tls-* flags "
                            "(default: agents run --insecure)")
    controller.add_argument("--agent-addresses", type=Path, metavar="FILE",
                            help="Kubernetes: JSON {service: host:port} for agents reached "
                            "under other names (port-forwarding, tests)")
    controller.set_defaults(handler=_controller)

    apply_cmd = commands.add_parser(
        "apply", help="create or update TieredModels from a YAML file",
        description="Validate every TieredModel in FILE (--- separated), pin each "
        "artifact's path and sha256, and store them; a changed artifact starts a rollout.")
    apply_cmd.add_argument("-f", "--file", required=True, type=Path, metavar="FILE")
    _backend_flags(apply_cmd)
    apply_cmd.set_defaults(handler=_verb("apply", _apply))

    get = commands.add_parser("get", help="list TieredModels and where their rollouts stand")
    get.add_argument("name", nargs="?", help="one model (default: all)")
    get.add_argument("-o", "--output", choices=("table", "yaml", "json"), default="table",
                     help="table (default), or the whole record as yaml or json")
    _backend_flags(get)
    get.set_defaults(handler=_verb("get", _get))

    rollout = commands.add_parser(
        "rollout", help="show or steer a rollout: status, pause, resume, promote, abort",
        description="status: the rollout's stage, weights and the latest decisions with "
        "their numbers (--watch follows them). pause: hold at the current stage. resume: go "
        "on (the stage's clock restarts). promote: skip to the next stage (--full: make "
        "the canary stable now). abort: send all traffic back to the stable version.")
    rollout.add_argument("verb", choices=("status", "pause", "resume", "promote", "abort"))
    rollout.add_argument("name", help="the TieredModel")
    rollout.add_argument("--full", action="store_true", help="promote: all the way")
    rollout.add_argument("--watch", "-w", action="store_true", help="status: keep following")
    _backend_flags(rollout)
    rollout.set_defaults(handler=_verb("rollout", _rollout))

    crds = commands.add_parser(
        "crds", help="write the TieredModel CustomResourceDefinition (for the Helm chart)",
        description="Write tieredmodels.tiered.dev.yaml, made from the same schema that "
        "validates TieredModel YAML locally, into DIR.")
    crds.add_argument("--out", type=Path, default=Path("helm/tiered/crds"), metavar="DIR",
                      help="directory (default: helm/tiered/crds)")
    crds.set_defaults(handler=_crds)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return args.handler(args)
