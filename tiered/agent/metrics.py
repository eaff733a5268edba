"""Prometheus `/metrics` for an agent.

Triton's names, exactly (`nv_inference_request_success` ... with no `_total`
suffix, labels `model` and `version`, plus `tier`), so Triton's dashboards
and alerts work; request, queue and compute times as histograms in seconds,
which sum across replicas; and tiered's own: energy per device and its idle
draw, each with its source, and active joules per inference over the recent
window; for generative versions, time to first token and time per output
token as histograms, output tokens, running sequences and joules per output
token; for vision-language versions, the visual tokens their vision stage
kept and dropped (pruning and the cap: label `kept`); for ensembles, each step's time and failures (labels `step`, its index,
and `step_model`). Everything is read on the agent's event loop (the only
writer) and served from the exposition's HTTP thread.
"""

from __future__ import annotations

import asyncio
import logging

from tiered.agent.feed import FeedServer
from tiered.agent.generative import GenerativeVersion
from tiered.agent.telemetry import TelemetryHub
from tiered.telemetry import exposition
from tiered.telemetry.exposition import Family

log = logging.getLogger(__name__)

# (Triton's metric, InferenceStats field, help)
_DURATIONS = (
    ("nv_inference_request_duration_us", "success",
     "Cumulative inference request duration in microseconds"),
    ("nv_inference_queue_duration_us", "queue", "Cumulative inference queuing duration in "
     "microseconds"),
    ("nv_inference_compute_input_duration_us", "compute_input",
     "Cumulative compute input duration in microseconds (merging a batch)"),
    ("nv_inference_compute_infer_duration_us", "compute_infer",
     "Cumulative compute inference duration in microseconds"),
    ("nv_inference_compute_output_duration_us", "compute_output",
     "Cumulative inference compute output duration in microseconds (splitting a batch)"),
)
# (metric, InferenceStats histogram, help)
_HISTOGRAMS = (
    ("tiered_request_duration_seconds", "request_seconds",
     "Successful requests' time in the agent, from arrival to answer"),
    ("tiered_queue_duration_seconds", "queue_seconds",
     "Successful requests' time waiting for a batch"),
    ("tiered_compute_duration_seconds", "compute_seconds",
     "Successful requests' batch compute time: merge, engine and split"),
)
# (metric, TokenStats histogram, help), for generative versions
_TOKEN_HISTOGRAMS = (
    ("tiered_time_to_first_token_seconds", "first_token_seconds",
     "Generation requests' time from arrival to their first token (queue and prefill in it)"),
    ("tiered_time_per_output_token_seconds", "per_output_token_seconds",
     "Time between two consecutive output tokens of one sequence"),
)
RECENT_S = 10.0  # joules per inference cover this much recent time
TRITON_NAMES = (
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
    "nv_inference_exec_count", *(name for name, _, _ in _DURATIONS),
    "nv_inference_pending_request_count",
)


