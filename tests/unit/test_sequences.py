"""The sequence batcher's bookkeeping (tiered.agent.sequences), on a fake clock:
the controls a request gets, state carried over, order, bounds and idling.
The agent serving it through tritonclient: tests/integration/test_sequences.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tiered.agent.sequences import (
    Control,
    SequenceBatching,
    SequenceFlags,
    Sequences,
    StateTensor,
)
from tiered.errors import ConfigError, InvalidArgument, ResourceExhausted

CONFIG = SequenceBatching(
    max_sequence_idle_us=1_000_000, max_sequences=2,
    controls=(Control("START", "start", "INT32"), Control("END", "end", "BOOL"),
              Control("READY", "ready", "FP32", (-1.0, 2.0)),
              Control("CORRID", "corrid", "BYTES")),
    states=(StateTensor("S_IN", "S_OUT", "FP32", (3,)),))


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


async def step(sequences, flags, rows=2, output=None):
    async with sequences.turn(flags, rows) as (fed, keep):
        keep({"S_OUT": output if output is not None else fed["S_IN"] + 1})
        return fed


def test_a_request_gets_its_controls_and_the_state_its_sequence_left():
    sequences = Sequences("m", CONFIG, batched=True, clock=Clock())
    first = asyncio.run(step(sequences, SequenceFlags(7, start=True)))
    assert first["START"].tolist() == [[1], [1]] and first["START"].dtype == np.int32
    assert first["END"].tolist() == [[False], [False]]
    assert first["READY"].tolist() == [[2.0], [2.0]]
    assert first["CORRID"].tolist() == [[b"7"], [b"7"]]
    np.testing.assert_array_equal(first["S_IN"], np.zeros((2, 3), np.float32))
    second = asyncio.run(step(sequences, SequenceFlags(7, end=True)))
    assert second["START"].tolist() == [[0], [0]] and second["END"].tolist() == [[True], [True]]
    np.testing.assert_array_equal(second["S_IN"], np.ones((2, 3), np.float32))
    assert len(sequences) == 0 and (sequences.started, sequences.ended) == (1, 1)


def test_an_unbatched_model_gets_controls_without_a_batch_dimension():
    sequences = Sequences("m", CONFIG, batched=False, clock=Clock())
    fed = asyncio.run(step(sequences, SequenceFlags("a", start=True), rows=1))
    assert fed["START"].shape == (1,) and fed["S_IN"].shape == (3,)


def test_a_sequences_requests_run_one_at_a_time_in_arrival_order():
    sequences = Sequences("m", CONFIG, batched=True, clock=Clock())
    ran = []

    async def request(index: int, flags: SequenceFlags) -> None:
        async with sequences.turn(flags, 1) as (fed, keep):
            ran.append(("in", index))
            await asyncio.sleep(0.01 * (3 - index))  # the first holds longest
            keep({"S_OUT": fed["S_IN"] + index})
            ran.append(("out", index))

    async def main() -> None:
        await asyncio.gather(request(0, SequenceFlags(1, start=True)),
                             *(request(i, SequenceFlags(1)) for i in (1, 2)))

    asyncio.run(main())
    assert ran == [("in", 0), ("out", 0), ("in", 1), ("out", 1), ("in", 2), ("out", 2)]


def test_bounds_idling_and_refusals():
    clock = Clock()
    sequences = Sequences("m", CONFIG, batched=True, clock=clock)
    with pytest.raises(InvalidArgument, match="non-zero or non-empty correlation ID"):
        asyncio.run(step(sequences, None))
    with pytest.raises(InvalidArgument, match="START flag"):
        asyncio.run(step(sequences, SequenceFlags(3)))
    for sequence_id in (1, 2):
        asyncio.run(step(sequences, SequenceFlags(sequence_id, start=True)))
    with pytest.raises(ResourceExhausted, match="2 sequences are live"):
        asyncio.run(step(sequences, SequenceFlags(3, start=True)))
    asyncio.run(step(sequences, SequenceFlags(1, start=True)))  # a START restarts, in place
    clock.now += 1.5  # both idle past the limit
    asyncio.run(step(sequences, SequenceFlags(3, start=True)))
    assert sequences.expired == 2 and len(sequences) == 1
    with pytest.raises(InvalidArgument, match="START flag"):
        asyncio.run(step(sequences, SequenceFlags(1)))
    with pytest.raises(InvalidArgument, match="holds"):  # the batch size changed mid-sequence
        asyncio.run(step(sequences, SequenceFlags(3), rows=1))


@pytest.mark.parametrize("parameters, expected", [
    ({}, None), ({"sequence_id": 0}, None), ({"sequence_id": ""}, None),
    ({"sequence_id": 5, "sequence_start": True}, SequenceFlags(5, start=True)),
    ({"sequence_id": "abc", "sequence_end": True}, SequenceFlags("abc", end=True)),
])
def test_flags_from_request_parameters(parameters, expected):
    assert SequenceFlags.of(parameters) == expected


@pytest.mark.parametrize("parameters, words", [
    ({"sequence_id": 1.5}, "an integer or a string"),
    ({"sequence_id": 1, "sequence_start": 1}, "sequence_start: a boolean"),
])
def test_malformed_flags_are_refused(parameters, words):
    with pytest.raises(InvalidArgument, match=words):
        SequenceFlags.of(parameters)


@pytest.mark.parametrize("build, words", [
    (lambda: Control("X", "begin", "INT32"), "kind"),
    (lambda: Control("X", "start", "INT64"), "start takes one of INT32, FP32, BOOL"),
    (lambda: Control("X", "corrid", "FP32"), "corrid takes one of"),
    (lambda: StateTensor("a", "b", "FP32", (-1,)), "fixed sizes"),
    (lambda: SequenceBatching(strategy="fastest"), "strategy"),
    (lambda: SequenceBatching(controls=(Control("X", "start", "INT32"),),
                              states=(StateTensor("X", "Y", "INT32", (1,)),)), "filled twice"),
])
def test_bad_settings_are_config_errors(build, words):
    with pytest.raises(ConfigError, match=words):
        build()
