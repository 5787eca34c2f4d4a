"""One choice's answer as typed deltas: its thoughts, its content and its tool calls, read from the
generated text once, here, whatever the delivery (JSON, live SSE, a resumed or replayed stream, a
cached answer, n > 1 choices, the Responses API, the WebSocket).

Each view is a pure function of the text so far (`services.answers.reasoning`,
`services.answers.tool_parser`), and a call's id is a function of its stream's id, its choice and
its position, so a stream resumed after a disconnect or a restart, or replayed from the response
cache, shows exactly the deltas the uninterrupted one showed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from services.answers.events import ChunkFormat, StreamEvent
from services.answers.reading import Answer
from services.answers.reasoning import Reasoning, ReasoningParser
from services.answers.tool_parser import Delta, ToolCallDelta, ToolCallParser, assemble


def call_ids_of(stream_id: str, choice: int = 0) -> str:
    """What a choice's tool-call ids derive from: its stream's id and its index."""
    return f"{stream_id}:{choice}"


@dataclass(frozen=True)
class AnswerDelta:
    """What one token event adds to its choice's answer."""

    event: StreamEvent  # logprobs, counts, usage and error come from it as they are
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    finish_reason: str | None = None  # the event's, `tool_calls` once the answer made a call and stopped


class AnswerReader:
    """Invariant: the deltas read so far add up to `read_answer` of the text so far."""

    def __init__(self, tool_format: str | None, reasoning: Reasoning | None, call_ids: str = "") -> None:
        self.thinker = ReasoningParser(reasoning) if reasoning is not None else None
        self.calls = ToolCallParser(tool_format, call_ids) if tool_format else None

    @classmethod
    def of(cls, fmt: ChunkFormat, choice: int = 0, call_ids: str = "") -> AnswerReader:
        """The reader of choice `choice` of a request shown in `fmt`; its calls are named after its
        stream's id, or after `call_ids` (a cached answer's: those of the answer it replays)."""
        reasoning = None if fmt.reasoning_starts_inside is None else Reasoning(fmt.reasoning_starts_inside)
        return cls(fmt.tool_format, reasoning, call_ids or call_ids_of(fmt.id, choice))

    @property
    def thinking(self) -> bool:
        """The text so far is inside the thoughts (what comes next counts as reasoning tokens)."""
        return self.thinker is not None and self.thinker.thinking

    def feed(self, text: str, final: bool) -> tuple[str, Delta]:
        """(thoughts, content and calls) that `text` adds; `final`: the text is complete."""
        thoughts, content = self.thinker.feed(text) if self.thinker else ("", text)
        if final and self.thinker:
            more_thoughts, more_content = self.thinker.finish()
            thoughts, content = thoughts + more_thoughts, content + more_content
        if self.calls is None:
            return thoughts, Delta(content)
        delta = self.calls.feed(content)
        if final:
            rest = self.calls.finish()
            delta = Delta(delta.content + rest.content, delta.tool_calls + rest.tool_calls)
        return thoughts, delta

    def read(self, event: StreamEvent) -> AnswerDelta:
        """One token event of the choice, read (the last one, with a finish reason, flushes the rest)."""
        thoughts, delta = self.feed(event.text, final=event.finish_reason is not None)
        return AnswerDelta(event, delta.content, thoughts, delta.tool_calls, self.finish_reason(event.finish_reason))

    def finish_reason(self, reason: str | None) -> str | None:
        """`reason` as the client sees it: `tool_calls` for an answer that stopped after making a call."""
        return "tool_calls" if reason == "stop" and self.calls is not None and self.calls.num_calls else reason


def read_answer(answer: Answer, reader: AnswerReader) -> Answer:
    """A collected answer's raw text as its content, thoughts (`reasoning_content`) and calls."""
    thoughts, delta = reader.feed(answer.text, final=True)
    parsed = assemble([delta])
    finish = answer.finish_reason
    if parsed.tool_calls and finish == "stop":
        finish = "tool_calls"
    text = parsed.content or "" if parsed.tool_calls else delta.content
    return dataclasses.replace(answer, text=text, tool_calls=parsed.tool_calls or None, finish_reason=finish,
                               reasoning_content=thoughts or None if reader.thinker else None)


def answer_message(text: str, fmt: ChunkFormat) -> tuple[str, dict]:
    """A conversation's stored answer: its content, and its tool calls and thoughts (as OpenAI's
    message fields) read from the raw `text` of the stream shown in `fmt`."""
    answer = read_answer(Answer(text, [], None, {}), AnswerReader.of(fmt))
    extra: dict = {}
    if answer.tool_calls:
        extra["tool_calls"] = answer.tool_calls
    if answer.reasoning_content:
        extra["reasoning_content"] = answer.reasoning_content
    return answer.text, extra
