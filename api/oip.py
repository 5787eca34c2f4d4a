"""The Open Inference Protocol over REST (KServe v2, Triton's HTTP API): `/v2` server metadata and
health, each model's metadata and readiness, `infer` with JSON tensors and Triton's binary tensor
extension (`api.oip_tensors`), and Triton's `generate` / `generate_stream` extension for LLMs.

Every kind answers: tensor models (onnx, tabular) with their own inputs and outputs; `embed` takes
`text` (BYTES) and gives `embedding`; `classify` takes `text` and gives `label` and `scores`;
`generate` takes `text_input` and gives `text_output`, as Triton's LLM backends name them, with
sampling parameters in the request's `parameters`. Models route as everywhere (`/versions/{v}`
names one version, a cold one loads). Errors are `{"error": "..."}`, as the protocol says.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import numpy as np
from aiohttp import web
from pydantic import BaseModel, Field, ValidationError

from api.auth import caller_of
from api.errors import status_of, validation_error
from api.native.generate import prompt_input
from api.native.schemas import GenerateRequest
from api.oip_tensors import HEADER_LENGTH, response_body, split_body
from api.routes import VERSION, Route
from api.services import services
from api.sse import serve_sse
from api.versions import resolve_model
from services.answers import generation_failed
from services.deployments import KINDS
from services.errors import InvalidRequestError, ServiceError
from services.inference import read_inputs
from services.tenancy import Caller
from services.wiring import Services

MAX_BODY_BYTES = 64 << 20
TEXT = {"name": "text", "datatype": "BYTES", "shape": [-1]}
TENSOR_KINDS = ("onnx", "tabular", "torch")  # models of declared tensors in and out
IMAGE = {"name": "image", "datatype": "BYTES", "shape": [-1]}  # each element an encoded image file (PNG, JPEG, ...)


class OipError(BaseModel):
    error: str


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class InferTensor(BaseModel):
    name: str
    shape: list[int] = Field(description="Sizes >= 0.")
    datatype: Literal["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16",
                      "FP32", "FP64", "BYTES"]
    parameters: dict[str, Any] | None = Field(None, description="`binary_data_size`: its data follows the JSON "
                                              "header (Triton's binary tensor data extension).")
    data: list[Any] | None = Field(None, description="The elements, flat or nested, in row-major order.")


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = Field(None, description="`binary_data`: send it after the JSON header.")


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A generate model's sampling parameters "
                                              "(max_tokens, temperature, ...); `binary_data_output`.")
    inputs: list[InferTensor] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[InferTensor]


class GenerateBody(BaseModel):
    text_input: str
    parameters: dict[str, Any] | None = Field(None, description="Sampling parameters, as /api/v1/generate's body.")


class GenerateOut(BaseModel):
    model_name: str
    model_version: str
    text_output: str


def oip(handler):
    """Errors as the protocol has them: `{"error": message}`, with the status galley gives the same error."""
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ServiceError as exc:
            return web.json_response({"error": exc.message}, status=status_of(exc))
        except ValidationError as exc:
            problem = validation_error(exc)
            return web.json_response({"error": problem.message}, status=status_of(problem))
    return wrapped


def model_ref(request: web.Request) -> str:
    version = request.match_info.get("version")
    return request.match_info["name"] + (f"@{version}" if version else "")


def kind_of(model: Any) -> str:
    return getattr(model, "kind", "generate")  # a generative version (ServedModel) has no kind field


def signature(model: Any) -> tuple[str, list[dict], list[dict]]:
    """(platform, inputs, outputs) of a served version, as its metadata shows them."""
    if kind_of(model) in TENSOR_KINDS:
        return model.platform, model.inputs, model.outputs
    if kind_of(model) == "embed":
        return "galley_embed", [TEXT], [{"name": "embedding", "datatype": "FP32", "shape": [-1, model.dimensions]}]
    if kind_of(model) in ("classify", "image-classify"):
        image = kind_of(model) == "image-classify"
        outputs = [{"name": "label", "datatype": "BYTES", "shape": [-1]},
                   {"name": "scores", "datatype": "FP32", "shape": [-1, len(model.labels)]}]
        return f"galley_{kind_of(model).replace('-', '_')}", [IMAGE if image else TEXT], outputs
    return "galley_generate", [{"name": "text_input", "datatype": "BYTES", "shape": [1]}], [
        {"name": "text_output", "datatype": "BYTES", "shape": [1]}]


@oip
async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": "galley", "version": VERSION,
                              "extensions": ["binary_tensor_data", "model_repository", "generate"]})


@oip
async def live(request: web.Request) -> web.Response:
    return web.json_response({})


@oip
async def ready(request: web.Request) -> web.Response:
    state = services(request).status.readiness()
    return web.json_response({} if state == "ok" else {"error": state}, status=200 if state == "ok" else 503)


def model_metadata_of(svc: Services, model: Any) -> dict:
    """A served version's metadata: its model's versions, platform, inputs and outputs (REST and gRPC)."""
    platform, inputs, outputs = signature(model)
    versions = sorted(v for n, v, _ in svc.models.states() if n == model.name)
    return {"name": model.name, "versions": versions, "platform": platform, "inputs": inputs, "outputs": outputs}


@oip
async def model_metadata(request: web.Request) -> web.Response:
    model = await resolve_model(request, model_ref(request), kinds=KINDS)
    return web.json_response(model_metadata_of(services(request), model))


@oip
async def model_ready(request: web.Request) -> web.Response:
    """200 while the model (version) is loaded and takes requests; 400 otherwise, as Triton answers."""
    loaded = services(request).models.router.find(model_ref(request)) is not None
    return web.json_response({} if loaded else {"error": f"`{model_ref(request)}` is not loaded"},
                             status=200 if loaded else 400)


@oip
async def infer(request: web.Request) -> web.Response:
    header, binary = split_body(await request.read(), request.headers.get(HEADER_LENGTH))
    InferRequest.model_validate(header)  # the header's types (a 400 naming the field), before reading tensors
    tensors = read_inputs(header, binary)
    model = await resolve_model(request, model_ref(request), kinds=KINDS)
    outputs = await run_model(services(request), caller_of(request), model, tensors, header.get("parameters") or {})
    body, headers = response_body(header, outputs, {"model_name": model.name, "model_version": model.version})
    return web.Response(body=body, headers=headers)


async def run_model(svc: Services, caller: Caller, model: Any, tensors: dict[str, np.ndarray],
                    parameters: dict) -> list[tuple[str, str, np.ndarray]]:
    """One service call for the model's kind; its outputs as (name, datatype, array). REST and gRPC share it."""
    encoders = svc.encoders
    if kind_of(model) in TENSOR_KINDS:
        out = await encoders.infer(caller, model, tensors)
        return [(spec["name"], spec["datatype"], out[spec["name"]]) for spec in model.outputs]
    _, inputs, _ = signature(model)
    if kind_of(model) == "image-classify":
        images = [bytes(x) for x in bytes_input(tensors, "image")]
        return prediction_tensors(model, await encoders.classify_images(caller, model, images))
    texts = [x.decode() for x in bytes_input(tensors, inputs[0]["name"])]
    if kind_of(model) == "embed":
        outputs = await encoders.embed(caller, model, texts, None)
        return [("embedding", "FP32", np.array([o.values for o in outputs], dtype=np.float32))]
    if kind_of(model) == "classify":
        return prediction_tensors(model, await encoders.classify(caller, model, texts, None))
    if len(texts) != 1:
        raise InvalidRequestError("text_input takes one prompt per request", param="inputs")
    answer, _ = await generate_text(svc, caller, model.ref, texts[0], parameters)
    return [("text_output", "BYTES", np.array([answer.encode()], dtype=object))]


