"""Reasoning models: a thinking model's `<think>` text comes apart from its answer as vLLM's
`reasoning_content` (collected and streamed as its own deltas), the template's switch
(`chat_template_kwargs.enable_thinking`) turns it off, and a template that opens `<think>` itself
(DeepSeek-R1's) starts the answer inside the thoughts. A scripted model (its greedy output is
fixed text) thinks through the real app and the real openai SDK."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response
from transformers import AutoTokenizer

from services.answers.reasoning import THINK_CLOSE, THINK_OPEN, Reasoning, ReasoningParser, reasoning_for, split
from services.deployments.options import check_options
from tests.api.test_api import client, start_server, wait_blocks_free
from tests.api.test_openai_wire import assert_only_openai_fields, strict
from tests.api.test_responses import event_types, raw_events
from tests.models import CHAT_TEMPLATE, build_tokenizer, model_for

TURNS = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
QWEN3_LIKE = TURNS + ("{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined "
                      "and not enable_thinking %}<think></think>{% endif %}{% endif %}")
R1_LIKE = TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
THOUGHTS, ANSWER = "Paris, big", "Yes: 42"
ASK = [{"role": "user", "content": "Hi"}]


def save_thinking_model(out, template: str) -> None:
    """A Llama whose greedy answer to ASK is `<think>THOUGHTS</think>ANSWER` then EOS, with
    `<think>` and `</think>` as added (not special) tokens, as Qwen3's are. Only a token's own
    embedding reaches the head (attention and MLP outputs are zero), so each token predicts the
    next one of the script, whatever came before it."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([THINK_OPEN, THINK_CLOSE])
    tokenizer.chat_template = template
    prompt = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    think, unthink = tokenizer.convert_tokens_to_ids([THINK_OPEN, THINK_CLOSE])
    script = [tokenizer.encode(prompt)[-1], think, *tokenizer.encode(THOUGHTS), unthink, *tokenizer.encode(ANSWER),
              tokenizer.eos_token_id]
    assert len(set(script)) == len(script), "a scripted token may not repeat"
    torch.manual_seed(0)
    model = model_for("llama", len(tokenizer))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = torch.randn(len(tokenizer), model.config.hidden_size)
        model.model.embed_tokens.weight.copy_(embeddings)
        head = torch.randn(len(tokenizer), model.config.hidden_size) * 0.1
        for current, successor in zip(script, script[1:]):
            head[successor] = embeddings[current]
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def with_template(source, out, template: str):
    shutil.copytree(source, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


@pytest.fixture(scope="module")
def thinking_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("thinking") / "qwen3-like"
    save_thinking_model(out, QWEN3_LIKE)
    return out


@pytest.fixture
async def serve(aiohttp_server):
    started = []

    async def serve_path(path):
        server, router, workers = await start_server(aiohttp_server, path)
        started.append((router, workers))
        return client(server)

    yield serve_path
    for router, workers in started:
        await wait_blocks_free(router)
        for worker in workers:
            worker.stop()


def only_reasoning_extra(value) -> None:
    """Every field is the SDK's but vLLM's `reasoning` and `reasoning_content` (the same text)."""
    for part in [*getattr(value, "choices", [])]:
        holder = getattr(part, "message", None) or part.delta
        assert holder.model_extra.get("reasoning") == holder.model_extra.get("reasoning_content")
        holder.model_extra.pop("reasoning_content", None)
        holder.model_extra.pop("reasoning", None)
    assert_only_openai_fields(value)


async def test_thoughts_come_apart_collected_and_streamed(serve, thinking_path):
    sdk = await serve(thinking_path)
    answer = await sdk.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=40)
    parsed = ChatCompletion.model_validate_json(answer.model_dump_json(), strict=True)
    only_reasoning_extra(parsed)
    message = answer.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHTS, ANSWER)
    assert answer.choices[0].finish_reason == "stop"
    for cache in (False, True):  # generated live, then replayed from the response cache: the same split
        stream = await sdk.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=40,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"galley": {"cache": cache}})
        chunks = [ChatCompletionChunk.model_validate_json(chunk.model_dump_json(), strict=True)
                  async for chunk in stream]
        for chunk in chunks:
            only_reasoning_extra(chunk.model_copy(deep=True))
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        thoughts = [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")]
        assert "".join(thoughts) == THOUGHTS and (len(thoughts) > 1 or cache)  # live: streamed as they come
        assert "".join(d.content or "" for d in deltas) == ANSWER
        assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens


async def test_the_template_switch_and_a_template_that_opens_the_thoughts(serve, thinking_path, tmp_path):
    sdk = await serve(thinking_path)
    off = await sdk.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=40,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == ANSWER  # the prompt closed the thoughts: the model answers at once
    assert "reasoning_content" not in off.choices[0].message.model_extra
    r1 = await serve(with_template(thinking_path, tmp_path / "r1-like", R1_LIKE))
    answer = await r1.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=40)
    message = answer.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHTS, ANSWER)
    cut = await r1.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=3)
    assert cut.choices[0].message.content == "" and cut.choices[0].finish_reason == "length"
    assert THOUGHTS.startswith(cut.choices[0].message.reasoning_content)


