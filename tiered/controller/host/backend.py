"""The host backend: the Reconciler's adapter for agents run as processes on
this machine (the local system's; `tiered.local` starts them).

`tiered up` starts one agent per tier, the router and this controller as
child processes (see `tiered.local.supervisor`) and writes their addresses into
the state directory. Every pass reconciles each applied TieredModel with the
one Reconciler both backends share (`tiered.controller.reconciler`); this
module only observes and applies:

- a wanted version is built for each tier into that tier's model repository
  with `tiered build` in a process of its own, as the Kubernetes init
  container does (the artifact is checked against its sha256 first), in the
  background and a few at a time (`tiered.controller.host.builds`): the pass
  goes on, the version is Pending with what it waits for ("building, 12 s")
  and a later pass finds it built, or Refused with the build's verdict; it
  is Ready once the tier's agent serves it;
- the versions the plan keeps are loaded into each tier's agent (the
  repository's config.yaml names them, so a restarted controller knows what
  is loaded); a retired version is dropped from it;
- status and history live in the SQLite store, the routing table in a file
  the router re-reads, and each autoscaled tier's agents in `scale.json`,
  which `tiered up` follows (starting and stopping agents);
- while it runs, it holds a shared lock on `controller.lock`, which the
  kernel lets go however it ends, so the verbs can tell that none runs.

All progress lives in the store, so a restarted controller resumes the stage
where it was; only the stage's samples start afresh (the stage clock does not).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc
import yaml

from tiered import names
from tiered.controller import desired, plan
from tiered.controller.host.builds import LOADING, BuildKey, BuildRequest, Builds
from tiered.controller.host.state import RunningSystem, StateLayout
from tiered.controller.reconciler import Stored, readable_status, routed
from tiered.controller.store import StateStore
from tiered.errors import ConfigError, NotFound
from tiered.files import write_atomically
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
from tiered.protocol import routing
from tiered.rollout.snapshot import to_record
from tiered.rollout.spec import TieredModel
from tiered.rollout.status import ArtifactVersion, RolloutStatus
from tiered.rollout.wire import to_plain

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0


def _file_stamp(uri: str) -> tuple[int, int] | None:
    """Size and modification time of a local artifact file (a checkpoint
    directory's: its files' total size and latest time); None for a URI or a
    missing file."""
    try:
        path = Path(uri)
        if path.is_dir():
            stats = [file.stat() for file in path.rglob("*") if file.is_file()]
            return (sum(stat.st_size for stat in stats),
                    max((stat.st_mtime_ns for stat in stats), default=0))
        stat = path.stat()
    except (OSError, ValueError):
        return None
    return stat.st_size, stat.st_mtime_ns


class HostBackend:
    """Observes and applies for the Reconciler: builds, agents, store, table file."""

    def __init__(self, layout: StateLayout, store: StateStore,
                 channel: Callable[[str], grpc.Channel],
                 progress: Callable[[str], None], *, max_builds: int | None = None) -> None:
        self.layout = layout
        self.store = store
        self.channel = channel
        self.progress = progress
        self.system = RunningSystem({}, "")  # read afresh every pass
        self.builds = Builds(layout.builds, progress, max_builds=max_builds)

    def close(self) -> None:
        """Stop the builds still running."""
        self.builds.close()

    def read(self, name: str) -> Stored | None:
        try:
            record = self.store.get(name)
        except NotFound:
            return None
        return Stored(name, record.spec, record.status, record.generation, record.revision)

    def finalize(self, stored: Stored) -> None:
        """Nothing to do: a record removed from the store has no deletion
        marker to clear, and the next table leaves its routes out."""

    def settle(self, stored: Stored) -> Stored:
        """Never asked: the store keeps every model at the current API version
        and has no finalizers, so what it reads is settled."""
        return stored

    def prepare(self, spec: TieredModel, wanted: plan.Versions,
                replicas: Mapping[tuple[str, int], int]
                ) -> tuple[dict[tuple[str, int], plan.VersionState], frozenset[int]]:
        """Build what is missing, in the background: a version is Ready on a
        tier once the tier's agent serves it (its repository config names
        it), Pending while it builds or loads. A refused build is tried again
        only once its artifact file has changed (a build's verdict on the same
        bytes stands)."""
        by_version = {a.version: a for a in wanted.artifacts}
        self.builds.keep(spec.name, (BuildKey(spec.name, version, tier)
                                     for version in wanted.wanted for tier in self._tiers(spec)))
        self.builds.poll()
        states: dict[tuple[str, int], plan.VersionState] = {}
        for tier in self._tiers(spec):
            loaded = self._loaded(spec.name, tier)
            for version in wanted.wanted:
                states[(tier, version)] = self._state(spec, tier, by_version[version], loaded)
        present = frozenset(v for tier in self._tiers(spec)
                            for v in self._loaded(spec.name, tier))
        return states, present

    def _state(self, spec: TieredModel, tier: str, artifact: ArtifactVersion,
               loaded: Sequence[int]) -> plan.VersionState:
        repository = self.layout.repository(tier)
        if self._built(spec.name, tier, artifact.version):
            return plan.VersionState(plan.READY) if artifact.version in loaded else \
                plan.VersionState(plan.PENDING, LOADING)  # `apply` loads it
        command = (sys.executable, "-m", "tiered",
                   *desired.build_args(spec, tier, artifact, str(repository)), "--force")
        return self.builds.state(BuildRequest(BuildKey(spec.name, artifact.version, tier),
                                              command, _file_stamp(artifact.uri)))

    def _built(self, model: str, tier: str, version: int) -> bool:
        """Whether the version is in the tier's repository, its build over (a
        build renames its version into place, then writes a new model's
        config.yaml)."""
        model_dir = self.layout.repository(tier) / model
        return ((model_dir / str(version)).is_dir() and (model_dir / "config.yaml").is_file()
                and not self.builds.running(BuildKey(model, version, tier)))

    def agents(self, spec: TieredModel, rollout: RolloutStatus) -> Mapping[str, Sequence[str]]:
        return {tier: self.system.agents.get(tier, ()) for tier in self._tiers(spec)}

    def routers(self) -> Sequence[str]:
        return (self.system.router,) if self.system.router else ()

    def apply(self, spec: TieredModel, made: plan.Plan) -> None:
        """Each tier's agents serve the versions kept that are built there."""
        for tier in self._tiers(spec):
            repository = self.layout.repository(tier)
            versions = tuple(v for v in made.keep if self._built(spec.name, tier, v))
            if not versions or not self._write_config(spec, tier, repository, versions):
                continue
            for agent in self.system.agents.get(tier, ()):
                stub = pb_grpc.GRPCInferenceServiceStub(self.channel(agent))
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=spec.name),
                                         timeout=LOAD_TIMEOUT_S, metadata=self._admin())
            self.progress(f"{spec.name}: {tier} serves version"
                          f"{'s' if len(versions) > 1 else ''} "
                          f"{', '.join(map(str, versions))}")

    def _loaded(self, model: str, tier: str) -> tuple[int, ...]:
        """The versions the tier's repository config names (what its agent loads)."""
        try:
            config = yaml.safe_load((self.layout.repository(tier) / model /
                                     "config.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError):
            return ()
        specific = (config.get("version_policy") or {}).get("specific") or ()
        return tuple(sorted(int(v) for v in specific))

    def _write_config(self, spec: TieredModel, tier: str, repository: Path,
                      versions: tuple[int, ...]) -> bool:
        """The model's config.yaml with these versions and the spec's batching
        (one config serves every version here, where Kubernetes builds one per
        version); whether it changed. A generative model batches its sequences
        itself (the build's engine.max_sequences): no batching is written."""
        path = repository / spec.name / "config.yaml"
        before = dict(yaml.safe_load(path.read_text()) or {})
        batching = spec.tiers[tier].batching
        config = {**before, "version_policy": {"specific": list(versions)}}
        if not names.ModelKind(spec.kind).streams_tokens:
            config |= {"max_batch_size": batching.max_batch_size,
                       "dynamic_batching": {**(before.get("dynamic_batching") or {}),
                                            "max_queue_delay_us": batching.max_queue_delay_us}}
        if config == before:
            return False
        write_atomically(path, yaml.safe_dump(config, sort_keys=False))
        return True

    def write_status(self, stored: Stored, status) -> None:
        self.store.write_status(stored.name, stored.revision, status=to_plain(status))

    def record(self, spec: TieredModel, made: plan.Plan, now: float) -> None:
        if made.snapshot is not None:
            self.store.record(spec.name, to_record(made.snapshot), now)

    def write_routing(self) -> None:
        models = routed(Stored(r.name, r.spec, r.status, r.generation)
                        for r in self.store.list())
        path = self.layout.routing_table
        try:
            previous = routing.load_table(path) if path.is_file() else None
        except ConfigError:
            previous = None  # a table we cannot read is replaced
        table = desired.next_table(previous, models.models,
                                   desired.same_agents(self.system.agents), models.unreadable)
        if table is not None:
            write_atomically(path, routing.dump_table(table))

    def write_scale(self) -> None:
        """Agents per autoscaled tier, from every model's stored status (the
        most any model's autoscaling wants: a tier's agents serve every
        model), for `tiered up` to follow; unchanged, not written."""
        wanted: dict[str, int] = {}
        for record in self.store.list():
            stored = Stored(record.name, record.spec, record.status, record.generation)
            for tier, scale in readable_status(stored).scaling.items():
                wanted[tier] = max(wanted.get(tier, 0), scale.replicas)
        text = json.dumps(wanted, sort_keys=True)
        path = self.layout.scale
        if not path.is_file() or path.read_text() != text:
            write_atomically(path, text)

    def _admin(self) -> tuple[tuple[str, str], ...]:
        token = self.layout.admin_token.read_text().strip()
        return (("authorization", f"Bearer {token}"),)

    @staticmethod
    def _tiers(spec: TieredModel) -> list[str]:
        return [tier for tier in names.TIERS if tier in spec.tiers]


