"""OpenAI's Responses API through the real openai SDK against the real app on the tiny model: text
and item input, streamed and not (every event and answer validated strictly against the SDK's own
types, the stream exactly as OpenAI frames it), the same greedy text as a chat completion of the
same messages, a forced function call and its streamed arguments, `previous_response_id` with a
call's output (only for the tenant that stored it), GET and DELETE, the input token count, a client
that leaves, and 400s naming what cannot be done."""

from __future__ import annotations

import asyncio
import json
import typing

import aiohttp
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import Client, auth_app
from tests.api.test_openai_wire import strict
from tests.api.test_structured_output import WEATHER
from tests.helpers import start_tiny_engines

EVENT_TYPES = {cls.model_fields["type"].annotation.__args__[0]: cls
               for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather by city", "parameters": WEATHER,
          "strict": True}]
ITEM_EVENTS = {  # the events of one output item, in order (deltas may repeat)
    "message": ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                "response.output_text.done", "response.content_part.done", "response.output_item.done"],
    "function_call": ["response.output_item.added", "response.function_call_arguments.delta",
                      "response.function_call_arguments.done", "response.output_item.done"],
}


@pytest.fixture
def model_dir(long_context_dir):
    return long_context_dir


async def strict_response(sdk: openai.AsyncOpenAI, **kw) -> Response:
    raw = await sdk.responses.with_raw_response.create(**kw)
    return strict(Response, raw.content)


async def raw_events(sdk: openai.AsyncOpenAI, body: dict) -> list:
    """The stream as sent: each event's `event:` line names its type, `data:` holds it; strictly validated."""
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{sdk.base_url}responses", json={**body, "stream": True}) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            text = (await resp.read()).decode()
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = strict(EVENT_TYPES[name.removeprefix("event: ")], data.removeprefix("data: "))
        assert event.type == name.removeprefix("event: ")
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def event_types(events) -> list[str]:
    """The types with repeated deltas counted once."""
    out = []
    for event in events:
        if not (event.type.endswith(".delta") and out and out[-1] == event.type):
            out.append(event.type)
    return out


async def test_text_input_collected_and_streamed(sdk):
    ask = {"model": "tiny", "input": "Hello there", "max_output_tokens": 8, "temperature": 0}
    answer = await strict_response(sdk, **ask)
    assert answer.id.startswith("resp_") and answer.object == "response"
    [message] = answer.output
    assert message.type == "message" and message.content[0].type == "output_text"
    assert answer.output_text == message.content[0].text
    assert answer.usage.total_tokens == answer.usage.input_tokens + answer.usage.output_tokens
    if answer.usage.output_tokens == 8:
        assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    else:
        assert answer.status == "completed" and answer.incomplete_details is None

    events = await raw_events(sdk, ask)
    last = "response.incomplete" if answer.status == "incomplete" else "response.completed"
    assert event_types(events) == ["response.created", "response.in_progress", *ITEM_EVENTS["message"], last]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == answer.output_text == events[-1].response.output_text
    apart = {"input_tokens_details"}  # its cached_tokens: the prompt is in the prefix cache by now
    assert events[-1].response.usage.model_dump(exclude=apart) == answer.usage.model_dump(exclude=apart)

    streamed = [event async for event in await sdk.responses.create(stream=True, **ask)]  # the SDK reads it too
    assert streamed[-1].type == last and streamed[-1].response.output_text == answer.output_text


async def test_items_and_instructions_answer_as_the_same_chat(sdk):
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!",
                                                                     "annotations": []}]},
             {"role": "user", "content": "And now?"}]
    answer = await strict_response(sdk, model="tiny", instructions="You are terse.", input=items,
                                   max_output_tokens=10, temperature=0)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": "And now?"}]
    chat = await sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.instructions == "You are terse." and answer.temperature == 0
    count = await sdk.responses.input_tokens.count(model="tiny", instructions="You are terse.", input=items)
    assert (count.object, count.input_tokens) == ("response.input_tokens", answer.usage.input_tokens)


async def test_input_tokens_details_count_cached_tokens(sdk):
    instructions = "You are a careful assistant who answers briefly. " * 8
    usages = [(await strict_response(sdk, model="tiny", instructions=instructions, input=text, max_output_tokens=2,
                                     temperature=0)).usage for text in ("Hello", "Bye")]
    assert usages[0].input_tokens_details.cached_tokens == 0
    assert 0 < usages[1].input_tokens_details.cached_tokens < usages[1].input_tokens
    assert usages[1].input_tokens_details.cached_tokens % 16 == 0


