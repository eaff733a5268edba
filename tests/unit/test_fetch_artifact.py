"""`tiered build` builds only the pinned bytes: paths, file:// and http(s) artifacts."""

from __future__ import annotations

import hashlib
import http.server
import threading
from functools import partial

import pytest

from tiered.engines.build import fetch_artifact
from tiered.errors import ConfigError

BYTES = b"not really onnx, but bytes with a digest"
DIGEST = hashlib.sha256(BYTES).hexdigest()


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    (root / "m.onnx").write_bytes(BYTES)
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_local_path_is_checked_and_kept(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(BYTES)
    assert fetch_artifact(str(path), DIGEST, tmp_path) == path
    assert fetch_artifact(f"file://{path}", None, tmp_path) == path
    with pytest.raises(ConfigError, match=f"has sha256 {DIGEST}, not the expected {'0' * 64}"):
        fetch_artifact(str(path), "0" * 64, tmp_path)


def test_an_http_artifact_is_downloaded_and_checked(tmp_path, served):
    work = tmp_path / "work"
    work.mkdir()
    fetched = fetch_artifact(f"{served}/m.onnx", DIGEST, work)
    assert fetched.parent == work and fetched.read_bytes() == BYTES
    with pytest.raises(ConfigError, match="refusing to build it"):
        fetch_artifact(f"{served}/m.onnx", "f" * 64, work)
    with pytest.raises(ConfigError, match="cannot fetch"):
        fetch_artifact(f"{served}/missing.onnx", None, work)


@pytest.mark.parametrize(("uri", "message"), [
    ("s3://bucket/m.onnx", "unsupported URI scheme 's3'"),
    ("/nowhere/m.onnx", "is not a file"),
])
def test_what_cannot_be_fetched_says_why(tmp_path, uri, message):
    with pytest.raises(ConfigError, match=message):
        fetch_artifact(uri, None, tmp_path)
