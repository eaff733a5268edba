"""Prometheus `/metrics` for an agent.

Triton's `nv_inference_*` names where the meaning is the same (cumulative
counts and microseconds per model version), plus tiered's own: energy per
device and its idle draw, each with its source, active joules per inference
and latency quantiles over the recent window. The collector reads everything
on the agent's event loop (the only writer) and serves it from
prometheus_client's HTTP thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tiered.agent.telemetry import TelemetryHub

log = logging.getLogger(__name__)

# (metric suffix, InferenceStats field, help)
_DURATIONS = (
    ("request_duration_us", "success", "Cumulative time requests took, in microseconds"),
    ("queue_duration_us", "queue", "Cumulative time requests waited in the queue"),
    ("compute_input_duration_us", "compute_input", "Cumulative time merging inputs"),
    ("compute_infer_duration_us", "compute_infer", "Cumulative time in the engine"),
    ("compute_output_duration_us", "compute_output", "Cumulative time splitting outputs"),
)
_QUANTILES = (0.5, 0.95, 0.99)
RECENT_S = 10.0  # joules per inference and quantiles cover this much recent time


class AgentCollector:
    def __init__(self, hub: TelemetryHub, loop: asyncio.AbstractEventLoop) -> None:
        self.hub = hub
        self.loop = loop

    def collect(self) -> Iterator[Metric]:
        future = asyncio.run_coroutine_threadsafe(self._families(), self.loop)
        yield from future.result(timeout=10)

    async def _families(self) -> list[Metric]:
        tier = self.hub.repository.profile.tier
        labels = ["model", "version", "tier"]

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=labels)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=[*labels, *extra])

        success = counter("nv_inference_request_success", "Successful inference requests")
        failure = counter("nv_inference_request_failure", "Failed inference requests")
        count = counter("nv_inference_count", "Inferences performed (batch elements)")
        executions = counter("nv_inference_exec_count", "Batches the engine executed")
        durations = [(counter(f"nv_inference_{suffix}", doc), field)
                     for suffix, field, doc in _DURATIONS]
        pending = gauge("nv_inference_pending_request_count", "Requests waiting in the queue")
        in_flight = gauge("tiered_in_flight_requests", "Requests being answered")
        latency = gauge("tiered_request_latency_seconds",
                        f"Request latency quantiles over the last {RECENT_S:.0f} s",
                        ("quantile",))
        per_inference = gauge("tiered_joules_per_inference",
                              f"Active energy (above the device's idle draw) per inference "
                              f"over the last {RECENT_S:.0f} s; source model: an estimate",
                              ("source",))
        snap = self.hub.snapshot(cursor=self.hub.clock() - RECENT_S)
        for served in self.hub.repository.all_versions():
            key = (served.config.name, served.version)
            values = [served.config.name, str(served.version), tier]
            stats = served.stats
            success.add_metric(values, stats.success.count)
            failure.add_metric(values, stats.fail.count)
            count.add_metric(values, stats.inference_count)
            executions.add_metric(values, stats.execution_count)
            for family, field in durations:
                family.add_metric(values, getattr(stats, field).ns / 1000)
            pending.add_metric(values, served.queue_depth)
            in_flight.add_metric(values, served.in_flight)
            summary = snap.summaries.get(key)
            if summary is not None and summary.latency.count:
                for q in _QUANTILES:
                    latency.add_metric([*values, str(q)], summary.latency.quantile(q))
            energy = snap.energy.get(key)
            if energy is not None and energy.joules_per_inference is not None:
                per_inference.add_metric([*values, energy.source], energy.joules_per_inference)
        device_labels = ["device", "source", "tier"]
        total = CounterMetricFamily("tiered_energy_joules", "Energy used since start, per device",
                                    labels=device_labels)
        idle = GaugeMetricFamily("tiered_idle_watts", "A device's idle draw: measured (nvml, "
                                 "rapl) or the model's configured watts (model)",
                                 labels=device_labels)
        for device, meter in sorted(self.hub.ledger.meters.items()):
            reading = meter.read()
            total.add_metric([device, reading.source, tier], reading.joules)
            watts = self.hub.ledger.idle[device].watts
            if watts is not None:
                idle.add_metric([device, reading.source, tier], watts)
        return [success, failure, count, executions, *(f for f, _ in durations), pending,
                in_flight, latency, per_inference, total, idle]


def serve_metrics(hub: TelemetryHub, host: str, port: int) -> int:
    """Start `/metrics` on its own thread; return the port it listens on."""
    registry = CollectorRegistry()
    registry.register(AgentCollector(hub, asyncio.get_running_loop()))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_port
