"""Tensors survive the trip numpy -> v2 wire -> numpy, and bad wire data is
refused with InvalidArgument naming the tensor."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tiered.errors import InvalidArgument
from tiered.protocol import codec
from tiered.protocol import grpc_service_pb2 as pb

FIXED_DATATYPES = [name for name in codec.DATATYPES if name != "BYTES"]
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _request(*tensors: tuple[str, str, list[int]], raw: list[bytes] | None = None):
    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, shape in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    for buffer in raw or ():
        request.raw_input_contents.append(buffer)
    return request


@contextmanager
def _raises_naming(match: str, *names: str) -> Iterator[pytest.ExceptionInfo]:
    """pytest.raises(InvalidArgument) whose message also names each of `names`."""
    with pytest.raises(InvalidArgument, match=match) as info:
        yield info
    for name in names:
        assert name in str(info.value), f"{name!r} not in {info.value}"


# --- raw round trip -----------------------------------------------------------


@pytest.mark.parametrize("datatype", FIXED_DATATYPES)
@FAST
@given(data=st.data())
def test_fixed_size_tensors_round_trip_through_raw_bytes(datatype: str, data) -> None:
    dtype = codec.DATATYPES[datatype]
    shape = data.draw(SHAPES)
    elements = None
    if dtype.kind == "f":
        elements = hnp.from_dtype(dtype, allow_nan=True, allow_infinity=True)
    array = data.draw(hnp.arrays(dtype, shape, elements=elements))

    name, wire_shape, raw = codec.to_raw(array)
    back = codec.from_raw(raw, name, wire_shape, field="t")

    assert name == datatype
    assert wire_shape == list(array.shape)
    assert len(raw) == array.size * dtype.itemsize
    assert back.dtype == dtype
    assert back.shape == array.shape
    np.testing.assert_array_equal(back, array)  # NaN == NaN here
    if dtype.kind == "f":  # bit-exact, so -0.0 and NaN payloads survive too
        assert back.tobytes() == array.tobytes()


bytes_elements = st.binary(min_size=0, max_size=12) | st.sampled_from([b"", b"\x00", b"a\x00b\x00"])


@FAST
@given(shape=SHAPES, data=st.data())
def test_bytes_tensors_round_trip_through_length_prefixed_raw_bytes(shape, data) -> None:
    size = int(np.prod(shape, dtype=np.int64))
    items = data.draw(st.lists(bytes_elements, min_size=size, max_size=size))
    array = np.empty(size, dtype=object)
    array[:] = items
    array = array.reshape(shape)

    name, wire_shape, raw = codec.to_raw(array)
    back = codec.from_raw(raw, name, wire_shape, field="t")

    assert name == "BYTES"
    assert len(raw) == sum(4 + len(item) for item in items)
    assert back.dtype == object
    assert back.shape == array.shape
    np.testing.assert_array_equal(back, array)
    assert all(type(item) is bytes for item in back.reshape(-1))


@FAST
@given(texts=st.lists(st.text(max_size=8), min_size=0, max_size=6))
def test_str_elements_come_back_as_utf8_bytes(texts: list[str]) -> None:
    array = np.empty(len(texts), dtype=object)
    array[:] = texts

    name, shape, raw = codec.to_raw(array)
    back = codec.from_raw(raw, name, shape, field="t")

    assert name == "BYTES"
    assert list(back) == [text.encode("utf-8") for text in texts]


def test_unicode_arrays_are_sent_as_bytes() -> None:
    name, shape, raw = codec.to_raw(np.array([["héllo", ""], ["x", "ñ"]]))

    back = codec.from_raw(raw, name, shape, field="t")

    assert (name, shape) == ("BYTES", [2, 2])
    assert back.tolist() == [["héllo".encode(), b""], [b"x", "ñ".encode()]]


@pytest.mark.parametrize("dtype", [">i4", ">f8", ">u2", ">f2"])
def test_big_endian_arrays_go_on_the_wire_little_endian(dtype: str) -> None:
    array = np.arange(6, dtype=dtype).reshape(2, 3)

    name, shape, raw = codec.to_raw(array)
    back = codec.from_raw(raw, name, shape, field="t")

    assert raw == array.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    np.testing.assert_array_equal(back, array)


def test_non_contiguous_arrays_round_trip() -> None:
    array = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2].T

    name, shape, raw = codec.to_raw(array)

    np.testing.assert_array_equal(codec.from_raw(raw, name, shape, field="t"), array)


# --- BYTES serialization ------------------------------------------------------


def test_bytes_serialization_matches_the_known_wire_vector() -> None:
    wire = b"\x01\x00\x00\x00a\x00\x00\x00\x00\x03\x00\x00\x00xyz"
    array = np.array([b"a", b"", b"xyz"], dtype=object)

    assert codec.serialize_bytes(array) == wire
    assert codec.deserialize_bytes(wire, 3, field="t").tolist() == [b"a", b"", b"xyz"]


@pytest.mark.parametrize(
    ("case", "buffer", "count", "match"),
    [
        ("prefix cut short", b"\x01\x00", 1, "cannot hold 1 BYTES"),
        ("element claims more than remains", b"\x05\x00\x00\x00abc", 1, "claims 5 bytes"),
        ("bytes left over", b"\x01\x00\x00\x00ab", 1, "1 bytes left over"),
        ("fewer elements than count", b"\x00\x00\x00\x00", 2, "cannot hold 2 BYTES"),
        ("data for zero elements", b"\x00", 0, "left over"),
    ],
)
def test_deserialize_bytes_refuses_malformed_buffers(
    case: str, buffer: bytes, count: int, match: str
) -> None:
    with _raises_naming(match, "tensor-x"):
        codec.deserialize_bytes(buffer, count, field="tensor-x")


def _empty_bytes_request(*shapes: list[int]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest()
    for index, shape in enumerate(shapes):
        request.inputs.add(name=f"t{index}", datatype="BYTES", shape=shape)
        request.raw_input_contents.append(bytes(4 * int(np.prod(shape))))
    return request


@pytest.mark.parametrize("shapes", [[[codec.MAX_BYTES_ELEMENTS + 1]],
                                    [[codec.MAX_BYTES_ELEMENTS // 2, 2], [1]]])
def test_a_request_past_its_bytes_elements_is_refused_before_any_is_read(shapes) -> None:
    """Empty elements, the cheapest to send and the dearest to decode: one
    tensor past the bound, or two that together pass it; at the bound, read."""
    with pytest.raises(InvalidArgument, match="inputs: 65,537 BYTES elements; a request "
                                              "holds at most 65,536"):
        codec.decode_inputs(_empty_bytes_request(*shapes))
    at_bound = codec.decode_inputs(_empty_bytes_request([codec.MAX_BYTES_ELEMENTS]))
    assert at_bound["t0"].size == codec.MAX_BYTES_ELEMENTS


# --- typed contents -----------------------------------------------------------

TYPED_CASES = [
    # datatype, typed contents field, values
    ("BOOL", "bool_contents", [True, False, True, True]),
    ("UINT8", "uint_contents", [0, 1, 128, 255]),
    ("UINT16", "uint_contents", [0, 1, 40000, 65535]),
    ("UINT32", "uint_contents", [0, 1, 2**31, 2**32 - 1]),
    ("UINT64", "uint64_contents", [0, 1, 2**32, 2**63 - 1]),
    ("INT8", "int_contents", [-128, -1, 0, 127]),
    ("INT16", "int_contents", [-32768, -1, 0, 32767]),
    ("INT32", "int_contents", [-(2**31), -1, 0, 2**31 - 1]),
    ("INT64", "int64_contents", [-(2**63), -1, 0, 2**63 - 1]),
    ("FP32", "fp32_contents", [-1.5, 0.0, float("inf"), float("nan")]),
    ("FP64", "fp64_contents", [-1e300, 5e-324, float("-inf"), float("nan")]),
    ("BYTES", "bytes_contents", [b"", b"\x00\x01", b"abc", "é".encode()]),
]


@pytest.mark.parametrize(("datatype", "source", "values"), TYPED_CASES,
                         ids=[case[0] for case in TYPED_CASES])
def test_typed_contents_decode_to_the_same_values(datatype, source, values) -> None:
    request = _request(("x", datatype, [2, 2]))
    getattr(request.inputs[0].contents, source).extend(values)

    arrays = codec.decode_inputs(request)

    assert list(arrays) == ["x"]
    array = arrays["x"]
    assert array.dtype == codec.DATATYPES[datatype]
    assert array.shape == (2, 2)
    expected = np.empty(4, dtype=codec.DATATYPES[datatype])
    expected[:] = values
    np.testing.assert_array_equal(array, expected.reshape(2, 2))


def test_uint64_contents_above_int64_decode_exactly() -> None:
    request = _request(("big", "UINT64", [2]))
    request.inputs[0].contents.uint64_contents.extend([2**63 + 1, 2**64 - 1])

    np.testing.assert_array_equal(
        codec.decode_inputs(request)["big"], np.array([2**63 + 1, 2**64 - 1], np.uint64)
    )


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_uint64_contents_mixing_small_and_huge_values_decode_exactly() -> None:
    values = [0, 1, 2**63 + 1, 2**64 - 1]
    request = _request(("big", "UINT64", [4]))
    request.inputs[0].contents.uint64_contents.extend(values)

    np.testing.assert_array_equal(codec.decode_inputs(request)["big"], np.array(values, np.uint64))


def test_typed_contents_of_several_inputs_decode_by_name() -> None:
    request = _request(("a", "INT32", [3]), ("b", "FP64", [1, 2]), ("c", "BYTES", [0]))
    request.inputs[0].contents.int_contents.extend([1, 2, 3])
    request.inputs[1].contents.fp64_contents.extend([0.5, 1.5])

    arrays = codec.decode_inputs(request)

    assert list(arrays) == ["a", "b", "c"]
    np.testing.assert_array_equal(arrays["a"], np.array([1, 2, 3], np.int32))
    np.testing.assert_array_equal(arrays["b"], np.array([[0.5, 1.5]]))
    assert arrays["c"].shape == (0,) and arrays["c"].dtype == object


@pytest.mark.parametrize("datatype", sorted(set(FIXED_DATATYPES) - {"FP16"}) + ["BYTES"])
def test_empty_typed_contents_decode_to_zero_size_arrays(datatype: str) -> None:
    arrays = codec.decode_inputs(_request(("x", datatype, [0, 3])))

    assert arrays["x"].shape == (0, 3)
    assert arrays["x"].dtype == codec.DATATYPES[datatype]


def test_fp16_through_typed_contents_is_refused_naming_raw_input_contents() -> None:
    request = _request(("half", "FP16", [2]))
    request.inputs[0].contents.fp32_contents.extend([1.0, 2.0])

    with _raises_naming("raw_input_contents", "'half'", "FP16"):
        codec.decode_inputs(request)


OUT_OF_RANGE = [
    ("INT8", "int_contents", [0, 128]),
    ("INT8", "int_contents", [-129, 0]),
    ("INT16", "int_contents", [32768, 0]),
    ("INT16", "int_contents", [-32769, 0]),
    ("UINT8", "uint_contents", [256, 0]),
    ("UINT16", "uint_contents", [0, 65536]),
]


@pytest.mark.parametrize(("datatype", "source", "values"), OUT_OF_RANGE,
                         ids=[f"{d}-{v}" for d, _, v in OUT_OF_RANGE])
def test_typed_values_outside_the_datatype_range_are_refused(datatype, source, values) -> None:
    request = _request(("narrow", datatype, [2]))
    getattr(request.inputs[0].contents, source).extend(values)

    with _raises_naming("outside the range", "'narrow'", datatype, source):
        codec.decode_inputs(request)


def test_typed_contents_with_the_wrong_count_are_refused() -> None:
    request = _request(("x", "INT64", [2, 2]))
    request.inputs[0].contents.int64_contents.extend([1, 2, 3])

    with _raises_naming("expected 4 values in contents.int64_contents", "'x'", "got 3"):
        codec.decode_inputs(request)


def test_typed_contents_in_the_wrong_field_are_refused() -> None:
    request = _request(("x", "INT64", [2]))
    request.inputs[0].contents.int_contents.extend([1, 2])  # INT64 lives in int64_contents

    with _raises_naming("int64_contents", "'x'"):
        codec.decode_inputs(request)


# --- decode_inputs errors -----------------------------------------------------

DECODE_ERRORS = {
    "raw byte size mismatch": (
        _request(("img", "FP32", [2, 2]), raw=[b"\x00" * 15]),
        "expected 16 bytes", "'img'",
    ),
    "raw bytes for a zero-size tensor": (
        _request(("img", "INT8", [0, 4]), raw=[b"\x00"]),
        "expected 0 bytes", "'img'",
    ),
    "BYTES length prefix claims more than remains": (
        _request(("text", "BYTES", [1]), raw=[b"\x09\x00\x00\x00abc"]),
        "claims 9 bytes but only 3 remain", "'text'",
    ),
    "BYTES data runs out before the last element": (
        _request(("text", "BYTES", [2]), raw=[b"\x01\x00\x00\x00a"]),
        "cannot hold 2 BYTES", "'text'",
    ),
    "BYTES bytes left over": (
        _request(("text", "BYTES", [1]), raw=[b"\x01\x00\x00\x00ab!"]),
        "2 bytes left over", "'text'",
    ),
    "fewer raw buffers than inputs": (
        _request(("a", "FP32", [1]), ("b", "FP32", [1]), raw=[b"\x00" * 4]),
        "1 buffers for 2 inputs", "raw_input_contents",
    ),
    "more raw buffers than inputs": (
        _request(("a", "FP32", [1]), raw=[b"\x00" * 4, b"\x00" * 4]),
        "2 buffers for 1 inputs", "raw_input_contents",
    ),
    "duplicate input names (raw)": (
        _request(("dup", "FP32", [1]), ("dup", "FP32", [1]), raw=[b"\x00" * 4] * 2),
        "more than once", "inputs[1] 'dup'",
    ),
    "duplicate input names (typed)": (
        _request(("dup", "BOOL", [0]), ("dup", "BOOL", [0])),
        "more than once", "inputs[1] 'dup'",
    ),
    "negative dim (raw)": (
        _request(("neg", "FP32", [-1, 2]), raw=[b""]),
        "negative dimension", "'neg'",
    ),
    "negative dim (typed)": (
        _request(("neg", "INT32", [2, -3])),
        "negative dimension", "'neg'",
    ),
    "negative dim (BYTES)": (
        _request(("neg", "BYTES", [-1]), raw=[b""]),
        "negative dimension", "'neg'",
    ),
    "unknown datatype (raw)": (
        _request(("odd", "FP31", [1]), raw=[b"\x00" * 4]),
        "unknown datatype 'FP31'", "'odd'",
    ),
    "unknown datatype (typed)": (
        _request(("odd", "fp32", [1])),
        "unknown datatype 'fp32'", "'odd'",
    ),
}


@pytest.mark.parametrize(("request_", "match", "named"), DECODE_ERRORS.values(),
                         ids=DECODE_ERRORS.keys())
def test_decode_inputs_refuses_bad_wire_data_naming_the_input(request_, match, named) -> None:
    with _raises_naming(match, named):
        codec.decode_inputs(request_)


@pytest.mark.parametrize(
    ("datatype", "shape"),
    [("FP32", [0, 2**62]), ("BYTES", [2**62]), ("BYTES", [0, 2**62])],
    ids=["zero-size FP32 with a huge dim", "BYTES claiming 2**62 elements",
         "zero-size BYTES with a huge dim"],
)
def test_decode_inputs_refuses_absurd_shapes_as_invalid_argument(datatype, shape) -> None:
    request = _request(("huge", datatype, shape), raw=[b""])

    with _raises_naming("'huge'"):
        codec.decode_inputs(request)


def test_decode_inputs_reads_raw_buffers_by_position() -> None:
    a = np.arange(6, dtype=np.int16).reshape(2, 3)
    b = np.array([b"x", b""], dtype=object)
    request = _request(("a", "INT16", [2, 3]), ("b", "BYTES", [2]),
                       raw=[codec.to_raw(a)[2], codec.to_raw(b)[2]])

    arrays = codec.decode_inputs(request)

    np.testing.assert_array_equal(arrays["a"], a)
    assert arrays["b"].tolist() == [b"x", b""]


def test_decode_inputs_of_a_request_without_inputs_is_empty() -> None:
    assert codec.decode_inputs(pb.ModelInferRequest(model_name="m")) == {}


# --- datatype mapping ---------------------------------------------------------

DTYPE_TABLE = [
    ("BOOL", np.bool_),
    ("UINT8", np.uint8),
    ("UINT16", np.uint16),
    ("UINT32", np.uint32),
    ("UINT64", np.uint64),
    ("INT8", np.int8),
    ("INT16", np.int16),
    ("INT32", np.int32),
    ("INT64", np.int64),
    ("FP16", np.float16),
    ("FP32", np.float32),
    ("FP64", np.float64),
    ("BYTES", np.object_),
]


def test_the_datatype_table_covers_every_v2_datatype() -> None:
    assert [name for name, _ in DTYPE_TABLE] == list(codec.DATATYPES)


@pytest.mark.parametrize(("datatype", "numpy_type"), DTYPE_TABLE)
def test_datatype_names_and_numpy_dtypes_map_both_ways(datatype: str, numpy_type) -> None:
    dtype = codec.dtype_of(datatype)

    assert dtype == np.dtype(numpy_type)
    assert dtype.byteorder in "<|=" or dtype.itemsize == 1
    assert codec.datatype_of(np.dtype(numpy_type)) == datatype
    assert codec.datatype_of(dtype) == datatype


@pytest.mark.parametrize("dtype", ["S5", "U3", "O", ">i8", ">f4"])
def test_datatype_of_maps_strings_bytes_and_any_byte_order(dtype: str) -> None:
    expected = {"S5": "BYTES", "U3": "BYTES", "O": "BYTES", ">i8": "INT64", ">f4": "FP32"}
    assert codec.datatype_of(np.dtype(dtype)) == expected[dtype]


@pytest.mark.parametrize("dtype", ["c8", "c16", "M8[s]", "m8[s]", "V4"])
def test_numpy_dtypes_without_a_v2_datatype_are_refused(dtype: str) -> None:
    with pytest.raises(InvalidArgument, match="has no v2 datatype"):
        codec.datatype_of(np.dtype(dtype))


@pytest.mark.parametrize("name", ["fp32", "FLOAT", "", "BF16", "STRING"])
def test_unknown_datatype_names_are_refused_naming_the_field(name: str) -> None:
    with pytest.raises(InvalidArgument, match=r"outputs\[0\]\.datatype: unknown datatype"):
        codec.dtype_of(name, field="outputs[0].datatype")


# --- parameters ---------------------------------------------------------------

PARAMETER_CASES = [
    ("bool_param", True),
    ("bool_param", False),
    ("int64_param", -(2**63)),
    ("string_param", "edge"),
    ("string_param", ""),
    ("double_param", 2.5),
    ("uint64_param", 2**64 - 1),
]


@pytest.mark.parametrize(("kind", "value"), PARAMETER_CASES)
def test_parameters_of_reads_whichever_oneof_member_is_set(kind: str, value) -> None:
    request = pb.ModelInferRequest()
    request.parameters["p"].CopyFrom(pb.InferParameter(**{kind: value}))

    assert codec.parameters_of(request.parameters) == {"p": value}


def test_parameters_of_reads_a_mixed_map_and_unset_parameters_as_none() -> None:
    request = pb.ModelInferRequest()
    request.parameters["tiered-tier"].string_param = "regional"
    request.parameters["tiered-slo-ms"].double_param = 20.0
    request.parameters["priority"].int64_param = 3
    request.parameters["sequence_id"].uint64_param = 7
    request.parameters["binary"].bool_param = True
    request.parameters["empty"].SetInParent()

    assert codec.parameters_of(request.parameters) == {
        "tiered-tier": "regional",
        "tiered-slo-ms": 20.0,
        "priority": 3,
        "sequence_id": 7,
        "binary": True,
        "empty": None,
    }


def test_parameters_of_an_empty_map_is_empty() -> None:
    assert codec.parameters_of(pb.ModelInferRequest().parameters) == {}
