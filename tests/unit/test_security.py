"""Transport settings and authorization, pure."""

from __future__ import annotations

import pytest

from tiered.errors import ConfigError, PermissionDenied, Unauthenticated
from tiered.protocol.security import Authorizer, TransportSecurity, local_peer, read_tokens


class Context:
    """What a gRPC servicer context tells about the caller."""

    def __init__(self, token: str | None = None, names: tuple[str, ...] = (),
                 peer: str = "ipv4:127.0.0.1:40000") -> None:
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.names = names
        self._peer = peer

    def invocation_metadata(self):
        return self.metadata

    def peer(self):
        return self._peer

    def auth_context(self):
        return {"x509_common_name": [n.encode() for n in self.names]} if self.names else {}


@pytest.fixture
def pem(tmp_path):
    for name in ("cert", "key", "ca"):
        (tmp_path / f"{name}.pem").write_text("-----BEGIN X-----\n")
    return tmp_path


@pytest.mark.parametrize(("fields", "message"), [
    ({}, "or --insecure for plaintext: one is required"),
    ({"insecure": True, "client_auth": True}, "--insecure: give it alone"),
    ({"cert": "cert.pem"}, "--tls-cert and --tls-key: give both"),
    ({"cert": "cert.pem", "key": "key.pem", "client_auth": True}, "needs --tls-ca"),
    ({"ca": "missing.pem"}, "--tls-ca: .*missing.pem is not a file"),
])
def test_transport_settings_refuse_what_cannot_work(pem, fields, message):
    fields = {k: (pem / v if isinstance(v, str) else v) for k, v in fields.items()}
    with pytest.raises(ConfigError, match=message):
        TransportSecurity(**fields)


@pytest.mark.parametrize(("context", "error"), [
    (Context(), Unauthenticated),
    (Context("wrong"), PermissionDenied),
    (Context("s3cr\u00e9t"), PermissionDenied),  # non-ASCII: refused, not a TypeError
    (Context("s3cret\udcff"), PermissionDenied),  # invalid UTF-8, as a header decodes it
    (Context(names=("reader",)), PermissionDenied),
    (Context("s3cret"), None),
    (Context(names=("ops",)), None),
])
def test_admin_needs_a_token_or_an_admin_certificate(context, error):
    authorizer = Authorizer(admin_tokens=frozenset({"s3cret"}), admin_names=frozenset({"ops"}))
    if error is None:
        authorizer.require_admin(context)
    else:
        with pytest.raises(error, match="admin token"):
            authorizer.require_admin(context)


def test_inference_is_open_unless_tokens_are_set():
    Authorizer().require_inference(Context())
    guarded = Authorizer(admin_tokens=frozenset({"a"}), inference_tokens=frozenset({"i"}))
    guarded.require_inference(Context("i"))
    guarded.require_inference(Context("a"))  # an admin may always infer
    with pytest.raises(Unauthenticated):
        guarded.require_inference(Context())
    with pytest.raises(PermissionDenied):
        guarded.require_inference(Context("x"))


@pytest.mark.parametrize(("peer", "local"), [
    ("ipv4:127.0.0.1:5000", True), ("ipv4:127.3.2.1:5000", True), ("ipv6:[::1]:5000", True),
    ("ipv6:[::ffff:127.0.0.1]:5000", True), ("unix:/tmp/s.sock", True), ("unix:", True),
    ("http:127.0.0.1", True), ("http:::1", True),
    ("ipv4:192.0.2.2:5000", False), ("ipv6:[fd00::2]:5000", False), ("http:10.1.2.3", False),
    ("ipv6:[::ffff:10.0.0.1]:5000", False), ("http:", False), ("garbage", False),
])
def test_a_local_peer_is_a_unix_socket_or_a_loopback_address(peer, local):
    assert local_peer(peer) is local


def test_shared_memory_only_from_this_host_and_with_a_role_where_credentials_are_set():
    open_agent = Authorizer()
    open_agent.require_shared_memory(Context())  # no credentials anywhere: local is enough
    with pytest.raises(PermissionDenied, match="only from the agent's own host"):
        open_agent.require_shared_memory(Context(peer="ipv4:192.0.2.2:5000"))
    guarded = Authorizer(admin_tokens=frozenset({"a"}), inference_tokens=frozenset({"i"}),
                         shared_memory_tokens=frozenset({"s"}))
    guarded.require_shared_memory(Context("s"))
    guarded.require_shared_memory(Context("a"))
    with pytest.raises(PermissionDenied, match="shared-memory or admin token"):
        guarded.require_shared_memory(Context("i"))  # inference alone may not
    with pytest.raises(Unauthenticated):
        guarded.require_shared_memory(Context())
    with pytest.raises(PermissionDenied, match="own host"):
        guarded.require_shared_memory(Context("s", peer="ipv6:[fd00::2]:5000"))
    # an admin name alone is a credential configured: anonymous callers are refused
    with pytest.raises(Unauthenticated):
        Authorizer(admin_names=frozenset({"ops"})).require_shared_memory(Context())


def test_no_admin_configured_refuses_every_load():
    with pytest.raises(PermissionDenied):
        Authorizer().require_admin(Context("anything"))


def test_token_files(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# admins\none\n\n two \n")
    assert read_tokens(path, "--admin-token-file") == {"one", "two"}
    path.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no token"):
        read_tokens(path, "--admin-token-file")
    with pytest.raises(ConfigError, match="cannot read"):
        read_tokens(tmp_path / "absent", "--admin-token-file")
    assert read_tokens(None, "--admin-token-file") == frozenset()
