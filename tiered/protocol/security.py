"""Transport security for every gRPC hop and the REST port, and who may call what.

TLS on every server and channel (client -> router, router -> agent,
controller -> agent), mutual when the server asks for client certificates.
Plaintext only when asked for with `--insecure`, and then with a warning.
Authorization: repository load/unload need an admin token (metadata
`authorization: Bearer T`) or, under mTLS, a client certificate whose common
name is an admin's; inference is open unless inference tokens are set.
Settings, credentials and channels only: it never parses command-line flags
(the CLI's `tiered.cli.flags` does, into a `TransportSecurity`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from tiered.errors import ConfigError, PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransportSecurity:
    """PEM files of one process: its own certificate and key, and the CA its
    peers' certificates must chain to; or plaintext, explicitly."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    client_auth: bool = False  # servers: require a client certificate signed by `ca`
    insecure: bool = False
    # Clients: the name servers' certificates are checked against, where it is
    # not the address dialled (pods found behind a Service are dialled by IP).
    server_name: str | None = None

    def __post_init__(self) -> None:
        if self.insecure and (self.cert or self.key or self.ca or self.client_auth
                              or self.server_name):
            raise ConfigError("--insecure: give it alone, without --tls-* flags")
        if bool(self.cert) != bool(self.key):
            raise ConfigError("--tls-cert and --tls-key: give both or neither")
        if not self.insecure and not self.ca and not self.cert:
            raise ConfigError("--tls-cert and --tls-key (or --tls-ca), or --insecure for "
                              "plaintext: one is required")
        if self.client_auth and not self.ca:
            raise ConfigError("--tls-client-auth: needs --tls-ca to check client certificates")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key),
                           ("--tls-ca", self.ca)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{flag}: {path} is not a file")

    def _read(self, path: Path | None) -> bytes | None:
        return Path(path).read_bytes() if path is not None else None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None for plaintext."""
        if self.insecure:
            return None
        if not (self.cert and self.key):
            raise ConfigError("--tls-cert and --tls-key: a server needs its own certificate")
        return grpc.ssl_server_credentials(
            [(self._read(self.key), self._read(self.cert))],
            root_certificates=self._read(self.ca), require_client_auth=self.client_auth)

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """The same certificate, key and client checks as `server_credentials`,
        for an HTTPS server; None for plaintext."""
        if self.insecure:
            return None
        if not (self.cert and self.key):
            raise ConfigError("--tls-cert and --tls-key: a server needs its own certificate")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.cert, self.key)
            if self.client_auth:
                context.load_verify_locations(cafile=self.ca)
                context.verify_mode = ssl.CERT_REQUIRED
        except (ssl.SSLError, OSError) as error:
            raise ConfigError(f"--tls-cert, --tls-key, --tls-ca: {error}") from error
        return context

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """None for plaintext; else the CA to trust and, for mTLS, our certificate."""
        if self.insecure:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca), private_key=self._read(self.key),
            certificate_chain=self._read(self.cert))

    def warn_if_plaintext(self, component: str) -> None:
        if self.insecure:
            log.warning("%s: plaintext gRPC (--insecure): traffic and tokens are readable "
                        "on the network", component)


PLAINTEXT = TransportSecurity(insecure=True)


def add_port(server, address: str, security: TransportSecurity) -> int:
    credentials = security.server_credentials()
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def channel(address: str, security: TransportSecurity, options: Sequence = (),
            aio: bool = False, token: str | None = None):
    """A channel to `address` with this process's credentials; with `token`
    (aio only), every call on it carries `authorization: Bearer TOKEN`."""
    module = grpc.aio if aio else grpc
    extra = {"interceptors": [BearerToken(token)]} if token and aio else {}
    credentials = security.channel_credentials()
    if credentials is None:
        return module.insecure_channel(address, options=list(options), **extra)
    if security.server_name:
        options = [*options, ("grpc.ssl_target_name_override", security.server_name)]
    return module.secure_channel(address, credentials, options=list(options), **extra)


class BearerToken(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor,
                  grpc.aio.StreamUnaryClientInterceptor, grpc.aio.StreamStreamClientInterceptor):
    """Every call on a channel presents this process's token (in place of any
    `authorization` the call had): the router's own identity to its agents."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details):
        metadata = [(k, v) for k, v in details.metadata or () if k != "authorization"]
        return details._replace(metadata=grpc.aio.Metadata(*metadata, self._header))

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_stream_unary(self, continuation, details, requests):
        return await continuation(self._details(details), requests)

    async def intercept_stream_stream(self, continuation, details, requests):
        return await continuation(self._details(details), requests)


def read_token(path: Path, flag: str) -> str:
    """The one token a file holds, for a process to present."""
    tokens = read_tokens(path, flag)
    if len(tokens) != 1:
        raise ConfigError(f"{flag}: {path} holds {len(tokens)} tokens; give the one to present")
    return next(iter(tokens))


def read_tokens(path: Path | None, flag: str) -> frozenset[str]:
    """Tokens from a file, one per line; blank lines and #-comments ignored."""
    if path is None:
        return frozenset()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ConfigError(f"{flag}: cannot read {path}: {error.strerror}") from error
    tokens = frozenset(t.strip() for t in lines if t.strip() and not t.startswith("#"))
    if not tokens:
        raise ConfigError(f"{flag}: {path} holds no token")
    return tokens


