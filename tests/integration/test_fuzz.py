"""Fuzzing the running servers: malformed ModelInfer requests, built as raw
protobuf (and a few with the unmodified tritonclient), against a real agent and
a real router in front of it.

Each example starts from a well-formed request for `mlp`, `identity` (every
datatype) or `add_sub` and changes it in one of three modes:

- valid: harmless changes only (ids, unknown parameters, valid hints, timeouts
  and priorities, existing outputs): the answer must be OK and correct;
- one: exactly one change that makes it malformed, plus harmless ones: the
  answer is the code that change calls for, and the message names its field;
- chaos: several changes of any kind: whatever the answer, it is one of the
  codes a client can act on, never INTERNAL/UNKNOWN.

Every error message must be non-empty, free of tracebacks and, for
INVALID_ARGUMENT, start with the field it is about. After each run both
servers must still be live and answer a valid request correctly.
"""

from __future__ import annotations

import json
import math
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from tests.conftest import IDENTITY_DATATYPES
from tiered.local.processes import ServerProcess
from tiered.protocol import codec
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc

Code = grpc.StatusCode
ALLOWED = frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED,
                     Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.OUT_OF_RANGE})
# An INVALID_ARGUMENT message starts with the field it is about, or with
# Triton's text for its error and the field in parentheses after it.
FIELDS = (r"(model_name|model_version|inputs?|outputs|raw_input_contents|parameters"
          r"|tiered-tier|tiered-slo-ms|tiered-key)\b")
