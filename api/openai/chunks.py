"""OpenAI stream chunks from stream events (`services.answers.events`), for live streams and
replays alike: the chunk format of the original request travels with the stream, so a resumed
or replayed stream looks exactly like the original one.

A stream's chunks are numbered 1, 2, ... in the order they are sent: the opening chunk (chat:
the assistant role; a text completion with `echo`: the prompt), then each event's chunks
(`num_chunks` says how many without rendering them). The number is a function of the stored
events only, so a client that counted N `data:` chunks resumes after chunk N.
"""

from __future__ import annotations

from typing import Any

from engine.types import TokenLogprob
from services.answers import AnswerDelta, ChunkFormat, StreamEvent

FINISHES = ("stop", "length", "tool_calls")  # finish reasons a client sees; a cancel or an error ends otherwise


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer: Any, items: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in items
    ], "refusal": None}


def completion_logprobs(tokenizer: Any, items: list[TokenLogprob], offset: int) -> dict:
    tokens, offsets = [], []
    for lp in items:
        tokens.append(token_text(tokenizer, lp.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{token_text(tokenizer, t): v for t, v in lp.top} for lp in items],
        "text_offset": offsets,
    }


def usage_of(num_prompt_tokens: int, num_output_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}


def opening_chunks(fmt: ChunkFormat, index: int, num_prompt_tokens: int) -> list[dict]:
    """What a choice's stream starts with: chat: the assistant role; a text completion with
    `echo`: its prompt text."""
    if fmt.kind == "chat":
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
    elif fmt.echo:
        choice = {"index": index, "text": fmt.echo[index], "logprobs": None, "finish_reason": None}
    else:
        return []
    chunk = {**fmt.base, "choices": [choice]}
    if fmt.continuous_usage:
        chunk["usage"] = usage_of(num_prompt_tokens, 0)
    return [chunk]


def _chunk(fmt: ChunkFormat, event: StreamEvent, choice: dict) -> dict:
    chunk = {**fmt.base, "choices": [{"index": 0, **choice}]}
    if fmt.continuous_usage:
        chunk["usage"] = usage_of(event.num_prompt_tokens, event.num_output_tokens)
    return chunk


def _content(fmt: ChunkFormat, tokenizer: Any, event: StreamEvent, text: str, finish: str | None) -> dict:
    logprobs = event.logprobs if not finish else None
    if fmt.kind == "chat":
        lp = chat_logprobs(tokenizer, logprobs) if fmt.logprobs and logprobs else None
        return _chunk(fmt, event, {"delta": {"content": text} if text or not finish else {}, "logprobs": lp,
                                   "finish_reason": finish})
    lp = completion_logprobs(tokenizer, logprobs, event.text_offset) if fmt.logprobs and logprobs else None
    return _chunk(fmt, event, {"text": text, "logprobs": lp, "finish_reason": finish})


def shows_content(fmt: ChunkFormat, delta: AnswerDelta) -> bool:
    """A delta gets a content chunk when it has content, or (logprobs asked) whenever it is a token:
    decided from what a stored event keeps, so a replay numbers its chunks as the live stream did."""
    return bool(delta.content) or (fmt.logprobs and delta.event.has_token)


def num_chunks(fmt: ChunkFormat, delta: AnswerDelta) -> int:
    """len(event_chunks(fmt, _, delta)), without rendering them (no tokenizer work)."""
    ends = delta.finish_reason in FINISHES
    return (bool(delta.reasoning) + shows_content(fmt, delta) + bool(delta.tool_calls) + ends
            + (ends and fmt.include_usage and delta.event.usage is not None))


def event_chunks(fmt: ChunkFormat, tokenizer: Any, delta: AnswerDelta) -> list[dict]:
    """The chunks one read event becomes: its thoughts (vLLM's `reasoning` delta, and `reasoning_content`,
    vLLM's older name and DeepSeek's, which many clients read), its content (`shows_content`), its
    tool calls' deltas (a call's id and name first, then pieces of its arguments), then on the last
    event the finish chunk and, when asked for, the usage chunk."""
    event, chunks = delta.event, []
    if delta.reasoning:
        chunks.append(_chunk(fmt, event, {"delta": {"reasoning": delta.reasoning,
                                                    "reasoning_content": delta.reasoning},
                                          "logprobs": None, "finish_reason": None}))
    if shows_content(fmt, delta):
        chunks.append(_content(fmt, tokenizer, event, delta.content, None))
    if delta.tool_calls:
        chunks.append(_chunk(fmt, event, {"delta": {"tool_calls": [c.to_dict() for c in delta.tool_calls]},
                                          "logprobs": None, "finish_reason": None}))
    if delta.finish_reason in FINISHES:
        chunks.append(_content(fmt, tokenizer, event, "", delta.finish_reason))
        if fmt.include_usage and event.usage is not None:
            chunks.append({**fmt.base, "choices": [], "usage": event.usage})
    return chunks


def error_chunk(event: StreamEvent) -> dict:
    """The last chunk of a stream that failed after its first token."""
    return {"error": {"message": event.error, "type": "internal_error", "param": None, "code": event.error_code}}
