"""What the router knows of each agent: its own measurements and the agents'.

Two sources, folded into `AgentObservation` values for the policies:
the router's EWMA of the latency of calls it forwarded (and its in-flight
counts, which are also the backpressure limit), and each agent's
`tiered.v1.Telemetry/Stats` (recent P95, queue depth, service time, joules
per inference and their source; for a generative model also time to first
token and joules per output token from its `Generation`), read by
`TelemetryPoller` with a cursor. For a model split across tiers, the
router's EWMAs of each image path it took (whole on a tier, or split) too. The clock is
injected. Figures older than `stale_after_s` are forgotten, so a tier that
was slow once is tried again rather than shunned forever. This module never
chooses a route and never imports agent code.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc

from tiered.protocol import telemetry_messages
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc
from tiered.router import policies

log = logging.getLogger(__name__)

EWMA_ALPHA = 0.2  # weight of the newest forwarded call's latency
STALE_AFTER_S = 10.0
POLL_INTERVAL_S = 1.0
POLL_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class AgentTelemetry:
    """One agent's figures for one model over its last non-empty span."""

    at: float  # router clock when they were read
    p95_s: float | None
    mean_s: float | None
    service_s: float | None
    joules_per_inference: float | None
    energy_source: str = ""  # of joules_per_inference: nvml, rapl or model
    tokens: TokenFigures | None = None  # a generative model's, once it made a first token


@dataclass(frozen=True)
class TokenFigures:
    """A generative model's figures over the span: its time to first token
    (arrival at the agent to the first token, slot wait included) and joules
    per output token with their source."""

    ttft_p50_s: float
    ttft_p95_s: float
    joules_per_output_token: float | None = None
    energy_source: str = ""  # of joules_per_output_token


def merge_histograms(histograms: Sequence[tpb.Histogram]) -> tpb.Histogram:
    """One histogram of several of the same bucket layout (one agent's versions)."""
    merged: dict[int, int] = {}
    for histogram in histograms:
        for bucket, count in zip(histogram.bucket, histogram.count, strict=False):
            merged[bucket] = merged.get(bucket, 0) + count
    out = tpb.Histogram()
    if histograms:
        out.lowest_s, out.growth = histograms[0].lowest_s, histograms[0].growth
    out.bucket.extend(sorted(merged))
    out.count.extend(merged[b] for b in sorted(merged))
    return out


def token_figures(versions: Sequence[tpb.VersionStats]) -> TokenFigures | None:
    """TTFT p50/p95 and J/output token of one model's generative versions
    (None when none made a first token in the span). Versions metered by
    different sources give no energy figure."""
    started = [v for v in versions
               if v.HasField("generation") and sum(v.generation.time_to_first_token.count)]
    if not started:
        return None
    ttft = merge_histograms([v.generation.time_to_first_token for v in started])
    metered = [v for v in started if v.generation.HasField("joules_per_output_token")
               and v.generation.output_tokens]
    sources = {v.energy.source for v in metered}
    tokens = sum(v.generation.output_tokens for v in metered) if len(sources) == 1 else 0
    p50 = telemetry_messages.histogram_quantile(ttft, 0.5)
    p95 = telemetry_messages.histogram_quantile(ttft, 0.95)
    assert p50 is not None and p95 is not None  # the histogram has counts
    return TokenFigures(
        ttft_p50_s=p50, ttft_p95_s=p95,
        joules_per_output_token=(sum(v.generation.joules_per_output_token
                                     * v.generation.output_tokens for v in metered) / tokens
                                 if tokens else None),
        energy_source=sources.pop() if tokens else "")


def telemetry_of(response: tpb.StatsResponse, at: float) -> tuple[dict[str, AgentTelemetry],
                                                                 dict[str, int]]:
    """Per model: the span's figures (only models that answered in it) and the
    queue depth now (every model the agent serves)."""
    figures: dict[str, AgentTelemetry] = {}
    queues: dict[str, int] = {}
    by_model: dict[str, list[tpb.VersionStats]] = {}
    for version in response.versions:
        by_model.setdefault(version.model_name, []).append(version)
    for model, versions in by_model.items():
        queues[model] = sum(v.queue_depth for v in versions)
        tokens = token_figures(versions)
        answered = [v for v in versions if sum(v.latency.count)]
        if not answered:
            if tokens is not None:  # generations under way, none finished in the span
                figures[model] = AgentTelemetry(at, None, None, None, None, tokens=tokens)
            continue
        latency = merge_histograms([v.latency for v in answered])
        count = sum(latency.count)
        compute_count = sum(sum(v.compute.count) for v in answered)
        metered = [v for v in answered
                   if v.has_energy and v.inferences and v.joules_per_inference > 0]
        sources = {v.energy.source for v in metered}
        if len(sources) > 1:  # versions on devices metered differently: no one figure
            metered = []
        inferences = sum(v.inferences for v in metered)
        figures[model] = AgentTelemetry(
            at=at,
            p95_s=telemetry_messages.histogram_quantile(latency, 0.95),
            mean_s=sum(v.latency.sum_s for v in answered) / count,
            service_s=(sum(v.compute.sum_s for v in answered) / compute_count
                       if compute_count else None),
            joules_per_inference=(sum(v.joules_per_inference * v.inferences for v in metered)
                                  / inferences if inferences else None),
            energy_source=sources.pop() if inferences else "",
            tokens=tokens,
        )
    return figures, queues


