"""Tensors between numpy and the v2 wire format. Pure: no I/O, no state.

The v2 protocol carries a tensor as name + datatype + shape, with its data
either in typed `contents` fields or as little-endian bytes in
`raw_input_contents` / `raw_output_contents`. BYTES elements are each
prefixed by their length as a 4-byte little-endian unsigned integer.
Every error names the tensor and what was wrong with it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import numpy as np

from tiered.errors import InvalidArgument

# v2 datatype name -> numpy dtype. Multi-byte types are explicitly little-endian,
# which is what the wire carries whatever the host's byte order.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}

# Which typed `contents` field carries each datatype. FP16 has none: the
# protocol sends it raw only.
_CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

_LENGTH = struct.Struct("<I")

# No real tensor comes near these; a shape beyond them is an error, not an
# allocation.
MAX_DIMENSION = 1 << 40
MAX_ELEMENTS = 1 << 40
MAX_RANK = 32  # numpy's limit before numpy 2 (64 since)
# Every BYTES element costs Python objects on the way in and out, on the
# server's event loop (about 0.5 us each way): the 16.8 million empty
# elements a 64 MiB body holds took an agent 42 s and 4.9 GiB. A request's
# BYTES tensors hold at most this many elements in all.
MAX_BYTES_ELEMENTS = 1 << 16


def check_bytes_elements(count: int, field: str) -> None:
    """Refuse `count` BYTES elements past the bound, before any is read."""
    if count > MAX_BYTES_ELEMENTS:
        raise InvalidArgument(f"{field}: {count:,} BYTES elements; a request holds at most "
                              f"{MAX_BYTES_ELEMENTS:,}")


# A tensor's parameters that name a shared-memory range instead of bytes.
SHARED_MEMORY_REGION = "shared_memory_region"
SHARED_MEMORY_BYTE_SIZE = "shared_memory_byte_size"
SHARED_MEMORY_OFFSET = "shared_memory_offset"


def dtype_of(datatype: str, *, field: str = "datatype") -> np.dtype:
    """The numpy dtype of a v2 datatype name."""
    try:
        return DATATYPES[datatype]
    except KeyError:
        raise InvalidArgument(
            f"{field}: unknown datatype {datatype!r}; expected one of {', '.join(DATATYPES)}"
        ) from None


def datatype_of(dtype: np.dtype) -> str:
    """The v2 datatype name of a numpy dtype (strings and bytes are BYTES)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return "BYTES"
    for name, candidate in DATATYPES.items():
        if candidate.kind == dtype.kind and candidate.itemsize == dtype.itemsize:
            return name
    raise InvalidArgument(f"numpy dtype {dtype} has no v2 datatype")


def element_count(shape: Sequence[int], *, field: str) -> int:
    if len(shape) > MAX_RANK:
        raise InvalidArgument(f"{field}: shape has {len(shape)} dimensions; at most {MAX_RANK}")
    count = 1
    for dim in shape:
        if dim < 0:
            raise InvalidArgument(f"{field}: shape {list(shape)} has a negative dimension")
        if dim > MAX_DIMENSION:
            raise InvalidArgument(f"{field}: shape {list(shape)} has a dimension above 2**40")
        count *= dim
    if count > MAX_ELEMENTS:
        raise InvalidArgument(f"{field}: shape {list(shape)} has more than 2**40 elements")
    return count


