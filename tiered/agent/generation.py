"""What a generation request asks for, and how its tokens become text. Pure.

`parse_request` reads a v2 request to a generative model (`text_input`, or
chat `messages` as a request parameter, rendered by the model's chat
template; and `max_tokens`, `temperature`, `top_p`, `seed`, `stop` as request
parameters or as optional one-element input tensors) into a
`GenerationRequest`, naming the field that is wrong. `Detokenizer` turns
token ids into text pieces that are safe to send one by one (a character
split across tokens waits for its last byte); `StopText` holds back text
that may be the start of a stop string and cuts the text where one appears;
`TextSide` is the two for one sequence. Nothing here touches an engine, a
thread or the wire: the scheduler (`scheduler.py`) drives these on its
worker thread, a front end (`feed.py`) on its event loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiered.engines.generative.base import Sampling
from tiered.engines.generative.chat import ChatTemplate, read_messages
from tiered.errors import InvalidArgument
from tiered.protocol import error_text, messages

TEXT_INPUT = "text_input"
TEXT_OUTPUT, TOKEN_IDS = messages.TEXT_OUTPUT, messages.TOKEN_IDS  # the router reads them too
# Request parameters (or optional input tensors) a generative model reads.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed")
STOP = "stop"
MESSAGES = "messages"  # a request parameter: chat messages (JSON text), not text_input
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MAX_PROMPT_BYTES = 1 << 20  # a prompt's text; its tokens are bounded by the context
DEFAULT_MAX_TOKENS = 64
# Held text that does not become valid UTF-8 within this many tokens is sent as is.
MAX_HELD_TOKENS = 4


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    sampling: Sampling
    stop: tuple[str, ...] = ()
    empty_final_response: bool = False  # the client asked for Triton's empty final response
    # A vision-language decoder's visual tokens, FP32 [image tokens of the
    # prompt, hidden]: the vision stage's output for the prompt's images, in order.
    visual: np.ndarray | None = None
    # A vision-language request's images until its vision stage encodes them
    # (`vision_language.Images`).
    images: Any = None
    # Its tokens become text where it is answered (a front end, which applies
    # the stop strings too): the scheduler hands over token ids alone.
    text_elsewhere: bool = False


def parse_request(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any],
                  model: str, chat: ChatTemplate | None = None) -> GenerationRequest:
    """A generation request from decoded v2 inputs and request parameters;
    chat `messages` become the prompt through `chat` (the plain template
    where None)."""
    for name in inputs:
        if name != TEXT_INPUT and name not in SAMPLING_FIELDS and name != STOP:
            raise InvalidArgument(error_text.unexpected_input(
                name, model, (TEXT_INPUT, *(f"{n} (optional)" for n in (*SAMPLING_FIELDS, STOP)))))
    if MESSAGES in parameters:
        if TEXT_INPUT in inputs:
            raise InvalidArgument(f"{MESSAGES}: given with {TEXT_INPUT}; give one")
        prompt = (chat or ChatTemplate()).render(read_messages(parameters[MESSAGES]))
    elif TEXT_INPUT not in inputs:
        raise InvalidArgument(error_text.missing_inputs(model, 1, len(inputs), [TEXT_INPUT]))
    else:
        prompt = _text(inputs[TEXT_INPUT], TEXT_INPUT)
    if len(prompt.encode()) > MAX_PROMPT_BYTES:
        raise InvalidArgument(f"{TEXT_INPUT}: the prompt exceeds {MAX_PROMPT_BYTES} bytes")
    values = {name: _value(name, inputs, parameters) for name in (*SAMPLING_FIELDS, STOP)}
    max_tokens = _integer(values["max_tokens"], "max_tokens", DEFAULT_MAX_TOKENS)
    seed = _integer(values["seed"], "seed", 0)
    if not 0 <= seed < 2**63:
        raise InvalidArgument(f"seed: expected 0..2^63-1, got {seed}")
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=_number(values["temperature"], "temperature", 0.0),
        top_p=_number(values["top_p"], "top_p", 1.0),
        seed=seed,
    )
    return GenerationRequest(prompt, sampling, _stops(values[STOP]),
                             messages.wants_empty_final(parameters))


def _value(name: str, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any]) -> Any:
    if name in inputs and name in parameters:
        raise InvalidArgument(f"{name}: given both as an input and as a parameter; give one")
    if name not in inputs:
        return parameters.get(name)
    array = inputs[name]
    if name == STOP:
        return [_element(item, name) for item in array.reshape(-1)]
    if array.size != 1:
        raise InvalidArgument(f"input {name!r}: expected one element, got shape "
                              f"{list(array.shape)}")
    item = array.reshape(-1)[0]
    return _element(item, name) if array.dtype == object else item.item()


def _element(item: Any, name: str) -> str:
    if isinstance(item, bytes):
        try:
            return item.decode()
        except UnicodeDecodeError as error:
            raise InvalidArgument(f"{name}: not UTF-8 text ({error})") from error
    return str(item)


def _text(array: np.ndarray, name: str) -> str:
    if array.dtype != object:
        raise InvalidArgument(f"input {name!r}: expected BYTES text")
    if array.size != 1:
        raise InvalidArgument(f"input {name!r}: expected one prompt, got shape "
                              f"{list(array.shape)}")
    return _element(array.reshape(-1)[0], name)


def _integer(value: Any, name: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name}: expected an integer, got {value!r}")
    return value


def _number(value: Any, name: str, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidArgument(f"{name}: expected a finite number, got {value!r}")
    return float(value)


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgument(f"stop: expected a string or strings, got {value!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for stop in stops:
        if not 0 < len(stop) <= MAX_STOP_CHARS:
            raise InvalidArgument(f"stop: each string needs 1..{MAX_STOP_CHARS} characters, "
                                  f"got {len(stop)}")
    return tuple(stops)


class Detokenizer:
    """Text of a growing list of token ids, one safe piece per token.

    A piece is the text the newest tokens added, decoded together with the
    token before them (so a tokenizer that drops a word's leading space when
    a token is decoded alone still spaces it); while that text ends in an
    incomplete character the tokens wait, at most MAX_HELD_TOKENS, after which
    they are sent as the tokenizer decodes them.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] were sent; decoded again for context
        self._read = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        before, after = self._window()
        if len(after) > len(before) and not after.endswith("\ufffd") \
                and after.startswith(before):
            return self._sent(after[len(before):])
        if len(self.ids) - self._read >= MAX_HELD_TOKENS:
            return self._sent("".join(self._decode([t]) for t in self.ids[self._read:]))
        return ""

    def flush(self) -> str:
        """What is still held (the sequence ended): as the window decodes it,
        else as the tokenizer decodes each token."""
        if self._read == len(self.ids):
            return ""
        before, after = self._window()
        if after.startswith(before):  # a special token (end of sequence) adds nothing
            return self._sent(after[len(before):])
        return self._sent("".join(self._decode([t]) for t in self.ids[self._read:]))

    def _window(self) -> tuple[str, str]:
        return (self._decode(self.ids[self._prefix:self._read]),
                self._decode(self.ids[self._prefix:]))

    def _sent(self, text: str) -> str:
        self._prefix, self._read = self._read, len(self.ids)
        return text


class StopText:
    """Text as it may be sent, given stop strings: the part that cannot be the
    start of a stop string goes out; a stop string ends the text before it."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def add(self, text: str) -> str:
        if self.stopped:
            return ""
        pending = self._held + text
        found = [(pending.find(s), s) for s in self.stops if s in pending]
        if found:
            self.stopped, self._held = True, ""
            return pending[:min(found)[0]]
        keep = max((k for s in self.stops for k in range(1, len(s))
                    if pending.endswith(s[:k])), default=0)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


class TextSide:
    """One sequence's tokens as the text to send: detokenized, cut at its
    first stop string (after which it has `stopped`)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str]) -> None:
        self._detokenizer = Detokenizer(decode)
        self._stop_text = StopText(stops)

    @property
    def stopped(self) -> bool:
        return self._stop_text.stopped

    def add(self, token: int, last: bool) -> tuple[str, bool]:
        """The text `token` lets out, and whether the sequence has ended: its
        `last` token, or a stop string."""
        text = self._detokenizer.add(token)
        if last:
            text += self._detokenizer.flush()
        text = self._stop_text.add(text)
        if self._stop_text.stopped:
            return text, True
        if last:
            text += self._stop_text.flush()
        return text, last
