"""Constrained decoding for one engine: a grammar matcher per constrained request, the
allowed-token mask of each step, and advancing the matchers with the sampled tokens.

A matcher's state is a function of the request's output tokens alone, which a preempted
sequence keeps (it resumes by recompute), so preemption needs nothing here; a stream resumed
after a restart replays its emitted tokens into a fresh matcher. EOS is the engine's to decide:
its EOS ids and the request's stop tokens are allowed wherever the grammar may end, and a
grammar that can take no further token ends the request at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from llguidance import LLMatcher

from engine.grammar import GrammarCompiler, GrammarError, compiler_for
from engine.types import GuidedSpec, Sequence

INT32_SIGN = 1 << 31


@dataclass
class TokenMask:
    """The allowed tokens of the constrained rows of one sampling batch."""

    rows: list[int]  # rows of the batch's logits that are constrained
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32 on CPU, bit t % 32 of word t // 32: token t allowed


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """A copy of `logits` where the constrained rows' disallowed tokens are -inf (one masked_fill
    over those rows); the other rows are as they were."""
    vocab = logits.shape[1]
    words = mask.bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1).bool()  # [rows, words * 32]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    allowed = allowed[:, :vocab]
    if len(mask.rows) == logits.shape[0]:  # every row constrained: no gather and scatter
        return logits.masked_fill(~allowed, float("-inf"))
    rows = torch.tensor(mask.rows, device=logits.device)
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


class GuidedDecoding:
    """Invariant: `matchers[request_id]` has consumed exactly that request's output tokens,
    but for a final EOS or stop token (which ends the request)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.matchers: dict[str, LLMatcher] = {}
        self._bitmask: torch.Tensor | None = None  # reused across steps, grown to the most constrained rows

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on the first constrained request (about a second for a large vocabulary), not at load."""
        return compiler_for(self.tokenizer, self.vocab_size)

    def add(self, request_id: str, spec: GuidedSpec, output_token_ids: list[int]) -> None:
        """Start `request_id`'s matcher, advanced past the output it already has (a resumed stream)."""
        matcher = self.compiler.matcher(spec)
        if output_token_ids and not matcher.consume_tokens(output_token_ids):
            raise GrammarError(f"the output so far does not match the grammar: {matcher.get_error()}")
        self.matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def mask(self, seqs: list[Sequence]) -> TokenMask | None:
        """The mask of the constrained rows among `seqs` (one per logits row); None when none is."""
        if not self.matchers:
            return None
        rows = [row for row, seq in enumerate(seqs) if seq.request_id in self.matchers]
        if not rows:
            return None
        bitmask = self._buffer(len(rows))
        for i, row in enumerate(rows):
            seq = seqs[row]
            matcher = self.matchers[seq.request_id]
            fill_bitmask(matcher, bitmask[i])
            if matcher.is_accepting():
                ends = seq.params.stop_token_ids | (frozenset() if seq.params.ignore_eos else self.eos_token_ids)
                allow(bitmask[i], ends)
        return TokenMask(rows, bitmask)

    def advance(self, seq: Sequence, token_id: int) -> bool:
        """Feed a sampled token (not one that ends the request) to the request's matcher; True
        when the grammar is complete (it takes no further token), so the request must end."""
        matcher = self.matchers.get(seq.request_id)
        if matcher is None:
            return False
        if not matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} does not match the grammar: {matcher.get_error()}")
        return matcher.is_stopped()

    def _buffer(self, num_rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            words = -(-self.compiler.vocab_size // 32)
            self._bitmask = torch.full((max(num_rows, 8), words), -1, dtype=torch.int32)
        return self._bitmask[:num_rows]


def fill_bitmask(matcher: LLMatcher, row: torch.Tensor) -> None:
    """The matcher's allowed tokens into one contiguous CPU int32 row, as `llguidance.torch` does; that
    module compiles a function with torch.compile when imported, seconds of every server start."""
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def allow(words: torch.Tensor, token_ids: frozenset[int]) -> None:
    """Set the bits of `token_ids` in one row of a bitmask (int32 words: bit 31 is the sign)."""
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        if word < words.shape[0]:
            value = int(words[word]) | (1 << bit)
            words[word] = value - (1 << 32) if value >= INT32_SIGN else value
