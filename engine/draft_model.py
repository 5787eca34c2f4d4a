"""Draft-model proposals (vLLM's `draft_model` method): a second, smaller model guesses each
sequence's next k tokens greedily, for the target to verify in its next step.

Owns the draft's weights, its KV tensors and how many of each sequence's tokens they hold. The
draft's KV is indexed by the target's block ids (the sequences' own block tables, no second
allocator) plus one scratch block per proposing sequence past the target's pool: guesses beyond a
sequence's own blocks land there. Real tokens are only counted as seen once their K/V sits in the
sequence's own slots, so a later catch-up overwrites any guess written there.

Must not: write the target's KV or touch scheduler state, or change any output. A draft is only a
guess the target checks; a failing draft forward proposes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from engine.loader import LoadedModel, ModelLoadError, load_model
from engine.model_runner import ModelRunner, kv_bytes_per_block
from engine.speculative import SpeculativeConfig, num_drafts
from engine.types import GenerationRequest, ScheduledBatch, ScheduledSeq, Sequence, SequenceStatus

log = structlog.get_logger(__name__)


def load_draft(config: SpeculativeConfig, target_source: str, target: LoadedModel) -> LoadedModel:
    """The draft model of `config` on the target's device and dtype: `config.model`, or the target's
    own source again (self-drafting). ModelLoadError if its vocabulary is not the target's."""
    source = config.model or target_source
    if not source:
        raise ModelLoadError("speculative method draft_model with no model (self-drafting) needs the target's source")
    draft = load_model(source, device=str(target.device), dtype=str(target.dtype).removeprefix("torch."),
                       quantization=config.quantization or None)
    if draft.model.shape.vocab_size != target.model.shape.vocab_size:
        raise ModelLoadError(f"draft model {source!r} has a vocabulary of {draft.model.shape.vocab_size} tokens, "
                             f"the target {target.model.shape.vocab_size}: a draft must share its target's tokenizer")
    return draft


def num_target_blocks(num_blocks: int, target: LoadedModel, draft: LoadedModel, block_size: int) -> int:
    """The target's share of a KV budget of `num_blocks` target blocks when the draft keeps KV for
    the same blocks: both pools together fit where the target's alone would have."""
    target_bytes = kv_bytes_per_block(target.model, block_size, target.dtype)
    draft_bytes = kv_bytes_per_block(draft.model, block_size, draft.dtype)
    return max(1, num_blocks * target_bytes // (target_bytes + draft_bytes))


@dataclass
class DraftKV:
    """What the draft's KV holds for one sequence: its first `num_computed_tokens` tokens, valid
    while the sequence keeps its blocks (the same preemption count, its target KV never shrunk)."""

    seq: Sequence
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_target_computed: int = 0


class DraftModelProposer:
    """Invariant: for every tracked sequence, the draft KV of its first `num_computed_tokens` tokens
    is in its own blocks (`seq.block_table`), computed by the draft over those same tokens."""

    def __init__(self, config: SpeculativeConfig, draft: LoadedModel, num_blocks: int, block_size: int,
                 max_model_len: int, max_num_seqs: int, cpu_kernels: bool = True) -> None:
        self.config = config
        self.model = draft.model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_target_blocks = num_blocks
        self.num_scratch = max(1, min(config.disable_by_batch_size, max_num_seqs))  # most sequences drafting at once
        self.max_drafts = min(config.num_speculative_tokens, block_size)  # a round's guesses fit one scratch block
        self.runner = ModelRunner(draft.model, draft.device, draft.dtype, block_size, num_blocks + self.num_scratch,
                                  cpu_kernels)
        self.kv: dict[str, DraftKV] = {}
        self.num_failures = 0  # draft forwards that raised

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """Up to k greedy guesses per sequence (fewer near max_tokens or the context, none for a
        request that may not be drafted), all sequences batched in each draft forward."""
        self.kv = {rid: state for rid, state in self.kv.items() if state.seq.status is not SequenceStatus.FINISHED}
        drafts: list[list[int]] = [[] for _ in seqs]
        wanted = [(i, k) for i, seq in enumerate(seqs) if (k := self._num_drafts(seq)) > 0][: self.num_scratch]
        if not wanted:
            return drafts
        try:
            guesses = self._draft([seqs[i] for i, _ in wanted], [k for _, k in wanted])
        except Exception:
            self.num_failures += 1  # the first with its traceback; a broken draft would repeat it every step
            log.error("draft model forward failed; no drafts this step", num_seqs=len(wanted),
                      num_failures=self.num_failures, exc_info=self.num_failures == 1)
            return drafts
        for (i, _), guess in zip(wanted, guesses):
            drafts[i] = guess
        return drafts

    def _num_drafts(self, seq: Sequence) -> int:
        """As many as the target allows, so long as the positions they are fed at end within the
        scratch block after the sequence's own (its last token is at most one past them)."""
        room = (len(seq.block_table) + 1) * self.block_size - seq.num_tokens + 1
        return min(num_drafts(seq, self.max_drafts, self.max_model_len), room)

    def _state(self, seq: Sequence) -> DraftKV:
        state = self.kv.get(seq.request_id)
        if (state is None or state.seq is not seq or state.num_preemptions != seq.num_preemptions
                or seq.num_computed_tokens < state.num_target_computed):  # its blocks were freed since
            state = self.kv[seq.request_id] = DraftKV(seq, 0, seq.num_preemptions)
        state.num_target_computed = seq.num_computed_tokens
        return state

    @torch.inference_mode()
    def _draft(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Catch each sequence's draft KV up to its last token (the first time: its whole prompt), then
        k - 1 more single-token steps; the argmax after each is the next guess."""
        views, states = [], []
        for slot, seq in enumerate(seqs):
            state = self._state(seq)
            view = Sequence(GenerationRequest(seq.request_id, seq.token_ids, seq.params))
            view.num_computed_tokens = min(state.num_computed_tokens, seq.num_tokens - 1)
            view.block_table = [*seq.block_table, self.num_target_blocks + slot]  # scratch past its own blocks
            views.append(view)
            states.append(state)
        guesses: list[list[int]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while active:
            items = [ScheduledSeq(views[i], views[i].num_uncomputed_tokens) for i in active]
            sampled, logits = self.runner.execute(ScheduledBatch(items))
            row_of = {id(item): row for row, item in enumerate(sampled)}
            tokens = logits.argmax(dim=-1).tolist()
            for i, item in zip(active, items):
                if not guesses[i]:  # the catch-up: real tokens in the sequence's own slots are now seen
                    own_slots = len(seqs[i].block_table) * self.block_size
                    states[i].num_computed_tokens = min(views[i].num_tokens, own_slots)
                views[i].num_computed_tokens = views[i].num_tokens
                guesses[i].append(tokens[row_of[id(item)]])
                views[i].token_ids.append(guesses[i][-1])
            active = [i for i in active if len(guesses[i]) < ks[i]]
        return guesses
