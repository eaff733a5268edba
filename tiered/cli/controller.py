"""`tiered up` (the local system, supervised) and `tiered controller` (the
reconcile loop, over a local state directory or a cluster). The local system,
the controller and the kubernetes client are imported only when they run."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from tiered.cli import flags
from tiered.errors import ConfigError, TieredError


def register(commands: argparse._SubParsersAction) -> None:
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
    up_cmd.set_defaults(handler=_run_up)

    controller = commands.add_parser(
        "controller",
        help="reconcile TieredModels of a local system (`tiered up` starts it)",
        description="The controller loop over a local system's state directory: builds "
        "versions for each tier, starts, judges, promotes and rolls back rollouts, and "
        "writes the routing table. Safe to kill and restart: progress lives in the store.",
    )
    controller.add_argument("--interval", type=float, default=2.0, metavar="S",
                            help="local: seconds between reconcile passes (default 2)")
    controller.add_argument("--max-builds", type=int, metavar="N",
                            help="local: tier builds run at once, in the background "
                            "(default 1 on two cores or fewer, else 2)")
    flags.add_backend_flags(controller)
    flags.add_tls_flags(controller, server=False)
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
                            help="serve Prometheus /metrics here (0: any free port): each "
                            "rollout's phase, stage, weights and latest analysis per metric "
                            "and tier; locally on 127.0.0.1, on Kubernetes on every address "
                            "(also what the liveness probe connects to)")
    controller.add_argument("--agent-tls-secret", metavar="SECRET",
                            help="Kubernetes: a kubernetes.io/tls Secret (with ca.crt) the "
                            "agents serve mTLS with; the controller then needs --tls-* flags "
                            "(default: agents run --insecure)")
    controller.add_argument("--agent-pods", type=Path, metavar="FILE",
                            help="Kubernetes: YAML settings of the agent pods it creates "
                            "(labels, httpPort, per tier: priorityClassName, "
                            "runtimeClassName, topologySpreadConstraints, extraArgs, "
                            "extraEnv); the chart writes it (default: REST on 8000, no more)")
    controller.add_argument("--agent-addresses", type=Path, metavar="FILE",
                            help="Kubernetes: JSON {service: host:port} for agents reached "
                            "under other names (port-forwarding, tests)")
    controller.set_defaults(handler=_run_controller)


def _run_up(args: argparse.Namespace) -> int:
    import signal
    import threading

    from tiered.local import supervisor
    from tiered.local.processes import AgentError

    try:
        system = supervisor.load_system(args.file)
        if args.state is not None:
            system = dataclasses.replace(system, state_dir=str(args.state))
        local = supervisor.LocalUp(system, args.file.parent,
                                   progress=lambda line: print(line, flush=True))
    except ConfigError as error:
        print(f"tiered up: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        running = local.start()
        rest = f" (REST http://{local.router.http_address})" if local.router.http_port else ""
        print(f"up: router on {running.router}{rest}; state in {local.layout.root}. "
              "Ctrl-C stops everything.", flush=True)
        local.supervise(stop)
    except (TieredError, AgentError) as error:
        print(f"tiered up: {error}", file=sys.stderr)
        return 1
    finally:
        local.stop()
    return 0


def _run_controller(args: argparse.Namespace) -> int:
    import signal
    import threading

    from tiered.controller.host.controller import HostController

    if args.log_level == "INFO":  # progress is printed; builds' library chatter is not
        logging.getLogger().setLevel(logging.WARNING)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    if args.kubernetes:
        return _kube_controller(args, stop)
    try:
        controller = HostController(args.state, interval_s=args.interval,
                                     retire_grace_s=args.retire_grace,
                                     progress=lambda line: print(line, flush=True),
                                     max_builds=args.max_builds)
    except TieredError as error:
        print(f"tiered controller: {error}", file=sys.stderr)
        return 2
    try:
        if args.metrics_port is not None:
            _serve_metrics(controller.reconciler.metrics, "127.0.0.1", args.metrics_port)
        controller.run(stop)
    finally:
        controller.close()
    return 0


def _serve_metrics(metrics, host: str, port: int) -> None:
    from tiered.telemetry import exposition

    server = exposition.serve(metrics.families, host, port)
    print(f"tiered controller: metrics on http://{host}:{server.server_port}/metrics",
          flush=True)


def _kube_controller(args: argparse.Namespace, stop) -> int:
    import json
    import socket

    from tiered.controller.kube.cluster import api_client, current_namespace
    from tiered.controller.kube.controller import ControllerOptions, KubeController
    from tiered.controller.kube.render import AgentPods, ClusterSettings, load_agent_pods

    try:
        args.namespace = args.namespace or current_namespace(args.kubeconfig, args.context)
        addresses = json.loads(args.agent_addresses.read_text()) if args.agent_addresses else {}
        transport = flags.security_from_args(args)
        settings = ClusterSettings(
            namespace=args.namespace, agent_image=args.agent_image,
            agent_gpu_image=args.agent_gpu_image, routing_configmap=args.routing_configmap,
            router=args.router, tls_secret=args.agent_tls_secret,
            agent_pods=load_agent_pods(args.agent_pods) if args.agent_pods else AgentPods())
        options = ControllerOptions(
            identity=args.identity or socket.gethostname(), leader_elect=args.leader_elect,
            lease_name=args.lease_name, lease_duration_s=args.lease_duration,
            retire_grace_s=args.retire_grace, agent_addresses=addresses, transport=transport)
        client = api_client(args.kubeconfig, args.context)
    except (OSError, ValueError, TieredError) as error:
        print(f"tiered controller: {error}", file=sys.stderr)
        return 2
    controller = KubeController(settings, client, options=options,
                                progress=lambda line: print(line, flush=True))
    if args.metrics_port is not None:  # also what the liveness probe connects to
        _serve_metrics(controller.reconciler.metrics, "0.0.0.0", args.metrics_port)
    print(f"tiered controller: namespace {args.namespace}, identity {options.identity}"
          f"{', leader election on' if args.leader_elect else ''}", flush=True)
    controller.run(stop)
    return 0