async def test_a_model_that_does_not_think_answers_as_before(serve, thinking_path, tmp_path):
    sdk = await serve(with_template(thinking_path, tmp_path / "plain", CHAT_TEMPLATE))
    answer = await sdk.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=40)
    assert answer.choices[0].message.content == f"{THINK_OPEN}{THOUGHTS}{THINK_CLOSE}{ANSWER}"
    assert_only_openai_fields(ChatCompletion.model_validate_json(answer.model_dump_json(), strict=True))


async def test_responses_show_thoughts_as_a_reasoning_item(serve, thinking_path):
    sdk = await serve(thinking_path)
    ask = {"model": "tiny", "input": "Hi", "temperature": 0, "max_output_tokens": 40}
    answer = strict(Response, (await sdk.responses.with_raw_response.create(**ask)).content)
    thought, message = answer.output
    assert thought.type == "reasoning" and thought.content[0].text == THOUGHTS
    assert message.type == "message" and answer.output_text == ANSWER
    assert answer.usage.output_tokens_details.reasoning_tokens >= 3
    events = await raw_events(sdk, ask)
    assert event_types(events) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHTS
    off = await sdk.responses.create(**ask, reasoning={"effort": "none"})  # enable_thinking: false
    assert [item.type for item in off.output] == ["message"] and off.output_text == ANSWER


async def test_the_reasoning_parser_option_overrides_detection(aiohttp_server, thinking_path, tmp_path):
    plain = with_template(thinking_path, tmp_path / "plain", CHAT_TEMPLATE)
    server, router, workers = await start_server(aiohttp_server, plain)
    try:
        async with client(server) as sdk:
            for parser in ("qwen3", "deepseek_r1"):  # the model opens its thoughts: either way they come apart
                router.models["tiny"].reasoning_parser = parser
                answer = await sdk.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=40)
                message = answer.choices[0].message
                assert (message.reasoning_content, message.content) == (THOUGHTS, ANSWER), parser
            router.models["tiny"].reasoning_parser = "none"
            answer = await sdk.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=40)
            assert answer.choices[0].message.content == f"{THINK_OPEN}{THOUGHTS}{THINK_CLOSE}{ANSWER}"
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()


def test_where_the_answer_starts(thinking_path):
    tokenizer = AutoTokenizer.from_pretrained(thinking_path)

    def starts(prompt: str, template: str | None, parser: str | None = None) -> bool | None:
        reasoning = reasoning_for(tokenizer, template, tokenizer.encode(prompt), parser)
        return None if reasoning is None else reasoning.starts_inside

    assert starts("<|im_start|>assistant\n", CHAT_TEMPLATE) is None  # the template never thinks
    assert starts("<|im_start|>assistant\n", QWEN3_LIKE) is False
    assert starts("<|im_start|>assistant\n<think>", CHAT_TEMPLATE, "qwen3") is True
    assert starts("<|im_start|>assistant\n", QWEN3_LIKE, "none") is None
    assert starts("<|im_start|>assistant\n", CHAT_TEMPLATE, "deepseek_r1") is True  # R1 may skip `<think>`
    assert starts("<|im_start|>assistant\n<think></think>", CHAT_TEMPLATE, "deepseek_r1") is False
    assert split("Paris</think>Yes", starts_inside=True, final=True) == ("Paris", "Yes")
    assert split("<think>Paris</think>Yes", starts_inside=True, final=True) == ("Paris", "Yes")
    assert check_options({"reasoning_parser": "deepseek_r1"}) == {"reasoning_parser": "deepseek_r1"}
    with pytest.raises(ValueError, match="reasoning_parser"):
        check_options({"reasoning_parser": "granite"})


@pytest.mark.parametrize("text", ["<think>\nI think.\n</think>\n\nHello", "  <think>a</think>", "no thoughts",
                                  "<think>never closed", "<thi", "", "x</think>y"])
@pytest.mark.parametrize("starts_inside", [False, True])
def test_streamed_pieces_add_up_to_the_collected_split(text, starts_inside):
    whole = split(text, starts_inside, final=True)
    rng = random.Random(0)
    for _ in range(30):
        parser, thoughts, answer, at = ReasoningParser(Reasoning(starts_inside)), "", "", 0
        while at < len(text):
            end = rng.randint(at + 1, len(text))
            piece = parser.feed(text[at:end])
            thoughts, answer, at = thoughts + piece[0], answer + piece[1], end
        rest = parser.finish()
        assert (thoughts + rest[0], answer + rest[1]) == whole
