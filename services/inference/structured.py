"""Structured output: `response_format` (and vLLM's `guided_*` / `structured_outputs`) -> a
grammar the engine enforces token by token (`SamplingParams.guided`).

Checked before admission: the grammar is compiled for the model's tokenizer on a worker thread,
never on the event loop (`engine.grammar` caches it by spec, so the engine only copies it). A
feature the backend cannot enforce is a 400 naming it, never silently ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from engine.grammar import GrammarError, compiler_for
from engine.types import GuidedSpec, SamplingParams
from scheduling.router import ServedModel
from services.errors import InvalidRequestError

ANY_JSON_OBJECT = json.dumps({"type": "object"})


@dataclass(frozen=True)
class OutputFormat:
    """What a request asked its output to be, as plain values: `kind` json_object (no value),
    json_schema (a schema), regex (a pattern), choice (a list of strings) or grammar (Lark)."""

    kind: str
    value: Any = None
    param: str = "response_format"  # the field it came in, named by errors

    def spec(self) -> GuidedSpec:
        if self.kind == "json_object":
            return GuidedSpec("json", ANY_JSON_OBJECT)
        if self.kind == "json_schema":
            return GuidedSpec("json", self.value if isinstance(self.value, str) else json.dumps(self.value))
        if self.kind == "regex":
            return GuidedSpec("regex", self.value)
        if self.kind == "choice":
            return GuidedSpec("choice", json.dumps(list(self.value)))
        if self.kind == "grammar":
            return GuidedSpec("lark", self.value)
        raise InvalidRequestError(f"unknown output format {self.kind!r}", param=self.param)


async def compile_spec(model: ServedModel, spec: GuidedSpec, param: str) -> None:
    """Compile `spec` for `model` off the event loop (the first one also reads the tokenizer's
    vocabulary: about a second for 50k tokens); a 400 naming what cannot be enforced."""
    def work() -> None:
        compiler_for(model.tokenizer, model.vocab_size).compile(spec)

    try:
        await asyncio.to_thread(work)
    except GrammarError as exc:
        raise InvalidRequestError(f"{param} cannot be enforced: {exc}", param=param) from exc


async def constrain(model: ServedModel, params: SamplingParams, spec: GuidedSpec | None,
                    param: str = "response_format") -> SamplingParams:
    """`params` constrained to `spec` (checked for `model` first); as they were when `spec` is None."""
    if spec is None:
        return params
    await compile_spec(model, spec, param)
    return dataclasses.replace(params, guided=spec)
