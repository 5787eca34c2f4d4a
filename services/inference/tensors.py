"""Named tensors as the Open Inference Protocol carries them, to and from numpy: JSON `data` (flat or
nested, row-major) and Triton's raw little-endian bytes (BYTES elements: a 4-byte length, then the bytes),
each input checked against its declared datatype and shape with a 400 naming it. Shared by the protocol's
REST and gRPC front doors (`api.oip_tensors` frames the HTTP body) and batch jobs over tensor models, so a
tensor is read, and refused, the same way everywhere. Nothing here knows a model: `encoders.check_tensors`
checks tensors against one."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from engine.types import TENSOR_DATATYPES
from services.errors import InvalidRequestError

MAX_ELEMENTS = 1 << 26  # per tensor


def read_inputs(header: dict, binary: bytes) -> dict[str, np.ndarray]:
    """Each input tensor as a numpy array of its shape and datatype (BYTES: an object array of bytes)."""
    tensors, offset = {}, 0
    for i, spec in enumerate(header["inputs"]):
        where = f"inputs.{i}"
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise InvalidRequestError(f"{where} must be an object with a `name`", param=where)
        name, datatype, shape = spec["name"], spec.get("datatype"), spec.get("shape")
        if datatype not in TENSOR_DATATYPES:
            raise InvalidRequestError(f"{where}.datatype must be one of {', '.join(TENSOR_DATATYPES)}", param=where)
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise InvalidRequestError(f"{where}.shape must be a list of sizes >= 0", param=where)
        count = int(np.prod(shape, dtype=np.int64))
        if count > MAX_ELEMENTS:
            raise InvalidRequestError(f"{where} has {count} elements; at most {MAX_ELEMENTS}", param=where)
        size = (spec.get("parameters") or {}).get("binary_data_size")
        if name in tensors:
            raise InvalidRequestError(f"{where}: input {name!r} is given twice", param=where)
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise InvalidRequestError(f"{where}.parameters.binary_data_size runs past the body", param=where)
            tensors[name] = from_bytes(binary[offset:offset + size], datatype, shape, where)
            offset += size
        elif "data" in spec:
            tensors[name] = from_json(spec["data"], datatype, shape, where)
        else:
            raise InvalidRequestError(f"{where} has neither `data` nor binary data", param=where)
    return tensors


def from_json(data: Any, datatype: str, shape: list[int], where: str) -> np.ndarray:
    try:
        if datatype == "BYTES":
            flat = np.asarray(data, dtype=object).reshape(-1)
            if not all(isinstance(x, str) for x in flat):
                raise ValueError("BYTES elements must be strings")
            array = np.array([x.encode() for x in flat] if len(flat) else [], dtype=object)
        else:
            array = np.asarray(data, dtype=TENSOR_DATATYPES[datatype]).reshape(-1)
            if datatype == "BOOL" and array.dtype != np.bool_:
                raise ValueError("BOOL elements must be true or false")
        return array.reshape(shape)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidRequestError(f"{where}.data does not fit datatype {datatype} and shape {shape}: {exc}",
                                  param=where) from exc


def from_bytes(raw: bytes, datatype: str, shape: list[int], where: str) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    if datatype != "BYTES":
        dtype = np.dtype(TENSOR_DATATYPES[datatype])
        if len(raw) != count * dtype.itemsize:
            raise InvalidRequestError(f"{where} has {len(raw)} bytes of data; shape {shape} of {datatype} needs "
                                      f"{count * dtype.itemsize}", param=where)
        return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)
    items, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidRequestError(f"{where}: a BYTES element's length is cut off", param=where)
        (length,) = struct.unpack_from("<I", raw, offset)
        items.append(raw[offset + 4:offset + 4 + length])
        offset += 4 + length
    if offset != len(raw) or len(items) != count:
        raise InvalidRequestError(f"{where} holds {len(items)} BYTES elements; shape {shape} needs {count}",
                                  param=where)
    return np.array(items, dtype=object).reshape(shape)


def to_bytes(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(x)) + x for x in (v if isinstance(v, bytes) else str(v).encode()
                                                                  for v in array.reshape(-1)))
    return np.ascontiguousarray(array, dtype=np.dtype(TENSOR_DATATYPES[datatype]).newbyteorder("<")).tobytes()


def to_json_data(array: np.ndarray, datatype: str) -> list:
    flat = array.reshape(-1)
    if datatype == "BYTES":
        return [x.decode(errors="replace") if isinstance(x, bytes) else str(x) for x in flat]
    return flat.tolist()