FIELD = re.compile(rf"^(?:{FIELDS}[^:\n]*: \S|.*\({FIELDS})")
CALL_TIMEOUT_S = 10.0
# Per target: 25 valid + 5 for each of 18 breaking changes + 4 for each of 10
# chaotic ones = 155 requests, and 15 streams and 30 tritonclient calls.
FUZZ = settings(max_examples=5, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

# The models the router's table names; the agent serves add_sub and slow too.
MAX_BATCH = {"mlp": 16, "identity": 4, "add_sub": 8}
INPUTS = {"mlp": ("input",), "add_sub": ("INPUT0", "INPUT1"),
          "identity": tuple(f"in_{dt}" for dt in IDENTITY_DATATYPES)}
OUTPUTS = {"mlp": ("probabilities",), "add_sub": ("OUTPUT0", "OUTPUT1"),
           "identity": tuple(f"out_{dt}" for dt in IDENTITY_DATATYPES)}
ROUTED = ("mlp", "identity")
SERVED = ("add_sub", "identity", "mlp", "slow")
HINTS = ("tiered-tier", "tiered-slo-ms", "tiered-key")


class RouterProcess(ServerProcess):
    def __init__(self, table: Path) -> None:
        super().__init__([sys.executable, "-m", "tiered", "router", "--routing-table",
                          str(table), "--port", "0", "--metrics-port", "0", "--seed", "0",
                          "--http-port", "0", "--insecure"], "router-fuzz")


@pytest.fixture(scope="module")
def router(agent, tmp_path_factory):
    table = tmp_path_factory.mktemp("fuzz-router") / "routing.yaml"
    edge = {"edge": {"agents": [agent.address], "stable": 1}}
    table.write_text(json.dumps({"version": 1, "models": {
        model: {"policy": "slo-energy", "tiers": edge} for model in ROUTED}}))
    with RouterProcess(table) as process:
        yield process
        assert process.alive(), process.log_tail()


@pytest.fixture(scope="module")
def servers(agent, router):
    return {"agent": agent, "router": router}


@pytest.fixture(scope="module")
def stubs(servers):
    channels = {name: grpc.insecure_channel(p.address) for name, p in servers.items()}
    yield {name: pb_grpc.GRPCInferenceServiceStub(c) for name, c in channels.items()}
    for channel in channels.values():
        channel.close()


# --- well-formed requests ----------------------------------------------------


@dataclass
class Case:
    """A request being built, with what its answer must be."""

    target: str  # agent or router
    model: str
    arrays: dict[str, np.ndarray]
    request: pb.ModelInferRequest
    metadata: list[tuple[str, str]] = field(default_factory=list)
    expect: set[Code] | None = None  # None: must be OK (no breaking change yet)
    field: str = ""  # what the message must name, when one breaking change was made
    may_expire: bool = False  # a tiny timeout was set: DEADLINE_EXCEEDED is fine
    chaos: bool = False  # validity unknown: only the general rules hold

    @property
    def raw(self) -> bool:
        return bool(self.request.raw_input_contents)


def random_array(rng: np.random.Generator, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    if datatype == "BYTES":  # onnxruntime's string tensors hold UTF-8 text
        alphabet = "ab\0é€😀"
        items = ["".join(rng.choice(list(alphabet), rng.integers(0, 6))).encode()
                 for _ in range(math.prod(shape))]
        return np.array(items, dtype=object).reshape(shape)
    if datatype == "BOOL":
        return rng.random(shape) > 0.5
    dtype = codec.DATATYPES[datatype]
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def well_formed(model: str, batch: int, widths: list[int], seed: int, typed: bool
                ) -> tuple[dict[str, np.ndarray], pb.ModelInferRequest]:
    rng = np.random.default_rng(seed)
    if model == "identity":
        arrays = {f"in_{dt}": random_array(rng, dt, (batch, width))
                  for dt, width in zip(IDENTITY_DATATYPES, widths)}
        typed = False  # FP16 travels raw only, and raw is all inputs or none
    else:
        arrays = {name: random_array(rng, "FP32", (batch, 16)) for name in INPUTS[model]}
    request = pb.ModelInferRequest(model_name=model)
    for name, array in arrays.items():
        datatype, shape, raw = codec.to_raw(array)
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        if typed:
            tensor.contents.fp32_contents.extend(array.reshape(-1).tolist())
        else:
            request.raw_input_contents.append(raw)
    return arrays, request


@st.composite
def cases(draw, target: str) -> Case:
    model = draw(st.sampled_from(ROUTED if target == "router" else ("mlp", "identity", "add_sub")))
    batch = draw(st.integers(1, MAX_BATCH[model]))
    widths = draw(st.lists(st.integers(1, 3), min_size=len(IDENTITY_DATATYPES),
                           max_size=len(IDENTITY_DATATYPES)))
    seed = draw(st.integers(0, 2**32 - 1))
    typed = draw(st.booleans())
    arrays, request = well_formed(model, batch, widths, seed, typed)
    return Case(target, model, arrays, request)


# --- changes -----------------------------------------------------------------

texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
# Versions in digits other than ASCII's: see test_a_version_in_non_ascii_digits_is_not_found.
versions = texts.filter(lambda v: not any(c.isdigit() and not c.isascii() for c in v))
int64s = st.integers(-(2**63), 2**63 - 1)


def set_parameter(parameters, key: str, value) -> None:
    codec.set_parameter(parameters[key], value)


any_value = st.one_of(st.booleans(), texts, int64s, st.integers(0, 2**64 - 1),
                      st.floats(allow_nan=True, allow_infinity=True))


def breaks(case: Case, codes: set[Code], field_name: str) -> None:
    """Record one breaking change: the answer must be one of `codes`, naming the field."""
    case.expect = codes if case.expect is None else case.expect | codes
    case.field = field_name


INVALID = {Code.INVALID_ARGUMENT}


# Harmless changes: the request stays well-formed.

def benign_id(data, case: Case) -> None:
    case.request.id = data.draw(texts)


def benign_unknown_parameter(data, case: Case) -> None:
    key = data.draw(texts.filter(lambda k: k not in ("timeout", "priority", *HINTS)))
    set_parameter(case.request.parameters, key, data.draw(any_value))


def benign_priority(data, case: Case) -> None:
    set_parameter(case.request.parameters, "priority", data.draw(st.integers(0, 2**64 - 1)))


def benign_timeout(data, case: Case) -> None:
    value = data.draw(st.one_of(st.just(0), st.integers(30_000_000, 2**64 - 1)))
    set_parameter(case.request.parameters, "timeout", value)


def benign_key(data, case: Case) -> None:
    set_parameter(case.request.parameters, "tiered-key", data.draw(any_value))


def benign_tier(data, case: Case) -> None:
    value = data.draw(st.sampled_from(["", "edge"]) if case.target == "router" else any_value)
    set_parameter(case.request.parameters, "tiered-tier", value)


def benign_slo(data, case: Case) -> None:
    value = data.draw(st.one_of(st.floats(0.001, 1e300), st.integers(1, 2**62),
                                st.sampled_from(["5", "0.5", " 12 ", "1e3"]))
                      if case.target == "router" else any_value)
    set_parameter(case.request.parameters, "tiered-slo-ms", value)


def benign_outputs(data, case: Case) -> None:
    names = data.draw(st.lists(st.sampled_from(OUTPUTS[case.model]), min_size=1, unique=True))
    del case.request.outputs[:]
    for name in names:
        output = case.request.outputs.add(name=name)
        if data.draw(st.booleans()):
            output.parameters["binary_data"].bool_param = True


def benign_version(data, case: Case) -> None:
    if case.target == "agent":
        case.request.model_version = data.draw(st.sampled_from(["", "1"]))


BENIGN = (benign_id, benign_unknown_parameter, benign_priority, benign_timeout, benign_key,
          benign_tier, benign_slo, benign_outputs, benign_version)


# Breaking changes: each makes the request malformed whatever else is done.

def bad_model_name(data, case: Case) -> None:
    known = ROUTED if case.target == "router" else SERVED
    case.request.model_name = data.draw(texts.filter(lambda n: n not in known))
    breaks(case, {Code.NOT_FOUND}, "model_name")


def bad_version(data, case: Case) -> None:
    if case.target == "router":
        return bad_model_name(data, case)  # the router picks versions itself
    case.request.model_version = data.draw(st.one_of(
        versions.filter(lambda v: v not in ("", "1") and not (v.isascii() and v.isdigit()
                                                          and int(v) == 1)),
        st.integers(2, 2**70).map(str), st.integers(-(2**70), 0).map(str)))
    breaks(case, {Code.NOT_FOUND}, "model_version")


def pick_input(data, case: Case) -> int:
    if not case.request.inputs:  # an earlier change removed them all
        case.request.inputs.add(name="x", datatype="FP32", shape=[1])
        if case.raw:
            case.request.raw_input_contents.append(b"\0" * 4)
    return data.draw(st.integers(0, len(case.request.inputs) - 1))


def bad_input_name(data, case: Case) -> None:
    index = pick_input(data, case)
    case.request.inputs[index].name = data.draw(
        texts.filter(lambda n: n not in INPUTS[case.model]))
    breaks(case, INVALID, "input")


def missing_input(data, case: Case) -> None:
    index = pick_input(data, case)
    del case.request.inputs[index]
    if case.raw:
        del case.request.raw_input_contents[index]
    breaks(case, INVALID, "input")


def duplicate_input(data, case: Case) -> None:
    index = pick_input(data, case)
    case.request.inputs.add().CopyFrom(case.request.inputs[index])
    if case.raw:
        case.request.raw_input_contents.append(case.request.raw_input_contents[index])
    breaks(case, INVALID, "input")


def bad_datatype(data, case: Case) -> None:
    tensor = case.request.inputs[pick_input(data, case)]
    tensor.datatype = data.draw(st.one_of(
        st.sampled_from([*codec.DATATYPES, "BF16", "fp32", "FP8", "", "STRING"]),
        texts).filter(lambda d: d != tensor.datatype))
    breaks(case, INVALID, "input")


def bad_shape(data, case: Case) -> None:
    tensor = case.request.inputs[pick_input(data, case)]
    shape = list(tensor.shape)
    how = data.draw(st.sampled_from(["negative", "huge", "many", "ones", "scalar", "rank",
                                     "batch0", "batch_over"]))
    if how == "negative":
        shape[data.draw(st.integers(0, len(shape) - 1))] = data.draw(st.integers(-(2**63), -1))
    elif how == "huge":
        shape[data.draw(st.integers(0, len(shape) - 1))] = data.draw(st.integers(2**40 + 1,
                                                                                 2**62))
    elif how == "many":
        shape += data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=100))
    elif how == "ones":  # the byte count still fits: only the rank is wrong
        shape += [1] * data.draw(st.integers(1, 100))
    elif how == "scalar":
        shape = []
    elif how == "rank":
        shape = shape[:1]
    elif how == "batch0":
        shape[0] = 0
    else:
        shape[0] = data.draw(st.integers(MAX_BATCH[case.model] + 1, 2**20))
    del tensor.shape[:]
    tensor.shape.extend(shape)
    breaks(case, INVALID, "input")


