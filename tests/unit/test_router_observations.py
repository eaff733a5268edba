"""The router's picture of its agents, and hint parsing: no processes needed."""

from __future__ import annotations

import pytest

from tiered.errors import InvalidArgument
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol.telemetry_messages import histogram_quantile
from tiered.router.hints import deadline, read_hints
from tiered.router.observations import Observer, telemetry_of


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stats(model="m", buckets=(10,), counts=(10,), queue=0, jpi=None, source="rapl",
          version="1") -> tpb.StatsResponse:
    version = tpb.VersionStats(
        model_name=model, model_version=version, inferences=sum(counts), queue_depth=queue,
        latency=tpb.Histogram(lowest_s=1e-3, growth=2.0, bucket=buckets, count=counts,
                              sum_s=0.01 * sum(counts)),
        compute=tpb.Histogram(lowest_s=1e-3, growth=2.0, bucket=buckets, count=counts,
                              sum_s=0.004 * sum(counts)))
    if jpi is not None:
        version.has_energy, version.joules_per_inference = True, jpi
        version.energy.source = source
    return tpb.StatsResponse(versions=[version])


def test_histogram_quantile_reads_bucket_midpoints():
    h = tpb.Histogram(lowest_s=1e-3, growth=2.0, bucket=[1, 3], count=[90, 10])
    assert histogram_quantile(h, 0.5) == pytest.approx(1e-3 * 2 ** 0.5)
    assert histogram_quantile(h, 0.95) == pytest.approx(1e-3 * 4 * 2 ** 0.5)
    assert histogram_quantile(tpb.Histogram(), 0.95) is None


def test_telemetry_gives_p95_service_time_energy_and_queue():
    figures, queues = telemetry_of(stats(queue=3, jpi=0.25), at=1.0)
    assert figures["m"].mean_s == pytest.approx(0.01)
    assert figures["m"].service_s == pytest.approx(0.004)
    assert figures["m"].joules_per_inference == 0.25 and figures["m"].energy_source == "rapl"
    assert queues == {"m": 3}
    figures, queues = telemetry_of(stats(buckets=(), counts=(), queue=1), at=1.0)
    assert figures == {} and queues == {"m": 1}  # an idle span keeps no figures


def test_versions_metered_by_different_sources_give_no_energy_figure():
    response = stats(jpi=0.25, source="model")
    response.versions.extend(stats(jpi=0.5, source="nvml", version="2").versions)
    figures, _ = telemetry_of(response, at=1.0)
    assert figures["m"].joules_per_inference is None and figures["m"].energy_source == ""
    response = stats(jpi=0.25, source="nvml")
    response.versions.extend(stats(jpi=0.5, source="nvml", version="2").versions)
    figures, _ = telemetry_of(response, at=1.0)
    assert figures["m"].joules_per_inference == pytest.approx(0.375)
    assert figures["m"].energy_source == "nvml"


def test_observer_folds_ewma_and_telemetry_into_an_observation():
    clock = Clock()
    observer = Observer(clock, stale_after_s=10, alpha=0.5)
    observer.record_latency("a:1", "m", 0.020)
    observer.record_latency("a:1", "m", 0.010)
    observer.record_stats("a:1", stats(queue=2, jpi=0.5))
    seen = observer.observe("a:1", "m")
    assert seen.ewma_s == pytest.approx(0.015)
    assert seen.rtt_s == pytest.approx(0.005)  # router EWMA minus the agent's mean
    assert seen.queue_depth == 2 and seen.joules_per_inference == 0.5
    assert seen.energy_source == "rapl"
    assert seen.predicted_p95_s() == pytest.approx(seen.p95_s + 2 * 0.004 + 0.005)
    clock.now += 11  # stale figures are forgotten, so the agent gets tried again
    assert observer.observe("a:1", "m").predicted_p95_s() is None


def test_in_flight_limit_and_forgetting_agents():
    observer = Observer(Clock())
    assert observer.try_acquire("a:1", 2) and observer.try_acquire("a:1", 2)
    assert not observer.try_acquire("a:1", 2)
    observer.release("a:1")
    assert observer.observe("a:1", "m").in_flight == 1
    observer.record_latency("b:1", "m", 0.01)
    observer.forget({"a:1"})
    assert observer.observe("b:1", "m").ewma_s is None


def test_hints_from_parameters_win_over_metadata():
    request = pb.ModelInferRequest(model_name="m")
    request.parameters["tiered-tier"].string_param = "edge"
    request.parameters["tiered-slo-ms"].int64_param = 20
    hints = read_hints("m", request.parameters,
                       [("tiered-tier", "datacenter"), ("tiered-key", "alice")])
    assert (hints.tier, hints.slo_ms, hints.key) == ("edge", 20.0, "alice")
    assert read_hints("m", {}, None).tier is None


