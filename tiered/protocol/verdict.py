"""The verdict of one `tiered build`, as typed data between our own parts.

`tiered build` ends by writing its verdict as one compact JSON line (its last
line on stderr, the file named by --termination-log, and the "verdict" key of
the build.json it installs); the controller's two backends read it back with
`read_verdict`: locally from the build process's stderr, on Kubernetes from
the build init container's termination message. A fixed "kind" key tells a
verdict from any other JSON a log may hold.

A leaf module: it imports nothing of ours, so the CLI, the controller and
tests can all use it. It must never raise on what it reads: text that holds
no well-formed verdict reads as None.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KIND = "tiered.build/verdict"

# `tiered build`'s exit codes, which the verdict repeats.
BUILT = 0  # the gate accepted the version and it was installed
REJECTED = 1  # the gate rejected the version; nothing was written
REFUSED = 2  # refused before or while building (bad flags, sha256 mismatch, unloadable model)
FAILED = 3  # an unexpected error (a bug, or a library's own exception)

# The kubelet keeps at most 4096 bytes of a termination message and cuts the
# rest, which would leave no JSON to read: a bounded reason keeps the line whole.
MAX_REASON_CHARS = 1000

_FIELDS: dict[str, tuple[type, ...]] = {
    "built": (bool,),
    "model": (str,),
    "version": (int,),
    "tier": (str,),
    "reason": (str,),
    "installed": (str, type(None)),
    "exit_code": (int,),
}


@dataclass(frozen=True)
class BuildVerdict:
    """Whether a build installed its version, and why (the gate's reason, or
    why it was refused or failed). `reason` is held as one line of at most
    MAX_REASON_CHARS characters."""

    built: bool
    model: str
    version: int
    tier: str
    reason: str
    installed: str | None  # the version directory, when written
    exit_code: int

    def __post_init__(self) -> None:
        line = re.sub(r"\s*[\r\n]+\s*", " ", self.reason).strip()
        if len(line) > MAX_REASON_CHARS:
            line = line[: MAX_REASON_CHARS - 1] + "…"
        object.__setattr__(self, "reason", line)  # normalised once, so round trips are exact

    def to_dict(self) -> dict[str, Any]:
        """The verdict as a JSON object, its kind first."""
        return {"kind": KIND, **{name: getattr(self, name) for name in _FIELDS}}

    def to_json(self) -> str:
        """One compact line, no trailing newline."""
        return json.dumps(self.to_dict(), separators=(",", ":"))


def parse_verdict(value: object) -> BuildVerdict | None:
    """A decoded JSON value as a verdict; None unless it is a verdict object
    with every field of the right type (unknown keys are ignored)."""
    if not isinstance(value, Mapping) or value.get("kind") != KIND:
        return None
    fields = {}
    for name, types in _FIELDS.items():
        if name not in value:
            return None
        field = value[name]
        # bool is an int in Python; JSON's true is not a version number.
        if not isinstance(field, types) or (bool not in types and isinstance(field, bool)):
            return None
        fields[name] = field
    return BuildVerdict(**fields)


def read_verdict(text: str) -> BuildVerdict | None:
    """The last line of `text` that is a well-formed verdict; None when none is.

    Other lines (log output, a traceback, a malformed or foreign JSON object)
    are passed over.
    """
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            verdict = parse_verdict(json.loads(line))
        except (ValueError, RecursionError):
            continue
        if verdict is not None:
            return verdict
    return None
