"""Vision-language models on the generic backend (issue 35): the text model over our paged cache, the
vision encoder through the model's own `get_image_features`, image features replacing the prompt's
image-token embeddings chunk by chunk. Greedy tokens equal HF `generate` with the same processor's
inputs (tiny random LLaVA; Idefics3, SmolVLM's architecture; Qwen2-VL and Qwen2.5-VL, multi-axis
rotary positions; Gemma 3, whose image tokens see each other both ways; PaliGemma, whose whole
prompt does, and PaliGemma 2, the same over Gemma 2's soft-capped attention), batched with
text-only requests, chunked through the image tokens, and with prefix hits that never cross images."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
import torch

from engine.attention import visible_mask
from engine.loader import load_model
from engine.types import GenerationRequest, ImageInputs, SamplingParams
from launch import EngineConfig, build_engine
from tests.helpers import assert_all_blocks_free
from tests.models import save_vision_model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TEXT_ONLY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                      "{{ m['content'] }}{% else %}{{ m['content'][-1]['text'] }}{% endif %}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


FAMILIES = ["llava", "idefics3", "qwen2_vl", "qwen2_5_vl", "gemma3", "paligemma", "paligemma2"]


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tmp_path_factory):
    """Each vision family in turn."""
    return save_vision_model(request.param, tmp_path_factory.mktemp(request.param) / "model")


def pictures(n: int, seed: int = 0) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (30 + 9 * i, 44 - 4 * i, 3), dtype=np.uint8)) for i in range(n)]


def conversation(images: list, text: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                          {"type": "text", "text": text}]}]


def processed(processor, images: list, text: str) -> dict:
    """The processor's inputs for a chat with `images`; with none, the tokenizer's (as galley renders a
    text-only chat: PaliGemma's processor insists on images)."""
    render = processor.apply_chat_template if images else processor.tokenizer.apply_chat_template
    return dict(render(conversation(images, text), add_generation_prompt=True, tokenize=True, return_dict=True,
                       return_tensors="np"))


def request(request_id: str, encoded: dict, images: list) -> GenerationRequest:
    arrays = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}
    digests = tuple(hashlib.sha256(png(im)).hexdigest() for im in images)
    return GenerationRequest(request_id, encoded["input_ids"][0].tolist(), GREEDY,
                             images=ImageInputs(arrays, digests) if images else None)


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def hf_greedy(path, encoded: dict, device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[int]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval()
    inputs = {k: torch.from_numpy(v).to(device) for k, v in encoded.items()}
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def run(engine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    outputs = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        for event in engine.step():
            outputs[event.request_id].extend(event.token_ids)
    return outputs


def check_images_match_hf(path, device: str = "cpu", dtype: str = "float32") -> None:
    """Prompts with one and two images beside a text prompt, chunked through the image tokens: greedy
    tokens equal HF `generate` on the same processor's inputs, device and dtype (tests/engine/test_gpu.py
    runs this on CUDA)."""
    loaded = load_model(str(path), device=device, dtype=dtype)
    assert loaded.backend == "generic" and loaded.processor is not None, loaded.images_refused
    engine = build_engine(loaded, EngineConfig(max_num_batched_tokens=12), num_blocks=128)  # chunks cut image runs
    images = pictures(3)
    cases = {"one": ([images[0]], "What is in the picture?"), "two": (images[1:], "Compare them."),
             "none": ([], "Just text, no image here."), "other": ([images[2]], "What is in the picture?")}
    encoded = {name: processed(loaded.processor, ims, text) for name, (ims, text) in cases.items()}
    got = run(engine, [request(name, encoded[name], cases[name][0]) for name in cases])
    for name in cases:
        assert got[name] == hf_greedy(path, encoded[name], device, getattr(torch, dtype)), name
    assert got["one"] != got["other"]  # the same text, another image: the image is seen
    assert_all_blocks_free(engine.scheduler.kv)
    assert not engine.runner.image_features  # nothing held once the prompts are in the cache


def test_image_prompts_match_hf_batched_chunked_and_beside_text_prompts(vlm):
    check_images_match_hf(vlm)


def test_prefix_hits_stay_within_the_same_images(vlm):
    """Image tokens are one id whatever the image: a cached prompt with another image must not be
    reused, and one with the same image must be (and still give HF's tokens)."""
    loaded = load_model(str(vlm))
    engine = build_engine(loaded, EngineConfig(), num_blocks=128)
    [first], [second] = pictures(1, seed=1), pictures(1, seed=2)  # one size: the same number of image tokens
    text = "Describe this image in a few words, please."
    a, b = processed(loaded.processor, [first], text), processed(loaded.processor, [second], text)
    assert (a["input_ids"] == b["input_ids"]).all()  # the same tokens: only the images differ
    run(engine, [request("a", a, [first])])
    assert engine.scheduler.kv.num_hit_tokens == 0
    got = run(engine, [request("b", b, [second])])
    assert got["b"] == hf_greedy(vlm, b) and engine.scheduler.kv.num_hit_tokens == 0  # a's blocks not reused
    got = run(engine, [request("a2", a, [first])])
    assert got["a2"] == hf_greedy(vlm, a)
    # the same image: reused, except where the whole prompt is one span (its last token is recomputed)
    prompt_span = loaded.model.image_attention == "both ways within the prompt"
    assert (engine.scheduler.kv.num_hit_tokens > 0) != prompt_span


@pytest.mark.parametrize("family, rule", [("gemma3", "both ways within each image"),
                                          ("paligemma", "both ways within the prompt"),
                                          ("paligemma2", "both ways within the prompt")])
def test_spans_that_attend_both_ways_are_computed_whole_and_cached_only_whole(family, rule, tmp_path):
    """A step budget smaller than an image (Gemma 3: 4 tokens) or a prompt (PaliGemma) still computes
    each span in one chunk, over the budget; a second question about the same image never reuses
    blocks whose tokens saw the first question (PaliGemma's prompt is one span). Both equal HF."""
    path = save_vision_model(family, tmp_path / family)
    loaded = load_model(str(path))
    assert loaded.model.image_attention == rule
    engine = build_engine(loaded, EngineConfig(max_num_batched_tokens=3), num_blocks=64)
    [image] = pictures(1, seed=4)
    for name, text in (("first", "What is in the picture?"), ("second", "What is in the frame?")):
        encoded = processed(loaded.processor, [image], text)
        assert run(engine, [request(name, encoded, [image])])[name] == hf_greedy(path, encoded), name
    assert_all_blocks_free(engine.scheduler.kv)


@pytest.mark.parametrize("window", [None, 3, 6])
def test_span_masks_equal_hfs_blockwise_mask_over_its_causal_and_sliding_ones(window):
    """`visible_mask` against transformers' own mask functions (masking_utils: the blockwise overlay ORed
    over the causal or sliding-window one), for spans shorter and longer than the window."""
    from transformers import masking_utils as hf

    spans, n = ((2, 6), (7, 8), (9, 17)), 20
    groups = torch.full((1, n), -1)
    for i, (a, b) in enumerate(spans):
        groups[0, a:b] = i
    base = hf.causal_mask_function if window is None else hf.sliding_window_causal_mask_function(window)
    reference = hf.or_masks(base, hf.blockwise_overlay(groups))
    zero = torch.tensor(0)
    expected = reference(zero, zero, torch.arange(n)[:, None], torch.arange(n)[None, :]).expand(n, n)
    for first in (0, 9):  # a whole prompt, and a chunk from position 9 over the cached keys before it
        got = visible_mask(torch.arange(first, n), n, n, window, spans)
        assert torch.equal(got, expected[first:]), (window, first)
    assert not visible_mask(torch.arange(n), n, n - 2, window, spans)[:, n - 2:].any()  # padding never seen


def test_a_processor_that_cannot_render_images_serves_text_only_saying_why(tmp_path):
    """A folder whose chat template has no place for images: the load's check with an image fails,
    so the model serves text (equal to HF) and its images are refused with that reason."""
    path = save_vision_model("llava", tmp_path / "llava", chat_template=TEXT_ONLY_TEMPLATE)
    loaded = load_model(str(path))
    assert loaded.processor is None and "cannot render a chat with an image" in loaded.images_refused
    engine = build_engine(loaded, EngineConfig(), num_blocks=64)
    prompt = loaded.tokenizer.encode("Just text, no image here.")
    got = run(engine, [GenerationRequest("text", prompt, GREEDY)])["text"]
    assert got == hf_greedy(path, {"input_ids": np.array([prompt])})
