"""Flags more than one command takes, and what they become.

Transport security (`--tls-*`, `--insecure`) becomes a
`tiered.protocol.security.TransportSecurity`; the authorization flags an
`Authorizer`; the backend flags say where a command acts (the local system's
state directory, or a cluster). Imported while the parser is built, so it
imports nothing heavy: the security module (and grpc with it) only when
flags are turned into settings.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tiered import names

if TYPE_CHECKING:
    from tiered.protocol.security import Authorizer, TransportSecurity

STATE_HELP = "state directory of the local system (default: .tiered)"
# Plain strings, not the enum's members: argparse names the choices with repr().
TIER_CHOICES = tuple(str(tier) for tier in names.TIERS)


def add_tls_flags(parser: argparse.ArgumentParser, server: bool = True,
                  dials: bool = True) -> None:
    group = parser.add_argument_group("transport security")
    group.add_argument("--tls-cert", type=Path, metavar="PEM",
                       help="this process's certificate (servers: required unless --insecure)")
    group.add_argument("--tls-key", type=Path, metavar="PEM", help="its private key")
    group.add_argument("--tls-ca", type=Path, metavar="PEM",
                       help="CA bundle that peers' certificates must chain to")
    if server:
        group.add_argument("--tls-client-auth", action="store_true",
                           help="require client certificates signed by --tls-ca (mTLS)")
    if dials:
        group.add_argument("--tls-server-name", metavar="NAME",
                           help="check the certificates of the servers this process "
                           "dials against NAME, not the address dialled (pods behind a "
                           "Service are dialled by IP)")
    group.add_argument("--insecure", action="store_true",
                       help="plaintext gRPC, no TLS (logged as a warning)")


def security_from_args(args: argparse.Namespace) -> TransportSecurity:
    from tiered.protocol.security import TransportSecurity

    return TransportSecurity(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca,
                             client_auth=getattr(args, "tls_client_auth", False),
                             server_name=getattr(args, "tls_server_name", None), insecure=args.insecure)


def add_auth_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("authorization")
    group.add_argument("--admin-token-file", type=Path, metavar="FILE",
                       help="tokens (one per line) allowed to load and unload models; "
                       "without admin credentials load and unload are refused")
    group.add_argument("--admin-cn", action="append", metavar="NAME",
                       help="a client-certificate common name allowed to load and unload "
                       "(mTLS; repeatable)")
    group.add_argument("--inference-token-file", type=Path, metavar="FILE",
                       help="tokens (one per line) inference requires (default: open)")
    group.add_argument("--shared-memory-token-file", type=Path, metavar="FILE",
                       help="tokens (one per line) allowed to register, list and unregister "
                       "shared-memory regions, besides admins'; these calls are taken only "
                       "from the agent's own host, and with any token or admin name set, "
                       "only with one of these or an admin credential. A region is its "
                       "token's: only it lists, unregisters and names it in tensors (these "
                       "tokens may infer)")


def authorizer_from_args(args: argparse.Namespace) -> Authorizer:
    from tiered.protocol.security import Authorizer, read_tokens

    inference = read_tokens(args.inference_token_file, "--inference-token-file")
    return Authorizer(admin_tokens=read_tokens(args.admin_token_file, "--admin-token-file"),
                      admin_names=frozenset(args.admin_cn or ()),
                      inference_tokens=inference or None,
                      shared_memory_tokens=read_tokens(args.shared_memory_token_file,
                                                       "--shared-memory-token-file"))


def add_backend_flags(parser: argparse.ArgumentParser) -> None:
    """Where a command acts: the local system's state directory, or a cluster."""
    parser.add_argument("--state", type=Path, default=Path(".tiered"), metavar="DIR",
                        help=STATE_HELP)
    parser.add_argument("--kubernetes", "-k", action="store_true",
                        help="act on a cluster (the kubeconfig's current context, or "
                        "in-cluster) instead of the local system")
    parser.add_argument("--namespace", "-n",
                        help="Kubernetes namespace (default: the kubeconfig context's, "
                        "in a pod its own, else default)")
    parser.add_argument("--kubeconfig", type=Path, metavar="FILE",
                        help="Kubernetes: kubeconfig file (default: ~/.kube/config)")
    parser.add_argument("--context", help="Kubernetes: kubeconfig context")
