"""The Open Inference Protocol over gRPC, driven by tritonclient.grpc (asyncio and sync): tensor models and an
embedding model answer as over REST and as their libraries predict; a generative model streams its text
through `stream_infer` (Triton's decoupled ModelStreamInfer), equal to `/v1/completions`' text; keys,
bad tensors and unknown models map to gRPC status codes."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from api.oip_grpc.service import start_grpc
from api.services import SERVICES
from tests.api.test_deployments import make_stack  # noqa: F401 (fixture)
from tests.api.test_oip import stack, tensor_models  # noqa: F401 (fixtures)
from tests.process.test_server_process import free_port


@pytest.fixture
async def grpc_url(stack):  # noqa: F811
    port = free_port()
    server = await start_grpc(stack.app[SERVICES], "127.0.0.1", port)
    yield f"127.0.0.1:{port}"
    await server.stop(grace=None)


def tensor(name: str, array: np.ndarray, datatype: str):
    made = grpcclient.InferInput(name, list(array.shape), datatype)
    made.set_data_from_numpy(array)
    return made


async def test_tritonclient_grpc_aio_serves_tensor_models_and_embeddings(stack, grpc_url, tensor_models):  # noqa: F811
    headers = {"authorization": f"Bearer {stack.key}"}
    client = aioclient.InferenceServerClient(grpc_url)
    try:
        assert await client.is_server_live() and await client.is_server_ready()
        assert await client.is_model_ready("iris-xgb", headers=headers)
        x = tensor_models["x"]
        result = await client.infer("iris-xgb", [tensor("input", x[:9].astype(np.float32), "FP32")], headers=headers)
        assert np.allclose(result.as_numpy("predict_proba"), tensor_models["xgb"].predict_proba(x[:9]), atol=1e-6)
        assert (result.as_numpy("predict") == tensor_models["xgb"].predict(x[:9])).all()
        rows = np.random.default_rng(2).normal(size=(4, 4)).astype(np.float32)
        result = await client.infer("onnx-tiny", [tensor("x", rows, "FP32")], headers=headers,
                                    outputs=[aioclient.InferRequestedOutput("best")])
        want = np.maximum(rows @ tensor_models["w"] + tensor_models["b"], 0).argmax(axis=1)
        assert (result.as_numpy("best") == want).all() and result.as_numpy("y") is None
        result = await client.infer("minilm", [tensor("text", np.array([b"a cat", b"a dog"], dtype=object),
                                                      "BYTES")], headers=headers)
        assert result.as_numpy("embedding").shape == (2, 384)
        metadata = await client.get_model_metadata("iris-lgbm", headers=headers, as_json=True)
        assert metadata["platform"] == "lightgbm" and metadata["inputs"][0]["datatype"] == "FP64"
        assert (await client.get_server_metadata(as_json=True))["name"] == "galley"
    finally:
        await client.close()


async def test_a_generation_streams_over_model_stream_infer_as_completions_answer(stack, grpc_url):  # noqa: F811
    headers = {"authorization": f"Bearer {stack.key}"}
    client = aioclient.InferenceServerClient(grpc_url)

    async def requests():
        prompt = tensor("text_input", np.array([b"The quick brown"], dtype=object), "BYTES")
        yield {"model_name": "tiny", "inputs": [prompt], "request_id": "one",
               "parameters": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}}

    try:
        pieces, final = [], None
        async for result, error in client.stream_infer(requests(), headers=headers):
            assert error is None, error
            pieces.append(result.as_numpy("text_output")[0].decode())
            final = result.get_response().parameters["triton_final_response"].bool_param
        status, _, body = await stack.complete("tiny", max_tokens=6)
        assert "".join(pieces) == body["choices"][0]["text"] and final is True and len(pieces) > 1
    finally:
        await client.close()


async def test_the_sync_client_and_errors_as_status_codes(stack, grpc_url, tensor_models):  # noqa: F811
    def calls() -> list[tuple[str, str]]:
        client = grpcclient.InferenceServerClient(grpc_url)
        outcomes = []
        x = tensor_models["x"][:2].astype(np.float32)
        cases = [({"authorization": f"Bearer {stack.key}"}, "iris-xgb", [tensor("input", x, "FP32")]),
                 ({"authorization": "Bearer gk_nope_nope"}, "iris-xgb", [tensor("input", x, "FP32")]),
                 ({"authorization": f"Bearer {stack.key}"}, "iris-xgb", [tensor("input", x[:, :3], "FP32")]),
                 ({"authorization": f"Bearer {stack.key}"}, "ghost", [tensor("input", x, "FP32")])]
        for headers, model, inputs in cases:
            try:
                client.infer(model, inputs, headers=headers)
                outcomes.append(("OK", ""))
            except InferenceServerException as exc:
                outcomes.append((exc.status(), exc.message()))
        client.close()
        return outcomes

    ok, unauthenticated, bad_shape, unknown = await asyncio.to_thread(calls)
    assert ok == ("OK", "")
    assert unauthenticated[0] == str(grpc.StatusCode.UNAUTHENTICATED)
    assert bad_shape[0] == str(grpc.StatusCode.INVALID_ARGUMENT) and "shape" in bad_shape[1]
    assert unknown[0] == str(grpc.StatusCode.NOT_FOUND) and "ghost" in unknown[1]
