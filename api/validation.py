"""Reads a JSON request body into its pydantic model (errors become 400 via the middleware)."""

from __future__ import annotations

from typing import TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel

from api.errors import InvalidRequestError

B = TypeVar("B", bound=BaseModel)


async def parse_body(request: web.Request, schema: type[B]) -> B:
    try:
        data = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return schema.model_validate(data)
