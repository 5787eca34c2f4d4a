"""Vision chat through the real app and the openai SDK (issue 35): OpenAI `image_url` content parts
(data URLs and bare base64) to a vision-language model answer as HF `generate` does on the same
processor's inputs, streamed or not; the same text with another image answers differently and is
never served from the response cache; a conversation keeps its images for the next turn; bad images
and images for a text model get a 400 naming the part."""

from __future__ import annotations

import asyncio
import base64

import openai
import pytest

from engine.processors import load_processor
from storage.registry import ModelVersion
from tests.api.test_deployments import make_stack  # noqa: F401 (fixture)
from tests.api.test_generic_models import sdk_for
from tests.engine.test_vision import TEXT_ONLY_TEMPLATE, hf_greedy, pictures, png, processed
from tests.models import save_vision_model


@pytest.fixture(scope="module", params=["llava", "idefics3", "qwen2_5_vl"])
def llava(request, tmp_path_factory):
    return save_vision_model(request.param, tmp_path_factory.mktemp(f"{request.param}-http") / "model")


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def user(text: str, *urls: str) -> dict:
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                        {"type": "text", "text": text}]}


async def test_image_chat_answers_as_hf_streamed_or_not_and_sees_the_image(make_stack, llava, tiny_models):  # noqa: F811
    stack = await make_stack([ModelVersion("vlm", "1", str(llava)),
                              ModelVersion("tiny", "1", str(tiny_models["llama"]))])
    sdk = sdk_for(stack)
    cards = {card.id: card.model_extra for card in (await sdk.models.list()).data}
    assert cards["vlm"]["modalities"] == ["text", "image"] and cards["tiny"]["modalities"] == ["text"]
    processor = load_processor(llava, "")
    [first], [second] = pictures(1, seed=3), pictures(1, seed=4)  # one size: the same tokens (Qwen's vary with it)
    text = "What is in this picture?"
    expected = {name: processor.decode(hf_greedy(llava, processed(processor, [image], text)), skip_special_tokens=True)
                for name, image in (("first", first), ("second", second))}
    assert expected["first"] != expected["second"]

    ask = dict(model="vlm", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = await sdk.chat.completions.create(messages=[user(text, data_url(first))], **ask)
    assert whole.choices[0].message.content == expected["first"]
    bare = base64.b64encode(png(second)).decode()  # bare base64, as some clients send it
    other = await sdk.chat.completions.create(messages=[user(text, bare)], **ask)  # the same tokens: not a cache hit
    assert other.choices[0].message.content == expected["second"]
    assert whole.usage.prompt_tokens == other.usage.prompt_tokens > 16  # the image's tokens and the text's
    streamed = await sdk.chat.completions.create(messages=[user(text, data_url(first))], stream=True, **ask)
    assert "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices]) == expected["first"]

    # a conversation stores its turns with their images: the next turn still sees the first image
    status, created = await stack.client.call("POST", "/api/v1/conversations", stack.key, json={"model": "vlm"})
    assert status == 201, created
    turn = dict(ask, extra_body={"ignore_eos": True, "conversation_id": created["id"]})
    await sdk.chat.completions.create(messages=[user(text, data_url(first))], **turn)
    follow = await sdk.chat.completions.create(messages=[{"role": "user", "content": "And now?"}], **turn)
    history = [{"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": text}]},
               {"role": "assistant", "content": expected["first"]}, {"role": "user", "content": "And now?"}]
    encoded = processor.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=True,
                                            return_tensors="np")
    assert follow.choices[0].message.content == processor.decode(hf_greedy(llava, encoded), skip_special_tokens=True)
    # a bad image in a later turn is named where this request has it, not counted after the history's
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.chat.completions.create(messages=[user(text, "data:image/png;base64,bad!")], **turn)
    assert caught.value.body["param"] == "messages.0.content.0"
    await sdk.close()


