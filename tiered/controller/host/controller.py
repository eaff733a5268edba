"""`tiered controller --state DIR`: the host backend's controller, which
reconciles every model in the local system's store each pass."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from tiered.controller import plan
from tiered.controller.host.backend import HostBackend
from tiered.controller.host.state import RunningSystem, StateLayout
from tiered.controller.judge import RolloutJudge
from tiered.controller.reconciler import Reconciler
from tiered.controller.store import StateStore
from tiered.errors import Conflict, TieredError
from tiered.files import hold_shared_lock
from tiered.protocol.security import ChannelCache

log = logging.getLogger(__name__)


class HostController:
    """Reconciles every model in the store against the running local system."""

    def __init__(self, state_dir: Path, *, interval_s: float = 2.0,
                 clock: Callable[[], float] = time.time, seed: int = 0,
                 retire_grace_s: float = plan.RETIRE_GRACE_S,
                 progress: Callable[[str], None] | None = None,
                 max_builds: int | None = None) -> None:
        self.layout = StateLayout(Path(state_dir))
        self.store = StateStore(self.layout.store)
        self.interval_s = interval_s
        self.progress = progress or (lambda line: log.info("%s", line))
        self._channel = ChannelCache()  # loopback agents run --insecure
        self.backend = HostBackend(self.layout, self.store, self._channel, self.progress,
                                    max_builds=max_builds)
        self.reconciler = Reconciler(self.backend, RolloutJudge(self._channel, seed),
                                     clock=clock, progress=self.progress,
                                     retire_grace_s=retire_grace_s)

    def close(self) -> None:
        self.backend.close()
        self._channel.close()
        self.store.close()

    def run(self, stop: threading.Event) -> None:
        self.progress(f"controller: state in {self.layout.root}, every {self.interval_s:g} s")
        lock = hold_shared_lock(self.layout.controller_lock)  # the verbs see it runs
        try:
            while not stop.is_set():
                try:
                    self.reconcile_all()
                except TieredError as error:
                    self.progress(f"controller: {error}")
                stop.wait(self.interval_s)
        finally:
            os.close(lock)

    def reconcile_all(self) -> None:
        system = RunningSystem.read(self.layout.system)
        if system is None:
            raise TieredError(f"no running system in {self.layout.system}: start `tiered up`")
        self.backend.system = system
        records = self.store.list()
        self.backend.builds.keep_models(record.name for record in records)
        for record in records:
            try:
                self.reconciler.reconcile(record.name)
            except Conflict as error:
                self.progress(f"{record.name}: {error}")  # a verb wrote first: next pass
            except TieredError as error:
                self.progress(f"{record.name}: error: {error}")
            except grpc.RpcError as error:
                self.progress(f"{record.name}: an agent did not answer: "
                              f"{error.code().name} {error.details()}")
        self.backend.write_routing()  # also when no model is left
        self.backend.write_scale()
