"""The admin page's models with their inputs and outputs, and its try-a-model panel, in a real headless
Chromium (Playwright) against the real app with auth on: XGBoost iris (tabular), an ONNX graph and a tiny
ViT (image-classify), built here. The answers the page shows equal the libraries' own predictions; a bad
body shows the server's error.

Skipped only where Debian's /usr/bin/chromium is absent (`.ci/run` installs it).
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from api.admin.dashboard import SignatureList
from storage.registry import ModelVersion
from tests.api.test_admin_page import CHROMIUM, page  # noqa: F401 (fixture)
from tests.api.test_auth import ADMIN
from tests.api.test_deployments import make_stack  # noqa: F401 (fixture)
from tests.api.test_images import LABELS, encoded, images, reference, vit  # noqa: F401 (fixture)
from tests.api.test_oip import tensor_models  # noqa: F401 (fixture)

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's /usr/bin/chromium")]


@pytest.fixture
async def stack(make_stack, tensor_models, vit):  # noqa: F811
    root = tensor_models["root"]
    return await make_stack([ModelVersion("iris-xgb", "1", str(root / "iris-xgb.json"), "tabular"),
                             ModelVersion("onnx-tiny", "1", str(root / "tiny.onnx"), "onnx"),
                             ModelVersion("vit", "1", str(vit), "image-classify")])


async def sign_in(tab, stack) -> None:
    from playwright.async_api import expect

    await tab.goto(str(stack.client.session._base_url).rstrip("/") + "/admin")
    await tab.fill("#admin-key", ADMIN)
    await tab.click("#login-button")
    await expect(tab.locator("#app")).to_be_visible()


async def send(tab) -> dict:
    """Click Send; the JSON answer the page shows."""
    from playwright.async_api import expect

    await tab.click("#try-send")
    await expect(tab.locator("#try-status")).to_have_text("HTTP 200", timeout=20_000)
    return json.loads(await tab.locator("#try-output").text_content())


async def test_models_show_inputs_outputs_and_answer_the_try_panel(stack, page, tensor_models, vit):  # noqa: F811
    from playwright.async_api import expect

    # the page's source: each loaded version's inputs and outputs as its /v2 metadata has them, in /openapi.json
    status, listed = await stack.client.admin("GET", "/signatures")
    assert status == 200 and [(s.name, s.kind) for s in SignatureList.model_validate(listed).data] == [
        ("iris-xgb", "tabular"), ("onnx-tiny", "onnx"), ("vit", "image-classify")]
    status, metadata = await stack.client.call("GET", "/v2/models/onnx-tiny", stack.key)
    assert status == 200 and {k: metadata[k] for k in ("platform", "inputs", "outputs")} == {
        k: listed["data"][1][k] for k in ("platform", "inputs", "outputs")}
    status, spec = await stack.client.call("GET", "/openapi.json")
    response = spec["paths"]["/admin/api/signatures"]["get"]["responses"]["200"]
    assert response["content"]["application/json"]["schema"]["$ref"].endswith("/SignatureList")

    await sign_in(page, stack)
    rows = {name: page.locator(f'#models-table tr[data-model="{name}"][data-version="1"]')
            for name in ("iris-xgb", "onnx-tiny", "vit")}
    for name, kind, tensors in (
            ("iris-xgb", "tabular", ["input FP32 [-1, 4]", "predict INT64 [-1]", "predict_proba FP64 [-1, 3]"]),
            ("onnx-tiny", "onnx", ["x FP32 [-1, 4]", "y FP32 [-1, 3]", "best INT64 [-1]"]),
            ("vit", "image-classify", ["image BYTES [-1]", "label BYTES [-1]", "scores FP32 [-1, 3]"])):
        await expect(rows[name]).to_contain_text(kind)
        for tensor in tensors:
            await expect(rows[name]).to_contain_text(tensor)
    await page.fill("#play-key", stack.key)  # with --auth, inference takes a tenant key

    # tabular: the prefilled row of zeros, then an iris row typed in, as XGBoost predicts them
    xgb, x = tensor_models["xgb"], tensor_models["x"]
    await page.click('[data-testid="try-iris-xgb@1"]')
    await expect(page.locator("#try-path")).to_have_text("POST /api/v1/models/iris-xgb@1/predict")
    assert json.loads(await page.input_value("#try-body")) == {"inputs": [{"features": [0, 0, 0, 0]}]}
    for row in (np.zeros(4, dtype=np.float32), x[100].astype(np.float32)):
        if row.any():
            await page.fill("#try-body", json.dumps({"inputs": [{"features": row.tolist()}]}))
        answer = await send(page)
        proba = xgb.predict_proba(row[None])[0]
        assert answer["prediction"] == [str(xgb.predict(row[None])[0])] and answer["model_version"] == "1"
        assert np.allclose([answer["scores"][0][str(i)] for i in range(3)], proba, atol=1e-6)

    # a bad body: the server's 400, named as it names it
    assert not page.errors, page.errors
    await page.fill("#try-body", json.dumps({"inputs": [{"features": [1, 2]}]}))
    await page.click("#try-send")
    await expect(page.locator("#try-status")).to_have_text("HTTP 400: `iris-xgb` takes 4 features per input")
    await expect(page.locator("#try-status")).to_have_class("error")
    await expect(page.locator("#try-output")).to_be_empty()
    page.errors.clear()  # the browser logs the expected 400; nothing else may fail

    # onnx: a tensor of zeros of its declared shape, through /v2 infer, as the graph computes it
    await page.select_option("#try-model", "onnx-tiny@1")
    await expect(page.locator("#try-path")).to_have_text("POST /v2/models/onnx-tiny/versions/1/infer")
    assert json.loads(await page.input_value("#try-body")) == {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 0, 0, 0]}]}
    outputs = {o["name"]: o for o in (await send(page))["outputs"]}
    assert outputs["y"]["shape"] == [1, 3]
    assert np.allclose(outputs["y"]["data"], np.maximum(tensor_models["b"], 0), atol=1e-6)
    assert outputs["best"]["data"] == [int(np.argmax(np.maximum(tensor_models["b"], 0)))]

    # image-classify: its example image, and then a file picked from disk (sent as a data URL), as the ViT
    # classifies them through its own processor
    await page.click('[data-testid="try-vit@1"]')
    example = json.loads(await page.input_value("#try-body"))["inputs"][0]["image"]
    assert example.startswith("data:image/png;base64,")
    picture = images()[0]
    for shown in (Image.open(io.BytesIO(base64.b64decode(example.split(",", 1)[1]))), picture):
        if shown is picture:
            await page.set_input_files("#try-image", files=[{"name": "cat.png", "mimeType": "image/png",
                                                             "buffer": encoded(picture)}])
            url = "data:image/png;base64," + base64.b64encode(encoded(picture)).decode()
            await expect(page.locator("#try-body")).to_have_value(json.dumps({"inputs": [{"image": url}]}, indent=2))
        answer = await send(page)
        proba = reference(vit, [shown.convert("RGB")])[0]
        assert answer["prediction"] == [LABELS[int(proba.argmax())]]
        assert np.allclose([answer["scores"][0][LABELS[i]] for i in range(3)], proba, atol=1e-5)
    assert not page.errors, page.errors
