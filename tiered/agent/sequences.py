"""The sequence batcher: stateful models, as Triton's `sequence_batching` runs them.

Requests that carry one correlation ID (`sequence_id`, an integer or a
string) form a sequence: the first says `sequence_start`, the last
`sequence_end`. The agent runs a sequence's requests one at a time, in the
order they arrived, and fills in the model inputs the client never sends:

- control inputs (`controls`): START, END and READY as the configured false
  and true values, CORRID as the correlation ID, one value per batch row
  (shape [rows, 1] for a batched model, [1] otherwise);
- implicit state (`states`): the model's state output of one request is its
  state input on the next; zeros on the first.

Requests of different sequences still batch together (each row carries its
own controls). The live sequences are bounded (`max_sequences`); one left
without a request for `max_sequence_idle_us` is dropped, and its next request
is refused as a sequence never started.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from tiered.errors import ConfigError, InvalidArgument, ResourceExhausted, Unavailable
from tiered.protocol import codec

CONTROL_KINDS = ("start", "end", "ready", "corrid")
FLAG_TYPES = ("INT32", "FP32", "BOOL")  # START, END, READY
CORRID_TYPES = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")
STRATEGIES = ("direct", "oldest")  # both: a sequence in order; batches mix sequences


@dataclass(frozen=True)
class Control:
    """A model input the batcher fills: `false_true` for START/END/READY."""

    name: str
    kind: str
    datatype: str
    false_true: tuple[float, float] = (0, 1)

    def __post_init__(self) -> None:
        if self.kind not in CONTROL_KINDS:
            raise ConfigError(f"kind: {self.kind!r} is not one of {', '.join(CONTROL_KINDS)}")
        allowed = CORRID_TYPES if self.kind == "corrid" else FLAG_TYPES
        if self.datatype not in allowed:
            raise ConfigError(f"datatype: {self.kind} takes one of {', '.join(allowed)}, "
                              f"not {self.datatype!r}")
        if len(self.false_true) != 2:
            raise ConfigError(f"false_true: two values (false, then true), got "
                              f"{list(self.false_true)}")


@dataclass(frozen=True)
class StateTensor:
    """An implicit state: `output` of one request is `input` of the next."""

    input: str
    output: str
    datatype: str
    dims: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.datatype not in codec.DATATYPES or self.datatype == "BYTES":
            raise ConfigError(f"datatype: {self.datatype!r} is not a numeric tensor type")
        if any(d < 1 for d in self.dims):
            raise ConfigError(f"dims: a state has fixed sizes, got {list(self.dims)}")


@dataclass(frozen=True)
class SequenceBatching:
    """A model's `sequence_batching` (config.yaml; config.pbtxt maps to it)."""

    max_sequence_idle_us: int = 1_000_000  # Triton's default
    max_sequences: int = 1024
    strategy: str = "direct"
    controls: tuple[Control, ...] = ()
    states: tuple[StateTensor, ...] = ()

    def __post_init__(self) -> None:
        if self.max_sequence_idle_us < 1:
            raise ConfigError(f"max_sequence_idle_us: must be >= 1, got "
                              f"{self.max_sequence_idle_us}")
        if self.max_sequences < 1:
            raise ConfigError(f"max_sequences: must be >= 1, got {self.max_sequences}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy: {self.strategy!r} is not one of "
                              f"{', '.join(STRATEGIES)}")
        names = [c.name for c in self.controls] + [s.input for s in self.states]
        if len(names) != len(set(names)):
            raise ConfigError(f"controls, states: an input is filled twice ({names})")

    @property
    def fed_inputs(self) -> frozenset[str]:
        """The model inputs the batcher fills (never sent by a client)."""
        return frozenset([c.name for c in self.controls] + [s.input for s in self.states])

    @property
    def state_outputs(self) -> frozenset[str]:
        return frozenset(s.output for s in self.states)


@dataclass(frozen=True)
class SequenceFlags:
    """A request's place in its sequence (its `sequence_*` parameters)."""

    id: int | str
    start: bool = False
    end: bool = False

    @classmethod
    def of(cls, parameters: Mapping[str, object]) -> SequenceFlags | None:
        """From a request's parameters; None when it names no sequence."""
        sequence_id = parameters.get("sequence_id", 0)
        if isinstance(sequence_id, bool) or not isinstance(sequence_id, (int, str)):
            raise InvalidArgument(f"parameters.sequence_id: an integer or a string, got "
                                  f"{sequence_id!r}")
        flags = {}
        for key in ("sequence_start", "sequence_end"):
            value = parameters.get(key, False)
            if not isinstance(value, bool):
                raise InvalidArgument(f"parameters.{key}: a boolean, got {value!r}")
            flags[key.removeprefix("sequence_")] = value
        if sequence_id in (0, ""):
            return None
        return cls(sequence_id, **flags)


