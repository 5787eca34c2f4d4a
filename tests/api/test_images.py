"""Image classification (`image-classify`): a tiny random ViT with its image processor, built here, served
through the native predict route (base64 and data: URLs) and the Open Inference Protocol (raw image bytes
in a BYTES tensor, with tritonclient); labels and scores equal the model's own in-process prediction
through its processor; bad images get a 400 naming the input, and the rest of the server is unharmed."""

from __future__ import annotations

import base64
import io

import aiohttp
import numpy as np
import pytest
import torch

from storage.registry import ModelVersion
from tests.api.test_deployments import make_stack  # noqa: F401 (fixture)

LABELS = {0: "cat", 1: "dog", 2: "boat"}


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    folder = tmp_path_factory.mktemp("vit")
    torch.manual_seed(0)
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    ViTForImageClassification(config).eval().save_pretrained(folder)
    ViTImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def images() -> list:
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (40 + 7 * i, 50 - 3 * i, 3), dtype=np.uint8)) for i in range(5)]


def encoded(image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def reference(folder, pictures) -> np.ndarray:
    """Softmax of the model's logits through its own processor, in-process."""
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    processor = AutoImageProcessor.from_pretrained(folder)
    model = AutoModelForImageClassification.from_pretrained(folder).eval()
    with torch.inference_mode():
        logits = model(**processor(images=pictures, return_tensors="pt")).logits
    return torch.softmax(logits, dim=-1).numpy()


@pytest.fixture
async def stack(make_stack, vit, tiny_models):  # noqa: F811
    return await make_stack([ModelVersion("vit", "1", str(vit), "image-classify"),
                             ModelVersion("tiny", "1", str(tiny_models["llama"]))])


async def test_images_classified_as_the_model_does_in_process(stack, vit):
    pictures = images()
    want = reference(vit, pictures)
    headers = {"Authorization": f"Bearer {stack.key}"}
    inputs = [{"image": base64.b64encode(encoded(p)).decode()} for p in pictures[:3]] + [
        {"image": "data:image/jpeg;base64," + base64.b64encode(encoded(p, "JPEG")).decode()} for p in pictures[3:]]
    from PIL import Image

    want[3:] = reference(vit, [Image.open(io.BytesIO(encoded(p, "JPEG"))) for p in pictures[3:]])  # JPEG is lossy
    async with aiohttp.ClientSession(base_url=str(stack.client.session._base_url)) as session:
        async with session.post("/api/v1/models/vit/predict", json={"inputs": inputs}, headers=headers) as resp:
            body = await resp.json()
    assert resp.status == 200, body
    assert body["prediction"] == [LABELS[i] for i in want.argmax(axis=1)]
    got = np.array([[scores[LABELS[i]] for i in range(3)] for scores in body["scores"]])
    assert np.allclose(got, want, atol=1e-5)

    import tritonclient.http.aio as aioclient

    client = aioclient.InferenceServerClient(str(stack.client.session._base_url).removeprefix("http://").rstrip("/"))
    try:
        data = np.array([encoded(p) for p in pictures[:3]], dtype=object)
        tensor = aioclient.InferInput("image", [3], "BYTES")
        tensor.set_data_from_numpy(data)
        result = await client.infer("vit", [tensor], headers=dict(headers))
        assert np.allclose(result.as_numpy("scores"), want[:3], atol=1e-5)
        assert [x.decode() for x in result.as_numpy("label")] == body["prediction"][:3]
    finally:
        await client.close()


@pytest.mark.parametrize("image, why", [
    ("not base64!", "not valid base64"),
    (base64.b64encode(b"hello, not an image").decode(), "cannot be decoded"),
    ("https://example.com/cat.png", "remote image URLs are not fetched"),
    ("data:image/png,rawbytes", "must be base64"),
])
async def test_bad_images_get_a_400_naming_the_input(stack, image, why):
    headers = {"Authorization": f"Bearer {stack.key}"}
    async with aiohttp.ClientSession(base_url=str(stack.client.session._base_url)) as session:
        async with session.post("/api/v1/models/vit/predict", json={"inputs": [{"image": image}]},
                                headers=headers) as resp:
            body = await resp.json()
        assert resp.status == 400 and why in body["error"]["message"] and body["error"]["param"] == "inputs.0", body
    status, _, answer = await stack.complete("tiny")
    assert status == 200  # the rest of the server is unharmed


async def test_an_image_of_too_many_pixels_is_refused_before_it_is_decoded(stack, monkeypatch):
    from PIL import Image

    from services.inference import images as images_module

    monkeypatch.setattr(images_module, "MAX_IMAGE_PIXELS", 1000)
    big = base64.b64encode(encoded(Image.new("RGB", (40, 40)))).decode()
    async with aiohttp.ClientSession(base_url=str(stack.client.session._base_url)) as session:
        async with session.post("/api/v1/models/vit/predict", json={"input": {"image": big}},
                                headers={"Authorization": f"Bearer {stack.key}"}) as resp:
            body = await resp.json()
    assert resp.status == 400 and "40x40" in body["error"]["message"], body


async def test_a_batch_job_over_images_fails_only_the_bad_one(stack, vit):
    """The seed's batch job over an image classifier: every good image classified as the model does, the
    undecodable one failed with the reason, the job completed."""
    from tests.helpers import wait_until

    pictures = images()[:3]
    want = reference(vit, pictures)
    inputs = [{"image": base64.b64encode(encoded(p)).decode()} for p in pictures]
    inputs.insert(1, {"image": base64.b64encode(b"not an image").decode()})
    headers = {"Authorization": f"Bearer {stack.key}"}
    async with aiohttp.ClientSession(base_url=str(stack.client.session._base_url)) as session:
        async with session.post("/api/v1/batch", json={"model": "vit", "inputs": inputs}, headers=headers) as resp:
            created = await resp.json()
        assert resp.status == 200 and created["kind"] == "image-classify", created

        async def finished():
            async with session.get(f"/api/v1/batch/{created['batch_id']}", headers=headers) as resp:
                summary = await resp.json()
            return summary if summary["status"] in ("completed", "failed") else None

        summary = await wait_until(finished, timeout_s=60, what="the job to end")
        async with session.get(f"/api/v1/batch/{created['batch_id']}/results", headers=headers) as resp:
            results = (await resp.json())["results"]
    assert summary["status"] == "completed", summary
    assert [r["status"] for r in results] == ["completed", "failed", "completed", "completed"]
    assert "cannot be decoded" in results[1]["error"]
    good = [r for r in results if r["status"] == "completed"]
    assert [r["prediction"] for r in good] == [LABELS[i] for i in want.argmax(axis=1)]
    assert np.allclose([[r["scores"][LABELS[i]] for i in range(3)] for r in good], want, atol=1e-5)