def bad_raw_length(data, case: Case) -> None:
    if not case.raw:
        return bad_typed_count(data, case)
    index = pick_input(data, case)
    raw = case.request.raw_input_contents[index]
    if raw and data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif case.request.inputs[index].datatype == "BYTES":
        raw += data.draw(st.binary(min_size=1, max_size=3))  # shorter than a length prefix
    else:
        raw += data.draw(st.binary(min_size=1, max_size=64))
    case.request.raw_input_contents[index] = raw
    breaks(case, INVALID, "input")


def bad_raw_count(data, case: Case) -> None:
    raw = case.request.raw_input_contents
    if len(raw) >= 2 and data.draw(st.booleans()):
        del raw[data.draw(st.integers(0, len(raw) - 1))]
    else:
        target = len(case.request.inputs) + data.draw(st.integers(1, 3))
        while len(raw) < target:
            raw.append(data.draw(st.binary(max_size=16)))
    breaks(case, INVALID, "raw_input_contents")


def typed_beside_raw(data, case: Case) -> None:
    if not case.raw:
        return bad_raw_count(data, case)
    index = pick_input(data, case)
    tensor = case.request.inputs[index]
    array = case.arrays[tensor.name]
    source = {"FP16": "fp32_contents"}.get(tensor.datatype,
                                           codec._CONTENTS_FIELD.get(tensor.datatype))
    values = array.reshape(-1).tolist()
    getattr(tensor.contents, source).extend(values)  # the same values: still two sources
    breaks(case, INVALID, "input")


