"""Reads request bodies, query strings and headers into their pydantic models (errors become 400
via the middleware), with JSON Schema's meaning of the types the spec shows: a body is validated
strictly (no "3" for an integer, no `true` for a number) and `3.0` is the integer 3."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any, TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel

from services.errors import InvalidRequestError, PayloadTooLargeError

B = TypeVar("B", bound=BaseModel)


OFF_LOOP_BYTES = 256 * 1024  # larger bodies are parsed and validated on a thread, not on the event loop
MAX_DEPTH = 32  # no schema nests near this; deeper bodies would only exhaust the recursion limit


async def parse_body(request: web.Request, schema: type[B]) -> B:
    """The body as `schema`; over the schema's `max_body_bytes` (if it has one): 413."""
    raw = await read_body(request, getattr(schema, "max_body_bytes", None))
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(decode_body, raw, schema)
    return decode_body(raw, schema)


async def read_body(request: web.Request, max_bytes: int | None) -> bytes:
    """The body, refused before reading when its Content-Length is over `max_bytes` (the app's
    `client_max_size` bounds every body; a route's own bound may be tighter)."""
    too_large = PayloadTooLargeError(f"the request body is over {max_bytes} bytes, this route's limit",
                                     code="request_too_large")
    if max_bytes is not None and (request.content_length or 0) > max_bytes:
        raise too_large
    raw = await request.read()
    if max_bytes is not None and len(raw) > max_bytes:
        raise too_large
    return raw


def decode_body(raw: bytes, schema: type[B]) -> B:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        data = non_finite_json(raw, schema, exc)
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return schema.model_validate(json_integers(data), strict=True)


def non_finite_json(raw: bytes, schema: type[BaseModel], error: orjson.JSONDecodeError) -> Any:
    """`NaN`, `Infinity` and numbers past a double (`1e400`) are not JSON, but Python clients send
    them (json.dumps allows them). For a schema that refuses non-finite floats anyway, read them,
    so the 400 names the field that held one instead of only saying "not JSON"."""
    if schema.model_config.get("allow_inf_nan", True):
        raise InvalidRequestError(f"request body is not valid JSON: {error}") from error
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidRequestError(f"request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError:
        raise InvalidRequestError(f"request body is not valid JSON: {error}") from error
    try:  # Python's parser also takes lone surrogates ("\\ud800"), which orjson refused and no tokenizer encodes
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise InvalidRequestError("request body is not valid JSON: a string holds a lone surrogate") from None
    except RecursionError:
        raise InvalidRequestError(f"request body nests deeper than {MAX_DEPTH} levels") from None
    return data


def json_integers(value: Any, depth: int = 0) -> Any:
    """Integral floats as ints, all the way down: JSON Schema's `integer` includes 3.0. A body
    nested deeper than MAX_DEPTH is a 400 (orjson reads 1024 levels; Python recurses fewer).
    Only containers and floats are visited: a list of 60k token ids costs no call per id."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if not isinstance(value, (dict, list)):
        return value
    if depth >= MAX_DEPTH:
        raise InvalidRequestError(f"request body nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        return {key: json_integers(item, depth + 1) if isinstance(item, _VISITED) else item
                for key, item in value.items()}
    return [json_integers(item, depth + 1) if isinstance(item, _VISITED) else item for item in value]


_VISITED = (dict, list, float)


def parse_params(values: Mapping[str, str], schema: type[B]) -> B:
    """Query parameters or headers (strings, so validated in lax mode: "5" is the integer 5).
    Names the model does not declare are ignored, as HTTP does."""
    fields = {field.alias or name for name, field in schema.model_fields.items()}
    return schema.model_validate({name: values[name] for name in fields if name in values})
