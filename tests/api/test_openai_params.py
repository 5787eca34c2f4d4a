"""The parameters real OpenAI and vLLM clients send: nulls, vLLM's extensions, fields accepted
and ignored, prompt lists, echo, history as the SDK dumps it, /tokenize and /detokenize.
Through the real openai SDK (or raw JSON where a client sends what the SDK would not) against
the real app on the tiny model."""

from __future__ import annotations

import shutil

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from tests.api.test_api import client, start_server, wait_blocks_free

MESSAGES = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture
async def http(served):
    async with aiohttp.ClientSession(base_url=served.make_url("/")) as session:
        yield session


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    return AutoTokenizer.from_pretrained(llama_path)


async def post(http: aiohttp.ClientSession, path: str, body: dict) -> tuple[int, dict]:
    async with http.post(path, json=body) as resp:
        return resp.status, await resp.json()


NULLABLE = ["temperature", "top_p", "n", "frequency_penalty", "presence_penalty", "stream", "stream_options",
            "max_tokens", "stop", "seed", "logit_bias", "user", "top_k", "min_p", "repetition_penalty", "logprobs"]
IGNORED = {"store": True, "metadata": {"team": "a"}, "service_tier": "auto", "prompt_cache_key": "k",
           "prompt_cache_retention": "24h", "safety_identifier": "u1", "verbosity": "low", "reasoning_effort": "low",
           "parallel_tool_calls": True, "modalities": ["text"], "audio": None, "prediction": {"type": "content",
           "content": "x"}, "web_search_options": {}, "stream_options": {"include_usage": True,
                                                                        "include_obfuscation": False}}


async def test_null_means_the_default_and_ignored_fields_are_accepted(http):
    nulls = dict.fromkeys(NULLABLE)
    status, chat = await post(http, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, **nulls,
                                                             "max_completion_tokens": 3, "top_logprobs": None})
    assert status == 200 and chat["usage"]["completion_tokens"] <= 3, chat
    status, comp = await post(http, "/v1/completions", {"model": "tiny", "prompt": "hi", **nulls, "echo": None,
                                                        "best_of": None, "suffix": None})
    assert status == 200 and len(comp["choices"]) == 1
    status, _ = await post(http, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                          **IGNORED})
    assert status == 200


@pytest.mark.parametrize(("path", "extra", "needle"), [
    ("/v1/chat/completions", {"bogus_field": 1}, "bogus_field"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "tokenize"),
    ("/v1/chat/completions", {"continue_final_message": True}, "add_generation_prompt"),
    ("/v1/chat/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://x/y.png"}}]}]}, "image_url"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"prompt": ["a"] * 20, "n": 16}, "choices"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 99999]]}, "prompt.1"),
])
async def test_what_cannot_be_honoured_is_a_400_naming_it(http, path, extra, needle):
    base = {"model": "tiny", "max_tokens": 2}
    base.update({"messages": MESSAGES} if "chat" in path else {"prompt": "hi"})
    status, body = await post(http, path, {**base, **extra})
    assert status == 400 and needle in body["error"]["message"], body


async def test_logit_bias_through_the_sdk(sdk, tokenizer):
    forced = tokenizer.convert_tokens_to_ids("Ġfox")
    out = await sdk.completions.create(model="tiny", prompt="The quick brown", max_tokens=5, **GREEDY,
                                       logit_bias={str(forced): 100})
    assert out.choices[0].text == " fox" * 5
    banned = await sdk.completions.create(model="tiny", prompt="The quick brown", max_tokens=5, **GREEDY)
    first = tokenizer.encode(banned.choices[0].text)[0]
    other = await sdk.completions.create(model="tiny", prompt="The quick brown", max_tokens=5, **GREEDY,
                                         logit_bias={str(first): -100})
    assert tokenizer.encode(other.choices[0].text)[0] != first