def bytes_input(tensors: dict[str, np.ndarray], name: str) -> list[bytes]:
    if set(tensors) != {name} or tensors[name].dtype != object:
        raise InvalidRequestError(f"this model takes one BYTES input, `{name}`", param="inputs")
    items = list(tensors[name].reshape(-1))
    if name != "image":
        try:
            [x.decode() for x in items]
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(f"`{name}` must be UTF-8 text", param="inputs") from exc
    return items


def prediction_tensors(model: Any, results: list[dict]) -> list[tuple[str, str, np.ndarray]]:
    """A classifier's predictions as `label` (BYTES) and `scores` (FP32, by label index)."""
    return [("label", "BYTES", np.array([r["prediction"].encode() for r in results], dtype=object)),
            ("scores", "FP32", np.array([[r["scores"][label] for label in model.labels] for r in results],
                                        dtype=np.float32))]


def generation_body(text: str, parameters: dict) -> GenerateRequest:
    """The prompt and sampling parameters as /api/v1/generate's body (the same fields, ranges and errors)."""
    fields = {key: value for key, value in parameters.items() if key not in ("binary_data_output",)}
    return GenerateRequest.model_validate({"model": "-", **fields, "prompt": text})


async def generate_text(svc: Services, caller: Caller, ref: str, text: str, parameters: dict) -> tuple[str, Any]:
    """The text and the version that generated it."""
    generated = await svc.inference.generate(caller, prompt_input(generation_body(text, parameters), ref),
                                             stream=False, cache_asked=None)
    return generated.result["text"], generated.model


