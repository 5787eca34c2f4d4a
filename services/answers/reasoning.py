"""Reasoning models: their `<think>...</think>` text apart from the answer (vLLM's `reasoning_content`).

A model thinks when its chat template speaks of `<think>` (Qwen3, DeepSeek-R1 distills, SmolLM3),
or when its `reasoning_parser` option says so. Where its answer starts is read from the prompt: a
template that opens `<think>` itself (DeepSeek-R1's) starts the answer inside the thoughts; one
that closes it (Qwen3 with `enable_thinking: false`) or never opens it starts it outside, and a
`<think>` the model writes first opens them. `deepseek_r1` starts inside unless the prompt closed
them (R1 distills often skip the opening tag, as vLLM's parser of that name assumes); `none`
never splits. The split is one parser for streamed and collected answers: each view is a
pure function of the text so far and only grows, so streamed deltas add up to the collected
answer. Thoughts are trimmed of surrounding whitespace, the answer after them of leading
whitespace (Qwen3 writes `</think>\\n\\n`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.answers.tool_parser import held_back

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 8  # enough of a prompt's end to see whether it leaves `<think>` open


@dataclass(frozen=True)
class Reasoning:
    """A thinking model's answer: whether it starts inside its thoughts."""

    starts_inside: bool = False


def thinks(chat_template: str | None) -> bool:
    return THINK_CLOSE in (chat_template or "") or THINK_OPEN in (chat_template or "")


def opens_thoughts(prompt_tail: str) -> bool:
    """The prompt ends inside `<think>` (its template opened it for the model)."""
    return prompt_tail.rfind(THINK_OPEN) > prompt_tail.rfind(THINK_CLOSE)


def reasoning_for(tokenizer: Any, chat_template: str | None, prompt_ids: list[int],
                  parser: str | None = None) -> Reasoning | None:
    """How a chat's answer is split, None when the model does not think; `parser`: the model's
    `reasoning_parser` option (None: detected from the template)."""
    if parser == "none" or (parser is None and not thinks(chat_template)):
        return None
    tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    if parser == "deepseek_r1":
        return Reasoning(starts_inside=tail.rfind(THINK_CLOSE) <= tail.rfind(THINK_OPEN))  # unless closed
    return Reasoning(starts_inside=opens_thoughts(tail))


def marks_are_special(tokenizer: Any) -> bool:
    """The think marks are special tokens (decoding would drop them unless asked to keep them)."""
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    return THINK_OPEN in special or THINK_CLOSE in special


def split(text: str, starts_inside: bool, final: bool) -> tuple[str, str]:
    """(thoughts, answer) as far as `text` tells; not `final`: what may still change is held back."""
    lead = text.lstrip()
    if not final and THINK_OPEN.startswith(lead):  # may still become `<think>`
        return "", ""
    if lead.startswith(THINK_OPEN):  # opened by the model (again, when its prompt had opened them)
        body = lead[len(THINK_OPEN):]
    elif starts_inside:
        body = text
    else:
        return "", text
    close = body.find(THINK_CLOSE)
    if close >= 0:
        return body[:close].strip(), body[close + len(THINK_CLOSE):].lstrip()
    if final:
        return body.strip(), ""
    return body[: len(body) - held_back(body, THINK_CLOSE)].strip(), ""


class ReasoningParser:
    """Invariant: what was sent of the thoughts and of the answer are prefixes of the latest view."""

    def __init__(self, reasoning: Reasoning) -> None:
        self.starts_inside = reasoning.starts_inside
        self.text = ""
        self.sent = (0, 0)

    def feed(self, text: str) -> tuple[str, str]:
        """(thoughts, answer) added by `text`."""
        self.text += text
        return self._delta(final=False)

    def finish(self) -> tuple[str, str]:
        return self._delta(final=True)

    @property
    def thinking(self) -> bool:
        """The text so far is inside the thoughts (what comes next counts as reasoning tokens)."""
        inside = self.starts_inside or self.text.lstrip().startswith(THINK_OPEN)
        return inside and THINK_CLOSE not in self.text

    def _delta(self, final: bool) -> tuple[str, str]:
        thoughts, answer = split(self.text, self.starts_inside, final)
        delta = thoughts[self.sent[0]:], answer[self.sent[1]:]
        self.sent = (max(self.sent[0], len(thoughts)), max(self.sent[1], len(answer)))
        return delta
