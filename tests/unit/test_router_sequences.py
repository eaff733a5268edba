"""The router's sequence pins (tiered.router.sequences) on a fake clock."""

from __future__ import annotations

from tiered.protocol import codec
from tiered.protocol import grpc_service_pb2 as pb
from tiered.router.policies import Candidate
from tiered.router.sequences import SequencePins, SequenceStep, sequence_step

A, B = Candidate("edge", "a:1", 1), Candidate("edge", "b:1", 1)


def request(**parameters) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m")
    for key, value in parameters.items():
        codec.set_parameter(message.parameters[key], value)
    return message


def test_a_request_names_its_sequence_by_tritons_parameters():
    assert sequence_step(request()) is None
    assert sequence_step(request(sequence_id=0)) is None
    assert sequence_step(request(sequence_id="")) is None
    assert sequence_step(request(sequence_id=5, sequence_start=True)) == \
        SequenceStep(("m", 5), start=True, end=False)
    assert sequence_step(request(sequence_id="x", sequence_end=True)) == \
        SequenceStep(("m", "x"), start=False, end=True)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pins_follow_start_and_end_and_are_bounded_and_forgotten_when_idle():
    clock = Clock()
    pins = SequencePins(idle_s=10, most=2, clock=clock)
    start, step, end = (SequenceStep(("m", 1), s, e)
                        for s, e in ((True, False), (False, False), (False, True)))
    assert pins.pinned(start) is None
    pins.answered(start, A)
    assert pins.pinned(step) == A
    assert pins.pinned(start) is None  # a START is ranked afresh
    pins.answered(start, B)
    assert pins.pinned(step) == B
    pins.answered(end, B)
    assert pins.pinned(step) is None and len(pins) == 0
    for sequence in (1, 2, 3):  # the least recently used goes first
        pins.answered(SequenceStep(("m", sequence), True, False), A)
    assert len(pins) == 2 and pins.pinned(SequenceStep(("m", 1), False, False)) is None
    clock.now = 11
    assert pins.pinned(SequenceStep(("m", 3), False, False)) is None  # idle past the limit
