"""The router's own inference statistics, in the shape of Triton's.

Per (model, version): requests answered and failed with their cumulative
time in the router (arrival to answer, upstream calls and failover
included), so that `tritonclient`'s `get_inference_statistics` and
`perf_analyzer` work through the router. What the router can honestly say
differs from an agent's in three ways, and the message says it the same way:

- the version is the one that answered (the agent's `model_version`); a
  failed request has no answering version and is counted under version "0";
- the router forwards whole requests and does not know a model's batching,
  so `inference_count` and `execution_count` both count answered requests;
- queueing and compute happen on the agents: those durations stay 0 here
  (each agent's own ModelStatistics has them).

Updated only from the router's event loop. Bounded: at most `max_rows`
(model, version) pairs; rows of models that leave the routing table are
dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tiered.protocol import grpc_service_pb2 as pb

MAX_ROWS = 4096
FAILED_VERSION = "0"  # where failures go: no version answered them


@dataclass
class Tally:
    success_count: int = 0
    success_s: float = 0.0
    fail_count: int = 0
    fail_s: float = 0.0
    last_at: float | None = None  # router clock of the last answer or failure


class RouterStatistics:
    def __init__(self, max_rows: int = MAX_ROWS) -> None:
        self.max_rows = max_rows
        self._rows: dict[tuple[str, str], Tally] = {}

    def _tally(self, model: str, version: str) -> Tally | None:
        tally = self._rows.get((model, version))
        if tally is None and len(self._rows) < self.max_rows:
            tally = self._rows[(model, version)] = Tally()
        return tally

    def succeeded(self, model: str, version: str, seconds: float, now: float) -> None:
        tally = self._tally(model, version)
        if tally is not None:
            tally.success_count += 1
            tally.success_s += seconds
            tally.last_at = now

    def failed(self, model: str, seconds: float, now: float) -> None:
        tally = self._tally(model, FAILED_VERSION)
        if tally is not None:
            tally.fail_count += 1
            tally.fail_s += seconds
            tally.last_at = now

    def keep_only(self, models: Iterable[str]) -> None:
        kept = set(models)
        for key in [k for k in self._rows if k[0] not in kept]:
            del self._rows[key]

    def messages(self, models: Iterable[str], version: str, now: float, wall_now: float
                 ) -> list[pb.ModelStatistics]:
        """Rows of `models` (every version, or just `version`), as Triton's
        ModelStatistics; `wall_now` (Unix seconds) dates `last_inference`."""
        wanted = set(models)
        out = []
        for (model, row_version), tally in sorted(self._rows.items()):
            if model not in wanted or (version and row_version != version):
                continue
            last_ms = 0 if tally.last_at is None else \
                int((wall_now - (now - tally.last_at)) * 1000)
            message = pb.ModelStatistics(
                name=model, version=row_version, last_inference=last_ms,
                inference_count=tally.success_count, execution_count=tally.success_count)
            message.inference_stats.success.count = tally.success_count
            message.inference_stats.success.ns = int(tally.success_s * 1e9)
            message.inference_stats.fail.count = tally.fail_count
            message.inference_stats.fail.ns = int(tally.fail_s * 1e9)
            out.append(message)
        return out
