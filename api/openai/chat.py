"""POST /v1/chat/completions: parse, plan the chat (`services.inference`), answer it (`api.openai.answer`).

A conversation turn (`conversation_id`) prepends the stored history and stores the new
messages and the answer; every answer but n > 1 choices is resumable by its `X-Stream-Id`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from api.auth import caller_of
from api.openai.answer import Shape, how, respond
from api.openai.chunks import chat_logprobs
from api.openai.objects import ChatCompletion, ChatCompletionChunk
from api.openai.schemas import ChatCompletionRequest
from api.routes import Route
from api.services import services
from api.validation import parse_body
from services.answers import Answer, ChunkFormat


def chat_choice(fmt: ChunkFormat, tokenizer: Any, index: int, result: Answer) -> dict:
    message = {"role": "assistant", "content": result.text, "refusal": None, "annotations": []}  # as OpenAI's
    if result.tool_calls:  # content is null when the answer is only calls
        message.update(content=result.text or None, tool_calls=result.tool_calls)
    if result.reasoning_content is not None:  # a thinking model's thoughts: vLLM's field, by its old name too
        message.update(reasoning=result.reasoning_content, reasoning_content=result.reasoning_content)
    return {"index": index, "message": message,
            "logprobs": chat_logprobs(tokenizer, result.logprobs) if fmt.logprobs else None,
            "finish_reason": result.finish_reason}


CHAT = Shape("chat.completion", chat_choice, resumable=True)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, ChatCompletionRequest)
    outcome = await services(request).inference.chat(caller_of(request), body.chat_input(), **how(request, body))
    return await respond(request, outcome, CHAT)


ROUTES = [
    Route("POST", "/v1/chat/completions", chat_completions, "Create a chat completion",
          request=ChatCompletionRequest, response=ChatCompletion, stream_response=ChatCompletionChunk,
          errors=(409,)),
]
