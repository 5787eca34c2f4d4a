"""Grammar specs -> compiled llguidance matchers, for one model's tokenizer (torch-free).

llguidance (over xgrammar and outlines-core) because it refuses what it cannot enforce
(`uniqueItems`, `not`, `if`/`then`, look-around in patterns, ...) with a message naming it,
where xgrammar 0.2.8 logs a warning and drops the keyword; it also covers JSON schema widely
(`$ref`/`$defs`, `anyOf`/`oneOf`, bounds, `pattern`, `format`) and computes a mask in tens of
microseconds on CPU with no per-grammar precompile of the whole vocabulary.

The services compile (and so check) a request's spec off the event loop before it is admitted;
the engine then takes a copy of the cached matcher, so its worker thread rarely compiles.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
from llguidance import LLMatcher

from engine.types import GuidedSpec

MAX_CACHED_GRAMMARS = 256
# JSON as `json.dumps` writes it: no free whitespace, which a weak model could emit forever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A spec the backend cannot enforce, or not a valid grammar; the message says what."""


def llguidance_grammar(spec: GuidedSpec) -> str:
    """The spec as llguidance's grammar text."""
    if spec.kind == "json":
        try:
            return LLMatcher.grammar_from_json_schema(spec.value, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"not a JSON schema: {exc}") from exc
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        return LLMatcher.grammar_from_lark(choice_lark(json.loads(spec.value)))
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.value)
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def choice_lark(choices: list[str]) -> str:
    """Exactly one of `choices` (JSON string literals are valid Lark literals)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("a choice needs a list of non-empty strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    """One tokenizer as llguidance sees it and the matchers compiled for it, by spec (LRU).

    Thread-safe: the services compile on a thread pool while a device worker takes copies.
    Cached matchers are templates: never advanced, only copied."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        # the mask covers the model's rows (a model may have more embedding rows than the tokenizer has tokens)
        self.vocab_size = max(vocab_size, len(tokenizer))
        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size)
        except ValueError as exc:  # a slow (Python-only) tokenizer: llguidance reads the Rust one
            raise GrammarError(f"this model's tokenizer cannot drive constrained decoding: {exc}") from exc
        self._compiled: OrderedDict[GuidedSpec, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GuidedSpec) -> None:
        """Compile and cache `spec`; GrammarError naming what cannot be enforced."""
        self.matcher(spec)

    def matcher(self, spec: GuidedSpec) -> LLMatcher:
        """A fresh matcher for `spec` at its start (compiled once per spec, then copied)."""
        with self._lock:
            template = self._compiled.get(spec)
            if template is not None:
                self._compiled.move_to_end(spec)
                return template.deep_copy()
        grammar = llguidance_grammar(spec)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise GrammarError(messages[0] if messages else "invalid grammar")
        template = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        with self._lock:
            self._compiled[spec] = template
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return template.deep_copy()


_compilers: weakref.WeakKeyDictionary[Any, GrammarCompiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int) -> GrammarCompiler:
    """The tokenizer's compiler, built once (about a second for a 50k vocabulary): the services
    and the engine of a replica hold the same tokenizer object, so they share compiled grammars."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
    if compiler is None:
        compiler = GrammarCompiler(tokenizer, vocab_size)
        with _compilers_lock:
            compiler = _compilers.setdefault(tokenizer, compiler)
    return compiler
