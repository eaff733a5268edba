"""The local backend: the controller loop over processes on this machine.

`tiered up` starts one agent per tier, the router and this controller as
child processes (see `tiered.controller.up`) and writes their addresses into
the state directory. The controller reconciles every applied TieredModel, level-based:
each pass reads spec and status from the store, and

1. numbers the spec's artifact (a new digest is a new version);
2. builds each served version for each tier into that tier's model
   repository with `tiered build` in a process of its own, as the Kubernetes
   init container does (the artifact is checked against its sha256 first);
3. follows the spec (first version serves at once, a new one starts a
   rollout, going back aborts it) and, while a rollout is live, judges it
   with the rollout engine from the agents' Telemetry.Stats and the router's
   shadow counters;
4. writes the status back (refused when a CLI verb wrote in between: the next
   pass re-reads), the routing table with the stage's weights, and the
   versions each agent serves; versions leave the agents only after the
   router has had time to read a table without them.

All progress lives in the store, so a restarted controller resumes the stage
where it was; only the stage's samples start afresh (the stage clock does not).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from tiered.controller import desired
from tiered.controller.judge import RolloutJudge, snapshot
from tiered.controller.store import Record, StateStore
from tiered.errors import Conflict, TieredError
from tiered.files import write_atomically
from tiered.profiles import TIERS
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
from tiered.protocol.security import ChannelCache
from tiered.rollout import engine
from tiered.rollout.spec import RolloutStatus, TieredModel, load_tiered_model, to_plain
from tiered.settings import load_dataclass

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0
BUILD_TIMEOUT_S = 600.0  # one tier build of one version
TABLE_GRACE_S = 3.0  # the router re-reads its table every second; leave it three


@dataclass(frozen=True)
class StateLayout:
    """Where the local backend keeps things, under one state directory."""

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
    def logs(self) -> Path:
        return self.root / "logs"

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


@dataclass(frozen=True)
class RunningSystem:
    """What `tiered up` started: agent addresses per tier, the router's."""

    agents: Mapping[str, tuple[str, ...]]
    router: str
    router_metrics: str | None = None  # http://host:port/metrics

    @staticmethod
    def read(path: Path) -> RunningSystem | None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return RunningSystem({t: tuple(a) for t, a in data["agents"].items()},
                             data["router"], data.get("router_metrics"))

    def write(self, path: Path) -> None:
        write_atomically(path, json.dumps({"agents": {t: list(a) for t, a in
                                                      self.agents.items()},
                                           "router": self.router,
                                           "router_metrics": self.router_metrics}, indent=2))


def decode_status(record: Record) -> RolloutStatus | None:
    if record.status is None:
        return None
    return load_dataclass(RolloutStatus, record.status, f"{record.name} status")


def _file_stamp(uri: str) -> tuple[int, int] | None:
    """Size and modification time of a local artifact file; None for a URI or
    a missing file."""
    try:
        stat = Path(uri).stat()
    except (OSError, ValueError):
        return None
    return stat.st_size, stat.st_mtime_ns


def decode_artifacts(record: Record) -> tuple[desired.ArtifactVersion, ...]:
    return tuple(desired.ArtifactVersion(a["version"], a["uri"], a["sha256"])
                 for a in record.artifacts)