def bad_typed_count(data, case: Case) -> None:
    if case.raw:
        return bad_raw_length(data, case)
    values = case.request.inputs[pick_input(data, case)].contents.fp32_contents
    if data.draw(st.booleans()):
        del values[data.draw(st.integers(0, len(values) - 1)):]
    else:
        values.extend(data.draw(st.lists(st.floats(width=32), min_size=1, max_size=8)))
    breaks(case, INVALID, "input")


def unknown_output(data, case: Case) -> None:
    case.request.outputs.add(name=data.draw(texts.filter(lambda n: n not in OUTPUTS[case.model])))
    breaks(case, INVALID, "outputs")


def bad_output_parameter(data, case: Case) -> None:
    output = case.request.outputs.add(name=data.draw(st.sampled_from(OUTPUTS[case.model])))
    key = data.draw(texts.filter(lambda k: k != "binary_data"))
    set_parameter(output.parameters, key, data.draw(any_value))
    breaks(case, INVALID, "outputs")


def bad_timeout(data, case: Case) -> None:
    value = data.draw(st.one_of(st.integers(-(2**63), -1), st.booleans(), texts,
                                st.floats(allow_nan=True, allow_infinity=True)))
    set_parameter(case.request.parameters, "timeout", value)
    breaks(case, INVALID, "parameters.timeout")


def bad_priority(data, case: Case) -> None:
    value = data.draw(st.one_of(st.integers(-(2**63), -1), st.booleans(), texts,
                                st.floats(allow_nan=True, allow_infinity=True)))
    set_parameter(case.request.parameters, "priority", value)
    breaks(case, INVALID, "parameters.priority")


def bad_tier(data, case: Case) -> None:
    if case.target == "agent":
        return bad_timeout(data, case)  # the agent passes routing hints by
    value = data.draw(st.one_of(texts.filter(lambda t: t not in ("", "edge")),
                                st.booleans(), st.integers(-5, 5)))
    if isinstance(value, str) and value.isascii() and value.isprintable() \
            and data.draw(st.booleans()):
        case.request.parameters.pop("tiered-tier", None)
        case.metadata.append(("tiered-tier", value))
    else:
        set_parameter(case.request.parameters, "tiered-tier", value)
    breaks(case, {Code.INVALID_ARGUMENT, Code.NOT_FOUND}, "tiered-tier")