@dataclass(frozen=True)
class Authorizer:
    """Who may do what: admins load and unload; inference is open unless
    `inference_tokens` are set (an admin or a shared-memory token may always
    infer); shared-memory regions are registered, listed and unregistered only
    from the agent's own host, and, where any credential is configured, only
    with an admin or a shared-memory credential (as Triton restricts those
    endpoints). A region is its caller's (`caller`): only the credential that
    registered it lists it, unregisters it and names it in tensors."""

    admin_tokens: frozenset[str] = frozenset()
    admin_names: frozenset[str] = frozenset()  # client certificate common names (mTLS)
    inference_tokens: frozenset[str] | None = None
    shared_memory_tokens: frozenset[str] = frozenset()

    def require_admin(self, context) -> None:
        if self._token_in(context, self.admin_tokens) or self._name_in(context):
            return
        self._refuse(context, "repository load and unload need an admin token "
                     "(authorization: Bearer ...) or an admin client certificate")

    def require_inference(self, context) -> None:
        if self.inference_tokens is None:
            return
        if (self._token_in(context, self.inference_tokens | self.admin_tokens
                           | self.shared_memory_tokens)  # to name its regions in tensors
                or self._name_in(context)):
            return
        self._refuse(context, "inference needs a token (authorization: Bearer ...)")

    def require_shared_memory(self, context) -> None:
        peer = context.peer()
        if not local_peer(peer):
            raise PermissionDenied(
                "shared memory: regions are registered, listed and unregistered only from "
                f"the agent's own host (loopback or a unix socket), not from {peer}")
        configured = (self.inference_tokens is not None or self.admin_tokens
                      or self.admin_names or self.shared_memory_tokens)
        if not configured or self._token_in(context, self.admin_tokens
                                            | self.shared_memory_tokens) \
                or self._name_in(context):
            return
        self._refuse(context, "shared memory needs a shared-memory or admin token "
                     "(authorization: Bearer ...) or an admin client certificate")

    def caller(self, context) -> str:
        """Who a call comes from, for what it owns (shared-memory regions): its
        token's digest, else its client certificate's names, else "" (every
        caller without credentials, where the server asks for none, is one)."""
        token = _bearer(context)
        if token is not None:
            digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
            return f"token:{digest[:16]}"
        names = _peer_names(context)
        return "cert:" + ",".join(sorted(names)) if names else ""

    def _refuse(self, context, what: str) -> None:
        if _bearer(context) is None and not _peer_names(context):
            raise Unauthenticated(what)
        raise PermissionDenied(f"{what}; the credentials given are not allowed")

    @staticmethod
    def _token_in(context, tokens: Iterable[str]) -> bool:
        given = _bearer(context)
        if given is None:
            return False
        # As bytes: compare_digest refuses str with non-ASCII characters, which
        # a client may send; surrogatepass keeps invalid UTF-8 comparable too.
        given_bytes = given.encode("utf-8", "surrogatepass")
        return any(hmac.compare_digest(given_bytes, t.encode("utf-8")) for t in tokens)

    def _name_in(self, context) -> bool:
        return bool(self.admin_names & _peer_names(context))


class _TrustFrontEnds(Authorizer):
    """For the engine process's private socket, reached only by its own front
    ends, which have checked every caller's credentials already."""

    def require_admin(self, context) -> None:
        pass

    def require_inference(self, context) -> None:
        pass

    def require_shared_memory(self, context) -> None:
        pass

    def caller(self, context) -> str:
        """As the front end that passed the call on found it (CALLER)."""
        return next((value for key, value in context.invocation_metadata() or ()
                     if key == CALLER), "")


TRUST_FRONT_ENDS = _TrustFrontEnds()
# What a front end tells its engine process of a call's caller: a metadata key
# on the calls it passes on, a request parameter on those it feeds. Whatever a
# client sends under this name is replaced.
CALLER = "tiered-caller"


def claim(request, caller: str) -> None:
    """Mark a ModelInferRequest with its caller (whose shared-memory regions
    it may name), over anything its client put there."""
    request.parameters[CALLER].string_param = caller


def local_peer(peer: str) -> bool:
    """A call from this host: a unix socket or a loopback address, as gRPC
    (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`, `unix:...`) and the REST
    server (`http:127.0.0.1`) name their peers."""
    kind, _, address = peer.partition(":")
    if kind == "unix":
        return True
    if kind == "ipv4":
        address = address.rsplit(":", 1)[0]
    elif kind == "ipv6":
        address = address.rpartition("]")[0].lstrip("[") if "]" in address else address
    elif kind != "http":
        return False
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _bearer(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):].strip()
    return None


def _peer_names(context) -> frozenset[str]:
    auth = context.auth_context() or {}
    return frozenset(v.decode() for v in auth.get("x509_common_name", ()))


class ChannelCache:
    """One blocking channel per address, with this process's credentials."""

    def __init__(self, security: TransportSecurity = PLAINTEXT) -> None:
        self.security = security
        self._channels: dict[str, grpc.Channel] = {}

    def __call__(self, address: str) -> grpc.Channel:
        found = self._channels.get(address)
        if found is None:
            found = self._channels[address] = channel(address, self.security)
        return found

    def close(self) -> None:
        for open_channel in self._channels.values():
            open_channel.close()
        self._channels.clear()
