"""`tiered up`: the whole system on this machine, supervised.

Starts one agent per tier (each on its tier's profile, serving the tier's
model repository under the state directory), the router and the controller
as child processes, writes their addresses for the controller and the CLI,
applies the TieredModels the system file lists, and then watches: a child
that dies is started again (agents and the router on the port they had),
the controller's progress lines are echoed, and each tier runs as many
agents as the controller's autoscaling decided (`follow_scale`). Ctrl-C
stops everything, the controller first and the agents last. It never
reconciles: the controller child does.

    # examples/local.yaml
    state_dir: .tiered                # relative to the working directory
    tiers: [edge, regional, datacenter]
    router: {port: 8000, http_port: 8080, metrics_port: 0}
    controller: {interval_s: 2, metrics_port: 0}
    sample_models: ../build/models    # train the sample digits models here when missing
    apply: [digits.yaml]              # TieredModels, relative to this file
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tiered import names
from tiered.controller.host.state import RunningSystem, StateLayout
from tiered.controller.plan import RETIRE_GRACE_S
from tiered.controller.store import StateStore
from tiered.controller.verbs import apply_file
from tiered.errors import ConfigError
from tiered.files import write_atomically
from tiered.local.processes import AgentError, AgentProcess, RouterProcess, ServerProcess
from tiered.router.server import TABLE_POLL_S
from tiered.settings import load_dataclass, read_yaml

log = logging.getLogger(__name__)
# "MODEL: ACTION: REASON", as the controller logs a rollout's step
_STEP_LINE = re.compile(rf"^\S+: ({'|'.join(names.Action)}): ")

SUPERVISE_INTERVAL_S = 0.5
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)  # then every 10 s
SAMPLE_VARIANTS = ("v1", "v2", "heavy")


@dataclass(frozen=True)
class RouterPorts:
    port: int = 8000
    http_port: int | None = 0  # KServe v2 REST; 0: any free port (printed); None: off
    metrics_port: int = 0  # 0: any free port, for Prometheus (the router logs it)


@dataclass(frozen=True)
class ControllerSettings:
    interval_s: float = 2.0
    retire_grace_s: float = RETIRE_GRACE_S  # a retired version's agents outlive its routes
    metrics_port: int = 0  # Prometheus /metrics on loopback; 0: any free port (it logs it)
    max_builds: int | None = None  # tier builds at once; None: 1 on two cores or fewer, else 2

    def __post_init__(self) -> None:
        if self.max_builds is not None and not 1 <= self.max_builds <= 64:
            raise ConfigError(f"max_builds: expected 1..64, got {self.max_builds}")
        if not 0.1 <= self.interval_s <= 3600:
            raise ConfigError(f"interval_s: expected 0.1..3600 s, got {self.interval_s}")
        if not 0 <= self.retire_grace_s <= 86400:
            raise ConfigError(f"retire_grace_s: expected 0..86400 s, got {self.retire_grace_s}")


@dataclass(frozen=True)
class LocalSystem:
    state_dir: str = ".tiered"
    tiers: tuple[str, ...] = names.TIERS
    router: RouterPorts = field(default_factory=RouterPorts)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    sample_models: str | None = None
    apply: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for index, tier in enumerate(self.tiers):
            if tier not in names.TIERS:
                raise ConfigError(f"tiers[{index}]: unknown tier {tier!r}; expected one of "
                                  f"{', '.join(names.TIERS)}")
        if not self.tiers or len(set(self.tiers)) != len(self.tiers):
            raise ConfigError("tiers: list each tier once, at least one")


def load_system(path: Path) -> LocalSystem:
    return load_dataclass(LocalSystem, read_yaml(path), str(path))


def prepare_sample_models(out: Path, progress: Callable[[str], None]) -> None:
    """Train the sample digits models into `out` unless they are there."""
    missing = [v for v in SAMPLE_VARIANTS if not (out / f"digits-{v}.onnx").is_file()]
    if not missing:
        return
    try:
        from tiered.models import digits
    except ImportError as error:
        raise ConfigError(f"sample_models: training needs the samples extra "
                          f"(pip install 'tiered[agent,samples]'): {error}") from error
    for variant in missing:
        started = time.monotonic()
        model = digits.write_digits(out, variant)
        progress(f"trained digits {variant} in {time.monotonic() - started:.1f} s: "
                 f"{model.onnx_accuracy:.2%} held-out accuracy -> {model.onnx_path}")


def thread_share(processes: int, environ=os.environ) -> dict[str, str]:
    """The environment that gives each of `processes` processes on one machine
    (an agent per tier; the controller's builds) a share of its cores for
    torch's CPU thread pools, not each all of them. On two cores, one thread
    each cut the CPU of test_local_generative.py's system from 256 to 193 s
    (the datacenter agent's torch engine from 55 to 33), and its rollouts
    decided as before, sooner. A value the environment gives (OMP_NUM_THREADS)
    is kept."""
    if "OMP_NUM_THREADS" in environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}


class LocalUp:
    """Start, supervise and stop the local system."""

    def __init__(self, system: LocalSystem, base: Path, *,
                 progress: Callable[[str], None] = print) -> None:
        self.system = system
        self.base = Path(base)
        self.layout = StateLayout(Path(system.state_dir).resolve())
        self.progress = progress
        self.agents: dict[str, list[AgentProcess]] = {}  # each tier's, first started first
        self.leaving: list[tuple[AgentProcess, float]] = []  # out of the table; stop when
        self._scale_stamp: int | None = None  # scale.json's, as last read
        self._wanted: dict[str, int] = {}  # agents per tier, as scale.json said last
        self._retry_at: dict[str, float] = {}  # a tier whose new agent failed: when again
        self.router: ServerProcess | None = None
        self.controller: subprocess.Popen | None = None
        self._controller_log_offset = 0
        self._restarts: dict[str, int] = {}
        self._next_start: dict[str, float] = {}
        self._lock: int | None = None  # the state directory's lock, while this runs

    # -- start / stop ---------------------------------------------------------

    def start(self) -> RunningSystem:
        layout = self.layout.create()
        self._take_lock()  # before anything starts: one system per state directory
        layout.logs.mkdir(parents=True, exist_ok=True)
        if self.system.sample_models:
            prepare_sample_models((self.base / self.system.sample_models).resolve(),
                                  self.progress)
        if not layout.routing_table.is_file():
            write_atomically(layout.routing_table, "version: 0\nmodels: {}\n")
        layout.ensure_admin_token()
        for tier in self.system.tiers:
            layout.repository(tier).mkdir(parents=True, exist_ok=True)
            self.agents[tier] = [self._agent(tier)]
        self.router = RouterProcess(layout.routing_table, port=self.system.router.port,
                                    metrics_port=self.system.router.metrics_port,
                                    http_port=self.system.router.http_port,
                                    log_dir=layout.logs)
        for name, process in [*self._named_agents(), ("router", self.router)]:
            process.start()
            rest = f", REST http://{process.http_address}" if process.http_port else ""
            self.progress(f"{name}: pid {process.pid}, {process.address}{rest} "
                          f"(log {process.log_path})")
        running = self.running()
        running.write(layout.system)
        with StateStore(layout.store) as store:
            for path in self.system.apply:
                for name, result in apply_file(store, self.base / path):
                    self.progress(f"tieredmodel/{name} {result}")
        self._start_controller()
        return running

    def _agent(self, tier: str) -> AgentProcess:
        """A new agent of `tier` on a free port, serving the tier's repository."""
        return AgentProcess(tier, self.layout.repository(tier), log_dir=self.layout.logs,
                            extra_args=["--allow-failed-models"],
                            admin_token_file=self.layout.admin_token,
                            env=thread_share(len(self.system.tiers)))

    def _named_agents(self) -> list[tuple[str, AgentProcess]]:
        """Every agent in the table, named as progress lines name it: its tier
        for the first, `tier-2`, `tier-3`, ... for those scaled up."""
        return [(tier if index == 0 else f"{tier}-{index + 1}", agent)
                for tier, agents in self.agents.items() for index, agent in enumerate(agents)]

    def running(self) -> RunningSystem:
        assert self.router is not None
        return RunningSystem({tier: tuple(agent.address for agent in agents)
                              for tier, agents in self.agents.items()}, self.router.address)

    def _start_controller(self) -> None:
        log_path = self.layout.logs / "controller.log"
        self._controller_log_offset = log_path.stat().st_size if log_path.exists() else 0
        with log_path.open("ab") as out:
            self.controller = subprocess.Popen(
                [sys.executable, "-m", "tiered", "controller", "--state", str(self.layout.root),
                 "--interval", str(self.system.controller.interval_s),
                 "--retire-grace", str(self.system.controller.retire_grace_s),
                 "--metrics-port", str(self.system.controller.metrics_port),
                 *(["--max-builds", str(self.system.controller.max_builds)]
                   if self.system.controller.max_builds is not None else [])],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **thread_share(len(self.system.tiers))})
        self.progress(f"controller: pid {self.controller.pid} (log {log_path})")

    def _take_lock(self) -> None:
        """Lock the state directory for as long as this system runs (the kernel
        lets go when the process ends, however it ends); ConfigError naming the
        holder when another `tiered up` has it."""
        import fcntl

        fd = os.open(self.layout.up_lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"a system is already running on {self.layout.root} (tiered up, "
                              f"pid {holder}); stop it first, or pass --state DIR for "
                              "another") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock = fd

    def stop(self) -> None:
        if self._lock is None:
            return  # never started (another system holds the directory): nothing is ours
        if self.controller is not None and self.controller.poll() is None:
            self.controller.terminate()
            try:
                self.controller.wait(30)
            except subprocess.TimeoutExpired:
                self.controller.kill()
        for process in [self.router, *(a for _, a in self._named_agents()),
                        *(a for a, _ in self.leaving)]:
            if process is not None:
                process.stop()
        self.echo_controller()
        if self._lock is not None:
            os.close(self._lock)  # closing lets the lock go
            self._lock = None

    # -- supervision ----------------------------------------------------------

    def supervise(self, stop: threading.Event) -> None:
        while not stop.wait(SUPERVISE_INTERVAL_S):
            self.echo_controller()
            self.restart_dead()
            self.follow_scale()

    def follow_scale(self, now: float | None = None) -> None:
        """Run as many agents of each tier as the controller's scale.json
        says (a tier it leaves out: one). A new agent joins the table once it
        serves; one that goes leaves the table first and stops (draining
        what it has) once every router has read a table without it."""
        now = time.monotonic() if now is None else now
        for process, after in [entry for entry in self.leaving if entry[1] <= now]:
            process.stop()
            self.leaving.remove((process, after))
        self._read_scale()
        changed = False
        for tier, agents in self.agents.items():
            count = self._wanted.get(tier, 1)
            while len(agents) < count and now >= self._retry_at.get(tier, 0.0):
                agent, started = self._agent(tier), time.monotonic()
                try:
                    agent.start()  # returns once it serves: the cold start
                except AgentError as error:
                    self._retry_at[tier] = now + RESTART_BACKOFF_S[-1]
                    self.progress(f"{tier}: scaling up failed (again in "
                                  f"{RESTART_BACKOFF_S[-1]:g} s): {error}")
                    break
                agents.append(agent)
                changed = True
                self.progress(f"{tier}: agent {len(agents)} of {count} serving after a "
                              f"{time.monotonic() - started:.1f} s cold start, pid "
                              f"{agent.pid}, {agent.address}")
            while len(agents) > count:
                agent = agents.pop()
                self.leaving.append((agent, now + self.leave_grace_s))
                changed = True
                self.progress(f"{tier}: agent {agent.address} leaves the routing table; "
                              f"it stops in {self.leave_grace_s:g} s ({len(agents)} of "
                              f"{tier} left)")
        if changed:
            self.running().write(self.layout.system)

    @property
    def leave_grace_s(self) -> float:
        """Long enough for the controller to write a table without an agent
        and the router to read it (`TABLE_POLL_S`), with a pass to spare."""
        return 2 * self.system.controller.interval_s + 2 * TABLE_POLL_S

    def _read_scale(self) -> None:
        """scale.json's counts, read again when it changed."""
        try:
            stamp = self.layout.scale.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if stamp == self._scale_stamp:
            return
        try:
            wanted = json.loads(self.layout.scale.read_text())
        except (OSError, ValueError) as error:
            self.progress(f"controller's scale unreadable: {error}")
            return
        self._scale_stamp = stamp
        self._wanted = {tier: int(count) for tier, count in wanted.items()
                        if tier in self.agents}

    def echo_controller(self, decisions: bool = True) -> None:
        """Print what the controller logged since last time, its holds aside:
        they change often and run long, and `tiered rollout status --watch`
        (the demo's live line) shows them; its decisions too unless
        `decisions` (a caller that prints each with its numbers)."""
        log_path = self.layout.logs / "controller.log"
        try:
            with log_path.open("rb") as out:
                out.seek(self._controller_log_offset)
                text = out.read()
        except FileNotFoundError:
            return
        complete = text.rfind(b"\n") + 1
        self._controller_log_offset += complete
        for line in text[:complete].decode(errors="replace").splitlines():
            step = _STEP_LINE.match(line)
            if step is None or decisions and step[1] != names.Action.HOLD:
                self.progress(line)

    def restart_dead(self) -> None:
        controller = self.controller
        if (controller is not None and controller.poll() is not None
                and self._due("controller", controller.returncode)):
            self._start_controller()
        for name, process in [*self._named_agents(), ("router", self.router)]:
            if process is None or process.alive():
                continue
            if not self._due(name, process.stop()):
                continue
            # Come back where clients and the table expect it.
            for flag, port in (("--port", process.port), ("--http-port", process.http_port)):
                if port is not None and flag in process.command:
                    process.command[process.command.index(flag) + 1] = str(port)
            try:
                process.start()
                self.progress(f"{name}: restarted, pid {process.pid}")
            except AgentError as error:
                self.progress(f"{name}: restart failed: {error}")

    def _due(self, name: str, code: int | None) -> bool:
        now = time.monotonic()
        if name not in self._next_start:
            count = self._restarts.get(name, 0)
            delay = RESTART_BACKOFF_S[min(count, len(RESTART_BACKOFF_S) - 1)]
            self._next_start[name] = now + delay
            self.progress(f"{name}: exited with code {code}; restarting in {delay:g} s")
        if now < self._next_start[name]:
            return False
        del self._next_start[name]
        self._restarts[name] = self._restarts.get(name, 0) + 1
        return True
