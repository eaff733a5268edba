"""The pure parts of generative serving: request parsing, incremental
detokenization and stop strings."""

from __future__ import annotations

import numpy as np
import pytest

from tiered.agent.generation import Detokenizer, StopText, TextSide, parse_request
from tiered.errors import InvalidArgument

PROMPT = {"text_input": np.array([b"hello"], dtype=object)}


def test_parameters_and_input_tensors_both_set_sampling():
    request = parse_request(PROMPT, {"max_tokens": 5, "temperature": 0.5, "stop": "x"}, "m")
    assert (request.sampling.max_tokens, request.sampling.temperature) == (5, 0.5)
    assert request.stop == ("x",)
    tensors = {**PROMPT, "top_p": np.array([0.5], np.float32), "seed": np.array([7], np.uint64),
               "stop": np.array([b"a", b"bc"], dtype=object)}
    request = parse_request(tensors, {}, "m")
    assert (request.sampling.top_p, request.sampling.seed, request.stop) == (0.5, 7, ("a", "bc"))


@pytest.mark.parametrize(("inputs", "parameters", "named"), [
    (PROMPT, {"max_tokens": 0}, "max_tokens"),
    (PROMPT, {"max_tokens": 2.5}, "max_tokens"),
    (PROMPT, {"temperature": -1.0}, "temperature"),
    (PROMPT, {"temperature": float("nan")}, "temperature"),
    (PROMPT, {"top_p": 1.5}, "top_p"),
    (PROMPT, {"seed": -1}, "seed"),
    (PROMPT, {"stop": [""]}, "stop"),
    (PROMPT, {"stop": ["s"] * 9}, "stop"),
    ({}, {}, "inputs"),
    ({**PROMPT, "max_tokens": np.array([3], np.int32)}, {"max_tokens": 3}, "max_tokens"),
    ({**PROMPT, "extra": np.array([1])}, {}, "inputs"),
    ({"text_input": np.array([b"a", b"b"], dtype=object)}, {}, "text_input"),
    ({"text_input": np.array([1.0], np.float32)}, {}, "text_input"),
])
def test_bad_requests_name_their_field(inputs, parameters, named):
    with pytest.raises(InvalidArgument, match=named):
        parse_request(inputs, parameters, "m")


# A byte-level vocabulary: token i is one byte; decoding drops a trailing
# incomplete character as U+FFFD, as byte-level tokenizers do.
VOCAB = {i: bytes([i]) for i in range(256)}


def decode(ids):
    return b"".join(VOCAB[i] for i in ids).decode(errors="replace")


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    detokenizer = Detokenizer(decode)
    pieces = [detokenizer.add(b) for b in "aé€b".encode()]
    assert pieces == ["a", "", "é", "", "", "€", "b"]
    assert "".join(pieces) + detokenizer.flush() == "aé€b"


def test_bytes_that_never_make_a_character_are_sent_after_a_few_tokens():
    detokenizer = Detokenizer(decode)
    pieces = [detokenizer.add(b) for b in (0xF0, 0x41, 0x42, 0x43, 0x44)]
    assert "".join(pieces) + detokenizer.flush() == "\ufffdABCD"
    assert all(len(p) < 5 for p in pieces)


@pytest.mark.parametrize(("stops", "chunks", "sent", "stopped"), [
    ((), ["ab", "cd"], ["ab", "cd"], False),
    (("cd",), ["ab", "c", "d", "ef"], ["ab", "", "", ""], True),
    (("cd",), ["abc", "x"], ["ab", "cx"], False),
    (("xyz", "b"), ["axy", "b"], ["a", "xy"], True),
    (("lo w",), ["hel", "lo", " w", "orld"], ["he", "l", "", ""], True),
])
def test_stop_strings_cut_the_text_before_them(stops, chunks, sent, stopped):
    text = StopText(stops)
    assert [text.add(chunk) for chunk in chunks] == sent
    assert text.stopped is stopped


def test_text_held_for_a_stop_string_comes_out_at_the_end():
    text = StopText(["xyz"])
    assert text.add("abx") == "ab"
    assert text.flush() == "x"


def test_a_sequences_text_side_ends_at_its_stop_string_or_gives_all_on_its_last_token():
    tokens = list("ab€x".encode())  # "€" is three tokens; "x" the last
    stopped = TextSide(decode, ["€"])
    assert [stopped.add(t, False) for t in tokens[:4]] == [
        ("a", False), ("b", False), ("", False), ("", False)]
    assert stopped.add(tokens[4], False) == ("", True) and stopped.stopped
    whole = TextSide(decode, ["yz"])
    out = [whole.add(t, i == len(tokens) - 1) for i, t in enumerate(tokens)]
    assert "".join(text for text, _ in out) == "ab€x" and out[-1][1] and not whole.stopped
