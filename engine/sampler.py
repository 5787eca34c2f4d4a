"""Turns logits into next tokens, vectorised over the batch.

Order: logit bias and the min_tokens mask -> the grammar's mask (`engine.guided`) -> penalties
-> greedy argmax, or temperature -> softmax -> top-k / top-p / min-p -> sample. Logprobs are
those of the model's raw logits (as vLLM's).
Sampling inverts each row's CDF at one uniform draw: a seeded request draws it from a generator
seeded by (seed, token position), so its output does not depend on batch neighbours or on how
many steps ran before (a resumed stream samples the same tokens). It was the exponential race
(argmax of p / E, E ~ Exp(1)), which needs a random draw per vocabulary entry: torch makes those
at ~1.8 ms a row of 49152 on CPU. On SmolLM2's logits, 32 rows at temperature 1: 59 -> 3 ms a
step (two threads; `bench/sampler.py`), where the model's decode step takes ~150 ms.
"""

from __future__ import annotations

from collections import Counter

import torch

from engine.guided import TokenMask, apply_token_mask
from engine.types import Sequence, TokenLogprob

SEED_STRIDE = 1_000_003


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty (HF/CTRL style, prompt + output) and OpenAI frequency/presence (output),
    each as one gather/scatter over the (row, token) pairs it touches: a row's own ops (a
    vocabulary-sized count per row) took 15-19 ms a step for 32 rows."""
    rows, tokens, factors = [], [], []
    for row, seq in enumerate(seqs):
        if seq.params.repetition_penalty != 1.0:
            seen = set(seq.token_ids)
            rows += [row] * len(seen)
            tokens += seen
            factors += [seq.params.repetition_penalty] * len(seen)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        # in float64, then clamped into the logits' range: a tiny penalty (1e-300, vLLM takes any > 0)
        # is 0 in float32, and a logit divided by it inf; a huge one sends negatives to -inf (never drawn)
        factor = torch.tensor(factors, device=logits.device, dtype=torch.float64)
        picked = logits[index].double()
        top = torch.finfo(logits.dtype).max
        logits[index] = torch.where(picked > 0, picked / factor, picked * factor).clamp(max=top).to(logits.dtype)
    rows, tokens, amounts = [], [], []
    for row, seq in enumerate(seqs):
        p = seq.params
        if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
            for token, count in Counter(seq.output_token_ids).items():
                rows.append(row)
                tokens.append(token)
                amounts.append(p.frequency_penalty * count + p.presence_penalty)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(index, -torch.tensor(amounts, device=logits.device, dtype=logits.dtype), accumulate=True)
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


# a row's most likely tokens, among which its top-k and top-p cuts are looked for first: at
# temperature 0.7 and top-p 0.9 SmolLM2's rows all cut within 128; at 1.0 and 0.95, all but 2% within 2048
CANDIDATES = (128, 2048)


def keep_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """For rows of probabilities sorted in descending order: which to keep under top-k, top-p (the
    token that crosses top_p stays; top_p 1 keeps all, though a float32 running sum passes 1) and
    min-p; the first always stays."""
    ranks = torch.arange(probs.shape[1], device=probs.device)[None, :]
    keep = ranks < top_k[:, None]
    keep &= ((probs.cumsum(dim=-1) - probs) <= top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    return keep


def filter_probs(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Top-k, top-p and min-p, per row of softmax probabilities: the dropped ones set to 0.

    Sorting a row of 49152 takes ~3 ms on CPU (32 rows: 100 ms a step), and the cuts nearly
    always fall among a row's most likely tokens: those are taken first (`topk`), more of them for
    a row whose cut lies beyond, and only then the whole row sorted. Min-p needs no order."""
    vocab = probs.shape[1]
    top_k = torch.tensor([min(s.params.top_k or vocab, vocab) for s in seqs], device=probs.device)
    top_p = torch.tensor([s.params.top_p for s in seqs], device=probs.device, dtype=probs.dtype)
    min_p = torch.tensor([s.params.min_p for s in seqs], device=probs.device, dtype=probs.dtype)
    out = probs  # (the softmax's own tensor, filtered in place)
    if bool((min_p > 0.0).any()):
        out = probs * (probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values)
    todo = (top_k < vocab) | (top_p < 1.0)  # rows that need their most likely tokens in order
    for k in CANDIDATES + (vocab,):
        if not todo.any():
            break
        rows = todo.nonzero().squeeze(1)
        sub = probs if len(rows) == len(probs) else probs[rows]
        values, ids = sub.topk(k, dim=-1) if k < vocab else sub.sort(dim=-1, descending=True)
        # cut within the candidates: its top-k is one of them (so always, sorted whole), or they
        # outweigh its top_p
        done = (top_k[rows] <= k) | ((top_p[rows] < 1.0) & (values.sum(dim=-1) > top_p[rows]))
        rows, values, ids = rows[done], values[done], ids[done]
        kept = values.new_zeros(len(rows), vocab).scatter_(1, ids, values * keep_mask(values, top_k[rows],
                                                                                       top_p[rows], min_p[rows]))
        if len(rows) == len(out):
            return kept
        out[rows] = kept
        todo[rows] = False
    return out


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the token where the CDF of `probs` (unnormalised; zeros are never drawn) first
    exceeds uniform x its total: a draw from the normalised row. In float32 each token's share of
    the CDF is its probability to within ~1e-7 (one rounding of the running sum). A row with no
    mass to draw from (every token masked, or NaN) gets its most likely token: never an id past
    the vocabulary, which the next step's embedding lookup would fail on."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    empty = ~(total.squeeze(1) > 0)  # (NaN compares false)
    if bool(empty.any()):
        tokens[empty] = greedy(probs[empty].nan_to_num(nan=-1.0))
    return tokens