async def families(hub: TelemetryHub, feed: FeedServer | None = None) -> list[Family]:
    tier = hub.repository.profile.tier
    success = Family("nv_inference_request_success", "counter",
                     "Number of successful inference requests, all batch sizes")
    failure = Family("nv_inference_request_failure", "counter",
                     "Number of failed inference requests, all batch sizes")
    count = Family("nv_inference_count", "counter",
                   "Number of inferences performed (batch elements)")
    executions = Family("nv_inference_exec_count", "counter",
                        "Number of model executions performed (batches)")
    durations = [(Family(name, "counter", doc), field) for name, field, doc in _DURATIONS]
    pending = Family("nv_inference_pending_request_count", "gauge",
                     "Instantaneous number of pending requests awaiting execution")
    histograms = [(Family(name, "histogram", doc), field) for name, field, doc in _HISTOGRAMS]
    in_flight = Family("tiered_in_flight_requests", "gauge", "Requests being answered")
    per_inference = Family(
        "tiered_joules_per_inference", "gauge",
        f"Active energy (above the device's idle draw) per inference over the last "
        f"{RECENT_S:.0f} s; source nvml or rapl: measured, model: an estimate")
    token_histograms = [(Family(name, "histogram", doc), field)
                        for name, field, doc in _TOKEN_HISTOGRAMS]
    output_tokens = Family("tiered_output_tokens_total", "counter",
                           "Output tokens generated and sent")
    running = Family("tiered_running_sequences", "gauge",
                     "Sequences in a generative engine's running batch")
    per_token = Family(
        "tiered_energy_joules_per_output_token", "gauge",
        f"Active energy (above the device's idle draw) per output token over the last "
        f"{RECENT_S:.0f} s; source nvml or rapl: measured, model: an estimate")
    engine_up = Family("tiered_engine_up", "gauge",
                       "1 while a version's engine process on a device takes requests, 0 "
                       "while it is down (restarting, or its device gone)")
    restarts = Family("tiered_engine_restarts_total", "counter",
                      "Times a version's engine process on a device was restarted")
    live_sequences = Family("tiered_live_sequences", "gauge",
                            "Sequences a sequence-batched model holds state for")
    sequence_ends = Family("tiered_sequences_total", "counter",
                           "Sequences of a sequence-batched model, by how they went: started, "
                           "ended (by a request's END), expired (idle past the limit)")
    visual_tokens = Family("tiered_visual_tokens_total", "counter",
                           "Visual tokens the vision stage made of the images it encoded: "
                           "kept (read by the decoder) or not (dropped by pruning or the "
                           "cap, generation.vision)")
    step_seconds = Family("tiered_ensemble_step_duration_seconds", "histogram",
                          "An ensemble's calls of one step, from the step's start to its "
                          "answer (the step model's queue and compute in it)")
    step_failures = Family("tiered_ensemble_step_failures_total", "counter",
                           "An ensemble's calls of one step that failed")
    snap = hub.snapshot(cursor=hub.clock() - RECENT_S)
    for served in hub.repository.all_versions():
        labels = {"model": served.config.name, "version": str(served.version), "tier": tier}
        stats = served.stats
        success.add(labels, stats.success.count)
        failure.add(labels, stats.fail.count)
        count.add(labels, stats.inference_count)
        executions.add(labels, stats.execution_count)
        for family, field in durations:
            family.add(labels, getattr(stats, field).ns / 1000)
        for family, field in histograms:
            family.add_histogram(labels, getattr(stats, field))
        pending.add(labels, served.queue_depth)
        in_flight.add(labels, served.in_flight)
        for lane in getattr(served, "lanes", ()):
            if lane.own_process:
                engine_up.add({**labels, "device": lane.device}, 0 if lane.down else 1)
                restarts.add({**labels, "device": lane.device}, lane.restarts)
        sequences = getattr(served, "sequences", None)
        if sequences is not None:
            live_sequences.add(labels, len(sequences))
            for outcome in ("started", "ended", "expired"):
                sequence_ends.add({**labels, "outcome": outcome}, getattr(sequences, outcome))
        for index, step in enumerate(getattr(served, "step_stats", ())):
            step_labels = {**labels, "step": str(index), "step_model": step.model}
            step_seconds.add_histogram(step_labels, step.seconds)
            step_failures.add(step_labels, step.failures)
        energy = snap.energy.get((served.config.name, served.version))
        if energy is not None and energy.joules_per_inference is not None:
            per_inference.add({**labels, "source": energy.source}, energy.joules_per_inference)
        if isinstance(served, GenerativeVersion):
            for family, field in token_histograms:
                family.add_histogram(labels, getattr(served.tokens, field))
            output_tokens.add(labels, served.tokens.output_tokens)
            if served.vision is not None:
                visual_tokens.add({**labels, "kept": "true"}, served.vision.kept)
                visual_tokens.add({**labels, "kept": "false"}, served.vision.dropped)
            running.add(labels, served.running)
            recent = snap.summaries.get((served.config.name, served.version))
            if energy is not None and recent is not None and recent.output_tokens:
                per_token.add({**labels, "source": energy.source},
                              energy.joules / recent.output_tokens)
    total = Family("tiered_energy_joules_total", "counter",
                   "Energy used since start, per device; source nvml or rapl: measured, "
                   "model: an estimate")
    idle = Family("tiered_idle_watts", "gauge", "A device's idle draw: measured (nvml, rapl) "
                  "or the model's configured watts (model)")
    for device, meter in sorted(hub.ledger.meters.items()):
        reading = meter.read()
        labels = {"device": device, "source": reading.source, "tier": tier}
        total.add(labels, reading.joules)
        watts = hub.ledger.idle[device].watts
        if watts is not None:
            idle.add(labels, watts)
    fed = []
    if feed is not None:  # the agent's front ends feed its engine process
        requests = Family("tiered_front_end_requests_total", "counter",
                          "Inference requests the front ends passed to the engine process, "
                          "by frame: batch (checked, placed and answered in the front end, "
                          "the engine sees only the batch's bytes), single (the engine "
                          "handles the request) or stream (a generative model's: the "
                          "engine sends its tokens, the front end builds the responses)")
        frames = Family("tiered_front_end_frames_total", "counter",
                        "Frames the front ends sent the engine process, by kind")
        for kind in feed.requests:
            requests.add({"frame": kind, "tier": tier}, feed.requests[kind])
            frames.add({"frame": kind, "tier": tier}, feed.frames[kind])
        fed = [requests, frames]
    return [success, failure, count, executions, *(f for f, _ in durations), pending,
            *(f for f, _ in histograms), in_flight, per_inference,
            *(f for f, _ in token_histograms), output_tokens, running, per_token, engine_up,
            restarts, live_sequences, sequence_ends, visual_tokens, step_seconds, step_failures, total, idle,
            *fed]


def serve_metrics(hub: TelemetryHub, host: str, port: int, feed: FeedServer | None = None,
                  ) -> int:
    """Start `/metrics` on its own thread; return the port it listens on."""
    loop = asyncio.get_running_loop()

    def collect() -> list[Family]:
        return asyncio.run_coroutine_threadsafe(families(hub, feed), loop).result(timeout=10)

    return exposition.serve(collect, host, port).server_port
