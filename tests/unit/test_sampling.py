from __future__ import annotations

import pytest

from tiered.telemetry.sampling import decide


@pytest.mark.parametrize(
    "case, failed, latency_ms, base, u, keep, probability, reason",
    [
        ("a failure is always kept", True, 1.0, 0.0, 0.999, True, 1.0, "error"),
        ("100 ms is kept one time in ten", False, 100.0, 0.01, 0.05, True, 0.1, "latency"),
        ("... and not the other nine", False, 100.0, 0.01, 0.2, False, 0.1, "latency"),
        ("from 1 s on, always", False, 1500.0, 0.0, 0.999, True, 1.0, "latency"),
        ("fast requests fall to the base rate", False, 2.0, 0.05, 0.04, True, 0.05, "base rate"),
        ("base rate zero keeps no fast request", False, 0.0, 0.0, 0.0, False, 0.0, "base rate"),
    ],
)
def test_trace_sampling(case, failed, latency_ms, base, u, keep, probability, reason):
    decision = decide(failed, latency_ms, base, u)
    assert (decision.keep, decision.reason) == (keep, reason), case
    assert decision.probability == pytest.approx(probability), case
