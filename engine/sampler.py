"""Turns logits into next tokens, vectorised over the batch.

Order: logit bias and the min_tokens mask -> the grammar's mask (`engine.guided`) -> penalties
-> greedy argmax, or temperature -> top-k / top-p / min-p -> sample. Logprobs are those of the
model's raw logits (as vLLM's).
Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws from p
exactly and lets each row have its own noise: a seeded request draws its noise from a
generator seeded by (seed, token position), so its output does not depend on batch
neighbours or on how many steps ran before (a resumed stream samples the same tokens).
"""

from __future__ import annotations

import torch

from engine.guided import TokenMask, apply_token_mask
from engine.types import Sequence, TokenLogprob

SEED_STRIDE = 1_000_003


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty (HF/CTRL style, prompt + output) and OpenAI frequency/presence (output)."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.needs_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
            picked = logits[row, seen]
            logits[row, seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
            out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(logits.shape[1], device=logits.device).scatter_add_(
                0, out, torch.ones_like(out, dtype=torch.float)
            )
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Each request's `logit_bias` added to its row, for the whole batch in one scatter."""
    rows = [row for row, seq in enumerate(seqs) for _ in seq.params.logit_bias]
    tokens = [token for seq in seqs for token, _ in seq.params.logit_bias]
    bias = [value for seq in seqs for _, value in seq.params.logit_bias]
    index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    return logits.index_put_(index, torch.tensor(bias, device=logits.device, dtype=logits.dtype), accumulate=True)


def mask_stops_before_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int]
                                 ) -> torch.Tensor:
    """Rows still short of their `min_tokens`: EOS (unless ignored) and stop tokens cannot be drawn."""
    rows, tokens = [], []
    for row, seq in enumerate(seqs):
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            banned = p.stop_token_ids if p.ignore_eos else p.stop_token_ids | eos_token_ids
            rows += [row] * len(banned)
            tokens += banned
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device, dtype=logits.dtype))
    return logits


def filter_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Top-k, top-p and min-p, per row; masked entries become -inf."""
    vocab = logits.shape[1]
    top_k = torch.tensor([min(s.params.top_k or vocab, vocab) for s in seqs], device=logits.device)
    top_p = torch.tensor([s.params.top_p for s in seqs], device=logits.device, dtype=logits.dtype)
    min_p = torch.tensor([s.params.min_p for s in seqs], device=logits.device, dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]  # keep the token that crosses top_p
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids  # masked before a request's min_tokens
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _noise(self, probs: torch.Tensor, seqs: list[Sequence], offsets: list[int]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, (seq, offset) in enumerate(zip(seqs, offsets)):
            if seq.params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed((seq.params.seed * SEED_STRIDE + seq.num_tokens + offset) % (2**63))
                noise[row].exponential_(generator=gen)
        return noise

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], mask: TokenMask | None = None,
               offsets: list[int] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [num_rows, vocab] float32, one row per entry of `seqs`; `mask`: the grammar's
        allowed tokens of the constrained rows (`engine.guided`). `offsets`: per row, how many
        tokens past the sequence's end it samples for (a speculative draft's position; 0: the
        next token), so a seeded row draws the noise of its own position."""
        offsets = offsets or [0] * len(seqs)
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
        biased = any(s.params.logit_bias for s in seqs)
        short = any(s.num_output_tokens < s.params.min_tokens for s in seqs)
        if biased or short:
            logits = logits.clone()
            if biased:
                logits = apply_logit_bias(logits, seqs)
            if short:
                logits = mask_stops_before_min_tokens(logits, seqs, self.eos_token_ids)
        if mask is not None:
            logits = apply_token_mask(logits, mask)
        if any(s.params.needs_penalties for s in seqs):
            logits = apply_penalties(logits if biased or short else logits.clone(), seqs)
        tokens = greedy(logits)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sub_seqs = [seqs[i] for i in random_rows]
            sub_offsets = [offsets[i] for i in random_rows]
            temps = torch.tensor([s.params.temperature for s in sub_seqs], device=logits.device)
            sub = logits[rows] / temps[:, None]
            if any(s.params.top_k or s.params.top_p < 1.0 or s.params.min_p > 0.0 for s in sub_seqs):
                sub = filter_logits(sub, sub_seqs)
            probs = sub.softmax(dim=-1)
            tokens[rows] = greedy(probs / self._noise(probs, sub_seqs, sub_offsets))
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw_logprobs, token_list, seqs)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], seqs: list[Sequence]) -> list[TokenLogprob | None]:
        if raw is None:
            return [None] * len(seqs)
        out: list[TokenLogprob | None] = []
        for row, (token, seq) in enumerate(zip(tokens, seqs)):
            n = seq.params.logprobs
            if n is None:
                out.append(None)
                continue
            top = []
            if n:
                values, ids = raw[row].topk(min(n, raw.shape[1]))
                top = list(zip(ids.tolist(), values.tolist()))
            out.append(TokenLogprob(token, raw[row, token].item(), top))
        return out


def greedy(scores: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, first index among ties (as `argmax` and HF's greedy search): `max`'s
    kernel does the same 2.5x faster on CPU (32 x 49152 float32 logits: 0.4 against 1.1 ms)."""
    return scores.max(dim=-1).indices