def finite_scores(scores: torch.Tensor) -> torch.Tensor:
    """Scores softmax can take: NaN is never drawn (-inf), +inf becomes the largest float (a row's
    infinities then share its mass instead of making it all NaN)."""
    return scores.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(scores.dtype).max, neginf=float("-inf"))


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids  # masked before a request's min_tokens
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _uniforms(self, seqs: list[Sequence], offsets: list[int]) -> torch.Tensor:
        """One draw in [0, 1) per row: a seeded request's from its (seed, position) generator."""
        uniforms = torch.rand(len(seqs), generator=self.generator, device=self.device, dtype=torch.float64)
        for row, (seq, offset) in enumerate(zip(seqs, offsets)):
            if seq.params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed((seq.params.seed * SEED_STRIDE + seq.num_tokens + offset) % (2**63))
                uniforms[row] = torch.rand(1, generator=gen, device=self.device, dtype=torch.float64)[0]
        return uniforms

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], mask: TokenMask | None = None,
               offsets: list[int] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [num_rows, vocab] float32, one row per entry of `seqs`; `mask`: the grammar's
        allowed tokens of the constrained rows (`engine.guided`). `offsets`: per row, how many
        tokens past the sequence's end it samples for (a speculative draft's position; 0: the
        next token), so a seeded row draws the noise of its own position."""
        offsets = offsets or [0] * len(seqs)
        logits = logits.float()  # (a no-op for float32; bf16/fp16 logits are sampled in float32, as HF does)
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
        random_rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if len(random_rows) < len(seqs):
            tokens = greedy(logits)
        else:
            tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sub_seqs = [seqs[i] for i in random_rows]
            sub_offsets = [offsets[i] for i in random_rows]
            temps = torch.tensor([s.params.temperature for s in sub_seqs], device=logits.device)
            sub = logits if len(random_rows) == len(seqs) else logits[rows]
            probs = finite_scores(sub / temps[:, None]).softmax(dim=-1)
            if any(s.params.top_k or s.params.top_p < 1.0 or s.params.min_p > 0.0 for s in sub_seqs):
                probs = filter_probs(probs, sub_seqs)
            tokens[rows] = draw(probs, self._uniforms(sub_seqs, sub_offsets))
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw_logprobs, token_list, seqs)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], seqs: list[Sequence]) -> list[TokenLogprob | None]:
        """Each asking row's token's log-probability and its top ones, gathered for all rows at once
        (row by row, `topk` and `.item()` took 13 ms a step for 32 rows)."""
        if raw is None:
            return [None] * len(seqs)
        index = torch.tensor(tokens, device=raw.device)[:, None]
        chosen = raw.gather(1, index).squeeze(1).tolist()
        most = min(max(s.params.logprobs or 0 for s in seqs), raw.shape[1])
        top_values, top_ids = [], []  # (read only by rows asking for top ones, so most > 0)
        if most:
            values, ids = raw.topk(most, dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        out: list[TokenLogprob | None] = []
        for row, (token, seq) in enumerate(zip(tokens, seqs)):
            n = seq.params.logprobs
            top = list(zip(top_ids[row][:n], top_values[row][:n])) if n else []
            out.append(None if n is None else TokenLogprob(token, chosen[row], top))
        return out


def greedy(scores: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, first index among ties (as `argmax` and HF's greedy search): `max`'s
    kernel does the same 2.5x faster on CPU (32 x 49152 float32 logits: 0.4 against 1.1 ms)."""
    return scores.max(dim=-1).indices
