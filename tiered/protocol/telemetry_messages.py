"""Conversions from telemetry summaries to `tiered.v1` messages. Pure.

Takes the telemetry values duck-typed (histograms with `counts`/`total_s`,
summaries with counts and histograms) so the protocol layer imports nothing
above it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from tiered.protocol import telemetry_pb2 as tpb


def histogram_message(histogram, lowest_s: float, growth: float) -> tpb.Histogram:
    nonzero = np.flatnonzero(histogram.counts)
    return tpb.Histogram(
        lowest_s=lowest_s,
        growth=growth,
        bucket=nonzero.tolist(),
        count=histogram.counts[nonzero].tolist(),
        sum_s=histogram.total_s,
    )


def version_stats(
    name: str, version: int, device: str, summary, energy, queue_depth: int, in_flight: int,
    lowest_s: float, growth: float,
) -> tpb.VersionStats:
    message = tpb.VersionStats(
        model_name=name,
        model_version=str(version),
        device=device,
        success=summary.success,
        failure=summary.failure,
        client_errors=summary.client_errors,
        inferences=summary.inferences,
        latency=histogram_message(summary.latency, lowest_s, growth),
        queue=histogram_message(summary.queue, lowest_s, growth),
        compute=histogram_message(summary.compute, lowest_s, growth),
        latency_samples_s=summary.samples,
        busy_s=summary.busy_s,
        queue_depth=queue_depth,
        in_flight=in_flight,
    )
    if energy is not None:
        message.has_energy = True
        message.energy.CopyFrom(tpb.Energy(source=energy.source, device=device,
                                           joules=energy.joules, idle_watts=energy.idle_watts))
        if energy.joules_per_inference is not None:
            message.joules_per_inference = energy.joules_per_inference
    return message


def device_shares(summary, energy, states: Mapping[str, tuple[str, int]]
                  ) -> list[tpb.DeviceShare]:
    """A version's part on each device: what it ran, its energy there, and
    (`states`: device -> (why it is down, restarts)) whether its engine is up."""
    by_device = energy.by_device if energy is not None else {}
    shares = []
    for device in sorted(set(summary.device_busy_s) | set(states)):
        down, restarts = states.get(device, ("", 0))
        share = tpb.DeviceShare(device=device, busy_s=summary.device_busy_s.get(device, 0.0),
                                inferences=summary.device_inferences.get(device, 0),
                                up=not down, down_reason=down, restarts=restarts)
        if device in by_device:
            share.joules = by_device[device]
        shares.append(share)
    return shares


def generation_stats(summary, energy, span_s: float, running: int, max_sequences: int,
                     lowest_s: float, growth: float) -> tpb.Generation:
    """A generative version's tokens over a span; J/token from its attributed energy."""
    message = tpb.Generation(
        output_tokens=summary.output_tokens,
        time_to_first_token=histogram_message(summary.first_token, lowest_s, growth),
        time_per_output_token=histogram_message(summary.per_token, lowest_s, growth),
        tokens_per_s=summary.output_tokens / span_s if span_s > 0 else 0.0,
        running=running,
        max_sequences=max_sequences,
    )
    if energy is not None and summary.output_tokens:
        message.joules_per_output_token = energy.joules / summary.output_tokens
    return message


def device_energy(used: Mapping) -> list[tpb.Energy]:
    """Each device's energy over the span; idle_watts absent while unknown."""
    return [tpb.Energy(source=e.source, device=device, joules=e.joules, idle_watts=e.idle_watts)
            for device, e in sorted(used.items())]


def histogram_quantile(histogram: tpb.Histogram, q: float) -> float | None:
    """The q-quantile in seconds of a sparse log histogram (bucket midpoints)."""
    total = sum(histogram.count)
    if total == 0:
        return None
    rank, seen = max(1, math.ceil(q * total)), 0
    for bucket, count in zip(histogram.bucket, histogram.count):
        seen += count
        if seen >= rank:
            return _bucket_midpoint_s(histogram, bucket)
    return None


def histogram_values(histogram: tpb.Histogram) -> tuple[tuple[float, int], ...]:
    """A sparse log histogram as (seconds, count) pairs, each bucket at its
    geometric midpoint (within half a bucket of every value in it)."""
    return tuple((_bucket_midpoint_s(histogram, bucket), int(count))
                 for bucket, count in zip(histogram.bucket, histogram.count) if count)


def _bucket_midpoint_s(histogram: tpb.Histogram, bucket: int) -> float:
    if bucket == 0:
        return histogram.lowest_s
    return histogram.lowest_s * histogram.growth ** (bucket - 1) * math.sqrt(histogram.growth)