class Observer:
    """The router's running picture of its agents. One event loop writes it."""

    def __init__(self, clock: Callable[[], float], stale_after_s: float = STALE_AFTER_S,
                 alpha: float = EWMA_ALPHA) -> None:
        self.clock = clock
        self.stale_after_s = stale_after_s
        self.alpha = alpha
        self._ewma: dict[tuple[str, str], tuple[float, float]] = {}  # -> (seconds, at)
        self._telemetry: dict[tuple[str, str], AgentTelemetry] = {}
        self._queues: dict[tuple[str, str], int] = {}
        # model -> path -> (first response EWMA, vision call EWMA or None, at)
        self._paths: dict[str, dict[policies.ImagePath, tuple[float, float | None, float]]] = {}
        self.in_flight: dict[str, int] = {}

    # Backpressure: counted here because the policies rank by the same load.
    def try_acquire(self, agent: str, limit: int) -> bool:
        current = self.in_flight.get(agent, 0)
        if current >= limit:
            return False
        self.in_flight[agent] = current + 1
        return True

    def release(self, agent: str) -> None:
        self.in_flight[agent] = max(0, self.in_flight.get(agent, 1) - 1)

    def record_latency(self, agent: str, model: str, seconds: float) -> None:
        key = (agent, model)
        previous = self._ewma.get(key)
        now = self.clock()
        if previous is None or now - previous[1] > self.stale_after_s:
            self._ewma[key] = (seconds, now)
        else:
            self._ewma[key] = (previous[0] + self.alpha * (seconds - previous[0]), now)

    def record_image_path(self, model: str, path: policies.ImagePath, first_s: float,
                          vision_s: float | None = None) -> None:
        """An image request of `model` took `path`: its stream's first response
        came `first_s` after it was sent; a split's vision call took `vision_s`."""
        paths = self._paths.setdefault(model, {})
        previous = paths.get(path)
        now = self.clock()
        if previous is None or now - previous[2] > self.stale_after_s:
            paths[path] = (first_s, vision_s, now)
            return
        first, vision, _ = previous

        def blend(old: float | None, new: float | None) -> float | None:
            if old is None or new is None:
                return new if old is None else old
            return old + self.alpha * (new - old)

        paths[path] = (first + self.alpha * (first_s - first), blend(vision, vision_s), now)

    def image_paths(self, model: str, now: float | None = None
                    ) -> dict[policies.ImagePath, policies.PathObservation]:
        """What is known of each image path of `model`, stale figures left out."""
        if now is None:
            now = self.clock()
        return {path: policies.PathObservation(first, vision)
                for path, (first, vision, at) in self._paths.get(model, {}).items()
                if now - at <= self.stale_after_s}

    def keep_models(self, models: Iterable[str]) -> None:
        """Drop the image paths of models that left the routing table."""
        kept = set(models)
        for model in [m for m in self._paths if m not in kept]:
            del self._paths[model]

    def record_stats(self, agent: str, response: tpb.StatsResponse) -> None:
        figures, queues = telemetry_of(response, self.clock())
        for model, value in figures.items():
            self._telemetry[(agent, model)] = value
        for (address, model) in [k for k in self._queues if k[0] == agent]:
            if model not in queues:
                del self._queues[(address, model)]
        for model, depth in queues.items():
            self._queues[(agent, model)] = depth

    def forget(self, keep: Iterable[str]) -> None:
        """Drop agents that left the routing table (bounded memory)."""
        kept = set(keep)
        for table in (self._ewma, self._telemetry, self._queues):
            for key in [k for k in table if k[0] not in kept]:
                del table[key]
        for agent in [a for a, n in self.in_flight.items() if a not in kept and n == 0]:
            del self.in_flight[agent]

    def observe(self, agent: str, model: str, now: float | None = None
                ) -> policies.AgentObservation:
        if now is None:
            now = self.clock()
        ewma = self._ewma.get((agent, model))
        ewma_s = ewma[0] if ewma and now - ewma[1] <= self.stale_after_s else None
        figures = self._telemetry.get((agent, model))
        if figures is not None and now - figures.at > self.stale_after_s:
            figures = None
        rtt = 0.0
        if figures is not None and ewma_s is not None and figures.mean_s is not None:
            rtt = max(0.0, ewma_s - figures.mean_s)
        return policies.AgentObservation(
            p95_s=figures.p95_s if figures else None,
            service_s=figures.service_s if figures else None,
            queue_depth=self._queues.get((agent, model), 0),
            rtt_s=rtt,
            ewma_s=ewma_s,
            joules_per_inference=figures.joules_per_inference if figures else None,
            energy_source=figures.energy_source if figures else "",
            in_flight=self.in_flight.get(agent, 0),
            **(_token_observation(figures.tokens) if figures and figures.tokens else {}),
        )

    def snapshot(self, agents: Iterable[str], model: str
                 ) -> dict[str, policies.AgentObservation]:
        now = self.clock()  # one reading for every agent of the snapshot
        return {agent: self.observe(agent, model, now) for agent in agents}


