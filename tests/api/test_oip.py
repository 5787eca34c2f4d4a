"""The Open Inference Protocol over REST, driven by Triton's own client (`tritonclient.http`, asyncio and
sync, binary tensors as it sends them by default, and JSON): an ONNX graph, XGBoost and LightGBM models
of iris, an embedding model and a generative model, through the real app with auth on. Served outputs
equal the libraries' own in-process predictions; bad tensors get a 400 naming what is wrong, as
`{"error": ...}`; health and metadata answer as Triton's do."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from tritonclient.utils import InferenceServerException

from storage.registry import ModelVersion
from tests.api.test_deployments import make_stack  # noqa: F401 (fixture)
from tests.api.test_encoders import MINILM, minilm_folder
from tests.helpers import wait_until


def save_onnx(path) -> tuple[np.ndarray, np.ndarray]:
    """y = relu(x @ w + b) and its argmax per row, over a free batch dimension; returns (w, b)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w, b = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["z"]),
         helper.make_node("Relu", ["z"], ["y"]), helper.make_node("ArgMax", ["y"], ["best"], axis=1, keepdims=0)],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("best", TensorProto.INT64, ["batch"])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return w, b


@pytest.fixture(scope="module")
def tensor_models(tmp_path_factory):
    from lightgbm import LGBMClassifier
    from sklearn.datasets import load_iris
    from xgboost import XGBClassifier

    root = tmp_path_factory.mktemp("tensor-models")
    x, y = load_iris(return_X_y=True)
    xgb = XGBClassifier(n_estimators=8, max_depth=3).fit(x, y)
    xgb.save_model(root / "iris-xgb.json")
    lgbm = LGBMClassifier(n_estimators=8, verbose=-1).fit(x, y)
    lgbm.booster_.save_model(str(root / "iris-lgbm.txt"))
    w, b = save_onnx(root / "tiny.onnx")
    module = save_torch_program(root / "tiny.pt2")
    return {"root": root, "x": x, "xgb": xgb, "lgbm": lgbm, "w": w, "b": b, "module": module}


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.linear(x)) * scale, x.sum(dim=1)


def save_torch_program(path) -> torch.nn.Module:
    """A `torch.export` program of two inputs and two outputs over a free batch dimension."""
    torch.manual_seed(0)
    module = Scaled().eval()
    batch = torch.export.Dim("batch")
    program = torch.export.export(module, (torch.randn(2, 4), torch.randn(2, 1)),
                                  dynamic_shapes={"x": {0: batch}, "scale": {0: batch}})
    torch.export.save(program, str(path))
    return module


@pytest.fixture
async def stack(make_stack, tensor_models, tiny_models):  # noqa: F811
    root = tensor_models["root"]
    return await make_stack([ModelVersion("tiny", "1", str(tiny_models["llama"])),
                             ModelVersion("onnx-tiny", "1", str(root / "tiny.onnx"), "onnx"),
                             ModelVersion("iris-xgb", "1", str(root / "iris-xgb.json"), "tabular"),
                             ModelVersion("iris-lgbm", "1", str(root / "iris-lgbm.txt"), "tabular"),
                             ModelVersion("torch-tiny", "1", str(root / "tiny.pt2"), "torch"),
                             ModelVersion("minilm", "1", MINILM, "embed")])


def url_of(stack) -> str:
    return str(stack.client.session._base_url).removeprefix("http://").rstrip("/")


def tensor(name: str, array: np.ndarray, datatype: str, binary: bool = True) -> httpclient.InferInput:
    made = httpclient.InferInput(name, list(array.shape), datatype)
    made.set_data_from_numpy(array, binary_data=binary)
    return made


