"""Rerank and score: `POST /v1/rerank` (also `/v2/rerank` and `/rerank`: the Cohere/Jina shape vLLM and
llama.cpp serve) and vLLM's `POST /v1/score` (also `/score`).

A cross-encoder (a `classify` model with one label) scores each (query, document) pair as one input,
as sentence-transformers' `CrossEncoder.predict` does; an `embed` model scores by cosine similarity.
The pairs go through `services.inference.encoders.Encoders.score` (response cache, then the
version's batcher), routed like any encoder request.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from aiohttp import web
from pydantic import BaseModel, Field

from api.auth import caller_of
from api.errors import json_response
from api.openai.embeddings import MAX_INPUTS, CacheOptions
from api.openai.fields import MAX_NAME_CHARS, Strict
from api.response_cache import cache_flag
from api.routes import Route
from api.services import services
from api.validation import parse_body
from api.versions import model_label, resolve_model
from services.errors import InvalidRequestError

SCORING = ("classify", "embed")  # cross-encoders, and embedding models by cosine


class DocumentIn(Strict):
    text: str = Field(description="The document's text (Cohere's object form of a document).")


Documents = Annotated[list[str | DocumentIn], Field(min_length=1, max_length=MAX_INPUTS)]
Texts = str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]


class RerankRequest(Strict):
    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    query: str
    documents: Documents = Field(description="Strings, or objects with a `text`.")
    top_n: int | None = Field(None, ge=0, description="Return the best N; 0 or unset: all, best first.")
    return_documents: bool = Field(True, description="false: results carry `index` and `relevance_score` only.")
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    galley: CacheOptions | None = Field(None, description="galley extensions")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ScoreRequest(Strict):
    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    text_1: Texts = Field(description="One text, scored against each of `text_2`; or a list as long as `text_2`.")
    text_2: Texts
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    galley: CacheOptions | None = Field(None, description="galley extensions")

    def pairs(self) -> list[tuple[str, str]]:
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise InvalidRequestError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, "
                                      "or as many as text_2", param="text_1")
        return list(zip(firsts, seconds))


class Score(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Score]
    usage: RerankUsage


async def rerank(request: web.Request) -> web.Response:
    body = await parse_body(request, RerankRequest)
    model = await resolve_model(request, body.model, user=body.user, kinds=SCORING)
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    scores, tokens = await services(request).encoders.score(caller_of(request), model,
                                                            [(body.query, text) for text in texts],
                                                            cache_flag(request, body.galley))
    ranked = sorted(range(len(texts)), key=lambda i: -scores[i])[: body.top_n or None]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}}
                                                            if body.return_documents else {})} for i in ranked]
    return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": model_label(request, model), "results": results,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def score(request: web.Request) -> web.Response:
    body = await parse_body(request, ScoreRequest)
    pairs = body.pairs()
    model = await resolve_model(request, body.model, user=body.user, kinds=SCORING)
    scores, tokens = await services(request).encoders.score(caller_of(request), model, pairs,
                                                            cache_flag(request, body.galley))
    return json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                          "model": model_label(request, model),
                          "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


ROUTES = [
    *(Route("POST", path, rerank, f"Rank documents by relevance to a query ({who})", request=RerankRequest,
            response=RerankResponse)
      for path, who in (("/v1/rerank", "Cohere, Jina, vLLM"), ("/v2/rerank", "Cohere v2"), ("/rerank", "vLLM"))),
    *(Route("POST", path, score, "Score text pairs (vLLM)", request=ScoreRequest, response=ScoreResponse)
      for path in ("/v1/score", "/score")),
]
