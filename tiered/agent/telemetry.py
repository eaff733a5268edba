"""The agent's telemetry: energy meters read each slot, and the Stats RPC.

`TelemetryHub` owns the energy ledger and the task that marks it at every
slot boundary, with each device's engine busy time since the last mark (so
the ledger learns the devices' idle draw); `TelemetryServicer` answers
`tiered.v1.Telemetry/Stats` from the versions' recorders and the ledger.
Everything runs on the agent's event loop, the recorders' only writer, so
reads need no locks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import grpc

from tiered.agent.generative import GenerativeVersion
from tiered.agent.repository import ModelRepository
from tiered.protocol import telemetry_messages
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc
from tiered.protocol.status import translate_errors
from tiered.telemetry import energy as meters
from tiered.telemetry.histogram import GROWTH, LOWEST_S
from tiered.telemetry.recorder import (
    SLOT_S,
    WINDOW_S,
    EnergyLedger,
    Summary,
    VersionEnergy,
    energy_per_version,
    slot_start,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """What happened over [start, end): per version, and per device."""

    start: float
    end: float
    summaries: dict[tuple[str, int], Summary]
    devices: dict[tuple[str, int], tuple[str, ...]]
    energy: dict[tuple[str, int], VersionEnergy]
    used: dict[str, meters.DeviceEnergy]


class TelemetryHub:
    def __init__(self, repository: ModelRepository, meters_by_device: Mapping,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.repository = repository
        self.instance = uuid.uuid4().hex  # tells readers a restarted agent from this one
        self.ledger = EnergyLedger(meters_by_device)
        self.clock = clock
        self._task: asyncio.Task | None = None

    @classmethod
    def for_this_machine(cls, repository: ModelRepository) -> TelemetryHub:
        """CPU energy always (RAPL or modeled); GPU energy where NVML answers, per
        device of the pool (else of GPU 0, as "cuda"); a CPU stand-in's modeled
        from its engine processes' CPU time."""
        found = {"cpu": meters.cpu_meter()}
        pool = repository.devices
        for device in pool.devices:
            meter = (meters.gpu_meter(device.visible) if device.gpu else
                     meters.ModeledCpuMeter(cpu_seconds=partial(pool.cpu_seconds, device.name)))
            if meter is not None:
                found[device.name] = meter
        if not any(d.gpu for d in pool.devices):
            gpu = meters.gpu_meter(0)
            if gpu is not None:
                found["cuda"] = gpu
        for device, meter in found.items():
            log.info("energy of %s from %s", device, meter.source)
        return cls(repository, found)

    def start(self) -> None:
        self.ledger.mark(slot_start(self.clock()))
        self._task = asyncio.get_running_loop().create_task(self._mark_each_slot())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _mark_each_slot(self) -> None:
        while True:
            now = self.clock()
            await asyncio.sleep(slot_start(now) + SLOT_S - now)
            at, since = slot_start(self.clock()), self.ledger.last_mark
            self.ledger.mark(at, None if since is None else self.busy_by_device(since, at))

    def busy_by_device(self, start: float, end: float) -> dict[str, float]:
        """Engine busy seconds per device over whole slots in [start, end); inf
        where a version keeps no recorder (it may have run: no idle sample)."""
        busy: dict[str, float] = {}
        for served in self.repository.all_versions():
            ran = ({d: math.inf for d in served.devices} if served.recorder is None
                   else served.recorder.busy_by_device(start, end))
            for device, seconds in ran.items():
                busy[device] = busy.get(device, 0.0) + seconds
        return busy

    def snapshot(self, cursor: float = 0.0, model: str = "", version: str = "") -> Snapshot:
        end = slot_start(self.clock())
        start = max(cursor, end - WINDOW_S) if cursor else end - WINDOW_S
        summaries, devices = {}, {}
        for served in self.repository.all_versions():
            if served.recorder is None:
                continue
            if model and served.config.name != model:
                continue
            if version and str(served.version) != version:
                continue
            key = (served.config.name, served.version)
            summaries[key] = served.recorder.since(start, end)
            devices[key] = served.devices
        used = self.ledger.used(start, end)
        return Snapshot(start, end, summaries, devices, energy_per_version(used, summaries), used)


def _lane_states(served) -> dict[str, tuple[str, int]]:
    """Per device of a version: why it is down ("" while up) and its restarts."""
    return {lane.device: (lane.down, lane.restarts) for lane in getattr(served, "lanes", ())}


class TelemetryServicer(tpb_grpc.TelemetryServicer):
    def __init__(self, hub: TelemetryHub) -> None:
        self.hub = hub

    @translate_errors
    async def Stats(self, request, context):
        snap = self.hub.snapshot(request.cursor, request.model_name, request.model_version)
        versions = {(v.config.name, v.version): v for v in self.hub.repository.all_versions()}
        response = tpb.StatsResponse(
            tier=self.hub.repository.profile.tier, start=snap.start, end=snap.end,
            window_s=WINDOW_S, devices=telemetry_messages.device_energy(snap.used),
            instance=self.hub.instance,
        )
        for key, summary in sorted(snap.summaries.items()):
            served = versions[key]
            stats = telemetry_messages.version_stats(
                key[0], key[1], ",".join(snap.devices[key]), summary, snap.energy.get(key),
                served.queue_depth, served.in_flight, LOWEST_S, GROWTH,
            )
            stats.devices.extend(telemetry_messages.device_shares(
                summary, snap.energy.get(key), _lane_states(served)))
            if isinstance(served, GenerativeVersion):
                stats.generation.CopyFrom(telemetry_messages.generation_stats(
                    summary, snap.energy.get(key), snap.end - snap.start, served.running,
                    served.engine.max_sequences, LOWEST_S, GROWTH))
            response.versions.append(stats)
        return response

    async def Agreement(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "an agent keeps no shadow agreement: ask the router")
