"""Speculative decoding's drafts: the config, prompt lookup (n-gram) proposals and who may use them.

Owns the config and the n-gram proposer, which never touches tensors or KV (the draft-model
proposer, `engine.draft_model`, runs a second model). The engine asks for drafts
after each step and verifies them in the next one (see `LLMEngine`): the model samples every
drafted position with the noise it would have used anyway (a seeded request's noise is keyed by
the position) and keeps the drafts up to the first disagreement, so the output is exactly the
model's own, drafts or not; good drafts only make it arrive in fewer steps.

Prompt lookup (vLLM's `ngram` method): find a recent earlier occurrence of the sequence's
last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) and propose the tokens that
followed it. It pays when the answer repeats its context: editing code, quoting a passage,
extracting fields. A draft model (vLLM's `draft_model` method) guesses from what it learned
instead: a smaller model with the target's vocabulary, or the target itself loaded again with
int4 weights (self-drafting, an empty `model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.quantization import QUANTIZATIONS
from engine.types import Sequence

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`[speculative]` in config.toml; vLLM's `speculative_config` names."""

    method: str = ""  # "" (off) | ngram | draft_model
    num_speculative_tokens: int = 4  # most drafts verified per sequence and step
    prompt_lookup_max: int = 4  # longest suffix looked up
    prompt_lookup_min: int = 2  # shortest suffix looked up
    disable_by_batch_size: int = 4  # more running sequences than this: no drafts (the step is compute-bound)
    max_lookup_tokens: int = 4096  # only the sequence's last this many tokens are searched
    model: str = ""  # draft_model: the draft's source (as [[models]] path); "": the target's own weights again
    quantization: str = ""  # draft_model: int8 | int4 | none for the draft's linears

    def __post_init__(self) -> None:
        if self.method and self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS} or empty, not {self.method!r}")
        if self.quantization not in ("", "none", *QUANTIZATIONS):
            raise ValueError(f"speculative quantization must be one of int8, int4, none, not {self.quantization!r}")
        if self.method != "draft_model" and (self.model or self.quantization):
            raise ValueError("speculative model and quantization are for method = \"draft_model\" only")
        if self.num_speculative_tokens < 1 or not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need num_speculative_tokens >= 1 and 1 <= prompt_lookup_min <= prompt_lookup_max")


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n tokens of
    `tokens` (the most recent followed by k tokens, if one is), for the largest n in
    [min_n, max_n] that occurs; [] when none does."""
    length = tokens.shape[0]
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])  # earlier positions a match could end at
    matched = np.ones(ends.shape[0], dtype=np.int64)  # how far back each candidate matches the suffix
    alive = np.ones(ends.shape[0], dtype=bool)
    for back in range(1, min(max_n, length - 1)):
        alive &= (ends >= back) & (tokens[np.maximum(ends - back, 0)] == tokens[length - 1 - back])
        matched += alive
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        hits = ends[matched >= n]
        if hits.size:
            full = hits[hits + 1 + k <= length]  # occurrences followed by k tokens, if any: the longest draft
            start = int(full[-1] if full.size else hits[-1]) + 1
            return tokens[start : start + k].tolist()
    return []


def can_speculate(seq: Sequence) -> bool:
    """May this request's next tokens be drafted? Not when sampling reads state that each drafted
    position would change (penalties over the output, a grammar, EOS still masked by min_tokens)."""
    p = seq.params
    return p.speculative and p.guided is None and not p.needs_penalties and seq.num_output_tokens >= p.min_tokens


def num_drafts(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many drafts `seq` may get (up to `k`): none if it may not be drafted, and no more than
    keep the step that verifies them (1 + drafts tokens) within max_tokens and the context."""
    if not can_speculate(seq):
        return 0
    return max(0, min(k, seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens - 1))


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """Drafts for the tokens after each sequence's last (possibly none), in `seqs` order."""
        ...


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        return [self.propose_one(seq) for seq in seqs]

    def propose_one(self, seq: Sequence) -> list[int]:
        c = self.config
        k = num_drafts(seq, c.num_speculative_tokens, self.max_model_len)
        if k == 0:
            return []
        recent = seq.token_ids[-c.max_lookup_tokens :]
        tokens = np.fromiter(recent, dtype=np.int64, count=len(recent))
        return ngram_lookup(tokens, c.prompt_lookup_min, c.prompt_lookup_max, k)
