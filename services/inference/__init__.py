"""The inference service: requests planned and answered (chat, completions, native generation, the
Responses API, tokenize), the API's façade onto them."""

from services.inference.choices import Choices
from services.inference.generation import Generated, Inference, Outcome
from services.inference.requests import ChatInput, PromptInput
from services.inference.responses_api import Change, OutputItem, Record, ResponseInput, ResponseRun, Responses
from services.inference.structured import OutputFormat
from services.inference.tensors import from_bytes, read_inputs, to_bytes, to_json_data
from services.inference.tokens import TokenizeInput, detokenize, tokenize
from services.inference.tools import ToolUse

__all__ = [
    "Change",
    "ChatInput",
    "Choices",
    "Generated",
    "Inference",
    "Outcome",
    "OutputFormat",
    "OutputItem",
    "PromptInput",
    "Record",
    "ResponseInput",
    "ResponseRun",
    "Responses",
    "TokenizeInput",
    "ToolUse",
    "detokenize",
    "from_bytes",
    "read_inputs",
    "to_bytes",
    "to_json_data",
    "tokenize",
]