def _token_observation(tokens: TokenFigures) -> dict:
    return {"ttft_p50_s": tokens.ttft_p50_s, "ttft_p95_s": tokens.ttft_p95_s,
            "joules_per_output_token": tokens.joules_per_output_token,
            "token_energy_source": tokens.energy_source}


Resolve = Callable[[str], Awaitable[Sequence[str]]]


async def pods_behind(address: str) -> tuple[str, ...]:
    """HOST:PORT of every address a name resolves to (each pod of a headless
    Service); an IP address, or a name that does not resolve, as it is."""
    host, _, port = address.rpartition(":")
    bare = host.strip("[]")
    try:
        ipaddress.ip_address(bare)
        return (address,)
    except ValueError:
        pass
    try:
        found = await asyncio.get_running_loop().getaddrinfo(bare, port,
                                                             type=socket.SOCK_STREAM)
    except OSError as error:
        log.debug("telemetry: %s does not resolve: %s", bare, error)
        return (address,)
    ips = sorted({info[4][0] for info in found})
    return tuple(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips) or (address,)


def merged(responses: Iterable[tpb.StatsResponse]) -> tpb.StatsResponse:
    """One response for the pods behind one address: their versions side by
    side (`telemetry_of` sums histograms, queues and joules across them); a
    process reached at two addresses counts once."""
    combined, seen = tpb.StatsResponse(), set()
    for response in responses:
        if response.instance and response.instance in seen:
            continue
        seen.add(response.instance)
        combined.versions.extend(response.versions)
        combined.end = max(combined.end, response.end)
    return combined


class TelemetryPoller:
    """Reads the Stats of every agent in the routing table each interval, from
    where it left off: of every pod behind an address that names several (a
    headless Service on Kubernetes), each with its own cursor, folded into
    one observation of the address."""

    def __init__(self, observer: Observer, dial: Callable[[str], grpc.aio.Channel],
                 agents: Callable[[], Iterable[str]], interval_s: float = POLL_INTERVAL_S,
                 resolve: Resolve = pods_behind) -> None:
        self.observer = observer
        self.dial = dial  # a channel to one pod
        self.agents = agents
        self.interval_s = interval_s
        self.resolve = resolve
        self._cursors: dict[str, tuple[str, float]] = {}  # pod -> (instance, cursor)
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def poll_once(self) -> None:
        agents = list(self.agents())
        pods = await asyncio.gather(*(self.resolve(agent) for agent in agents))
        reached = tuple(dict.fromkeys(pod for behind in pods for pod in behind))
        for pod in [p for p in self._channels if p not in reached]:
            await self._channels.pop(pod).close(grace=1)
        self._cursors = {p: c for p, c in self._cursors.items() if p in reached}
        replies = await asyncio.gather(*(self._poll(pod) for pod in reached))
        by_pod = dict(zip(reached, replies, strict=True))
        for agent, behind in zip(agents, pods, strict=True):
            answered = [by_pod[pod] for pod in behind if by_pod[pod] is not None]
            if answered:
                self.observer.record_stats(agent, merged(answered))

    async def _poll(self, pod: str) -> tpb.StatsResponse | None:
        channel = self._channels.get(pod)
        if channel is None:
            channel = self._channels[pod] = self.dial(pod)
        instance, cursor = self._cursors.get(pod, ("", 0.0))
        try:
            response = await tpb_grpc.TelemetryStub(channel).Stats(
                tpb.StatsRequest(cursor=cursor), timeout=POLL_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            log.debug("telemetry of %s: %s", pod, error.code().name)
            return None
        if instance and response.instance != instance:
            # Another process now answers at this address: its clock, a fresh cursor.
            self._cursors[pod] = (response.instance, 0.0)
            return None
        self._cursors[pod] = (response.instance, response.end)
        return response

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(grace=1)
        self._channels.clear()

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # a poll never stops the router
                log.exception("telemetry poll failed")
            await asyncio.sleep(self.interval_s)
