"""`tiered top`: a live table of each agent's model versions, from tiered.v1.Telemetry.

Polls every agent's Stats RPC with the cursor it got last time, so each row
covers exactly the span since the previous refresh. J/inf is the version's
active energy (above its device's idle draw, shown as idle W) per inference,
beside its source; a version over several devices lists them, each engine
process that is down marked DOWN, and their idle draw summed. Generative versions add output tokens per second, time to
first token and time per output token (P50) and joules per output token (same
source); other versions show "-" there. Rendering is a pure function of the
responses; the loop around it is a thin adapter.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from tiered import names
from tiered.errors import ConfigError
from tiered.protocol import telemetry_messages
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc
from tiered.protocol.security import PLAINTEXT, TransportSecurity, channel

# err%: the failures the server caused, of the requests it answered or
# failed; client-err/s: requests refused for what the client sent, apart.
HEADERS = ("agent", "tier", "model", "ver", "dev", "req/s", "err%", "client-err/s",
           "p50 ms", "p95 ms", "p99 ms", "queue p50", "J/inf", "source", "idle W", "inflight",
           "queued", "tok/s", "ttft p50", "tpot p50", "J/tok", "running")
SOURCE = HEADERS.index("source")


quantile = telemetry_messages.histogram_quantile


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _devices(v: tpb.VersionStats) -> str:
    """Where a version runs; a device whose engine process is down says so."""
    if not v.devices:
        return v.device
    return ",".join(d.device if d.up else f"{d.device} DOWN" for d in v.devices)


def _idle_watts(v: tpb.VersionStats, idle: dict[str, float]) -> str:
    """Its devices' idle draw together; "-" while one is unknown."""
    devices = [d.device for d in v.devices] or [v.device]
    return f"{sum(idle[d] for d in devices):.3g}" if all(d in idle for d in devices) else "-"


def rows(address: str, response: tpb.StatsResponse) -> list[tuple[str, ...]]:
    span = max(response.end - response.start, 1e-9)
    idle = {d.device: d.idle_watts for d in response.devices if d.HasField("idle_watts")}
    table = []
    for v in response.versions:
        answered = v.success + v.failure
        table.append((
            address, response.tier, v.model_name, v.model_version, _devices(v),
            f"{v.success / span:.1f}",
            f"{100 * v.failure / answered:.1f}" if answered else "-",
            f"{v.client_errors / span:.1f}",
            _ms(quantile(v.latency, 0.5)), _ms(quantile(v.latency, 0.95)),
            _ms(quantile(v.latency, 0.99)), _ms(quantile(v.queue, 0.5)),
            f"{v.joules_per_inference:.4g}" if v.has_energy and v.inferences else "-",
            v.energy.source if v.has_energy else "-",
            _idle_watts(v, idle),
            str(v.in_flight), str(v.queue_depth),
            *_generation(v),
        ))
    return table


def _generation(v: tpb.VersionStats) -> tuple[str, ...]:
    if not v.HasField("generation"):
        return ("-",) * 5
    g = v.generation
    return (f"{g.tokens_per_s:.1f}", _ms(quantile(g.time_to_first_token, 0.5)),
            _ms(quantile(g.time_per_output_token, 0.5)),
            f"{g.joules_per_output_token:.4g}" if g.HasField("joules_per_output_token") else "-",
            f"{g.running}/{g.max_sequences}")


def render(table: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in table)) if table else len(h)
              for i, h in enumerate(HEADERS)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADERS, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in table]
    if any(r[SOURCE] == names.EnergySource.MODEL for r in table):
        lines.append("source model: CPU time x configured watts, an estimate, not a measurement")
    return "\n".join(lines)


@dataclass
class _Agent:
    address: str
    stub: tpb_grpc.TelemetryStub
    cursor: float = 0.0


def local_agents(state: Path) -> list[str]:
    """The agents `tiered up` started on the state directory, cheapest tier
    first, as it recorded them (system.json, also what the controller reads)."""
    from tiered.controller.host.state import RunningSystem, StateLayout

    path = StateLayout(Path(state)).system
    try:
        system = RunningSystem.read(path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{path}: unreadable: {error}") from None
    addresses = [] if system is None else [
        address for tier in sorted(system.agents, key=_tier_order)
        for address in system.agents[tier]]
    if not addresses:
        raise ConfigError(f"no agent address given and no local system in {state} "
                          "(`tiered up -f FILE` starts one; or give agents as HOST:PORT, "
                          "or --state DIR)")
    return addresses


def _tier_order(tier: str) -> int:
    return names.TIERS.index(tier) if tier in names.TIERS else len(names.TIERS)


def run(addresses: Sequence[str], interval_s: float = 2.0, once: bool = False,
        model: str = "", transport: TransportSecurity = PLAINTEXT,
        unanswered: str = "") -> int:
    """Poll and show the agents; `unanswered`: a line for stderr when none answers."""
    agents = [_Agent(a, tpb_grpc.TelemetryStub(channel(a, transport))) for a in addresses]
    while True:
        table, errors = [], []
        for agent in agents:
            try:
                response = agent.stub.Stats(
                    tpb.StatsRequest(model_name=model, cursor=agent.cursor), timeout=5)
            except grpc.RpcError as error:
                errors.append(f"{agent.address}: {error.code().name}: {error.details()}")
                continue
            agent.cursor = response.end
            table.extend(rows(agent.address, response))
        if not once:
            sys.stdout.write("\x1b[2J\x1b[H")  # clear the terminal, cursor home
        print(render(table))
        for line in errors:
            print(line, file=sys.stderr)
        if unanswered and len(errors) == len(agents):
            print(unanswered, file=sys.stderr)
        if once:
            return 1 if errors and not table else 0
        time.sleep(interval_s)