def bad_slo(data, case: Case) -> None:
    if case.target == "agent":
        return bad_priority(data, case)
    value = data.draw(st.one_of(
        st.sampled_from(["", "abc", "-1", "0", "nan", "inf", "-inf", "1e999", "5ms"]),
        st.floats(max_value=0.0), st.sampled_from([math.nan, math.inf, -math.inf]),
        st.integers(-(2**63), 0), st.just(False)))
    if isinstance(value, str) and value.isprintable() and data.draw(st.booleans()):
        case.request.parameters.pop("tiered-slo-ms", None)
        case.metadata.append(("tiered-slo-ms", value))
    else:
        set_parameter(case.request.parameters, "tiered-slo-ms", value)
    breaks(case, INVALID, "tiered-slo-ms")


def broken_bytes(data, case: Case) -> None:
    if case.model != "identity":
        return bad_raw_length(data, case)
    index = INPUTS["identity"].index("in_BYTES")
    raw = bytearray(case.request.raw_input_contents[index])
    how = data.draw(st.sampled_from(["claims_more", "ffff", "cut", "trailing"]))
    if how in ("claims_more", "ffff"):  # the first prefix claims more than there is
        raw[0:4] = (0xFFFFFFFF if how == "ffff" else len(raw) - 3).to_bytes(4, "little")
    elif how == "cut":
        del raw[data.draw(st.integers(0, len(raw) - 1)):]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=3))
    case.request.raw_input_contents[index] = bytes(raw)
    breaks(case, INVALID, "input")


BREAKING = (bad_model_name, bad_version, bad_input_name, missing_input, duplicate_input,
            bad_datatype, bad_shape, bad_raw_length, bad_raw_count, typed_beside_raw,
            bad_typed_count, unknown_output, bad_output_parameter, bad_timeout, bad_priority,
            bad_tier, bad_slo, broken_bytes)


# Changes of unknown effect: only the general rules hold afterwards.

def chaos_timeout(data, case: Case) -> None:
    set_parameter(case.request.parameters, "timeout", data.draw(st.integers(1, 1000)))
    case.may_expire = True


def chaos_hint(data, case: Case) -> None:
    set_parameter(case.request.parameters, data.draw(st.sampled_from(HINTS)),
                  data.draw(any_value))


def chaos_version(data, case: Case) -> None:
    case.request.model_version = data.draw(st.one_of(versions, st.integers(-3, 3).map(str)))


def chaos_outputs(data, case: Case) -> None:
    names = [*OUTPUTS[case.model], *data.draw(st.lists(texts, max_size=2))]
    for name in data.draw(st.lists(st.sampled_from(names), max_size=6)):
        case.request.outputs.add(name=name)


def chaos_shape(data, case: Case) -> None:
    tensor = case.request.inputs[pick_input(data, case)]
    del tensor.shape[:]
    tensor.shape.extend(data.draw(st.lists(st.one_of(st.integers(-2, 20), int64s), max_size=80)))


def chaos_datatype(data, case: Case) -> None:
    tensor = case.request.inputs[pick_input(data, case)]
    tensor.datatype = data.draw(st.one_of(st.sampled_from(list(codec.DATATYPES)), texts))


def chaos_raw(data, case: Case) -> None:
    raw = case.request.raw_input_contents
    if raw:
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.binary(max_size=256))
    else:
        raw.extend(data.draw(st.lists(st.binary(max_size=64), max_size=4)))


def chaos_bytes_prefix(data, case: Case) -> None:
    raw = case.request.raw_input_contents
    if case.model == "identity" and raw:
        index = INPUTS["identity"].index("in_BYTES")
        buffer = bytearray(raw[index])
        at = data.draw(st.integers(0, max(0, len(buffer) - 4)))
        buffer[at:at + 4] = data.draw(st.integers(0, 2**32 - 1)).to_bytes(4, "little")
        raw[index] = bytes(buffer)


def chaos_many_inputs(data, case: Case) -> None:
    for index in range(data.draw(st.integers(1, 300))):
        case.request.inputs.add(name=f"extra{index}", datatype="FP32", shape=[1])
        if case.raw:
            case.request.raw_input_contents.append(b"\0\0\0\0")


