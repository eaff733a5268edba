"""The sequence loop both layouts turn (the agent's worker thread, an engine
core process): admission in order up to the engine's slots, deadlines,
cancellation of waiting and running requests, and an engine that fails a
step, each said in one Turn."""

from __future__ import annotations

import math

import pytest

from tiered.agent.scheduler import Entry, SequenceLoop
from tiered.engines.generative.base import GenerativeEngine, Sampling, Token
from tiered.errors import DeadlineExceeded, EngineError, ResourceExhausted


class Counting(GenerativeEngine):
    """Each sequence says 100, 101, ... and ends at its max_tokens."""

    max_sequences, max_context = 2, 64

    def __init__(self) -> None:
        self.sequences: dict[int, list[int]] = {}  # id -> [tokens given, max_tokens]
        self.next_id = 0
        self.fail = False

    def encode(self, text):
        return [1]

    def decode(self, ids):
        return ""

    def start(self, prompt, sampling, visual=None):
        self.next_id += 1
        self.sequences[self.next_id] = [0, sampling.max_tokens]
        return self.next_id

    def step(self):
        if self.fail:
            raise RuntimeError("device lost")
        tokens = []
        for sequence, state in list(self.sequences.items()):
            state[0] += 1
            last = state[0] >= state[1]
            if last:
                del self.sequences[sequence]
            tokens.append(Token(sequence, 99 + state[0], -0.5, last))
        return tokens

    def stop(self, sequence):
        self.sequences.pop(sequence, None)

    @property
    def running(self):
        return len(self.sequences)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(key: int, max_tokens: int = 3, deadline: float = math.inf,
          admit_by: float = 10.0) -> Entry:
    return Entry(key, [1, 2], Sampling(max_tokens=max_tokens), 0.0, deadline, admit_by)


@pytest.fixture()
def clock() -> Clock:
    return Clock()


@pytest.fixture()
def engine() -> Counting:
    return Counting()


@pytest.fixture()
def loop(engine, clock) -> SequenceLoop:
    return SequenceLoop(engine, clock)


def test_requests_join_in_order_up_to_the_slots_and_leave_on_their_last_token(loop, engine):
    for key in (1, 2, 3):
        loop.add(entry(key, max_tokens=2))
    turn = loop.turn()
    assert [key for key, _ in turn.admitted] == [1, 2]  # two slots: 3 waits
    assert [(k, t, last) for k, t, _, last in turn.tokens] == [(1, 100, False),
                                                               (2, 100, False)]
    assert turn.stepped == 2 and turn.running == 2
    turn = loop.turn()
    assert [(k, last) for k, _, _, last in turn.tokens] == [(1, True), (2, True)]
    assert turn.running == 0 and loop.busy  # 3 still waits
    turn = loop.turn()
    assert [key for key, _ in turn.admitted] == [3] and turn.tokens[0][:2] == (3, 100)


def test_a_cancelled_request_leaves_at_once_waiting_or_running(loop, engine):
    for key in (1, 2, 3):
        loop.add(entry(key, max_tokens=10))
    loop.turn()
    loop.cancel(1)  # running: its slot is free for the next turn
    loop.cancel(3)  # waiting: it never starts
    loop.cancel(42)  # unknown: ignored
    assert len(engine.sequences) == 1
    turn = loop.turn()
    assert turn.admitted == () and [k for k, *_ in turn.tokens] == [2]
    assert turn.running == 1


def test_deadlines_end_running_sequences_and_waiting_ones_fail_to_find_a_slot(loop, clock):
    loop.add(entry(1, max_tokens=100, deadline=5.0))
    loop.add(entry(2, max_tokens=100))
    loop.add(entry(3, admit_by=2.0))
    loop.turn()
    clock.now = 3.0
    turn = loop.turn()
    [(key, error)] = turn.failed
    assert key == 3 and isinstance(error, ResourceExhausted)
    assert "no sequence slot came free in 3.00 s (2 of 2 sequences running" in str(error)
    clock.now = 5.0
    turn = loop.turn()
    [(key, error)] = turn.failed
    assert key == 1 and isinstance(error, DeadlineExceeded)
    assert "after 2 tokens" in str(error)
    assert [k for k, *_ in turn.tokens] == [2] and turn.running == 1


def test_a_failed_step_fails_its_sequences_and_the_loop_goes_on(loop, engine):
    loop.add(entry(1, max_tokens=10))
    loop.turn()
    engine.fail = True
    turn = loop.turn()
    [(key, error)] = turn.failed
    assert key == 1 and isinstance(error, EngineError) and "device lost" in str(error)
    assert turn.running == 0 and not loop.busy and not engine.sequences
    engine.fail = False
    loop.add(entry(2, max_tokens=1))
    turn = loop.turn()
    assert [(k, last) for k, _, _, last in turn.tokens] == [(2, True)]


def test_an_idle_turn_is_empty(loop):
    assert loop.turn().empty and not loop.busy