def bytes_element(data: bytes) -> bytes:
    """One BYTES element as the wire holds it: its length, then its bytes."""
    return _LENGTH.pack(len(data)) + data


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES tensor -> length-prefixed elements in row-major order."""
    return b"".join(
        bytes_element(item.encode("utf-8") if isinstance(item, str) else bytes(item))
        for item in np.asarray(array, dtype=object).reshape(-1))


def deserialize_bytes(buffer: bytes, count: int, *, field: str) -> np.ndarray:
    """Length-prefixed elements -> a flat object array of `bytes`."""
    if count * 4 > len(buffer):  # each element needs at least its prefix
        raise InvalidArgument(
            f"{field}: {len(buffer)} bytes cannot hold {count} BYTES elements"
        )
    items = np.empty(count, dtype=object)
    offset, end = 0, len(buffer)
    for index in range(count):
        if offset + 4 > end:
            raise InvalidArgument(
                f"{field}: BYTES data ends after {index} of {count} elements"
            )
        (length,) = _LENGTH.unpack_from(buffer, offset)
        offset += 4
        if offset + length > end:
            raise InvalidArgument(
                f"{field}: BYTES element {index} claims {length} bytes but only "
                f"{end - offset} remain"
            )
        items[index] = bytes(buffer[offset:offset + length])
        offset += length
    if offset != end:
        raise InvalidArgument(
            f"{field}: {end - offset} bytes left over after {count} BYTES elements"
        )
    return items


def from_raw(raw: bytes, datatype: str, shape: Sequence[int], *, field: str) -> np.ndarray:
    """Raw little-endian bytes -> array. Zero-copy for fixed-size types."""
    dtype = dtype_of(datatype, field=f"{field}.datatype")
    count = element_count(shape, field=field)
    if datatype == "BYTES":
        return deserialize_bytes(raw, count, field=field).reshape(shape)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise InvalidArgument(
            f"{field}: expected {expected} bytes for {datatype} shape {list(shape)}, "
            f"got {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def from_contents(contents, datatype: str, shape: Sequence[int], *, field: str) -> np.ndarray:
    """Typed `InferTensorContents` -> array, range-checked for narrow types."""
    dtype = dtype_of(datatype, field=f"{field}.datatype")
    count = element_count(shape, field=field)
    source = _CONTENTS_FIELD.get(datatype)
    if source is None:
        raise InvalidArgument(f"{field}: {datatype} data must be sent in raw_input_contents")
    values = getattr(contents, source)
    if len(values) != count:
        raise InvalidArgument(
            f"{field}: expected {count} values in contents.{source} for shape "
            f"{list(shape)}, got {len(values)}"
        )
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    # The wide type must hold every value exactly: uint64 above 2**63 too.
    wide_type = np.float64 if dtype.kind == "f" else np.uint64 if dtype.kind == "u" else np.int64
    wide = np.asarray(values, dtype=wide_type)
    if dtype.kind in "iu" and wide.size:
        info = np.iinfo(dtype)
        if wide.min() < info.min or wide.max() > info.max:
            raise InvalidArgument(
                f"{field}: contents.{source} has values outside the range of {datatype}"
            )
    return wide.astype(dtype, copy=False).reshape(shape)


def to_raw(array: np.ndarray) -> tuple[str, list[int], bytes]:
    """Array -> (datatype, shape, raw little-endian bytes)."""
    datatype = datatype_of(array.dtype)
    if datatype == "BYTES":
        return datatype, list(array.shape), serialize_bytes(array)
    wire = DATATYPES[datatype]
    return datatype, list(array.shape), np.ascontiguousarray(array, dtype=wire).tobytes()


def decode_inputs(request, regions=None, raw=None) -> dict[str, np.ndarray]:
    """The inputs of a ModelInferRequest as arrays, keyed by name. An input
    whose parameters name a shared-memory region is read from it through
    `regions` (the agent's `SharedMemory`); raw_input_contents then holds
    one buffer for each of the other inputs, in order, as Triton reads it.
    `raw`: those buffers when they travelled apart from the message."""
    raw = list(request.raw_input_contents) if raw is None else raw
    arrays: dict[str, np.ndarray] = {}
    in_region = [SHARED_MEMORY_REGION in tensor.parameters for tensor in request.inputs]
    if raw and len(raw) != in_region.count(False):
        raise InvalidArgument(
            f"raw_input_contents: {len(raw)} buffers for {in_region.count(False)} inputs "
            "not in shared memory; send every such input raw or none"
        )
    if any(in_region) and regions is None:
        raise InvalidArgument("inputs: shared-memory regions are read only by the agent "
                              "they were registered with")
    check_bytes_elements(sum(element_count(tuple(tensor.shape),
                                           field=f"inputs[{index}] {tensor.name!r}")
                             for index, tensor in enumerate(request.inputs)
                             if tensor.datatype == "BYTES"), "inputs")
    next_raw = iter(raw)
    for index, tensor in enumerate(request.inputs):
        field = f"inputs[{index}] {tensor.name!r}"
        if tensor.name in arrays:
            raise InvalidArgument(f"{field}: input given more than once")
        shape = tuple(tensor.shape)
        if in_region[index]:
            arrays[tensor.name] = regions.read(parameters_of(tensor.parameters),
                                               tensor.datatype, shape, field)
        elif raw:
            if tensor.contents.ListFields():  # two sources for one tensor: refuse, never pick
                raise InvalidArgument(
                    f"{field}: contents given beside raw_input_contents; send one of them"
                )
            arrays[tensor.name] = from_raw(next(next_raw), tensor.datatype, shape, field=field)
        else:
            arrays[tensor.name] = from_contents(tensor.contents, tensor.datatype, shape, field=field)
    return arrays


def parameter_value(parameter):
    """The Python value of an InferParameter (whichever oneof member is set)."""
    kind = parameter.WhichOneof("parameter_choice")
    return None if kind is None else getattr(parameter, kind)


def set_parameter(parameter, value) -> None:
    """Set an InferParameter to a Python value (the oneof member its type names)."""
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        if value >= 2**63:
            parameter.uint64_param = value
        else:
            parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = str(value)


def parameters_of(parameters: Mapping) -> dict[str, object]:
    return {key: parameter_value(value) for key, value in parameters.items()}
