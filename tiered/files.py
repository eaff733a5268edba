"""Files shared between processes: written all or nothing, identified by digest.

Agents, routers and builds read files other processes write (config.yaml,
the routing table, build reports, TensorRT plans). Each is written to a
temporary file beside its place and renamed into it, so a reader sees the
old file or the new one, never a part of either.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` in one rename; readable by `mode` (the
    temporary file would otherwise keep mkstemp's private 0600)."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                         suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()
