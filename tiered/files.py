"""Files shared between processes: written all or nothing, identified by
digest, locked by whoever runs on them.

Agents, routers and builds read files other processes write (config.yaml,
the routing table, build reports, TensorRT plans). Each is written to a
temporary file beside its place and renamed into it, so a reader sees the
old file or the new one, never a part of either; the file is fsynced before
the rename and its directory after it, so after a power loss the place holds
the old file or the whole new one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` in one rename, durably; readable by `mode`
    (the temporary file would otherwise keep mkstemp's private 0600)."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                         suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
            file.flush()
            os.chmod(temporary, mode)
            os.fsync(file.fileno())  # bytes and mode on disk before the name points at them
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    """fsync a directory: what makes a rename (or a new name) in it survive a
    power loss. Where directories cannot be opened (Windows) there is nothing to do."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    handle = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def sha256_tree(directory: Path) -> str:
    """The digest of a directory artifact (a model checkpoint): the sha256 of
    its manifest, one line `<sha256 of the file>  <relative POSIX path>\\n`
    for every regular file beneath it (links followed), sorted by path. The
    same as `cd DIR && find -L . -type f -printf '%P\\n' | LC_ALL=C sort |
    xargs -d '\\n' sha256sum | sha256sum`: any file's bytes or name changing,
    or a file coming or going, changes it."""
    directory = Path(directory)
    files = sorted((path.relative_to(directory).as_posix(), path)
                   for path in directory.rglob("*") if path.is_file())
    manifest = "".join(f"{sha256_file(path)}  {name}\n" for name, path in files)
    return hashlib.sha256(manifest.encode()).hexdigest()


def hold_shared_lock(path: Path) -> int:
    """Take a shared flock on `path` (created when missing) and return its
    descriptor; closing it, or the process ending however it ends, lets go."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a probe's instant (see `lock_held`)
    return fd


def lock_held(path: Path) -> bool:
    """Whether a live process holds a lock on `path`: an exclusive lock taken
    at once means nobody does (and is let go at once). A file that cannot be
    opened is held by no one this process can see."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also lets go of the probe's lock
    return False
