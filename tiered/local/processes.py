"""Start and stop tiered's server processes (`tiered agent`, `tiered router`).

Used by the local system (`tiered up`), the demo, the benchmarks and the
tests. It only builds command lines: nothing here imports the agent or the
router. A server binds port 0 when asked and prints the port it got, so
nothing races for ports; its output goes to a log file whose tail is shown
when it fails.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

_LISTENING = re.compile(r"listening on (\S+):(\d+)")
_METRICS = re.compile(r"metrics on (http://\S+/metrics)")
_REST = re.compile(r"REST on https?://(\S+):(\d+)")


INTERRUPTIBLE = "TIERED_INTERRUPTIBLE"  # in a child's environment: see `interruptible`


def interruptible(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment (`env`, else this process's) for a child `tiered`
    command that will be stopped with SIGINT (Ctrl-C): the child takes SIGINT
    back as it starts (`take_sigint`), since a shell runs background jobs with
    SIGINT ignored, and a child inherits that (and a blocked SIGINT). Not a
    `preexec_fn`: that forks through gRPC's fork handlers, whose restarted
    poller then finds its epoll descriptor closed (close_fds), and the child
    can hang before it runs."""
    return {**(os.environ if env is None else env), INTERRUPTIBLE: "1"}


def take_sigint() -> None:
    """In a `tiered` command started with `interruptible`: SIGINT raises
    KeyboardInterrupt, whatever the parent had it do. Not passed on."""
    if os.environ.pop(INTERRUPTIBLE, None) == "1":
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


PARENT = "TIERED_PARENT_PID"  # in a server's environment: see `follow_parent`
PARENT_POLL_S = 1.0


def follow_parent() -> None:
    """In a `tiered` command a ServerProcess started: once the process that
    started it is gone, send this one SIGTERM (it drains and stops), so a
    parent killed outright (SIGKILL, a test's timeout) leaves no server
    serving behind it. Not PR_SET_PDEATHSIG: that fires when the *thread*
    that started the child ends, and servers are started from threads that
    end (a supervisor's restart, a pool). Not passed on."""
    given = os.environ.pop(PARENT, "")
    if not given.isdigit():
        return
    parent = int(given)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


class AgentError(RuntimeError):
    """A server process failed to start or exited."""


class ServerProcess:
    """A child process that prints `listening on HOST:PORT` once it serves."""

    def __init__(self, command: Sequence[str], name: str, env: dict[str, str] | None = None,
                 log_dir: Path | None = None):
        self.command = list(command)
        self.name = name
        self.env = env
        self.port: int | None = None
        self.metrics_url: str | None = None  # when the server prints one
        self.http_port: int | None = None  # KServe v2 REST, when the server serves it
        self._process: subprocess.Popen | None = None
        self._log_offset = 0
        # A log directory of our own is removed on exit; a given one is kept.
        self._log_dir = None if log_dir else tempfile.TemporaryDirectory(prefix=f"tiered-{name}-")
        self.log_path = Path(log_dir or self._log_dir.name) / f"{name}.log"

    @property
    def address(self) -> str:
        if self.port is None:
            raise AgentError(f"the {self.name} has not started")
        return f"127.0.0.1:{self.port}"

    @property
    def http_address(self) -> str:
        """HOST:PORT of its REST endpoints (tritonclient.http's url)."""
        if self.http_port is None:
            raise AgentError(f"the {self.name} serves no REST")
        return f"127.0.0.1:{self.http_port}"

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def start(self, timeout_s: float = 120.0) -> ServerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {}),
               PARENT: str(os.getpid())}
        # A restart appends to the same log; only what this run wrote counts.
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            log = self.log()
            match = _LISTENING.search(log)
            if match:
                self.port = int(match.group(2))
                metrics = _METRICS.search(log)
                self.metrics_url = metrics.group(1) if metrics else None
                rest = _REST.search(log)
                self.http_port = int(rest.group(2)) if rest else None
                return self
            if self._process.poll() is not None:
                raise AgentError(
                    f"{self.name} exited with code {self._process.returncode}:\n{self.log_tail()}"
                )
            time.sleep(0.05)
        self.kill()
        raise AgentError(f"{self.name} did not start within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log(self) -> str:
        """What this run of the process has written."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                return log.read().decode(errors="replace")
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

    def __enter__(self):
        return self.start() if self._process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._log_dir is not None:
            self._log_dir.cleanup()


class AgentProcess(ServerProcess):
    """`tiered agent` on a free loopback port."""

    def __init__(
        self,
        tier: str,
        repository: Path,
        *,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        port: int = 0,
        log_dir: Path | None = None,
        security_args: Sequence[str] = ("--insecure",),
        admin_token_file: Path | None = None,
    ) -> None:
        """`security_args`: the agent's --tls-* flags, or --insecure (loopback
        tests and the local system); `admin_token_file` allows load/unload."""
        self.tier = tier
        self.repository = Path(repository)
        command = [
            sys.executable, "-m", "tiered", "agent",
            "--tier", tier,
            "--model-repository", str(self.repository),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--metrics-port", "0",
            "--http-port", "0",
            *security_args,
            *(["--admin-token-file", str(admin_token_file)] if admin_token_file else []),
            *extra_args,
        ]
        super().__init__(command, f"agent-{tier}", env, log_dir)


class RouterProcess(ServerProcess):
    """`tiered router` on a loopback port (0: a free one) over a routing table file."""

    def __init__(
        self,
        routing_table: Path,
        *,
        port: int = 0,
        metrics_port: int | None = 0,  # None: no /metrics
        http_port: int | None = 0,  # None: no REST
        security_args: Sequence[str] = ("--insecure",),
        extra_args: Sequence[str] = (),
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        command = [
            sys.executable, "-m", "tiered", "router",
            "--routing-table", str(routing_table),
            "--host", "127.0.0.1",
            "--port", str(port),
            *(["--no-metrics"] if metrics_port is None else ["--metrics-port", str(metrics_port)]),
            *(["--no-http"] if http_port is None else ["--http-port", str(http_port)]),
            *security_args,
            *extra_args,
        ]
        super().__init__(command, "router", env, log_dir)
