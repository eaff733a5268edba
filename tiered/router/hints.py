"""What a request tells the router about itself: routing hints and deadline.

Hints travel as request `parameters` or gRPC metadata (`tiered-tier`,
`tiered-tier-strict`, `tiered-slo-ms`, `tiered-key`, `tiered-split`), so
plain v2 clients need none of them. Pure:
values in, a `RouteRequest` or a deadline out; the clock's reading is passed
in. Never forwards, chooses or counts anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from tiered import errors
from tiered.protocol import codec
from tiered.router import policies

HINTS = ("tiered-tier", "tiered-tier-strict", "tiered-slo-ms", "tiered-key", "tiered-split")
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def read_hints(model: str, parameters: Mapping, metadata: Sequence[tuple[str, str]] | None
               ) -> policies.RouteRequest:
    """Hints from request parameters, else gRPC metadata."""
    found: dict[str, object] = {}
    for key, value in metadata or ():
        if key in HINTS:
            found[key] = value
    if parameters:
        for key in HINTS:
            if key in parameters:
                found[key] = codec.parameter_value(parameters[key])
    if not found:  # most requests: no hint at all
        return policies.RouteRequest(model)
    slo = found.get("tiered-slo-ms")
    if slo is not None:
        try:
            slo = float(slo)
        except (TypeError, ValueError):
            raise errors.InvalidArgument(f"tiered-slo-ms: expected milliseconds, got {slo!r}"
                                         ) from None
        if not slo > 0 or math.isinf(slo):
            raise errors.InvalidArgument(f"tiered-slo-ms: expected > 0, got {slo!r}")
    tier, key = found.get("tiered-tier"), found.get("tiered-key")
    tier = None if tier in (None, "") else str(tier)
    strict = _boolean(found.get("tiered-tier-strict", False), "tiered-tier-strict")
    if strict and tier is None:
        raise errors.InvalidArgument("tiered-tier-strict: needs a tiered-tier hint naming the "
                                     "tier to keep to")
    split = found.get("tiered-split")
    return policies.RouteRequest(model=model, tier=tier, slo_ms=slo, strict=strict,
                                 key=None if key in (None, "") else str(key),
                                 split=None if split in (None, "") else _boolean(
                                     split, "tiered-split"))


def _boolean(value: object, field: str) -> bool:
    """A bool parameter, or metadata's text: true/false, 1/0, yes/no."""
    if isinstance(value, bool):
        return value
    found = _BOOLEANS.get(str(value).strip().lower())
    if found is None:
        raise errors.InvalidArgument(f"{field}: expected true or false, got {value!r}")
    return found


def deadline(parameters: Mapping, time_remaining: float | None, default_s: float,
             now: float) -> float:
    """The earliest of: the table's default, the gRPC deadline and Triton's
    `timeout` parameter (microseconds; anything else there is ignored)."""
    budget = default_s
    if time_remaining is not None:
        budget = min(budget, time_remaining)
    if parameters and "timeout" in parameters:
        timeout = codec.parameter_value(parameters["timeout"])
        if isinstance(timeout, int) and not isinstance(timeout, bool) and timeout > 0:
            budget = min(budget, timeout / 1e6)
    return now + budget


SHARED_MEMORY = ("tensors that name a shared-memory region are read by the agent the region "
                 "was registered with, on its own host; the router forwards over the network: "
                 "send such requests to that agent, or send the bytes to the router")


def refuse_shared_memory(request) -> None:
    """A tensor naming a shared-memory region cannot cross the router's hop."""
    for kind, tensors in (("inputs", request.inputs), ("outputs", request.outputs)):
        for index, tensor in enumerate(tensors):
            if codec.SHARED_MEMORY_REGION in tensor.parameters:
                raise errors.InvalidArgument(f"{kind}[{index}] {tensor.name!r}: "
                                             f"{SHARED_MEMORY}")