def chaos_contents(data, case: Case) -> None:
    tensor = case.request.inputs[pick_input(data, case)]
    source = data.draw(st.sampled_from(sorted(set(codec._CONTENTS_FIELD.values()))))
    values = {"bool_contents": st.booleans(), "int_contents": st.integers(-(2**31), 2**31 - 1),
              "int64_contents": int64s, "uint_contents": st.integers(0, 2**32 - 1),
              "uint64_contents": st.integers(0, 2**64 - 1), "fp32_contents": st.floats(width=32),
              "fp64_contents": st.floats(), "bytes_contents": st.binary(max_size=8)}[source]
    getattr(tensor.contents, source).extend(data.draw(st.lists(values, max_size=40)))


CHAOTIC = (chaos_timeout, chaos_hint, chaos_version, chaos_outputs, chaos_shape,
           chaos_datatype, chaos_raw, chaos_bytes_prefix, chaos_many_inputs, chaos_contents)


def mutate(data, case: Case, mode: str, first=None) -> Case:
    """Harmless changes, then: nothing more (valid), `first` (one breaking change)
    or `first` and up to three changes of any kind (chaos)."""
    changes = data.draw(st.lists(st.sampled_from(BENIGN), max_size=3))
    if mode == "one":
        changes.append(first)
    elif mode == "chaos":
        case.chaos = True
        changes += [first, *data.draw(st.lists(st.sampled_from(BREAKING + CHAOTIC + BENIGN),
                                               max_size=3))]
    for change in changes:
        change(data, case)
    return case


# --- checks ------------------------------------------------------------------


def check_message(code: Code, message: str, case: Case | None = None) -> None:
    where = f"{code.name}: {message!r}"
    assert message.strip(), f"{code.name} with an empty message"
    assert "Traceback" not in message and 'File "' not in message, where
    assert "internal error" not in message, where
    if code is Code.INVALID_ARGUMENT:
        assert FIELD.match(message), f"the message does not name a field: {where}"
    if case is not None and case.field and not case.chaos:
        assert case.field in message, f"{case.field!r} not named: {where}"


def check_outputs(case: Case, response: pb.ModelInferResponse) -> None:
    """A valid request's answer is the model's answer to its inputs."""
    outputs = {tensor.name: codec.from_raw(response.raw_output_contents[index], tensor.datatype,
                                           tuple(tensor.shape), field=f"outputs[{index}]")
               for index, tensor in enumerate(response.outputs)}
    requested = [o.name for o in case.request.outputs] or list(OUTPUTS[case.model])
    assert sorted(outputs) == sorted(set(requested))
    arrays = case.arrays
    if case.model == "mlp":
        probabilities = outputs["probabilities"]
        assert probabilities.shape == (arrays["input"].shape[0], 4)
        np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    elif case.model == "add_sub":
        a, b = arrays["INPUT0"], arrays["INPUT1"]
        for name, expected in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
            if name in outputs:
                np.testing.assert_allclose(outputs[name], expected, rtol=1e-6)
    else:
        for name, array in outputs.items():
            expected = arrays["in_" + name[len("out_"):]]
            assert codec.to_raw(array)[2] == codec.to_raw(expected)[2], name


def call(stub, case: Case) -> tuple[Code, str, pb.ModelInferResponse | None]:
    started = time.monotonic()
    try:
        response = stub.ModelInfer(case.request, timeout=CALL_TIMEOUT_S,
                                   metadata=case.metadata or None)
    except grpc.RpcError as error:
        elapsed = time.monotonic() - started
        assert elapsed < CALL_TIMEOUT_S - 1, f"hung for {elapsed:.1f} s: {error.details()}"
        return error.code(), error.details() or "", None
    return Code.OK, "", response


def judge(case: Case, code: Code, message: str, response) -> None:
    assert code in ALLOWED, f"{code.name}: {message}"
    if code is Code.OK:
        assert case.chaos or case.expect is None, f"a malformed request was answered OK " \
                                                  f"(expected {case.expect}, {case.field})"
        if not case.chaos:
            check_outputs(case, response)
        return
    check_message(code, message, case)
    if case.chaos:
        return
    if code is Code.DEADLINE_EXCEEDED and case.may_expire:
        return
    assert case.expect is not None, f"a well-formed request failed: {code.name}: {message}"
    assert code in case.expect, f"expected {case.expect} for {case.field}, got " \
                                f"{code.name}: {message}"


