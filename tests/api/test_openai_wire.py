"""What OpenAI clients see, byte for byte: /v1 streams are plain `data:` events (as vLLM's and
SGLang's benchmark clients parse them), every chunk and answer validates strictly against the
openai SDK's own types with no field they do not define, and the resume endpoint numbers its
events uniquely. Through the real openai SDK against the real app on the tiny model."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
        "temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPT = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 6, "temperature": 0,
          "extra_body": {"ignore_eos": True}}


def assert_only_openai_fields(value: object, path: str = "$") -> None:
    """No field anywhere that the SDK's type does not declare (its models accept extras silently)."""
    if isinstance(value, BaseModel):
        assert not value.model_extra, f"{path}: not OpenAI fields: {sorted(value.model_extra)}"
        for name in type(value).model_fields:
            assert_only_openai_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            assert_only_openai_fields(item, f"{path}[{i}]")


def strict(model: type[BaseModel], raw: str | bytes) -> BaseModel:
    parsed = model.model_validate_json(raw, strict=True)
    assert_only_openai_fields(parsed)
    return parsed


def strict_completion_chunk(raw: str) -> Completion:
    """A streamed text-completion chunk: openai's `Completion` requires a finish reason, which only
    the last chunk of a choice has (OpenAI and vLLM send null before it), so null reads as "stop"."""
    data = json.loads(raw)
    for choice in data["choices"]:
        choice["finish_reason"] = choice["finish_reason"] or "stop"
    return strict(Completion, json.dumps(data))


async def raw_stream(create, **kw) -> tuple[dict[str, str], list[str]]:
    """The SDK's streaming call, read as raw lines: (headers, every line of the body)."""
    async with create.with_streaming_response.create(stream=True, **kw) as response:
        return dict(response.headers), [line async for line in response.iter_lines()]


def data_of(lines: list[str]) -> list[str]:
    """The payloads of a plain OpenAI stream, checking it is only `data:` lines and blank separators."""
    assert all(line.startswith("data: ") or line == "" for line in lines), [x for x in lines if x[:6] != "data: "]
    payloads = [line[6:] for line in lines if line]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return payloads[:-1]


@pytest.mark.parametrize("options", [{}, {"include_usage": True}, {"include_usage": True,
                                                                    "continuous_usage_stats": True}])
async def test_chat_stream_is_plain_sse_and_every_chunk_is_strictly_openai(sdk, options):
    extra = {**CHAT["extra_body"], "stream_options": options} if options else CHAT["extra_body"]
    headers, lines = await raw_stream(sdk.chat.completions, **{**CHAT, "extra_body": extra},
                                      logprobs=True, top_logprobs=2)
    chunks = [strict(ChatCompletionChunk, raw) for raw in data_of(lines)]
    assert {c.id for c in chunks} == {headers["x-stream-id"]}  # the stream id: header and chunk id alike
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunks = [c for c in chunks if not c.choices]
    assert len(usage_chunks) == bool(options)
    if options.get("continuous_usage_stats"):
        done = [c.usage.completion_tokens for c in chunks]
        assert done == sorted(done) and done[0] == 0 and done[-1] == 6
        assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    elif options:
        assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == 6
    whole = await sdk.chat.completions.with_raw_response.create(**CHAT, logprobs=True, top_logprobs=2)
    answer = strict(ChatCompletion, whole.content)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert answer.choices[0].message.content == streamed
    assert len(answer.choices[0].logprobs.content) == 6


async def test_completion_stream_and_answer_are_strictly_openai(sdk):
    headers, lines = await raw_stream(sdk.completions, **PROMPT, logprobs=2, stream_options={"include_usage": True})
    payloads = data_of(lines)
    chunks = [strict_completion_chunk(raw) for raw in payloads[:-1]] + [strict(Completion, payloads[-1])]
    assert {c.id for c in chunks} == {headers["x-stream-id"]}
    whole = strict(Completion, (await sdk.completions.with_raw_response.create(**PROMPT, logprobs=2)).content)
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices)
    several = await sdk.completions.with_raw_response.create(**{**PROMPT, "prompt": ["a", "b"]}, n=2)
    assert [c.index for c in strict(Completion, several.content).choices] == [0, 1, 2, 3]


