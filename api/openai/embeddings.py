"""OpenAI's POST /v1/embeddings: its request and response bodies and the handler.

The model version is routed like a generation's (`name@version`, the traffic split by `user`
or request id, a cold version loads while the caller waits); the inputs go through
`services.inference.encoders.Encoders` (response cache, then the version's batcher).
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Literal

from aiohttp import web
from pydantic import BaseModel, Discriminator, Field, Tag

from api.auth import caller_of
from api.errors import json_response
from api.openai.fields import MAX_NAME_CHARS, Strict, TokenId
from api.response_cache import cache_flag
from api.routes import Route
from api.services import services
from api.validation import parse_body
from api.versions import model_label, resolve_model

MAX_INPUTS = 2048
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CacheOptions(Strict):
    cache: bool | None = Field(None, description="false: skip the response cache for this request "
                               "(as does the header `Cache-Control: no-cache`)")


def input_shape(value: object) -> str:
    """Which of the four shapes an embeddings `input` is, from its first item: the union is then
    validated against that one member, so an error names it (`input.list.3`), and a huge list
    is not validated four times over with an error per item (seconds holding the GIL)."""
    if not isinstance(value, list):
        return "str"
    first = value[0] if value else None
    if isinstance(first, list):
        return "lists"
    return "ids" if isinstance(first, int) and not isinstance(first, bool) else "list"


EmbeddingInput = Annotated[
    Annotated[Text, Tag("str")] | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS), Tag("list")]
    | Annotated[TokenIds, Tag("ids")]
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS), Tag("lists")],
    Discriminator(input_shape)]


class EmbeddingRequest(Strict):
    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    input: EmbeddingInput = Field(
        description="A string, a list of strings, a list of token ids, or a list of such lists.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each embedding is the base64 of its little-endian float32 bytes.")
    dimensions: int | None = Field(None, ge=1, le=1 << 20, description="Only the model's own dimension is supported.")
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    galley: CacheOptions | None = Field(None, description="galley extensions")

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def base64_floats(values: list[float]) -> str:
    """OpenAI's base64 encoding: the little-endian float32 bytes of the vector."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


async def embeddings(request: web.Request) -> web.Response:
    body = await parse_body(request, EmbeddingRequest)
    model = await resolve_model(request, body.model, user=body.user, kinds=("embed",))
    outputs = await services(request).encoders.embed(caller_of(request), model, body.inputs(),
                                                cache_flag(request, body.galley), body.dimensions)
    encode = base64_floats if body.encoding_format == "base64" else (lambda v: v)
    data = [{"object": "embedding", "index": i, "embedding": encode(out.values)} for i, out in enumerate(outputs)]
    tokens = sum(out.num_tokens for out in outputs)
    return json_response({"object": "list", "data": data, "model": model_label(request, model),
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


ROUTES = [
    Route("POST", "/v1/embeddings", embeddings, "Create embeddings (OpenAI)",
          request=EmbeddingRequest, response=EmbeddingResponse),
]