class Headers(dict):
    """The API key, as a fresh dict each time it is read: tritonclient adds its binary header length to the
    dict a call is given, and would send it again with the next call's JSON-only body."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def __call__(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}


async def test_tritonclient_aio_serves_every_kind_as_its_library_predicts(stack, tensor_models):
    auth = Headers(stack.key)
    client = aioclient.InferenceServerClient(url_of(stack))
    try:
        assert await client.is_server_live() and await client.is_server_ready()
        assert await client.is_model_ready("onnx-tiny", headers=auth())
        x = tensor_models["x"]
        for binary in (True, False):
            for name, model in (("iris-xgb", tensor_models["xgb"]), ("iris-lgbm", tensor_models["lgbm"])):
                dtype = np.float32 if name == "iris-xgb" else np.float64
                result = await client.infer(name, [tensor("input", x[:17].astype(dtype), "FP32" if name == "iris-xgb"
                                                          else "FP64", binary)], headers=auth())
                assert np.allclose(result.as_numpy("predict_proba"), model.predict_proba(x[:17]), atol=1e-6), name
                assert (result.as_numpy("predict") == model.predict(x[:17])).all(), name
            rows = np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32)
            result = await client.infer("onnx-tiny", [tensor("x", rows, "FP32", binary)], headers=auth(),
                                        outputs=[aioclient.InferRequestedOutput("y", binary_data=binary)])
            want = np.maximum(rows @ tensor_models["w"] + tensor_models["b"], 0)
            assert np.allclose(result.as_numpy("y"), want, atol=1e-6) and result.as_numpy("best") is None

        texts = np.array([b"a cat on a mat", b"rivers and the sea"], dtype=object)
        result = await client.infer("minilm", [tensor("text", texts, "BYTES")], headers=auth())
        from sentence_transformers import SentenceTransformer
        want = SentenceTransformer(minilm_folder(), device="cpu").encode(["a cat on a mat", "rivers and the sea"])
        assert np.abs(result.as_numpy("embedding") - want).max() < 1e-5

        prompt = np.array([b"The quick brown"], dtype=object)
        result = await client.infer("tiny", [tensor("text_input", prompt, "BYTES")], headers=auth(),
                                    parameters={"max_tokens": 6, "temperature": 0, "ignore_eos": True})
        [text] = result.as_numpy("text_output")
        status, _, body = await stack.complete("tiny", max_tokens=6)
        assert text.decode() == body["choices"][0]["text"]  # the same prompt, greedy: /v1/completions' text

        metadata = await client.get_model_metadata("iris-xgb", headers=auth())
        assert metadata["platform"] == "xgboost" and metadata["inputs"] == [
            {"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
        assert [o["name"] for o in metadata["outputs"]] == ["predict", "predict_proba"]
        assert (await client.get_model_metadata("onnx-tiny", "1", headers=auth()))["versions"] == ["1"]
        assert (await client.get_server_metadata())["name"] == "galley"
    finally:
        await client.close()


async def test_concurrent_requests_share_batches_and_the_sync_client_works(stack, tensor_models):
    headers = {"Authorization": f"Bearer {stack.key}"}
    x = tensor_models["x"].astype(np.float32)

    def one(i: int) -> np.ndarray:
        client = httpclient.InferenceServerClient(url_of(stack))
        try:
            return client.infer("iris-xgb", [tensor("input", x[i:i + 3], "FP32")], headers=headers).as_numpy(
                "predict_proba")
        finally:
            client.close()

    got = await asyncio.gather(*(asyncio.to_thread(one, i) for i in range(0, 30, 3)))
    assert np.allclose(np.concatenate(got), tensor_models["xgb"].predict_proba(tensor_models["x"][:30]), atol=1e-6)
    assert stack.metric("galley_encoder_batch_size_count", model="iris-xgb", kind="tabular") >= 1
    assert stack.metric("galley_encoder_requests_total", model="iris-xgb", kind="tabular", status="ok") >= 10
    assert stack.metric("galley_encoder_request_duration_seconds_count", model="iris-xgb", kind="tabular") >= 10


@pytest.mark.parametrize("inputs, why", [
    ([{"name": "input", "shape": [2, 3], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]}], "shape"),
    ([{"name": "input", "shape": [1, 4], "datatype": "INT64", "data": [1, 2, 3, 4]}], "must be FP32"),
    ([{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}], "no input"),
    ([{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3]}], "does not fit"),
    ([{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": ["a", "b", "c", "d"]}], "does not fit"),
    ([{"name": "input", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}],
     "runs past the body"),
])
async def test_bad_tensors_get_a_400_naming_them_and_change_nothing(stack, inputs, why):
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{url_of(stack)}/v2/models/iris-xgb/infer", json={"inputs": inputs},
                                headers={"Authorization": f"Bearer {stack.key}"}) as resp:
            body = await resp.json()
    assert resp.status == 400 and why in body["error"], body
    client = aioclient.InferenceServerClient(url_of(stack))
    try:
        with pytest.raises(InferenceServerException, match="not loaded|does not exist"):
            await client.infer("nope", [tensor("input", np.zeros((1, 4), np.float32), "FP32")],
                               headers={"Authorization": f"Bearer {stack.key}"})
    finally:
        await client.close()


async def test_generate_extension_and_its_stream(stack):
    headers = {"Authorization": f"Bearer {stack.key}"}
    body = {"text_input": "The quick brown", "parameters": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}}
    async with aiohttp.ClientSession(base_url=f"http://{url_of(stack)}") as session:
        async with session.post("/v2/models/tiny/generate", json=body, headers=headers) as resp:
            whole = await resp.json()
        async with session.post("/v2/models/tiny/versions/1/generate_stream", json=body, headers=headers) as resp:
            pieces = [line.decode().removeprefix("data: ").strip() async for line in resp.content
                      if line.startswith(b"data: ")]
        async with session.post("/v2/models/tiny/generate", json={"text_input": "x", "parameters": {
                "temperature": 9}}, headers=headers) as resp:
            assert resp.status == 400 and "temperature" in (await resp.json())["error"]
    import json

    assert whole["model_name"] == "tiny" and whole["text_output"]
    assert "".join(json.loads(p)["text_output"] for p in pieces if p != "[DONE]") == whole["text_output"]


async def test_the_seeds_predict_bodies_as_written(stack, tensor_models):
    """004's `inputs: [{"features": [...]}]` with `params.version`, and 001's `input: {"text": ...}` shape,
    on the native predict routes: a tabular model's class label and probabilities, equal to the library's."""
    headers = {"Authorization": f"Bearer {stack.key}"}
    x = tensor_models["x"]
    async with aiohttp.ClientSession(base_url=f"http://{url_of(stack)}") as session:
        body = {"inputs": [{"features": row} for row in x[:3].tolist()], "params": {"version": "1"}}
        async with session.post("/api/v1/models/iris-lgbm/predict", json=body, headers=headers) as resp:
            answer = await resp.json()
        assert resp.status == 200, answer
        proba = tensor_models["lgbm"].predict_proba(x[:3])
        assert answer["prediction"] == [str(c) for c in tensor_models["lgbm"].predict(x[:3])]
        assert np.allclose(answer["confidence"], proba.max(axis=1)) and answer["model_version"] == "1"
        async with session.post("/api/v1/predict", json={"model": "iris-xgb", "input": {"features": x[0].tolist()}},
                                headers=headers) as resp:
            one = await resp.json()
        assert resp.status == 200 and set(one["scores"]) == {"0", "1", "2"}, one
        for bad, why in (({"model": "iris-xgb", "input": {"features": [1.0, 2.0]}}, "4 features"),
                         ({"model": "iris-xgb", "input": {"text": "hello"}}, "features"),
                         ({"model": "iris-xgb", "input": "x", "params": {"version": "9"}}, "takes no traffic")):
            async with session.post("/api/v1/predict", json=bad, headers=headers) as resp:
                error = await resp.json()
            assert resp.status in (400, 403) and why in error["error"]["message"], error  # 403: a tenant's key


async def test_a_tabular_model_rolls_out_rolls_back_and_loads_cold(stack, tensor_models):
    """The registry's lifecycle for a tensor model: v2 (LightGBM's file) registered cold, deployed to all
    traffic, rolled back; unloaded, and loaded again by the next request."""
    from tests.api.test_auth import ADMIN
    from tests.api.test_deployments import DEPLOYMENTS

    root, x = tensor_models["root"], tensor_models["x"]
    status, made = await stack.client.admin("POST", "/models", json={
        "name": "iris-xgb", "version": "2", "source": str(root / "iris-lgbm.txt"), "kind": "tabular"})
    assert status == 201 and made["state"] == "unloaded", made
    auth = Headers(stack.key)
    client = aioclient.InferenceServerClient(url_of(stack))

    async def platform_answering() -> str:
        dtype = np.float32
        for _ in range(2):  # FP32 for XGBoost's input, FP64 for LightGBM's: which one answers says which version
            try:
                await client.infer("iris-xgb", [tensor("input", x[:2].astype(dtype), datatype_of(dtype))],
                                   headers=auth())
                return "xgboost" if dtype == np.float32 else "lightgbm"
            except InferenceServerException:
                dtype = np.float64
        raise AssertionError("neither version answered")

    try:
        assert await platform_answering() == "xgboost"
        status, body = await stack.client.call("POST", DEPLOYMENTS, ADMIN, json={
            "model_name": "iris-xgb", "version": "2", "traffic_percent": 100})
        assert status == 201, body
        await wait_until(lambda: stack.router.deployments["iris-xgb"].stable == "2", what="v2 to take the traffic")
        assert await platform_answering() == "lightgbm"
        status, _ = await stack.client.call("POST", f"{DEPLOYMENTS}/iris-xgb/rollback", ADMIN)
        assert status == 200 and await platform_answering() == "xgboost"
        assert (await stack.client.admin("POST", "/models/iris-xgb/versions/1/unload"))[0] == 202
        await stack.wait_state("iris-xgb@1", "unloaded")
        assert await platform_answering() == "xgboost"  # loaded again, cold, by this request
    finally:
        await client.close()


def datatype_of(dtype) -> str:
    return "FP32" if dtype == np.float32 else "FP64"


async def test_a_torch_export_program_answers_as_the_module(stack, tensor_models):
    client = aioclient.InferenceServerClient(url_of(stack))
    auth = {"Authorization": f"Bearer {stack.key}"}
    try:
        metadata = await client.get_model_metadata("torch-tiny", headers=dict(auth))
        assert metadata["platform"] == "pytorch_torch_export" and [i["name"] for i in metadata["inputs"]] == [
            "x", "scale"] and metadata["inputs"][0]["shape"] == [-1, 4]
        x = np.random.default_rng(3).normal(size=(3, 4)).astype(np.float32)
        scale = np.array([[1.0], [2.0], [0.5]], dtype=np.float32)
        result = await client.infer("torch-tiny", [tensor("x", x, "FP32"), tensor("scale", scale, "FP32")],
                                    headers=dict(auth))
        with torch.inference_mode():
            want = tensor_models["module"](torch.from_numpy(x), torch.from_numpy(scale))
        assert np.allclose(result.as_numpy("output__0"), want[0].numpy(), atol=1e-6)
        assert np.allclose(result.as_numpy("output__1"), want[1].numpy(), atol=1e-6)
        with pytest.raises(InferenceServerException, match="missing"):
            await client.infer("torch-tiny", [tensor("x", x, "FP32")], headers=dict(auth))
    finally:
        await client.close()


async def test_a_batch_job_over_a_tabular_model(stack, tensor_models):
    from tests.helpers import wait_until

    x = tensor_models["x"]
    headers = {"Authorization": f"Bearer {stack.key}"}
    async with aiohttp.ClientSession(base_url=f"http://{url_of(stack)}") as session:
        body = {"model": "iris-lgbm", "inputs": [{"features": row} for row in x[:5].tolist()]}
        async with session.post("/api/v1/batch", json=body, headers=headers) as resp:
            created = await resp.json()
        assert resp.status == 200 and created["kind"] == "tabular", created
        async with session.post("/api/v1/batch", json={"model": "iris-lgbm", "inputs": [{"features": [1.0]}]},
                                headers=headers) as resp:
            assert resp.status == 400 and "4 features" in (await resp.json())["error"]["message"]

        async def results():
            async with session.get(f"/api/v1/batch/{created['batch_id']}/results", headers=headers) as resp:
                found = await resp.json()
            return found["results"] if found["status"] == "completed" else None

        done = await wait_until(results, timeout_s=60, what="the job to complete")
    assert [r["prediction"] for r in done] == [str(c) for c in tensor_models["lgbm"].predict(x[:5])]
    assert np.allclose([r["confidence"] for r in done], tensor_models["lgbm"].predict_proba(x[:5]).max(axis=1))


def test_a_skops_model_serves_with_its_class_labels_and_untrusted_types_need_the_admin(tmp_path):
    """scikit-learn through skops' format: predictions equal the estimator's own, labelled with its classes;
    a file holding a type skops does not trust is refused, naming it, until `trusted_types` lists it."""
    import skops.io
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from engine.loader import ModelLoadError
    from engine.predictors import load_predictor

    x, y = load_iris(return_X_y=True)
    names = np.array(["setosa", "versicolor", "virginica"])[y]
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=300)).fit(x, names)
    skops.io.dump(model, tmp_path / "iris.skops")
    predictor = load_predictor(tmp_path / "iris.skops", "tabular")
    assert predictor.labels == ["setosa", "versicolor", "virginica"] and predictor.inputs[0].shape == (-1, 4)
    [out] = predictor.run([{"input": x[:6]}])
    assert np.allclose(out["predict_proba"], model.predict_proba(x[:6]))
    assert [predictor.labels[i] for i in out["predict"]] == list(model.predict(x[:6]))

    custom = make_pipeline(Halve(), LogisticRegression(max_iter=300)).fit(x, y)
    skops.io.dump(custom, tmp_path / "custom.skops")
    untrusted = skops.io.get_untrusted_types(file=tmp_path / "custom.skops")
    assert untrusted == ["tests.api.test_oip.Halve"]
    with pytest.raises(ModelLoadError, match="does not trust"):
        load_predictor(tmp_path / "custom.skops", "tabular")
    trusted = load_predictor(tmp_path / "custom.skops", "tabular", trusted_types=tuple(untrusted))
    assert np.allclose(trusted.run([{"input": x[:3]}])[0]["predict_proba"], custom.predict_proba(x[:3]))


class Halve:
    """A transformer of our own: a type skops does not trust until an admin says so."""

    def fit(self, x, y=None):
        self.n_features_in_ = x.shape[1]
        return self

    def transform(self, x):
        return x / 2

    def get_params(self, deep=True):
        return {}

    def set_params(self, **params):
        return self
