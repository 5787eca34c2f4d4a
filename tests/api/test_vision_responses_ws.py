"""Vision chat through the Responses API and the WebSocket chat (issue 35), on the real app with real
clients (the openai SDK, an aiohttp WebSocket): `input_image` parts and `image_url` parts answer as
HF `generate` does on the same processor's inputs; a `previous_response_id` follow-up still sees the
first image; bad images get a 400 (or an `error` frame) naming the part."""

from __future__ import annotations

import asyncio
import base64

import openai
import pytest

from engine.processors import load_processor
from storage.registry import ModelVersion
from tests.api.test_deployments import make_stack  # noqa: F401 (fixture)
from tests.api.test_generic_models import sdk_for
from tests.api.test_vision_chat import data_url, user
from tests.engine.test_vision import hf_greedy, pictures, png, processed
from tests.models import save_vision_model

TEXT = "What is in this picture?"
BAD_IMAGES = [
    ("https://example.com/cat.png", "not fetched"),
    ("data:image/png;base64,not-base64!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "cannot be decoded"),
]


@pytest.fixture(scope="module", params=["llava", "idefics3"])
def llava(request, tmp_path_factory):
    return save_vision_model(request.param, tmp_path_factory.mktemp(f"{request.param}-responses") / "model")


def input_message(text: str, url: str, **image) -> dict:
    return {"role": "user", "content": [{"type": "input_image", "image_url": url, **image},
                                        {"type": "input_text", "text": text}]}


def hf_answer(llava, history: list[dict]) -> str:
    processor = load_processor(llava, "")
    encoded = processor.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=True,
                                            return_tensors="np")
    return processor.decode(hf_greedy(llava, encoded), skip_special_tokens=True)


def hf_first_answers(llava, images: list) -> list[str]:
    processor = load_processor(llava, "")
    return [processor.decode(hf_greedy(llava, processed(processor, [image], TEXT)), skip_special_tokens=True)
            for image in images]


async def ws_chat(stack, message: dict) -> list[dict]:
    """The frames a `chat` gets, up to its `done` or `error`."""
    frames = []
    async with stack.client.session.ws_connect("/ws/chat", headers={"Authorization": f"Bearer {stack.key}"}) as ws:
        await ws.send_json(message)
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(await asyncio.wait_for(ws.receive_json(), 60))
    return frames


async def test_responses_answer_as_hf_and_a_follow_up_sees_the_image(make_stack, llava):  # noqa: F811
    stack = await make_stack([ModelVersion("vlm", "1", str(llava))])
    sdk = sdk_for(stack)
    first, second = pictures(2, seed=3)
    expected = hf_first_answers(llava, [first, second])
    assert expected[0] != expected[1]

    ask = dict(model="vlm", max_output_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    answer = await sdk.responses.create(input=[input_message(TEXT, data_url(first), detail="auto")], **ask)
    assert answer.output_text == expected[0]
    bare = base64.b64encode(png(second)).decode()  # bare base64, as on chat
    other = await sdk.responses.create(input=[input_message(TEXT, bare)], **ask)
    assert other.output_text == expected[1]
    assert answer.usage.input_tokens == other.usage.input_tokens > 16  # each image is 16 image tokens

    # the stored response keeps its image: a follow-up's prompt has it again
    follow = await sdk.responses.create(input="And now?", previous_response_id=answer.id, **ask)
    history = [{"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": TEXT}]},
               {"role": "assistant", "content": expected[0]}, {"role": "user", "content": "And now?"}]
    assert follow.output_text == hf_answer(llava, history)
    assert follow.usage.input_tokens > answer.usage.input_tokens
    await sdk.close()


async def test_ws_chat_with_image_parts_answers_as_hf(make_stack, llava):  # noqa: F811
    stack = await make_stack([ModelVersion("vlm", "1", str(llava))])
    first, second = pictures(2, seed=3)
    expected = hf_first_answers(llava, [first, second])
    params = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    for image, want in zip((first, second), expected):
        frames = await ws_chat(stack, {"type": "chat", "model": "vlm", "messages": [user(TEXT, data_url(image))],
                                       "params": params})
        assert frames[0]["type"] == "start" and frames[-1]["type"] == "done", frames[-1]
        assert "".join(f["text"] for f in frames if f["type"] == "token") == want


async def test_bad_images_are_refused_naming_the_part(make_stack, llava):  # noqa: F811
    stack = await make_stack([ModelVersion("vlm", "1", str(llava))])
    sdk = sdk_for(stack)
    for url, why in BAD_IMAGES:
        # instructions come first and the reasoning item is not shown: the error still names `input.1`
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.responses.create(model="vlm", instructions="Be brief.", max_output_tokens=4, input=[
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"role": "user", "content": [{"type": "input_text", "text": "What is it?"},
                                             {"type": "input_image", "image_url": url, "detail": "low"}]}])
        assert why in caught.value.body["message"] and caught.value.body["param"] == "input.1.content.1"
        frames = await ws_chat(stack, {"type": "chat", "model": "vlm", "params": {"max_tokens": 4}, "messages": [
            {"role": "system", "content": "Be brief."}, user("What is it?", url)]})
        assert len(frames) == 1 and frames[0]["code"] == "invalid_request_error", frames
        assert why in frames[0]["message"] and frames[0]["param"] == "messages.1.content.0"

    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.responses.create(model="vlm", max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_image", "file_id": "file-abc", "detail": "auto"}]}])
    assert "file_id" in caught.value.body["message"] and caught.value.body["param"] == "input.0.content.0"
    frames = await ws_chat(stack, {"type": "chat", "model": "vlm", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]})
    assert frames[0]["type"] == "error" and frames[0]["param"].startswith("messages.0.content"), frames
    await sdk.close()
