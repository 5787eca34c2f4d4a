"""LlamaIndex's `OpenAILike` against a galley server: `python llamaindex_checks.py BASE_URL MODEL`,
run by tests/api/test_client_venvs.py in its own venv (llama-index-llms-openai pins openai<3).
Exits non-zero on the first failed check; prints one line per check passed."""

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import offline  # noqa: E402
from shapes import ASK, Forecast, WeatherArgs, get_weather  # noqa: E402

offline.install()
from llama_index.core.llms import ChatMessage  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from llama_index.llms.openai_like import OpenAILike  # noqa: E402

BASE, MODEL = sys.argv[1], sys.argv[2]


def llm(**kw) -> OpenAILike:
    return OpenAILike(model=MODEL, api_base=BASE, api_key="x", is_chat_model=True, is_function_calling_model=True,
                      context_window=4096, max_retries=0, **{"temperature": 0, "max_tokens": 8, **kw})


def check_chat_stream_complete() -> None:
    messages = [ChatMessage(role="user", content="Hello there")]
    answer = llm().chat(messages)
    assert answer.message.content and answer.raw.usage.completion_tokens <= 8, answer
    assert "".join(c.delta or "" for c in llm().stream_chat(messages)) == answer.message.content
    text = llm().complete("The quick brown").text
    assert text == asyncio.run(llm().acomplete("The quick brown")).text


def check_structured_predict() -> None:
    """A function-calling model: LlamaIndex forces a call of a tool made from the schema."""
    forecast = llm(max_tokens=300).structured_predict(Forecast, PromptTemplate("The weather in {city}?"),
                                                      city="Paris")
    assert isinstance(forecast, Forecast), forecast


def check_tools() -> None:
    tool = FunctionTool.from_defaults(fn=get_weather, fn_schema=WeatherArgs)
    model = llm(max_tokens=300)
    response = model.chat_with_tools([tool], user_msg=ASK, tool_required=True, allow_parallel_tool_calls=False)
    [selection] = model.get_tool_calls_from_response(response, error_on_no_tool_call=True)
    assert selection.tool_name == "get_weather" and set(selection.tool_kwargs) == {"city", "days"}, selection
    called = model.predict_and_call([tool], user_msg=ASK, tool_required=True)
    assert called.response == get_weather(**selection.tool_kwargs), called  # greedy: the same call again
    assert not called.sources[0].is_error


for check in (check_chat_stream_complete, check_structured_predict, check_tools):
    check()
    print("ok", check.__name__, flush=True)