class LocalController:
    """Reconciles every model in the store against the running local system."""

    def __init__(self, state_dir: Path, *, interval_s: float = 2.0,
                 clock: Callable[[], float] = time.time, seed: int = 0,
                 progress: Callable[[str], None] | None = None) -> None:
        self.layout = StateLayout(Path(state_dir))
        self.store = StateStore(self.layout.store)
        self.interval_s = interval_s
        self.clock = clock
        self.progress = progress or (lambda line: log.info("%s", line))
        self._channel = ChannelCache()  # loopback agents run --insecure
        self.judge = RolloutJudge(self._channel, seed)
        # (model, version, tier) -> (the artifact file's stamp then, why refused)
        self._refused: dict[tuple[str, int, str], tuple[tuple[int, int] | None, str]] = {}
        self._served: dict[tuple[str, str], tuple[int, ...]] = {}  # (tier, model) -> versions
        self._table: dict[str, Any] | None = None
        self._table_models: dict[str, set[int]] = {}  # versions each model had in the table
        self._table_written_at = 0.0

    def close(self) -> None:
        self._channel.close()
        self.store.close()

    # -- the loop ---------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.progress(f"controller: state in {self.layout.root}, every {self.interval_s:g} s")
        while not stop.is_set():
            try:
                self.reconcile_all()
            except TieredError as error:
                self.progress(f"controller: {error}")
            except grpc.RpcError as error:
                self.progress(f"controller: an agent did not answer: {error.code().name} "
                              f"{error.details()}")
            stop.wait(self.interval_s)

    def reconcile_all(self) -> None:
        system = RunningSystem.read(self.layout.system)
        if system is None:
            raise TieredError(f"no running system in {self.layout.system}: start `tiered up`")
        models: list[tuple[TieredModel, RolloutStatus]] = []
        for record in self.store.list():
            try:
                result = self.reconcile(record, system)
            except Conflict as error:
                self.progress(f"{record.name}: {error}")  # a verb wrote first: next pass
                continue
            except TieredError as error:
                self._note(record, f"error: {error}")
                continue
            if result is not None:
                models.append(result)
        for spec, status in models:  # new versions load before the table names them
            self._serve(spec, status, system)
        self._write_table(models, system)

    def reconcile(self, record: Record, system: RunningSystem
                  ) -> tuple[TieredModel, RolloutStatus] | None:
        spec = load_tiered_model(record.spec, record.name)
        status = decode_status(record)
        target, artifacts = desired.version_of(spec.artifact, decode_artifacts(record))
        wanted = desired.wanted_versions(status, target)
        missing = self._build(spec, artifacts, wanted)
        if missing:
            self._write(record, status, artifacts, missing)
            return (spec, status) if status is not None else None
        now = self.clock()
        transition = desired.follow_spec(spec, status, target, now)
        if transition is not None:
            status = transition.status
            self.store.record(spec.name, snapshot(spec, status, transition.action,
                                                  transition.reason), now)
            self.progress(f"{spec.name}: {transition.reason}")
        if desired.live(status):
            decision, numbers = self.judge.judge(spec, status, system.agents,
                                                 system.router_metrics, now)
            status = decision.status
            self.store.record(spec.name, snapshot(spec, status, decision.action,
                                                  decision.reason, numbers), now)
            if decision.action != engine.HOLD:
                self.progress(f"{spec.name}: {decision.action}: {decision.reason}")
        else:
            self.judge.forget(spec.name)
        self._write(record, status, artifacts, status.message)
        return spec, status

    # -- acting -----------------------------------------------------------------

    def _build(self, spec: TieredModel, artifacts: Sequence[desired.ArtifactVersion],
               versions: Sequence[int]) -> str:
        """Build what is missing; '' when every version is in every tier's
        repository, else why not. A refused build is tried again only once its
        artifact file has changed (a build's verdict on the same bytes stands)."""
        by_version = {a.version: a for a in artifacts}
        for version in versions:
            for tier in (t for t in TIERS if t in spec.tiers):
                key, artifact = (spec.name, version, tier), by_version[version]
                stamp = _file_stamp(artifact.uri)
                if key in self._refused and self._refused[key][0] == stamp:
                    return self._refused[key][1]
                repository = self.layout.repository(tier)
                if (repository / spec.name / str(version)).is_dir():
                    continue
                self.progress(f"{spec.name}: building version {version} for {tier}")
                started = time.monotonic()
                built, said = self._build_one(spec, tier, artifact, repository)
                if not built:
                    why = f"version {version} refused on {tier}: {said}"
                    self._refused[key] = (stamp, why)
                    return why
                self.progress(f"{spec.name}: built version {version} for {tier} in "
                              f"{time.monotonic() - started:.1f} s: {said}")
        return ""

    def _build_one(self, spec: TieredModel, tier: str, artifact: desired.ArtifactVersion,
                   repository: Path) -> tuple[bool, str]:
        """`tiered build` in a process of its own, as on Kubernetes: whether it
        wrote the version, and its last word (the verdict, or why not)."""
        command = [sys.executable, "-m", "tiered",
                   *desired.build_args(spec, tier, artifact, str(repository)), "--force"]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return False, f"tiered build: did not finish in {BUILD_TIMEOUT_S:g} s"
        said = desired.last_word(done.stderr) or f"tiered build: exit code {done.returncode}"
        if done.returncode != 0:
            log.warning("%s: %s", " ".join(command), done.stderr.strip())
            return False, said
        # "tiered build: wrote DIR. VERDICT": the verdict is what progress shows
        return True, said.removeprefix("tiered build: wrote ").partition(". ")[2] or said

    def _serve(self, spec: TieredModel, status: RolloutStatus, system: RunningSystem) -> None:
        """Make each tier's agents serve the wanted versions (plus, for a grace
        period, those the router's table had until just now)."""
        wanted = set(desired.served_versions(status))
        if time.monotonic() - self._table_written_at < TABLE_GRACE_S:
            wanted |= self._table_models.get(spec.name, set())
        if self._table is not None:  # what the table names now, until a new one replaces it
            route = (self._table.get("models") or {}).get(spec.name)
            wanted |= _table_versions(route)
        for tier in (t for t in TIERS if t in spec.tiers):
            repository = self.layout.repository(tier)
            versions = tuple(sorted(v for v in wanted
                                    if (repository / spec.name / str(v)).is_dir()))
            if not versions or self._served.get((tier, spec.name)) == versions:
                continue
            self._write_config(spec, tier, repository, versions)
            for agent in system.agents.get(tier, ()):
                stub = pb_grpc.GRPCInferenceServiceStub(self._channel(agent))
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=spec.name),
                                         timeout=LOAD_TIMEOUT_S, metadata=self._admin())
            self._served[(tier, spec.name)] = versions
            self.progress(f"{spec.name}: {tier} serves version"
                          f"{'s' if len(versions) > 1 else ''} "
                          f"{', '.join(map(str, versions))}")

    def _write_config(self, spec: TieredModel, tier: str, repository: Path,
                      versions: tuple[int, ...]) -> None:
        path = repository / spec.name / "config.yaml"
        config = dict(yaml.safe_load(path.read_text()) or {})
        batching = spec.tiers[tier].batching
        config["version_policy"] = {"specific": list(versions)}
        config["max_batch_size"] = batching.max_batch_size
        config["dynamic_batching"] = {**(config.get("dynamic_batching") or {}),
                                      "max_queue_delay_us": batching.max_queue_delay_us}
        write_atomically(path, yaml.safe_dump(config, sort_keys=False))

    def _write_table(self, models: Sequence[tuple[TieredModel, RolloutStatus]],
                     system: RunningSystem) -> None:
        if self._table is None and self.layout.routing_table.is_file():
            self._table = yaml.safe_load(self.layout.routing_table.read_text()) or {}
        previous = self._table or {"version": 0, "models": {}}
        table = desired.routing_table(previous.get("version", 0), models,
                                      desired.same_agents(system.agents))
        if table["models"] == previous.get("models"):
            return
        table["version"] = previous.get("version", 0) + 1
        write_atomically(self.layout.routing_table, yaml.safe_dump(table, sort_keys=False))
        self._table = table
        self._table_written_at = time.monotonic()
        for name, route in (previous.get("models") or {}).items():
            self._table_models[name] = _table_versions(route)

    def _write(self, record: Record, status: RolloutStatus | None,
               artifacts: Sequence[desired.ArtifactVersion], message: str) -> None:
        plain = None if status is None else to_plain(status)
        plain_artifacts = tuple(dataclasses.asdict(a) for a in artifacts)
        if (plain, plain_artifacts, message) == (record.status, record.artifacts,
                                                 record.message):
            return
        self.store.write_status(record.name, record.revision, status=plain,
                                artifacts=plain_artifacts, message=message)

    def _note(self, record: Record, message: str) -> None:
        if message != record.message:
            self.progress(f"{record.name}: {message}")
            try:
                self.store.write_status(record.name, record.revision, status=record.status,
                                        artifacts=record.artifacts, message=message)
            except Conflict:
                pass

    def _admin(self) -> tuple[tuple[str, str], ...]:
        token = self.layout.admin_token.read_text().strip()
        return (("authorization", f"Bearer {token}"),)



def _table_versions(route: Mapping[str, Any] | None) -> set[int]:
    """The versions one model's routing-table entry sends traffic to."""
    if not route:
        return set()
    return {v for tier in route["tiers"].values()
            for v in (tier.get("stable"), tier.get("canary")) if v}