async def test_min_tokens_stops_and_stop_strings(sdk, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")  # the tiny model's EOS (its generation config)
    bias = {str(eos): 100}
    at_once = await sdk.completions.create(model="tiny", prompt="hi", max_tokens=8, temperature=0, logit_bias=bias)
    assert at_once.usage.completion_tokens == 1 and at_once.choices[0].finish_reason == "stop"
    held = await sdk.completions.create(model="tiny", prompt="hi", max_tokens=8, temperature=0, logit_bias=bias,
                                        extra_body={"min_tokens": 4})
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"
    full = (await sdk.completions.create(model="tiny", prompt="The quick brown", max_tokens=12, **GREEDY)).choices[0]
    stop = full.text[4:7]
    kept = await sdk.completions.create(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0,
                                        stop=[stop], extra_body={"ignore_eos": True,
                                                                 "include_stop_str_in_output": True})
    assert kept.choices[0].text == full.text[: full.text.index(stop) + len(stop)]
    special = await sdk.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0, logit_bias=bias,
                                           extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert special.choices[0].text == "<|im_end|>" * 2


async def test_prompt_lists_give_a_choice_per_prompt_in_openai_order(sdk):
    prompts = ["The quick brown", "To be, or not", "Emoji time"]
    alone = [(await sdk.completions.create(model="tiny", prompt=p, max_tokens=4, **GREEDY)).choices[0].text
             for p in prompts]
    together = await sdk.completions.create(model="tiny", prompt=prompts, max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in together.choices] == list(range(6))
    assert [c.text for c in together.choices] == [t for t in alone for _ in range(2)]
    single = await sdk.completions.create(model="tiny", prompt=prompts[0], max_tokens=4, **GREEDY)
    prompt_tokens = together.usage.prompt_tokens
    assert prompt_tokens > single.usage.prompt_tokens and together.usage.completion_tokens == 24
    streamed = await sdk.completions.create(model="tiny", prompt=prompts, max_tokens=4, stream=True, **GREEDY)
    texts = [""] * 3
    async for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == alone
    ids = await sdk.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=3, **GREEDY)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    langchain_style = await sdk.completions.create(model="tiny", prompt=["one prompt"], max_tokens=2, **GREEDY)
    assert len(langchain_style.choices) == 1


async def test_echo_prepends_the_prompt(sdk, tokenizer):
    plain = (await sdk.completions.create(model="tiny", prompt="The quick", max_tokens=4, **GREEDY)).choices[0].text
    echoed = await sdk.completions.create(model="tiny", prompt="The quick", max_tokens=4, echo=True, **GREEDY)
    assert echoed.choices[0].text == "The quick" + plain
    ids = tokenizer.encode("The quick")
    by_ids = await sdk.completions.create(model="tiny", prompt=ids, max_tokens=4, echo=True, **GREEDY)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + plain
    stream = await sdk.completions.create(model="tiny", prompt="The quick", max_tokens=4, echo=True, stream=True,
                                          **GREEDY)
    chunks = [chunk.choices[0].text async for chunk in stream]
    assert chunks[0] == "The quick" and "".join(chunks) == "The quick" + plain


async def test_history_as_the_sdk_dumps_it_with_tool_turns(sdk):
    first = await sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, **GREEDY)
    dumped = first.choices[0].message.model_dump()  # refusal, annotations, audio, function_call, tool_calls: null
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(dumped)
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "fox"}'}}
    history = [{"role": "developer", "content": "Be brief."}, *MESSAGES, dumped,
               {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
               {"role": "tool", "tool_call_id": "call_1", "content": "a quick brown fox"},
               {"role": "assistant", "content": "Yes.", "reasoning": "vLLM's name", "reasoning_content": "its old one",
                "provider_specific_fields": None},  # as vLLM answers and LiteLLM dumps a message
               {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "then?"}],
                "name": "ann"}]
    second = await sdk.chat.completions.create(model="tiny", messages=history, max_tokens=3, **GREEDY)
    assert second.choices[0].message.content is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