@pytest.mark.parametrize("url, why", [
    ("https://example.com/cat.png", "not fetched"),
    ("data:image/png;base64,not-base64!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "cannot be decoded"),
])
async def test_bad_images_get_a_400_naming_the_part(make_stack, llava, url, why):  # noqa: F811
    stack = await make_stack([ModelVersion("vlm", "1", str(llava))])
    sdk = sdk_for(stack)
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.chat.completions.create(model="vlm", messages=[{"role": "system", "content": "Be brief."},
                                                                 user("What is it?", url)], max_tokens=4)
    assert why in caught.value.body["message"] and caught.value.body["param"] == "messages.1.content.0"
    await sdk.close()


async def test_images_for_a_text_model_and_too_many_images_are_refused(make_stack, llava, tiny_models):  # noqa: F811
    stack = await make_stack([ModelVersion("vlm", "1", str(llava)),
                              ModelVersion("tiny", "1", str(tiny_models["llama"]))])
    sdk = sdk_for(stack)
    image = data_url(pictures(1)[0])
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.chat.completions.create(model="tiny", messages=[user("What is it?", image)], max_tokens=4)
    assert "takes no images" in caught.value.body["message"] and caught.value.body["code"] == "images_not_supported"
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.chat.completions.create(model="vlm", messages=[user("So many.", *[image] * 9)], max_tokens=4)
    assert "at most 8" in caught.value.body["message"]
    await sdk.close()


async def test_a_model_served_text_only_says_why_its_images_are_refused(make_stack, tmp_path):  # noqa: F811
    path = save_vision_model("llava", tmp_path / "llava", chat_template=TEXT_ONLY_TEMPLATE)
    stack = await make_stack([ModelVersion("textonly", "1", str(path))])
    sdk = sdk_for(stack)
    assert (await sdk.models.retrieve("textonly")).model_extra["modalities"] == ["text"]
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.chat.completions.create(model="textonly", messages=[user("What is it?", data_url(pictures(1)[0]))],
                                          max_tokens=4)
    assert "cannot render a chat with an image" in caught.value.body["message"]
    text = await sdk.chat.completions.create(model="textonly", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4)
    assert text.usage.completion_tokens >= 1  # text still served
    await sdk.close()


async def test_a_stream_with_images_resumes_after_a_restart_with_them(make_stack, llava):  # noqa: F811
    """A running stream keeps its prompt's images (until it finishes), so after a crash it resumes
    with them and gives the tokens it would have; one stored without them ends failed, saying why."""
    import dataclasses

    from api.services import SERVICES
    from services.inference.vision import encode_vision_chat
    from storage.streams import StreamStatus

    stack = await make_stack([ModelVersion("vlm", "1", str(llava))])
    sdk = sdk_for(stack)
    messages = [user("What?", data_url(pictures(1)[0]))]
    streamed = await sdk.chat.completions.create(model="vlm", messages=messages, max_tokens=8, stream=True,
                                                 temperature=0, extra_body={"ignore_eos": True})
    stream_id = [c async for c in streamed][0].id
    hub = stack.app[SERVICES].streams
    finished = hub.store.get(stream_id)
    assert finished.request["images"] and finished.status == StreamStatus.FINISHED and len(finished.token_ids) == 8
    assert hub.store.images(stream_id) is None  # a finished stream's images are gone: a replay needs only text
    _, images = await encode_vision_chat(hub.router.find("vlm"), messages)
    for suffix, stored in (("a", images.to_bytes()), ("b", None)):  # as a crash would leave them: running
        crashed = dataclasses.replace(finished, id=stream_id + suffix, status=StreamStatus.RUNNING,
                                      token_ids=finished.token_ids[:3], texts=finished.texts[:3])
        await asyncio.wrap_future(hub.store.insert(crashed, stored))
    assert await hub.recover() == 1
    for _ in range(200):
        resumed = hub.store.get(stream_id + "a")
        if resumed.status != StreamStatus.RUNNING:
            break
        await asyncio.sleep(0.05)
    assert resumed.status == StreamStatus.FINISHED and resumed.token_ids == finished.token_ids
    assert hub.store.images(stream_id + "a") is None
    unstored = hub.store.get(stream_id + "b")
    assert unstored.status == StreamStatus.FAILED and unstored.token_ids == finished.token_ids[:3]
    await sdk.close()


async def test_a_batch_job_of_image_chats_answers_as_hf_and_a_bad_image_fails_alone(make_stack, llava):  # noqa: F811
    from tests.helpers import wait_until

    stack = await make_stack([ModelVersion("vlm", "1", str(llava))])
    processor = load_processor(llava, "")
    first, second = pictures(2, seed=5)
    text = "Describe it."
    expected = [processor.decode(hf_greedy(llava, processed(processor, [image], text)), skip_special_tokens=True)
                for image in (first, second)]
    inputs = [[user(text, data_url(first))], [user(text, "data:image/png;base64,bm90IGFuIGltYWdl")],
              [user(text, data_url(second))]]
    status, created = await stack.client.call("POST", "/api/v1/batch", stack.key, json={
        "model": "vlm", "inputs": inputs, "params": {"max_tokens": 10, "temperature": 0, "ignore_eos": True}})
    assert status == 200, created

    async def results():
        _, found = await stack.client.call("GET", f"/api/v1/batch/{created['batch_id']}/results", stack.key)
        return found["results"] if found["status"] in ("completed", "failed") else None

    done = await wait_until(results, timeout_s=60, what="the job to end")
    assert [r["status"] for r in done] == ["completed", "failed", "completed"], done
    assert [done[0]["output"], done[2]["output"]] == expected  # each item saw its own image
    assert "cannot be decoded" in done[1]["error"]
