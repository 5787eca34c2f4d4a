"""The Open Inference Protocol over gRPC (KServe's `GRPCInferenceService`, with Triton's `ModelStreamInfer`
for streamed generation), on its own port in the server's process and event loop (grpc.aio).

Each RPC does what its REST twin in `api.oip` does, through the same helpers: the API key comes as
`authorization: Bearer <key>` metadata; a model routes as anywhere (version, split, a cold one loads);
tensors arrive in `raw_input_contents` (what tritonclient sends) or typed `contents`, and leave in
`raw_output_contents`. galley's errors become gRPC status codes: 400 INVALID_ARGUMENT, 401
UNAUTHENTICATED, 403 PERMISSION_DENIED, 404 NOT_FOUND, 409 ALREADY_EXISTS, 429 RESOURCE_EXHAUSTED
(with the retry hint in `retry-after` trailing metadata), 503 UNAVAILABLE, anything else INTERNAL.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
import numpy as np
import structlog
from pydantic import ValidationError

from api.errors import status_of, validation_error
from api.native.generate import prompt_input
from api.oip import generation_body, model_metadata_of, run_model
from api.oip_grpc import inference_pb2 as pb
from api.oip_grpc import inference_pb2_grpc
from api.routes import VERSION
from engine.types import TENSOR_DATATYPES
from services.answers import generation_failed
from services.deployments import KINDS
from services.errors import AuthenticationError, InvalidRequestError, ServiceError
from services.inference import from_bytes, to_bytes
from services.tenancy import Caller, key_prefix
from services.wiring import Services

log = structlog.get_logger(__name__)

CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
         403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.ALREADY_EXISTS,
         413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
         503: grpc.StatusCode.UNAVAILABLE}
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
            "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def parameter_value(parameter: pb.InferParameter):
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)


def request_tensors(request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    """Each input as a numpy array: from `raw_input_contents` (in input order) when given, else `contents`."""
    if not request.inputs:
        raise InvalidRequestError("the request has no inputs", param="inputs")
    if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
        raise InvalidRequestError(f"{len(request.raw_input_contents)} raw_input_contents for {len(request.inputs)} "
                                  "inputs", param="raw_input_contents")
    tensors = {}
    for i, tensor in enumerate(request.inputs):
        where, shape = f"inputs.{i}", [int(d) for d in tensor.shape]
        if tensor.datatype not in TENSOR_DATATYPES or tensor.datatype == "FP16" and not request.raw_input_contents:
            raise InvalidRequestError(f"{where}.datatype {tensor.datatype!r} is not one of "
                                      f"{', '.join(TENSOR_DATATYPES)}", param=where)
        if any(d < 0 for d in shape) or tensor.name in tensors:
            raise InvalidRequestError(f"{where}: negative sizes, or a name given twice", param=where)
        if request.raw_input_contents:
            tensors[tensor.name] = from_bytes(request.raw_input_contents[i], tensor.datatype, shape, where)
            continue
        values = list(getattr(tensor.contents, CONTENTS[tensor.datatype]))
        count = int(np.prod(shape, dtype=np.int64))
        if len(values) != count:
            raise InvalidRequestError(f"{where} has {len(values)} values; shape {shape} needs {count}", param=where)
        dtype = TENSOR_DATATYPES[tensor.datatype]
        tensors[tensor.name] = np.array(values, dtype=dtype).reshape(shape)
    return tensors


def infer_response(request: pb.ModelInferRequest, model, outputs: list[tuple[str, str, np.ndarray]]
                   ) -> pb.ModelInferResponse:
    asked = {o.name for o in request.outputs}
    if unknown := sorted(asked - {name for name, _, _ in outputs}):
        raise InvalidRequestError(f"the model has no output {unknown[0]!r}", param="outputs")
    response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=request.id)
    for name, datatype, array in outputs:
        if asked and name not in asked:
            continue
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        response.raw_output_contents.append(to_bytes(array, datatype))
    return response


class InferenceService(inference_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, services: Services) -> None:
        self.services = services

    # ---- who is asking, and errors ------------------------------------------------------

    def caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """The API key's tenant, as HTTP's `Authorization: Bearer` header gives it (auth off: the default tenant)."""
        auth = self.services.auth
        metadata = dict(context.invocation_metadata() or ())
        name, prefix = auth.directory.default.name, None
        if auth.enabled:
            scheme, _, key = metadata.get("authorization", "").partition(" ")
            tenant = auth.directory.tenant_for_key(key.strip()) if scheme.lower() == "bearer" else None
            if tenant is None:
                raise AuthenticationError("send a valid API key as `authorization: Bearer <key>` metadata",
                                          code="invalid_api_key")
            name, prefix = tenant.name, key_prefix(key.strip())
        return Caller(lambda: auth.directory.current(name, prefix), f"grpc-{uuid.uuid4().hex}", False, auth.enabled)

    @staticmethod
    async def fail(context: grpc.aio.ServicerContext, exc: Exception) -> None:
        if isinstance(exc, ValidationError):
            exc = validation_error(exc)
        if isinstance(exc, ServiceError):
            if exc.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
            await context.abort(CODES.get(status_of(exc), grpc.StatusCode.INTERNAL), exc.message)
        log.exception("gRPC request failed", exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, "internal server error")

    async def route(self, caller: Caller, name: str, version: str):
        return await self.services.models.route(caller, f"{name}@{version}" if version else name, kinds=KINDS)

    # ---- health and metadata ------------------------------------------------------------

    async def ServerLive(self, request, context):  # noqa: N802 (the protocol's names)
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):  # noqa: N802
        return pb.ServerReadyResponse(ready=self.services.status.readiness() == "ok")

    async def ServerMetadata(self, request, context):  # noqa: N802
        return pb.ServerMetadataResponse(name="galley", version=VERSION,
                                         extensions=["model_repository", "generate"])

    async def ModelReady(self, request, context):  # noqa: N802
        try:
            self.caller(context).check_model(request.name)
        except ServiceError as exc:
            await self.fail(context, exc)
        ref = f"{request.name}@{request.version}" if request.version else request.name
        return pb.ModelReadyResponse(ready=self.services.models.router.find(ref) is not None)

    async def ModelMetadata(self, request, context):  # noqa: N802
        try:
            model = await self.route(self.caller(context), request.name, request.version)
            meta = model_metadata_of(self.services, model)
        except Exception as exc:
            await self.fail(context, exc)
        response = pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"])
        for spec in meta["inputs"]:
            response.inputs.add(name=spec["name"], datatype=spec["datatype"], shape=spec["shape"])
        for spec in meta["outputs"]:
            response.outputs.add(name=spec["name"], datatype=spec["datatype"], shape=spec["shape"])
        return response

    # ---- inference ------------------------------------------------------------------------

    async def ModelInfer(self, request, context):  # noqa: N802
        try:
            caller = self.caller(context)
            tensors = request_tensors(request)
            model = await self.route(caller, request.model_name, request.model_version)
            parameters = {key: parameter_value(value) for key, value in request.parameters.items()}
            outputs = await run_model(self.services, caller, model, tensors, parameters)
            return infer_response(request, model, outputs)
        except Exception as exc:
            await self.fail(context, exc)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator, context):  # noqa: N802
        """Triton's decoupled streaming: each request to a generate model answers with one response per piece
        of text (`text_output`), the last one marked `triton_final_response`; another model's, with one.
        A failed request's error goes out as that response's `error_message`; the stream goes on."""
        caller = None
        async for request in request_iterator:
            try:
                caller = caller or self.caller(context)
                async for response in self.stream_one(caller, request):
                    yield pb.ModelStreamInferResponse(infer_response=response)
            except ServiceError as exc:
                yield pb.ModelStreamInferResponse(error_message=exc.message)
            except ValidationError as exc:
                yield pb.ModelStreamInferResponse(error_message=validation_error(exc).message)

    async def stream_one(self, caller: Caller, request: pb.ModelInferRequest) -> AsyncIterator[pb.ModelInferResponse]:
        tensors = request_tensors(request)
        model = await self.route(caller, request.model_name, request.model_version)
        parameters = {key: parameter_value(value) for key, value in request.parameters.items()}
        if getattr(model, "kind", "generate") != "generate":
            yield infer_response(request, model, await run_model(self.services, caller, model, tensors, parameters))
            return
        if set(tensors) != {"text_input"} or tensors["text_input"].size != 1:
            raise InvalidRequestError("a generate model takes one BYTES input, `text_input`, of one prompt",
                                      param="inputs")
        text = bytes(tensors["text_input"].reshape(-1)[0]).decode()
        inference = self.services.inference
        body = generation_body(text, {k: v for k, v in parameters.items() if not k.startswith("triton_")})
        generated = await inference.generate(caller, prompt_input(body, model.ref), stream=True, cache_asked=None)
        try:
            async for event in inference.events(generated.stream):
                if event.error:
                    raise generation_failed(event)
                if event.text or event.finished:
                    response = infer_response(request, model, [("text_output", "BYTES",
                                                                 np.array([event.text.encode()], dtype=object))])
                    response.parameters["triton_final_response"].bool_param = event.finished
                    yield response
        finally:
            inference.abort(generated.stream)


async def start_grpc(services: Services, host: str, port: int) -> grpc.aio.Server:
    """The gRPC server on `host:port`, started (the caller stops it: `await server.stop(grace)`)."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(services), server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    return server