def assert_healthy(stub) -> None:
    assert stub.ServerLive(pb.ServerLiveRequest(), timeout=CALL_TIMEOUT_S).live
    arrays, request = well_formed("mlp", 3, [], seed=7, typed=False)
    case = Case("agent", "mlp", arrays, request)
    code, message, response = call(stub, case)
    assert code is Code.OK, message
    check_outputs(case, response)


# --- the fuzz tests ----------------------------------------------------------


def fuzz_infer(stubs, servers, target: str, mode: str, first=None, examples: int = 5
               ) -> dict[str, int]:
    """One hypothesis run against `target`; then both servers must still be well."""
    stub, codes = stubs[target], {}

    @settings(FUZZ, max_examples=examples)
    @given(data=st.data())
    def fuzz(data):
        case = mutate(data, data.draw(cases(target)), mode, first)
        code, message, response = call(stub, case)
        codes[code.name] = codes.get(code.name, 0) + 1
        judge(case, code, message, response)

    fuzz()
    for process in servers.values():
        assert process.alive(), process.log_tail()
    for name in stubs:
        assert_healthy(stubs[name])
    return codes


@pytest.mark.parametrize("target", ["agent", "router"])
def test_well_formed_requests_with_odd_extras_are_answered(stubs, servers, target):
    assert fuzz_infer(stubs, servers, target, "valid", examples=25) == {"OK": 25}


@pytest.mark.parametrize("change", BREAKING, ids=lambda c: c.__name__)
@pytest.mark.parametrize("target", ["agent", "router"])
def test_one_malformed_field_is_named_in_a_clean_error(stubs, servers, target, change):
    codes = fuzz_infer(stubs, servers, target, "one", change, examples=5)
    assert "OK" not in codes, codes


@pytest.mark.parametrize("change", CHAOTIC, ids=lambda c: c.__name__)
@pytest.mark.parametrize("target", ["agent", "router"])
def test_stacked_garbage_gets_a_code_a_client_can_act_on(stubs, servers, target, change):
    fuzz_infer(stubs, servers, target, "chaos", change, examples=4)


@pytest.mark.parametrize("target", ["agent", "router"])
def test_garbage_in_a_stream_is_answered_in_stream_and_the_stream_goes_on(stubs, servers,
                                                                        target):
    stub = stubs[target]

    @settings(FUZZ, max_examples=15)
    @given(data=st.data())
    def fuzz(data):
        count = data.draw(st.integers(1, 8))
        requests: list[Case] = []
        for index in range(count):
            case = data.draw(cases(target))
            if data.draw(st.booleans()):
                data.draw(st.sampled_from(BREAKING))(data, case)
            for key, value in case.metadata:  # a stream's metadata is the stream's
                set_parameter(case.request.parameters, key, value)
            case.metadata = []
            case.request.id = f"r{index}"
            requests.append(case)
        arrays, last = well_formed("mlp", 2, [], seed=count, typed=False)
        last.id = "last"
        requests.append(Case(target, "mlp", arrays, last))
        by_id = {case.request.id: case for case in requests}
        answers = list(stub.ModelStreamInfer(iter([c.request for c in requests]),
                                             timeout=CALL_TIMEOUT_S * 3))
        assert sorted(a.infer_response.id for a in answers) == sorted(by_id)
        for answer in answers:
            case = by_id[answer.infer_response.id]
            if answer.error_message:
                assert case.expect is not None, answer.error_message
                message = answer.error_message
                assert "Traceback" not in message and "internal error" not in message, message
                assert case.field in message, (case.field, message)
            else:
                assert case.expect is None, f"{case.field}: answered OK in the stream"
                check_outputs(case, answer.infer_response)

    fuzz()
    for name in stubs:
        assert_healthy(stubs[name])


