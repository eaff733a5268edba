"""The artifact a build starts from, as a local file holding exactly the pinned
bytes: a path as it is, a file:// URI, or an http(s) URI downloaded. A
checkpoint directory, or a repository directory holding an ensemble and its
step models, is given as a path (or file:// URI); its sha256 is
`tiered.files.sha256_tree`'s, over all its files.

It must never hand over a file whose sha256 differs from the one given: a
build of anything but the pinned bytes is refused before it starts.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from pathlib import Path

from tiered.engines.build.ensemble import is_model_repository
from tiered.engines.generative import CHECKPOINT_FILES, is_checkpoint
from tiered.errors import ConfigError
from tiered.files import sha256_file, sha256_tree

MAX_ARTIFACT_BYTES = 4 << 30  # an artifact fetched over HTTP may be at most this large


def fetch_artifact(uri: str, sha256: str | None, work: Path, name: str = "artifact.onnx"
                   ) -> Path:
    """The artifact as a local file: a path as it is, an http(s) URI downloaded
    into `work`; checked against `sha256` when one is given, so that nothing
    but the pinned bytes is ever built."""
    scheme = urllib.parse.urlparse(uri).scheme
    if scheme in ("http", "https"):
        path = work / name
        try:
            with urllib.request.urlopen(uri, timeout=60) as reply, path.open("wb") as out:
                copied = 0
                while block := reply.read(1 << 20):
                    copied += len(block)
                    if copied > MAX_ARTIFACT_BYTES:
                        raise ConfigError(f"artifact: {uri} is larger than "
                                          f"{MAX_ARTIFACT_BYTES >> 30} GiB")
                    out.write(block)
        except OSError as error:
            raise ConfigError(f"artifact: cannot fetch {uri}: {error}") from error
    elif scheme in ("", "file"):
        path = Path(urllib.parse.urlparse(uri).path if scheme else uri)
        if not (path.is_file() or is_checkpoint(path) or is_model_repository(path)):
            raise ConfigError(f"artifact: {path} is not a file, a checkpoint directory "
                              f"({', '.join(CHECKPOINT_FILES)} and *.safetensors) or a "
                              "repository holding an ensemble (<model>/config.pbtxt)")
    else:
        raise ConfigError(f"artifact: unsupported URI scheme {scheme!r} in {uri} "
                          "(a path, file://, http:// or https://)")
    if sha256 is not None:
        digest = sha256_tree(path) if path.is_dir() else sha256_file(path)
        if digest != sha256:
            raise ConfigError(f"artifact: {uri} has sha256 {digest}, not the expected "
                              f"{sha256}; refusing to build it")
    return path
