"""Embedding and classification endpoints: OpenAI /v1/embeddings, native /api/v1/embed and
/api/v1/predict (and /api/v1/models/{name}/predict).

The model version is routed like a generation's (`services.deployments.manager.resolve_model`: `name@version`,
the traffic split by `user` or request id, a cold version loads while the caller waits). Each
input goes through the response cache first (per tenant, model version, input and params); the
misses go to the version's dynamic batcher in one submit, whose future the handler awaits
(a client that leaves stops waiting; its inputs still run, the version drains for them). Tenant
limits apply as for generations (tokens estimated, then settled).
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

import structlog
from aiohttp import web

from api.auth import tenant_limits
from api.context import ADMISSION, METRICS
from api.errors import json_response
from api.native.generate import named_model
from api.native.schemas import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbedRequest,
    EmbedResponse,
    NamedPredictRequest,
    PredictParams,
    PredictRequest,
    PredictResponse,
)
from api.routes import Route
from api.validation import parse_body
from scheduling.encoders import ServedEncoder
from services.cache.responses import RESPONSE_CACHE, cache_key, cache_scope, mark_lookup, wants_cache
from services.deployments.manager import model_label, resolve_model
from services.deployments.shadow import mirror_inputs
from services.errors import InvalidRequestError
from services.inference.encoders import prediction

log = structlog.get_logger(__name__)


async def encoder_for(request: web.Request, name: str, kind: str, user: str | None = None) -> ServedEncoder:
    model = await resolve_model(request, name, user=user, kinds=(kind,))
    assert isinstance(model, ServedEncoder)  # a name's versions are all of its registered kind
    return model


def check_token_ids(model: ServedEncoder, items: list[str | list[int]]) -> None:
    for item in items:
        if isinstance(item, list):
            if any(t >= model.vocab_size for t in item):
                raise InvalidRequestError(f"token ids must be in [0, {model.vocab_size})", param="input")
            if len(item) > model.max_seq_len:
                raise InvalidRequestError(f"a token id input has {len(item)} tokens; this model takes at most "
                                          f"{model.max_seq_len}", param="input", code="context_length_exceeded")


async def run_encoder(request: web.Request, model: ServedEncoder, items: list[str | list[int]],
                      params: dict, use_cache: bool) -> list[Any]:
    """One output (`.values`, `.num_tokens`) per item: cached ones at once, the rest in one batcher submit."""
    cache, metrics = request.app[RESPONSE_CACHE], request.app[METRICS]
    scope = cache_scope(request)
    keys = [cache_key(scope, model.name, model.version, item, params) for item in items] if use_cache else []
    outputs = [cache.get(key) for key in keys] if use_cache else [None] * len(items)
    missing = [i for i, out in enumerate(outputs) if out is None]
    if not missing:
        request.app[ADMISSION].cache_hit(model.name, tenant_limits(request)[0])
    if use_cache:
        metrics.cache_hits.labels(model.name).inc(len(items) - len(missing))
        metrics.cache_misses.labels(model.name).inc(len(missing))
        mark_lookup(request, hit=not missing)  # X-Cache: hit only when no input needed the model
    if not missing:
        metrics.encoder_requests.labels(model.name, "cached").inc()
        return outputs
    todo = [items[i] for i in missing]
    computed = await submit_inputs(request, model, todo)
    for i, out in zip(missing, computed):
        outputs[i] = out
        if use_cache:
            cache.put(keys[i], out)
    mirror_inputs(request, model, items, outputs)
    return outputs


async def submit_inputs(request: web.Request, model: ServedEncoder, items: list[str | list[int]]) -> list[Any]:
    limits, _ = tenant_limits(request)
    return await request.app[ADMISSION].encode(model, items, limits)


# ---- embeddings ----------------------------------------------------------------------------


def base64_floats(values: list[float]) -> str:
    """OpenAI's base64 encoding: the little-endian float32 bytes of the vector."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


def cache_flag(body: Any) -> bool | None:
    return body.galley.cache if body.galley is not None else None


async def embeddings(request: web.Request) -> web.Response:
    body = await parse_body(request, EmbeddingRequest)
    model = await encoder_for(request, body.model, "embed", body.user)
    if body.dimensions is not None and body.dimensions != model.dimensions:
        raise InvalidRequestError(f"`{model.name}` makes {model.dimensions}-dimensional embeddings; "
                                  f"dimensions={body.dimensions} is not supported", param="dimensions")
    items = body.inputs()
    check_token_ids(model, items)
    outputs = await run_encoder(request, model, items, {}, wants_cache(request, cache_flag(body)))
    encode = base64_floats if body.encoding_format == "base64" else (lambda v: v)
    data = [{"object": "embedding", "index": i, "embedding": encode(out.values)} for i, out in enumerate(outputs)]
    tokens = sum(out.num_tokens for out in outputs)
    return json_response({"object": "list", "data": data, "model": model_label(request, model),
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def embed(request: web.Request) -> web.Response:
    body = await parse_body(request, EmbedRequest)
    model = await encoder_for(request, body.model, "embed", body.user)
    outputs = await run_encoder(request, model, body.texts(), {}, wants_cache(request, cache_flag(body)))
    tokens = sum(out.num_tokens for out in outputs)
    return json_response({"model": model_label(request, model), "embeddings": [out.values for out in outputs],
                          "dimensions": model.dimensions, "model_version": model.version,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


# ---- classification ------------------------------------------------------------------------


async def predict(request: web.Request) -> web.Response:
    started = time.monotonic()
    name = named_model(request)
    body = await parse_body(request, PredictRequest if name is None else NamedPredictRequest)
    model = await encoder_for(request, name or body.model, "classify", body.user)
    params = body.params or PredictParams()
    texts = [body.input] if body.input is not None else list(body.inputs)
    outputs = await run_encoder(request, model, texts, {}, wants_cache(request, cache_flag(body)))
    results = [prediction(model, out.values, params.function_to_apply, params.top_k) for out in outputs]
    if body.input is not None:
        fields = results[0]
    else:
        fields = {key: [r[key] for r in results] for key in ("prediction", "confidence", "scores")}
    return json_response({"model": model_label(request, model), **fields, "model_version": model.version,
                          "latency_ms": round((time.monotonic() - started) * 1000, 3)})


async def predict_named(request: web.Request) -> web.Response:
    return await predict(request)


ROUTES = [
    Route("POST", "/v1/embeddings", embeddings, "Create embeddings (OpenAI)",
          request=EmbeddingRequest, response=EmbeddingResponse),
    Route("POST", "/api/v1/embed", embed, "Embed texts (native)", request=EmbedRequest, response=EmbedResponse),
    Route("POST", "/api/v1/predict", predict, "Classify text (native)",
          request=PredictRequest, response=PredictResponse),
    Route("POST", "/api/v1/models/{name}/predict", predict_named, "Classify text with the model in the path (native)",
          request=NamedPredictRequest, response=PredictResponse),
]
