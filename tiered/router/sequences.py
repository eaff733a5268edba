"""Sequences through the router: every request of a sequence goes to the agent
its START went to, where the sequence's state lives (the agents' sequence
batcher, tiered.agent.sequences).

A request names a sequence by Triton's `sequence_id` parameter (an integer
or a string; 0 and "" name none). The pin is taken by the START's answer and
dropped by the END's; pins are bounded, the least recently used going first,
and one unused for `idle_s` is forgotten (the agent has long dropped the
sequence by then, and says so). Each router keeps its own pins: a client
sends a sequence through one router, as its gRPC channel does.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tiered.protocol import codec
from tiered.protocol import grpc_service_pb2 as pb
from tiered.router.policies import Candidate

IDLE_S = 600.0
MOST_PINS = 65_536


@dataclass(frozen=True)
class SequenceStep:
    key: tuple[str, int | str]  # (model, sequence id)
    start: bool
    end: bool


def sequence_step(request: pb.ModelInferRequest) -> SequenceStep | None:
    """The request's place in a sequence; None when it names none."""
    parameters = request.parameters
    if "sequence_id" not in parameters:
        return None
    sequence_id = codec.parameter_value(parameters["sequence_id"])
    if sequence_id in (0, "") or isinstance(sequence_id, bool):
        return None
    flags = {key: "sequence_" + key in parameters
             and codec.parameter_value(parameters["sequence_" + key]) is True
             for key in ("start", "end")}
    return SequenceStep((request.model_name, sequence_id), **flags)


class SequencePins:
    """The agent of each live sequence."""

    def __init__(self, idle_s: float = IDLE_S, most: int = MOST_PINS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s, self.most, self._clock = idle_s, most, clock
        self._pins: OrderedDict[tuple, tuple[Candidate, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def pinned(self, step: SequenceStep) -> Candidate | None:
        """Where a sequence's request goes; None for a START or a sequence not pinned."""
        found = None if step.start else self._pins.get(step.key)
        if found is None:
            return None
        candidate, used = found
        if self._clock() - used > self.idle_s:
            del self._pins[step.key]
            return None
        return candidate

    def answered(self, step: SequenceStep, candidate: Candidate) -> None:
        """After an answer: the sequence stays with `candidate`, or ends."""
        self._pins.pop(step.key, None)
        if step.end:
            return
        self._pins[step.key] = (candidate, self._clock())
        while len(self._pins) > self.most:
            self._pins.popitem(last=False)