async def test_continue_final_message_and_generation_prompt(http, tokenizer):
    partial = [*MESSAGES, {"role": "assistant", "content": "The quick"}]
    status, body = await post(http, "/tokenize", {"messages": partial, "add_generation_prompt": False,
                                                  "continue_final_message": True})
    rendered = tokenizer.apply_chat_template(partial, tokenize=False, continue_final_message=True)
    assert status == 200 and body["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert rendered.endswith("The quick")
    status, chat = await post(http, "/v1/chat/completions", {"model": "tiny", "messages": partial, "max_tokens": 2,
                                                             "add_generation_prompt": False,
                                                             "continue_final_message": True})
    assert status == 200 and chat["usage"]["prompt_tokens"] == body["count"]
    status, bare = await post(http, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    status, full = await post(http, "/tokenize", {"messages": MESSAGES})
    assert full["count"] > bare["count"]


async def test_tokenize_and_detokenize_in_vllms_shapes(http, sdk, tokenizer):
    status, body = await post(http, "/tokenize", {"model": "tiny", "prompt": "The quick brown fox"})
    assert status == 200 and set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tokenizer.encode("The quick brown fox") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and body["token_strs"] is None
    status, chat = await post(http, "/tokenize", {"messages": MESSAGES, "return_token_strs": True})  # model: the only
    answer = await sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0)
    assert chat["count"] == answer.usage.prompt_tokens and len(chat["token_strs"]) == chat["count"]
    status, text = await post(http, "/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert status == 200 and text == {"prompt": "The quick brown fox"}
    status, error = await post(http, "/detokenize", {"tokens": [1, 99999]})
    assert status == 400 and "tokens" in error["error"]["message"]
    status, error = await post(http, "/tokenize", {"prompt": "x", "messages": MESSAGES})
    assert status == 400
    status, error = await post(http, "/tokenize", {"model": "nope", "prompt": "x"})
    assert status == 404


async def test_chat_template_kwargs_reach_the_template(aiohttp_server, llama_path, tmp_path):
    path = tmp_path / "greeter"
    shutil.copytree(llama_path, path)
    template = path / "chat_template.jinja"
    template.write_text("{% if shout %}LOUD {% endif %}" + template.read_text())
    server, router, workers = await start_server(aiohttp_server, path)
    try:
        async with aiohttp.ClientSession(base_url=server.make_url("/")) as http:
            _, quiet = await post(http, "/tokenize", {"messages": MESSAGES})
            _, loud = await post(http, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"shout": True}})
            assert loud["count"] > quiet["count"]
            async with client(server) as sdk:
                chat = await sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                                         extra_body={"chat_template_kwargs": {"shout": True}})
            assert chat.usage.prompt_tokens == loud["count"]
    finally:
        await wait_blocks_free(router)
        for worker in workers:
            worker.stop()


async def test_sdk_sends_nothing_we_refuse(sdk):
    """Every chat and completion parameter of the openai SDK, set at once."""
    chat = await sdk.chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=3, temperature=0.5, top_p=0.9, n=1, seed=1,
        stop=["zz"], frequency_penalty=0.1, presence_penalty=0.1, logit_bias={"5": -1}, logprobs=True,
        top_logprobs=1, user="u", store=False, metadata={"k": "v"}, service_tier="default", parallel_tool_calls=False,
        prompt_cache_key="p", safety_identifier="s", verbosity="medium", reasoning_effort="low", modalities=["text"],
        prediction={"type": "content", "content": "hi"}, stream_options=None, web_search_options={})
    assert chat.choices[0].logprobs is not None
    comp = await sdk.completions.create(model="tiny", prompt="hi", max_tokens=2, best_of=1, echo=False,
                                        frequency_penalty=0, logit_bias={}, logprobs=0, n=1, presence_penalty=0,
                                        seed=0, stop=None, suffix=None, temperature=1, top_p=1, user="u")
    assert len(comp.choices) == 1
    with pytest.raises(openai.BadRequestError, match="suffix"):
        await sdk.completions.create(model="tiny", prompt="hi", max_tokens=2, suffix="tail")
