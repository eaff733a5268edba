"""The local system's state directory: where `tiered up`, the host backend
and the verbs find the store, the routing table, the running system's
addresses, the logs, the locks, the admin token, the tier repositories and
the build records."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tiered.files import lock_held, write_atomically


@dataclass(frozen=True)
class StateLayout:
    """Where the local system keeps things, under one state directory."""

    root: Path

    @property
    def store(self) -> Path:
        return self.root / "state.db"

    @property
    def routing_table(self) -> Path:
        return self.root / "routing.yaml"

    @property
    def system(self) -> Path:
        return self.root / "system.json"

    @property
    def scale(self) -> Path:
        """Agents per autoscaled tier, as the controller decided (`tiered up` follows it)."""
        return self.root / "scale.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def up_lock(self) -> Path:
        """Locked by the `tiered up` running on this directory (it holds its pid)."""
        return self.root / "up.lock"

    @property
    def controller_lock(self) -> Path:
        """Locked (shared) by every controller running on this directory, so the
        verbs can say when none is (`controller_running`)."""
        return self.root / "controller.lock"

    @property
    def admin_token(self) -> Path:
        """The token the agents accept for load and unload (mode 0600)."""
        return self.root / "admin.token"

    def create(self) -> StateLayout:
        """The state directory, private to this user: whoever can write it can
        run every control verb, so it is the local system's authorization."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        return self

    def ensure_admin_token(self) -> Path:
        if not self.admin_token.is_file():
            import secrets

            self.create()
            fd = os.open(self.admin_token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(32) + "\n")
        return self.admin_token

    def repository(self, tier: str) -> Path:
        return self.root / "repositories" / tier

    @property
    def builds(self) -> Path:
        """The records of the tier builds (see `tiered.controller.host.builds`)."""
        return self.root / "builds"


def controller_running(layout: StateLayout) -> bool:
    """Whether a controller runs on the state directory now."""
    return lock_held(layout.controller_lock)


@dataclass(frozen=True)
class RunningSystem:
    """What `tiered up` started: agent addresses per tier, the router's."""

    agents: Mapping[str, tuple[str, ...]]
    router: str  # its gRPC address: routes, and the canary's shadow agreement

    @staticmethod
    def read(path: Path) -> RunningSystem | None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return RunningSystem({t: tuple(a) for t, a in data["agents"].items()},
                             data["router"])

    def write(self, path: Path) -> None:
        write_atomically(path, json.dumps({"agents": {t: list(a) for t, a in
                                                      self.agents.items()},
                                           "router": self.router}, indent=2))