@pytest.mark.parametrize("target", ["agent", "router"])
def test_tritonclient_requests_with_bad_shapes_names_and_parameters(servers, target):
    """The unmodified client: what it lets a caller get wrong comes back as a clean error."""
    with grpcclient.InferenceServerClient(servers[target].address) as client:

        @settings(FUZZ, max_examples=30)
        @given(data=st.data())
        def fuzz(data):
            batch = data.draw(st.integers(1, 16))
            array = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
            item = grpcclient.InferInput("input", [batch, 16], "FP32")
            item.set_data_from_numpy(array)
            model, outputs, kwargs, headers = "mlp", None, {}, {}
            broken = data.draw(st.sampled_from(["none", "shape", "model", "output", "timeout",
                                                "priority", "tier", "slo", "parameters"]))
            if broken == "shape":
                item.set_shape(data.draw(st.lists(st.integers(-(2**62), 2**62), max_size=6)
                                         .filter(lambda s: s != [batch, 16])))
            elif broken == "model":
                model = data.draw(texts.filter(lambda n: n and n not in SERVED and "/" not in n))
            elif broken == "output":
                outputs = [grpcclient.InferRequestedOutput(
                    data.draw(texts.filter(lambda n: n != "probabilities")))]
            elif broken == "timeout":
                kwargs["timeout"] = data.draw(st.integers(-(2**63), -1))
            elif broken == "priority":
                kwargs["priority"] = 2**64 - 1  # unsigned on the wire: valid
            elif broken == "tier":
                headers["tiered-tier"] = data.draw(st.sampled_from(["moon", "EDGE", "-"]))
            elif broken == "slo":
                headers["tiered-slo-ms"] = data.draw(st.sampled_from(["-1", "x", "nan", "0"]))
            elif broken == "parameters":
                kwargs["parameters"] = data.draw(st.dictionaries(
                    st.sampled_from(["tiered-key", "user", "x"]),
                    st.one_of(st.booleans(), texts, int64s, st.floats()), max_size=3))
            valid = broken in ("none", "priority", "parameters") or (
                target == "agent" and broken in ("tier", "slo"))
            try:
                result = client.infer(model, [item], outputs=outputs, headers=headers,
                                      client_timeout=CALL_TIMEOUT_S, **kwargs)
            except InferenceServerException as error:
                code = getattr(Code, error.status().removeprefix("StatusCode."))
                assert code in ALLOWED - {Code.OK}, error
                check_message(code, error.message())
                assert not valid, f"{broken}: {error}"
                return
            assert valid, f"{broken}: answered OK"
            assert result.as_numpy("probabilities").shape == (batch, 4)

        fuzz()
    for process in servers.values():
        assert process.alive(), process.log_tail()


@pytest.mark.parametrize("version", ["²", "١"])
def test_a_version_in_non_ascii_digits_is_not_found(stubs, version):
    arrays, request = well_formed("mlp", 1, [], seed=0, typed=False)
    request.model_version = version
    code, message, _ = call(stubs["agent"], Case("agent", "mlp", arrays, request))
    assert code is Code.NOT_FOUND, f"{code.name}: {message}"
    ready = stubs["agent"].ModelReady(pb.ModelReadyRequest(name="mlp", version=version),
                                      timeout=CALL_TIMEOUT_S)
    assert not ready.ready


def test_servers_survive_concurrent_garbage(stubs, servers):
    """Garbage from several threads at once, on both servers, then a valid call each."""
    failures: list[str] = []

    def hammer(target: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(40):
            request = pb.ModelInferRequest(model_name=str(rng.choice(list(ROUTED))))
            for index in range(int(rng.integers(0, 4))):
                request.inputs.add(name=f"x{index}", datatype=str(rng.choice(
                    [*codec.DATATYPES, "NOPE"])), shape=rng.integers(-3, 9, rng.integers(0, 5)))
                request.raw_input_contents.append(rng.bytes(int(rng.integers(0, 64))))
            try:
                stubs[target].ModelInfer(request, timeout=CALL_TIMEOUT_S)
                failures.append(f"{target}: garbage answered OK")
            except grpc.RpcError as error:
                if error.code() not in ALLOWED:
                    failures.append(f"{target}: {error.code().name}: {error.details()}")

    threads = [threading.Thread(target=hammer, args=(target, seed))
               for seed, target in enumerate(["agent", "router"] * 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:5]
    for name in stubs:
        assert_healthy(stubs[name])
    for process in servers.values():
        assert process.alive(), process.log_tail()
