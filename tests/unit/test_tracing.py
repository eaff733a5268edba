from __future__ import annotations

import random

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode, set_span_in_context

from tiered.telemetry.tracing import TailSampler, context_from_metadata

MS = 1_000_000


def tracer_with(base_rate: float):
    exporter = InMemorySpanExporter()
    sampler = TailSampler(SimpleSpanProcessor(exporter), base_rate, random.Random(0))
    provider = TracerProvider()
    provider.add_span_processor(sampler)
    return provider.get_tracer("test"), exporter, sampler


def request(tracer, latency_ms: float, failed: bool = False, start: int = 10**18) -> None:
    root = tracer.start_span("ModelInfer", start_time=start)
    child = tracer.start_span("engine", context=set_span_in_context(root),
                              start_time=start + MS)
    child.end(end_time=start + 2 * MS)
    if failed:
        root.set_status(Status(StatusCode.ERROR, "bad input"))
    root.end(end_time=start + int(latency_ms * MS))


def test_failed_requests_are_kept_with_all_their_spans():
    tracer, exporter, sampler = tracer_with(base_rate=0.0)
    request(tracer, latency_ms=3, failed=True)
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["ModelInfer", "engine"]
    assert (sampler.kept, sampler.dropped) == (1, 0)


def test_fast_successful_requests_follow_the_base_rate():
    tracer, exporter, sampler = tracer_with(base_rate=0.0)
    for _ in range(50):
        request(tracer, latency_ms=0.05)  # p = max(0, 0.00005)
    assert exporter.get_finished_spans() == () and sampler.dropped == 50


def test_slow_requests_are_kept_in_proportion_to_latency():
    tracer, exporter, sampler = tracer_with(base_rate=0.0)
    for _ in range(20):
        request(tracer, latency_ms=1500)  # p = 1 from one second on
    for _ in range(400):
        request(tracer, latency_ms=200)  # p = 0.2
    assert sampler.kept - 20 in range(50, 111)  # 80 expected


def test_trace_context_comes_from_grpc_metadata():
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    context = context_from_metadata([("traceparent", traceparent), ("bin-bin", b"\x00")])
    tracer, exporter, _ = tracer_with(base_rate=1.0)
    span = tracer.start_span("ModelInfer", context=context)
    span.end()
    (finished,) = exporter.get_finished_spans()
    assert f"{finished.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert finished.parent.is_remote
