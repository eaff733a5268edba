"""Per model-version token counters of a generative model, cumulative since
start (for Prometheus): time to first token, time per output token and
output tokens (a request's wait for a sequence slot is its queue time, in
InferenceStats). Updated only from the agent's event loop. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered.telemetry.histogram import CumulativeHistogram


@dataclass
class TokenStats:
    # From a request's arrival to its first token (its queue and prefill in it).
    first_token_seconds: CumulativeHistogram = field(default_factory=CumulativeHistogram)
    # Between two consecutive tokens of one sequence.
    per_output_token_seconds: CumulativeHistogram = field(default_factory=CumulativeHistogram)
    output_tokens: int = 0

    def token(self, seconds_since_previous: float, first: bool) -> None:
        """One output token; `seconds_since_previous`: since arrival for the first."""
        self.output_tokens += 1
        (self.first_token_seconds if first else self.per_output_token_seconds).observe(
            seconds_since_previous)
