"""The Open Inference Protocol's tensors on the wire (KServe v2 / Triton's HTTP/REST): JSON tensors, and
Triton's binary tensor data extension, which tritonclient's HTTP client uses by default.

An infer request is a JSON header, optionally followed by raw tensor bytes: the header's length is
in `Inference-Header-Content-Length`, and each input with `parameters.binary_data_size` takes that
many bytes, in input order. BYTES elements are each a 4-byte little-endian length and the bytes.
Responses put an output in binary the same way when the request asks (`binary_data` per output, or
`binary_data_output` for all). The tensors' values to and from numpy: `services.inference.tensors`.
"""

from __future__ import annotations

import numpy as np
import orjson

from services.errors import InvalidRequestError
from services.inference import to_bytes, to_json_data

HEADER_LENGTH = "Inference-Header-Content-Length"


def split_body(raw: bytes, header_length: str | None) -> tuple[dict, bytes]:
    """The JSON header and the binary data after it."""
    try:
        length = len(raw) if header_length is None else int(header_length)
        if not 0 <= length <= len(raw):
            raise ValueError(f"{HEADER_LENGTH} is {length}, the body {len(raw)} bytes")
        header = orjson.loads(raw[:length])
    except (ValueError, orjson.JSONDecodeError) as exc:
        raise InvalidRequestError(f"the request is not an inference request: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list) or not header["inputs"]:
        raise InvalidRequestError("the request must have a non-empty `inputs` list", param="inputs")
    return header, raw[length:]


def response_body(header: dict, outputs: list[tuple[str, str, np.ndarray]], meta: dict) -> tuple[bytes, dict]:
    """The response (`meta` and the outputs as JSON, then the binary outputs' bytes) and its headers, for
    (name, datatype, array) outputs filtered and encoded as the request's `outputs` ask (all of them, in JSON
    unless `parameters.binary_data_output`)."""
    asked = {o.get("name"): o for o in header.get("outputs") or [] if isinstance(o, dict)}
    binary_default = bool((header.get("parameters") or {}).get("binary_data_output", False))
    if unknown := sorted(set(asked) - {name for name, _, _ in outputs}, key=str):
        raise InvalidRequestError(f"the model has no output {unknown[0]!r}", param="outputs")
    tensors, blobs = [], []
    for name, datatype, array in outputs:
        if asked and name not in asked:
            continue
        tensor = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if (asked.get(name, {}).get("parameters") or {}).get("binary_data", binary_default):
            blob = to_bytes(array, datatype)
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = to_json_data(array, datatype)
        tensors.append(tensor)
    body = orjson.dumps({**meta, **({"id": header["id"]} if "id" in header else {}), "outputs": tensors})
    if not blobs:
        return body, {"Content-Type": "application/json"}
    return body + b"".join(blobs), {HEADER_LENGTH: str(len(body)), "Content-Type": "application/octet-stream"}