async def test_vllms_sampling_extensions(sdk):
    """What guidellm sends (`stop: null`, `ignore_eos`) and vLLM's other sampling fields on this endpoint."""
    extra = {"stop": None, "ignore_eos": True, "seed": 3, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1}
    answer = await strict_response(sdk, model="tiny", input="Hello", max_output_tokens=20, extra_body=extra)
    assert answer.usage.output_tokens == 20 and answer.status == "incomplete"
    again = await strict_response(sdk, model="tiny", input="Hello", max_output_tokens=20, extra_body=extra)
    assert again.output_text == answer.output_text  # seeded
    stopped = await strict_response(sdk, model="tiny", input="Hello", max_output_tokens=20,
                                    extra_body={**extra, "stop": answer.output_text[3:6]})
    assert stopped.output_text == answer.output_text[:3]


async def test_a_forced_call_then_its_output_continues_the_response(sdk):
    ask = {"model": "tiny", "input": "Weather in Paris?", "tools": TOOLS, "temperature": 0,
           "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 400}
    first = await strict_response(sdk, **ask)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert first.status == "completed" and first.tools[0].name == "get_weather"

    events = await raw_events(sdk, ask)
    assert event_types(events) == ["response.created", "response.in_progress", *ITEM_EVENTS["function_call"],
                                   "response.completed"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call.arguments and len(pieces) > 1

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}
    follow = await strict_response(sdk, model="tiny", previous_response_id=first.id, input=[result],
                                   max_output_tokens=12, temperature=0)
    assert follow.previous_response_id == first.id and follow.output[0].type == "message"
    chat = await sdk.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"celsius": 21}'}])
    assert follow.output_text == chat.choices[0].message.content  # the stored history came first
    assert follow.usage.input_tokens == chat.usage.prompt_tokens

    again = strict(Response, (await sdk.responses.with_raw_response.retrieve(first.id)).content)
    assert again.output[0].model_dump() == call.model_dump() and again.usage == first.usage
    await sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(first.id)
    assert (await sdk.responses.retrieve(follow.id)).output_text == follow.output_text  # a chain copies its history


async def test_unstored_and_unknown_responses_are_not_found(sdk):
    unstored = await sdk.responses.create(model="tiny", input="Hi", max_output_tokens=4, store=False)
    for bad in (unstored.id, "resp_0123", "nope"):
        with pytest.raises(openai.NotFoundError) as info:
            await sdk.responses.create(model="tiny", input="Hi", max_output_tokens=4, previous_response_id=bad)
        assert info.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(bad)


async def test_a_client_that_leaves_mid_stream_stores_nothing(served, sdk):
    body = {"model": "tiny", "input": "Hello", "max_output_tokens": 400, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{sdk.base_url}responses", json=body) as resp:
            await resp.content.readuntil(b"\n\n")
            created = json.loads((await resp.content.readuntil(b"\n\n")).decode().split("data: ", 1)[1])
    conversation = "conv_" + created["response"]["id"].removeprefix("resp_")
    async with aiohttp.ClientSession() as session:
        for _ in range(200):  # the conversation started for it is discarded in the background
            async with session.get(f"{sdk.base_url}".replace("/v1/", "/api/v1/conversations")) as resp:
                if conversation not in [c["id"] for c in (await resp.json())["data"]]:
                    break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the unfinished response's conversation was kept")


async def test_json_schema_text_format(sdk):
    answer = await sdk.responses.create(model="tiny", input="Weather?", temperature=0, max_output_tokens=300,
                                        text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}})
    jsonschema.validate(json.loads(answer.output_text), WEATHER)


@pytest.mark.parametrize(("body", "named"), [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"background": True}, "background"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "not in `tools`"),
])
async def test_what_cannot_be_done_is_a_400_naming_it(sdk, body, named):
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.responses.create(**{"model": "tiny", "input": "Hi", "max_output_tokens": 4, **body})
    error = info.value.body
    assert named in error["message"] or (error["param"] or "").startswith(named), error


async def test_only_the_tenant_that_stored_a_response_may_continue_it(aiohttp_server, db, llama_path):
    router, workers = await start_tiny_engines(llama_path)
    try:
        server = await aiohttp_server(auth_app(db, router))
        async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
            api = Client(session)
            acme, other = await api.new_key("acme"), await api.new_key("other")
        url = str(server.make_url("/v1"))
        async with openai.AsyncOpenAI(base_url=url, api_key=acme, max_retries=0) as mine, \
                openai.AsyncOpenAI(base_url=url, api_key=other, max_retries=0) as theirs:
            first = await mine.responses.create(model="tiny", input="Hi", max_output_tokens=4, temperature=0)
            with pytest.raises(openai.NotFoundError):
                await theirs.responses.create(model="tiny", input="Go on", max_output_tokens=4,
                                              previous_response_id=first.id)
            with pytest.raises(openai.NotFoundError):
                await theirs.responses.retrieve(first.id)
            with pytest.raises(openai.NotFoundError):
                await theirs.responses.delete(first.id)
            follow = await mine.responses.create(model="tiny", input="Go on", max_output_tokens=4,
                                                 previous_response_id=first.id)
            assert follow.status in ("completed", "incomplete")
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()
