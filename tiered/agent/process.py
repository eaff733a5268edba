"""Start and stop `tiered agent` child processes on loopback.

Used by the demo, the benchmarks and the tests (and later the local backend):
the agent binds port 0 and prints the port it got, so nothing races for
ports. Its output goes to a log file whose tail is shown when it fails.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

_LISTENING = re.compile(r"listening on (\S+):(\d+)")


class AgentError(RuntimeError):
    """The agent process failed to start or exited."""


class AgentProcess:
    def __init__(
        self,
        tier: str,
        repository: Path,
        *,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.tier = tier
        self.repository = Path(repository)
        self.host = host
        self.extra_args = tuple(extra_args)
        self.env = env
        self.port: int | None = None
        self._process: subprocess.Popen | None = None
        self._log_dir = tempfile.TemporaryDirectory(prefix=f"tiered-agent-{tier}-")
        self.log_path = Path(self._log_dir.name) / "agent.log"

    @property
    def address(self) -> str:
        if self.port is None:
            raise AgentError("the agent has not started")
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def start(self, timeout_s: float = 120.0) -> AgentProcess:
        command = [
            sys.executable, "-m", "tiered", "agent",
            "--tier", self.tier,
            "--model-repository", str(self.repository),
            "--host", self.host,
            "--port", "0",
            *self.extra_args,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = _LISTENING.search(self.log())
            if match:
                self.port = int(match.group(2))
                return self
            if self._process.poll() is not None:
                raise AgentError(
                    f"agent exited with code {self._process.returncode}:\n{self.log_tail()}"
                )
            time.sleep(0.05)
        self.kill()
        raise AgentError(f"agent did not start within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (drains in-flight requests), then SIGKILL if it lingers."""
        if self._process is None:
            return 0
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        return self._process.returncode

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> AgentProcess:
        return self.start() if self._process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log_dir.cleanup()
