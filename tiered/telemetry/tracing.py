"""OpenTelemetry tracing with a tail sampler: kept or dropped when the request ends.

Spans of a trace are held until its local root span ends; then `sampling.decide`
keeps every failed request, slow ones by latency, and the rest at a base rate,
and only kept traces reach the exporter. Context travels in gRPC metadata as
W3C `traceparent`, so a router's (or any client's) trace continues in the
agent. Tracing is off unless configured: then no span is made at all.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import StatusCode

from tiered.telemetry.sampling import decide

MAX_OPEN_TRACES = 10_000  # traces whose root has not ended; the oldest are dropped beyond
MAX_SPANS_PER_TRACE = 256


@dataclass(frozen=True)
class TracingSettings:
    base_rate: float = 0.01  # share of fast, successful requests kept
    otlp_endpoint: str = ""  # e.g. "localhost:4317"; empty: tracing off


class TailSampler(SpanProcessor):
    """Buffers each trace's ended spans; on the local root's end, keeps or drops them."""

    def __init__(self, downstream: SpanProcessor, base_rate: float,
                 rng: random.Random | None = None) -> None:
        self.downstream = downstream
        self.base_rate = base_rate
        self._rng = rng or random.Random()
        self._open: OrderedDict[int, list[ReadableSpan]] = OrderedDict()
        self._lock = threading.Lock()  # spans end on the loop and on engine threads
        self.kept = self.dropped = 0

    def on_start(self, span, parent_context=None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        trace_id = span.context.trace_id
        is_local_root = span.parent is None or span.parent.is_remote
        with self._lock:
            spans = self._open.setdefault(trace_id, [])
            if len(spans) < MAX_SPANS_PER_TRACE:
                spans.append(span)
            while len(self._open) > MAX_OPEN_TRACES:
                self._open.popitem(last=False)
            if not is_local_root:
                return
            spans = self._open.pop(trace_id)
            failed = span.status.status_code is StatusCode.ERROR
            latency_ms = (span.end_time - span.start_time) / 1e6
            keep = decide(failed, latency_ms, self.base_rate, self._rng.random()).keep
            if keep:
                self.kept += 1
            else:
                self.dropped += 1
        if keep:
            for kept in spans:
                self.downstream.on_end(kept)

    def shutdown(self) -> None:
        self.downstream.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.downstream.force_flush(timeout_millis)


def configure(service_name: str, settings: TracingSettings,
              exporter: SpanExporter | None = None) -> trace.Tracer | None:
    """A tracer exporting kept traces over OTLP (or to `exporter`); None when off."""
    if exporter is None:
        if not settings.otlp_endpoint:
            return None
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint, insecure=True)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(TailSampler(BatchSpanProcessor(exporter), settings.base_rate))
    return provider.get_tracer("tiered")


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None):
    """The caller's trace context from gRPC metadata (W3C traceparent), if any."""
    carrier: Mapping[str, str] = {
        key: value for key, value in (metadata or ()) if isinstance(value, str)
    }
    return extract(carrier)