@pytest.mark.parametrize("slo", ["fast", "-1", "0", "inf"])
def test_a_bad_slo_hint_is_invalid_argument(slo):
    with pytest.raises(InvalidArgument, match="tiered-slo-ms"):
        read_hints("m", {}, [("tiered-slo-ms", slo)])


def test_the_deadline_is_the_earliest_of_table_grpc_and_timeout_parameter():
    request = pb.ModelInferRequest(model_name="m")
    assert deadline(request.parameters, None, 30.0, now=100.0) == 130.0
    assert deadline(request.parameters, 2.0, 30.0, now=100.0) == 102.0
    request.parameters["timeout"].int64_param = 500_000  # Triton's: microseconds
    assert deadline(request.parameters, 2.0, 30.0, now=100.0) == 100.5
    request.parameters["timeout"].string_param = "soon"  # not a timeout: ignored
    assert deadline(request.parameters, None, 30.0, now=100.0) == 130.0


STRICT = {"metadata-true": ([("tiered-tier", "edge"), ("tiered-tier-strict", "true")], {}, True),
          "metadata-yes": ([("tiered-tier", "edge"), ("tiered-tier-strict", "Yes")], {}, True),
          "metadata-0": ([("tiered-tier", "edge"), ("tiered-tier-strict", "0")], {}, False),
          "bool-parameter": ([("tiered-tier", "edge")], {"tiered-tier-strict": True}, True),
          "absent": ([("tiered-tier", "edge")], {}, False)}


@pytest.mark.parametrize("metadata, parameters, strict", STRICT.values(), ids=STRICT)
def test_the_strict_hint_reads_as_a_boolean(metadata, parameters, strict):
    request = pb.ModelInferRequest(model_name="m")
    for key, value in parameters.items():
        request.parameters[key].bool_param = value
    hints = read_hints("m", request.parameters, metadata)
    assert (hints.tier, hints.strict) == ("edge", strict)


def test_a_bad_strict_hint_or_one_without_a_tier_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="tiered-tier-strict: expected true or false"):
        read_hints("m", {}, [("tiered-tier", "edge"), ("tiered-tier-strict", "maybe")])
    with pytest.raises(InvalidArgument, match="tiered-tier-strict: needs a tiered-tier hint"):
        read_hints("m", {}, [("tiered-tier-strict", "true")])


def generative(response: tpb.StatsResponse, ttft_counts=(8, 2), tokens=100, jpt=0.01,
               source="rapl", index=0) -> tpb.StatsResponse:
    """`response`'s version `index` with a Generation: TTFT buckets 4 and 6 (about 11 and 45 ms)."""
    generation = response.versions[index].generation
    generation.output_tokens = tokens
    generation.time_to_first_token.CopyFrom(tpb.Histogram(
        lowest_s=1e-3, growth=2.0, bucket=[4, 6], count=list(ttft_counts)))
    if jpt is not None:
        generation.joules_per_output_token = jpt
        response.versions[index].energy.source = source
    return response


def test_token_telemetry_gives_ttft_quantiles_and_joules_per_output_token():
    response = generative(stats(jpi=0.5))
    response.versions.extend(generative(stats(jpi=0.5, version="2"), tokens=300,
                                        jpt=0.03).versions)
    tokens = telemetry_of(response, at=1.0)[0]["m"].tokens
    assert tokens.ttft_p50_s == pytest.approx(1e-3 * 2 ** 3.5)
    assert tokens.ttft_p95_s == pytest.approx(1e-3 * 2 ** 5.5)
    assert tokens.joules_per_output_token == pytest.approx((0.01 * 100 + 0.03 * 300) / 400)
    assert tokens.energy_source == "rapl"
    # Sources that differ give no energy figure; a classifier has no token figures.
    mixed = generative(stats(jpi=0.5))
    mixed.versions.extend(generative(stats(jpi=0.5, version="2"), source="nvml").versions)
    assert telemetry_of(mixed, at=1.0)[0]["m"].tokens.joules_per_output_token is None
    assert telemetry_of(stats(jpi=0.5), at=1.0)[0]["m"].tokens is None
    # Generations under way, none finished in the span: the first tokens count.
    running = generative(stats(buckets=(), counts=()))
    assert telemetry_of(running, at=1.0)[0]["m"].tokens.ttft_p95_s == tokens.ttft_p95_s


def test_the_observer_carries_token_figures_into_the_observation():
    clock = Clock()
    observer = Observer(clock)
    observer.record_stats("a:1", generative(stats(jpi=0.5)))
    seen = observer.observe("a:1", "m")
    assert seen.ttft_p95_s == pytest.approx(1e-3 * 2 ** 5.5)
    assert seen.joules_per_output_token == 0.01 and seen.token_energy_source == "rapl"
    clock.now += 60  # stale: forgotten with the rest
    assert observer.observe("a:1", "m").ttft_p95_s is None