async def test_n_choices_stream_is_plain_and_strict(sdk):
    _, lines = await raw_stream(sdk.chat.completions, **CHAT, n=2, stream_options={"include_usage": True})
    chunks = [strict(ChatCompletionChunk, raw) for raw in data_of(lines)]
    assert chunks[-1].usage.completion_tokens == 12
    _, lines = await raw_stream(sdk.completions, **PROMPT, n=2)
    payloads = data_of(lines)
    for raw in payloads:
        strict_completion_chunk(raw)
    finishes = [(c["index"], c["finish_reason"]) for raw in payloads for c in json.loads(raw)["choices"]
                if c["finish_reason"]]
    assert sorted(finishes) == [(0, "length"), (1, "length")]


async def test_cached_tokens_count_the_prompt_prefix_found_in_the_prefix_cache(sdk):
    """A second request sharing a long prefix reports the prompt tokens it did not compute (whole
    KV blocks of 16); the first reports 0. Chat and completions, streamed usage and not."""
    system = {"role": "system", "content": "You are a careful assistant who answers briefly. " * 8}
    ask = {"model": "tiny", "max_tokens": 2, "temperature": 0}
    first = await sdk.chat.completions.with_raw_response.create(
        **ask, messages=[system, {"role": "user", "content": "Hello"}])
    assert strict(ChatCompletion, first.content).usage.prompt_tokens_details.cached_tokens == 0
    _, lines = await raw_stream(sdk.chat.completions, **ask, messages=[system, {"role": "user", "content": "Bye"}],
                                stream_options={"include_usage": True})
    usage = strict(ChatCompletionChunk, data_of(lines)[-1]).usage
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens % 16 == 0
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    texts = [strict(Completion, (await sdk.completions.with_raw_response.create(**ask, prompt=prompt + end)).content)
             for end in ("Then", "So")]
    assert [t.usage.prompt_tokens_details.cached_tokens % 16 for t in texts] == [0, 0]
    assert texts[0].usage.prompt_tokens_details.cached_tokens == 0 < texts[1].usage.prompt_tokens_details.cached_tokens


async def test_models_list_and_retrieve(sdk):
    listed = await sdk.models.with_raw_response.list()
    assert [m["id"] for m in json.loads(listed.content)["data"]] == ["tiny"]
    raw = await sdk.models.with_raw_response.retrieve("tiny")
    model = Model.model_validate_json(raw.content, strict=True)
    assert model.id == "tiny" and model.object == "model" and model.owned_by == "galley"
    assert set(model.model_extra) == {"kind", "max_model_len", "sampling_defaults", "architecture", "family",
                                      "backend", "modalities", "parent", "adapters", "ready"}  # galley's and vLLM's
    assert (model.model_extra["parent"], model.model_extra["adapters"]) == (None, [])
    with pytest.raises(openai.NotFoundError) as caught:
        await sdk.models.retrieve("nope")
    assert caught.value.body["code"] == "model_not_found" and "nope" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        await sdk.models.retrieve("some/org-model")  # a slash in a model id reaches the handler


async def test_resume_endpoint_numbers_every_chunk_once(served):
    """The last token, the finish chunk and the usage chunk each have their own id; resuming after
    any count of chunks gives exactly the rest, numbered on from there."""
    body = {"model": "tiny", "messages": CHAT["messages"], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "galley": {"on_disconnect": "continue"}}
    async with aiohttp.ClientSession(base_url=served.make_url("/")) as session:
        async with session.post("/v1/chat/completions", json=body) as resp:
            stream_id = resp.headers["X-Stream-Id"]
            plain = (await resp.text()).split("\n")
        assert not any(line.startswith("id:") for line in plain)
        chunks = [line[6:] for line in plain if line.startswith("data: ")][:-1]
        for after in range(len(chunks) + 1):
            async with session.get(f"/api/v1/streams/{stream_id}", headers={"Last-Event-ID": str(after)}) as resp:
                events = (await resp.text()).strip("\n").split("\n\n")
            numbered = [event.split("\n") for event in events[:-1]]
            assert [int(e[0].removeprefix("id: ")) for e in numbered] == list(range(after + 1, len(chunks) + 1))
            assert [e[1].removeprefix("data: ") for e in numbered] == chunks[after:]
            assert events[-1] == "data: [DONE]"
