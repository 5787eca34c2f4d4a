"""Native embedding and classification endpoints: /api/v1/embed, /api/v1/predict and
/api/v1/models/{name}/predict (OpenAI's /v1/embeddings: `api.openai.embeddings`).

The model version is routed like a generation's (`name@version`, the traffic split by `user`
or request id, a cold version loads while the caller waits); the inputs go through
`services.inference.encoders.Encoders` (response cache, then the version's batcher).
"""

from __future__ import annotations

import time

from aiohttp import web

from api.auth import caller_of
from api.errors import json_response
from api.native.generate import named_model
from api.native.schemas import (
    EmbedRequest,
    EmbedResponse,
    NamedPredictRequest,
    PredictParams,
    PredictRequest,
    PredictResponse,
)
from api.response_cache import cache_flag
from api.routes import Route
from api.services import services
from api.validation import parse_body
from api.versions import model_label, resolve_model


async def embed(request: web.Request) -> web.Response:
    body = await parse_body(request, EmbedRequest)
    model = await resolve_model(request, body.model, user=body.user, kinds=("embed",))
    outputs = await services(request).encoders.embed(caller_of(request), model, body.texts(),
                                                cache_flag(request, body.galley))
    tokens = sum(out.num_tokens for out in outputs)
    return json_response({"model": model_label(request, model), "embeddings": [out.values for out in outputs],
                          "dimensions": model.dimensions, "model_version": model.version,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def predict(request: web.Request) -> web.Response:
    started = time.monotonic()
    name = named_model(request)
    body = await parse_body(request, PredictRequest if name is None else NamedPredictRequest)
    params = body.params or PredictParams()
    ref = (name or body.model) if params.version is None else f"{(name or body.model).split('@')[0]}@{params.version}"
    model = await resolve_model(request, ref, user=body.user, kinds=("classify", "tabular", "image-classify"))
    results = await services(request).encoders.predict(caller_of(request), model, body.items(),
                                                       cache_flag(request, body.galley), params.function_to_apply,
                                                       params.top_k)
    if body.input is not None:
        fields = results[0]
    else:
        fields = {key: [r[key] for r in results] for key in ("prediction", "confidence", "scores")}
    return json_response({"model": model_label(request, model), **fields, "model_version": model.version,
                          "latency_ms": round((time.monotonic() - started) * 1000, 3)})


async def predict_named(request: web.Request) -> web.Response:
    return await predict(request)


ROUTES = [
    Route("POST", "/api/v1/embed", embed, "Embed texts (native)", request=EmbedRequest, response=EmbedResponse),
    Route("POST", "/api/v1/predict", predict, "Classify text (native)",
          request=PredictRequest, response=PredictResponse),
    Route("POST", "/api/v1/models/{name}/predict", predict_named, "Classify text with the model in the path (native)",
          request=NamedPredictRequest, response=PredictResponse),
]
