"""What a generation's answer is made of and how it is read: the stream's event shape and chunk
format, a generation's events read to an `Answer`, and its thoughts and tool calls read out of its
text (`deltas`). The floor under inference, streams, cache and conversations."""

from services.answers.deltas import AnswerDelta, AnswerReader
from services.answers.events import ChunkFormat, StreamEvent
from services.answers.reading import Answer, failure, generation_failed, prepend, stream_failed, usage, usage_n
from services.answers.tool_parser import parsed_arguments

__all__ = [
    "Answer",
    "AnswerDelta",
    "AnswerReader",
    "ChunkFormat",
    "StreamEvent",
    "failure",
    "generation_failed",
    "parsed_arguments",
    "prepend",
    "stream_failed",
    "usage",
    "usage_n",
]
