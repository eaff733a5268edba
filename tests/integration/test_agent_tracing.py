"""An agent exporting traces over OTLP to a real (in-test) gRPC collector."""

from __future__ import annotations

import queue
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import add_generative, build_repository
from tests.generation import is_final, prompt_input
from tiered.local.processes import AgentProcess

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector():
    receiver = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"127.0.0.1:{port}"
    server.stop(0)


def test_traces_continue_the_callers_context_and_show_queue_and_engine(tmp_path, collector):
    receiver, endpoint = collector
    root = build_repository(tmp_path)
    agent = AgentProcess("edge", root, extra_args=[
        "--otlp-endpoint", endpoint, "--trace-base-rate", "1.0"],
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    headers = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}
    with agent, grpcclient.InferenceServerClient(agent.address) as client:
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            item = grpcclient.InferInput(name, [1, 16], "FP32")
            item.set_data_from_numpy(np.ones((1, 16), np.float32))
            inputs.append(item)
        client.infer("add_sub", inputs, headers=headers)
        with pytest.raises(InferenceServerException):
            client.infer("add_sub", inputs[:1])  # missing INPUT1: a failed request
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with receiver.lock:
                if len(receiver.spans) >= 4:
                    break
            time.sleep(0.1)
    spans = receiver.spans
    ours = [s for s in spans if s.trace_id.hex() == TRACE_ID]
    assert sorted(s.name for s in ours) == ["ModelInfer", "engine", "queue"]
    (server_span,) = [s for s in ours if s.name == "ModelInfer"]
    assert server_span.parent_span_id.hex() == "00f067aa0ba902b7"
    children = [s for s in ours if s.name != "ModelInfer"]
    assert all(c.parent_span_id == server_span.span_id for c in children)
    assert all(server_span.start_time_unix_nano <= c.start_time_unix_nano
               and c.end_time_unix_nano <= server_span.end_time_unix_nano for c in children)
    failed = [s for s in spans if s.trace_id.hex() != TRACE_ID and s.name == "ModelInfer"]
    assert len(failed) == 1 and failed[0].status.code == 2  # STATUS_CODE_ERROR


def test_a_streamed_generation_has_a_span_that_counts_its_tokens(tmp_path, collector,
                                                                 generative_model):
    receiver, endpoint = collector
    add_generative(tmp_path, "tiny", generative_model, {})
    agent = AgentProcess("edge", tmp_path, extra_args=[
        "--otlp-endpoint", endpoint, "--trace-base-rate", "1.0"],
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    with agent, grpcclient.InferenceServerClient(agent.address) as client:
        finals: queue.Queue = queue.Queue()
        client.start_stream(
            callback=lambda result, error: finals.put(error or is_final(result)),
            headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"})
        try:
            client.async_stream_infer("tiny", [prompt_input()], parameters={"max_tokens": 7})
            while (outcome := finals.get(timeout=60)) is not True:
                assert outcome is False, outcome  # an error
        finally:
            client.stop_stream()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
                s.name == "ModelStreamInfer" for s in list(receiver.spans)):
            time.sleep(0.1)
    (span,) = [s for s in receiver.spans if s.name == "ModelStreamInfer"]
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == "00f067aa0ba902b7"
    attributes = {a.key: a.value for a in span.attributes}
    assert attributes["tiered.output_tokens"].int_value == 7
    assert attributes["tiered.model"].string_value == "tiny"
    assert [e.name for e in span.events] == ["first token"]
    assert span.start_time_unix_nano < span.events[0].time_unix_nano < span.end_time_unix_nano