@dataclass
class _Live:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    last: float = 0.0


class Sequences:
    """The live sequences of one model version."""

    def __init__(self, model: str, config: SequenceBatching, batched: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model, self.config, self.batched, self._clock = model, config, batched, clock
        self._live: OrderedDict[int | str, _Live] = OrderedDict()  # least recently used first
        self.started = self.ended = self.expired = 0

    def __len__(self) -> int:
        return len(self._live)

    @contextlib.asynccontextmanager
    async def turn(self, flags: SequenceFlags | None, rows: int
                   ) -> AsyncIterator[tuple[dict[str, np.ndarray], Callable]]:
        """The sequence's turn to run a request of `rows`: yields the inputs
        to add and a function that keeps the request's outputs' state."""
        if flags is None:
            raise InvalidArgument(f"inference request to model {self.model!r} must specify a "
                                  "non-zero or non-empty correlation ID")
        controls = self._controls(flags, rows)  # first: a request refused starts nothing
        live = self._join(flags)
        async with live.lock:
            if self._live.get(flags.id) is not live:
                raise Unavailable(f"sequence {flags.id} of model {self.model!r} ended or "
                                  "was restarted while this request waited")
            fed = controls | self._state(live, flags, rows)

            def keep(outputs: Mapping[str, np.ndarray]) -> None:
                live.state = {s.input: outputs[s.output] for s in self.config.states}

            try:
                yield fed, keep
            finally:
                live.last = self._clock()
                if self._live.get(flags.id) is live:
                    if flags.end:
                        del self._live[flags.id]
                        self.ended += 1
                    else:
                        self._live.move_to_end(flags.id)

    def _join(self, flags: SequenceFlags) -> _Live:
        self._expire()
        live = self._live.get(flags.id)
        if flags.start:
            if live is None and len(self._live) >= self.config.max_sequences:
                raise ResourceExhausted(
                    f"model {self.model!r}: {len(self._live)} sequences are live, the most it "
                    "keeps (sequence_batching.max_sequences)")
            self._live.pop(flags.id, None)  # a START restarts it
            live = self._live[flags.id] = _Live(last=self._clock())
            self.started += 1
        elif live is None:
            raise InvalidArgument(f"inference request for sequence {flags.id} to model "
                                  f"{self.model!r} must specify the START flag on the first "
                                  "request of the sequence")
        return live

    def _expire(self) -> None:
        """Drop the sequences idle for longer than the limit, from the least
        recently used on (a running one stops the sweep until it is done)."""
        oldest = self._clock() - self.config.max_sequence_idle_us / 1e6
        while self._live:
            key, live = next(iter(self._live.items()))
            if live.last >= oldest or live.lock.locked():
                return
            del self._live[key]
            self.expired += 1

    def _shape(self, rows: int, dims: tuple[int, ...] = (1,)) -> tuple[int, ...]:
        return (rows, *dims) if self.batched else dims

    def _controls(self, flags: SequenceFlags, rows: int) -> dict[str, np.ndarray]:
        fed = {}
        for control in self.config.controls:
            dtype = codec.dtype_of(control.datatype)
            if control.kind == "corrid":
                value = flags.id if control.datatype == "BYTES" or isinstance(flags.id, int) \
                    else _corrid_number(flags.id)
                if control.datatype == "BYTES":
                    value = str(value).encode()
            else:
                on = {"start": flags.start, "end": flags.end, "ready": True}[control.kind]
                value = control.false_true[on]
            fed[control.name] = np.full(self._shape(rows), value, dtype=dtype)
        return fed

    def _state(self, live: _Live, flags: SequenceFlags, rows: int) -> dict[str, np.ndarray]:
        fed = {}
        for state in self.config.states:
            shape = self._shape(rows, state.dims)
            kept = live.state.get(state.input)
            if kept is not None and kept.shape != shape:
                raise InvalidArgument(f"sequence {flags.id}: a request of {rows} rows, but its "
                                      f"state {state.input!r} holds {list(kept.shape)}")
            fed[state.input] = kept if kept is not None else \
                np.zeros(shape, codec.dtype_of(state.datatype))
        return fed


def _corrid_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"sequence_id {text!r}: this model's CORRID input is a number; "
                              "send an integer correlation ID") from None