@oip
async def generate(request: web.Request) -> web.Response:
    body = GenerateBody.model_validate_json(await request.read())
    text, model = await generate_text(services(request), caller_of(request), model_ref(request), body.text_input,
                                      body.parameters or {})
    return web.json_response({"model_name": model.name, "model_version": model.version, "text_output": text})


@oip
async def generate_stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events, one `{"model_name", "model_version", "text_output"}` per piece of text."""
    body = GenerateBody.model_validate_json(await request.read())
    inference = services(request).inference
    generated = await inference.generate(
        caller_of(request), prompt_input(generation_body(body.text_input, body.parameters or {}), model_ref(request)),
        stream=True, cache_asked=None)
    meta = {"model_name": generated.model.name, "model_version": generated.model.version}

    async def frames():
        try:
            async for event in inference.events(generated.stream):
                if event.error:
                    yield {"error": generation_failed(event).message}, None
                    break
                if event.text or event.finished:
                    yield {**meta, "text_output": event.text}, None
        finally:
            inference.abort(generated.stream)
    return await serve_sse(request, frames(), {"X-Request-Id": request["request_id"]})


def model_routes(suffix: str, method: str, handler, summary: str, **kw) -> list[Route]:
    return [Route(method, f"/v2/models/{{name}}{version}{suffix}", handler, summary, error_body=OipError, **kw)
            for version in ("", "/versions/{version}")]


ROUTES = [
    Route("GET", "/v2", server_metadata, "Server metadata (Open Inference Protocol)", response=ServerMetadata,
          error_body=OipError),
    Route("GET", "/v2/health/live", live, "Liveness (Open Inference Protocol)", error_body=OipError),
    Route("GET", "/v2/health/ready", ready, "Readiness (Open Inference Protocol)", error_body=OipError),
    *model_routes("", "GET", model_metadata, "A model's inputs and outputs (Open Inference Protocol)",
                  response=ModelMetadata),
    *model_routes("/ready", "GET", model_ready, "Whether a model is loaded (Open Inference Protocol)", errors=(400,)),
    *model_routes("/infer", "POST", infer, "Run a model on tensors (Open Inference Protocol; Triton's binary "
                  "tensor extension)", request=InferRequest, response=InferResponse),
    *model_routes("/generate", "POST", generate, "Generate text (Triton's generate extension)",
                  request=GenerateBody, response=GenerateOut),
    *model_routes("/generate_stream", "POST", generate_stream, "Stream generated text as server-sent events, "
                  "each `data:` a GenerateOut as JSON (Triton's generate extension)", request=GenerateBody,
                  content_type="text/event-stream"),
]
