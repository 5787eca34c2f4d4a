"""Speculative decoding's drafts: prompt lookup (n-gram) proposals and who may use them.

Owns the config and the proposer; it never touches tensors or KV. The engine asks for drafts
after each step and verifies them in the next one (see `LLMEngine`): the model samples every
drafted position with the noise it would have used anyway (a seeded request's noise is keyed by
the position) and keeps the drafts up to the first disagreement, so the output is exactly the
model's own, drafts or not; good drafts only make it arrive in fewer steps.

Prompt lookup (vLLM's `ngram` method): find a recent earlier occurrence of the sequence's
last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) and propose the tokens that
followed it. It pays when the answer repeats its context: editing code, quoting a passage,
extracting fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.types import Sequence

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """`[speculative]` in config.toml; vLLM's `speculative_config` names."""

    method: str = ""  # "" (off) | ngram
    num_speculative_tokens: int = 4  # most drafts verified per sequence and step
    prompt_lookup_max: int = 4  # longest suffix looked up
    prompt_lookup_min: int = 2  # shortest suffix looked up
    disable_by_batch_size: int = 4  # more running sequences than this: no drafts (the step is compute-bound)
    max_lookup_tokens: int = 4096  # only the sequence's last this many tokens are searched

    def __post_init__(self) -> None:
        if self.method and self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS} or empty, not {self.method!r}")
        if self.num_speculative_tokens < 1 or not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need num_speculative_tokens >= 1 and 1 <= prompt_lookup_min <= prompt_lookup_max")

    @property
    def enabled(self) -> bool:
        return bool(self.method)


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


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, seq: Sequence) -> list[int]:
        """Drafts for the tokens after `seq`'s last, capped so that the step that verifies them
        emits no token past max_tokens or the context (1 + k tokens at most)."""
        c = self.config
        k = min(c.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1)
        if k <= 0 or not can_speculate(seq):
            return []
        recent = seq.token_ids[-c.max_lookup_tokens :]
        tokens = np.fromiter(recent, dtype=np.int64, count=len(recent))
        return ngram_lookup(tokens, c.prompt_lookup_min, c.prompt_lookup_max, k)
