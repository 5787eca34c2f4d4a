"""LiteLLM against a galley server: `python litellm_checks.py BASE_URL MODEL`, run by
tests/api/test_client_venvs.py in LiteLLM's own venv (it pins openai<3 and huggingface-hub<2).
Exits non-zero on the first failed check; prints one line per check passed."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import offline  # noqa: E402

offline.install()
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # else it downloads its price list at import
import litellm  # noqa: E402

BASE, MODEL = sys.argv[1], f"openai/{sys.argv[2]}"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                           "parameters": WEATHER}}]
COMMON = {"model": MODEL, "api_base": BASE, "api_key": "x", "temperature": 0, "num_retries": 0}


def check_completion_and_stream() -> None:
    answer = litellm.completion(**COMMON, messages=ASK, max_tokens=8)
    text = answer.choices[0].message.content
    assert text and answer.usage.completion_tokens <= 8, answer
    chunks = list(litellm.completion(**COMMON, messages=ASK, max_tokens=8, stream=True,
                                     stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = next(c.usage for c in reversed(chunks) if getattr(c, "usage", None))
    assert usage.completion_tokens == answer.usage.completion_tokens, usage
    assert litellm.stream_chunk_builder(chunks, messages=ASK).choices[0].message.content == text


def check_tools() -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = litellm.completion(**COMMON, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200,
                                    parallel_tool_calls=False)
        [call] = answer.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and set(args) == {"city", "days"}, call
        assert answer.choices[0].finish_reason == "tool_calls"
    chunks = list(litellm.completion(**COMMON, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                                     parallel_tool_calls=False, stream=True))
    [streamed] = litellm.stream_chunk_builder(chunks, messages=ASK).choices[0].message.tool_calls
    assert json.loads(streamed.function.arguments) == args, streamed
    history = [*ASK, answer.choices[0].message.model_dump(),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    after = litellm.completion(**COMMON, messages=history, tools=TOOLS, max_tokens=8)
    assert after.choices[0].message.content, after


def check_responses() -> None:
    answer = litellm.responses(model=MODEL, api_base=BASE, api_key="x", input="Hello there", max_output_tokens=8,
                               temperature=0)
    # LiteLLM raises max_output_tokens to OpenAI's least, 16
    assert answer.status in ("completed", "incomplete") and answer.usage.output_tokens <= 16, answer
    events = list(litellm.responses(model=MODEL, api_base=BASE, api_key="x", input="Hello there",
                                    max_output_tokens=8, temperature=0, stream=True))
    deltas = "".join(getattr(e, "delta", "") for e in events if e.type == "response.output_text.delta")
    text = "".join(part.text for item in answer.output for part in item.content)
    assert deltas == text, (deltas, text)


for check in (check_completion_and_stream, check_tools, check_responses):
    check()
    print("ok", check.__name__, flush=True)
