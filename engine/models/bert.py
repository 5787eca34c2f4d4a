"""Packed forward for BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa), on HF's own weights.

A padded batch spends most of its compute on padding: in a batch of mixed-length inputs
every linear layer runs over batch x longest tokens. Here the inputs are concatenated into
one `[total_tokens, hidden]` row set, so the linear layers, layer norms and GELUs (nearly
all the work for short inputs) see each real token once; only attention is laid out padded,
`[inputs, heads, longest, head_dim]` with a key mask, one call per group of inputs of similar
lengths, and gathered back. The modules and
weights are the `transformers` model's (no copy), so outputs equal its padded forward up to
float summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.length_groups import length_groups

PACKED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
GELU_ACTS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def supports_packed(config) -> bool:
    """Whether `PackedBert` reproduces this config's HF forward (else the caller pads)."""
    return (config.model_type in PACKED_MODEL_TYPES
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and config.hidden_act in GELU_ACTS
            and not getattr(config, "is_decoder", False))


# one more attention call per layer costs about as much as this many padded query-key pairs
# (measured on 2 CPU cores with all-MiniLM-L6-v2's 12 heads: ~0.1 ms per call, ~2.5 ns per pair x head)
ATTENTION_CALL_PAIRS = 4096


@dataclass(frozen=True)
class AttentionGroup:
    """Inputs of similar lengths, contiguous in the packed rows, whose attention runs as one padded call."""

    start: int  # its first packed row
    stop: int  # one past its last
    size: int  # inputs
    longest: int
    slots: torch.Tensor | None  # [stop - start]: each row's index in the flattened [size * longest] padded
    # layout; None when the inputs are all `longest` long: the rows already are that layout
    key_mask: torch.Tensor | None  # [size, 1, 1, longest] bool: real (not padding) keys; None: no padding


@dataclass(frozen=True)
class PackedBatch:
    """Where each input's tokens sit: in the packed rows, and in its attention group's padded layout.

    Inputs are packed shortest first, so each attention group is a contiguous run of rows (a
    slice, not a gather); everything here is in that packed order, and `restore` puts per-input
    results back in the caller's."""

    order: list[int]  # packed input k is the caller's input order[k]
    lengths: torch.Tensor  # [batch]
    rows: torch.Tensor  # [tokens]: the (packed) input each token belongs to
    offsets: torch.Tensor  # [tokens]: its position within its input
    firsts: torch.Tensor  # [batch]: the packed index of each input's first token
    groups: list[AttentionGroup]

    @staticmethod
    def of(lengths: list[int], device: torch.device) -> PackedBatch:
        """Inputs are split into attention groups of similar lengths where the padded query-key
        pairs saved pay for the extra call (a batch of near-equal lengths stays one group)."""
        cut = length_groups(lengths, lambda n, width: ATTENTION_CALL_PAIRS + n * width * width)
        order = [i for members in cut for i in members]
        packed = [lengths[i] for i in order]
        lens = torch.tensor(packed, device=device)
        rows = torch.repeat_interleave(torch.arange(len(packed), device=device), lens)
        firsts = torch.cumsum(lens, 0) - lens
        offsets = torch.arange(rows.numel(), device=device) - firsts[rows]
        groups, first_input, first_row = [], 0, 0
        for members in cut:
            group_lengths = packed[first_input:first_input + len(members)]
            stop = first_row + sum(group_lengths)
            groups.append(attention_group(group_lengths, first_row, stop, offsets[first_row:stop]))
            first_input, first_row = first_input + len(members), stop
        return PackedBatch(order, lens, rows, offsets, firsts, groups)

    def pack(self, ids: list[list[int]], device: torch.device) -> torch.Tensor:
        """The inputs' token ids (caller's order) -> [tokens] packed ids."""
        return torch.tensor([t for i in self.order for t in ids[i]], dtype=torch.long, device=device)

    def restore(self, values: torch.Tensor) -> torch.Tensor:
        """[batch, ...] per-input results in packed order -> in the caller's order."""
        inverse = torch.empty(len(self.order), dtype=torch.long, device=values.device)
        inverse[torch.tensor(self.order, device=values.device)] = torch.arange(len(self.order), device=values.device)
        return values[inverse]


def attention_group(lengths: list[int], start: int, stop: int, offsets: torch.Tensor) -> AttentionGroup:
    longest, device = max(lengths), offsets.device
    if min(lengths) == longest:
        return AttentionGroup(start, stop, len(lengths), longest, None, None)
    lens = torch.tensor(lengths, device=device)
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens)
    key_mask = torch.arange(longest, device=device)[None, :] < lens[:, None]
    return AttentionGroup(start, stop, len(lengths), longest, rows * longest + offsets, key_mask[:, None, None, :])


class PackedBert:
    """Runs a loaded HF BERT-family model (base or `...ForSequenceClassification`) on packed inputs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.base = model.base_model
        config = model.config
        self.roberta = config.model_type != "bert"
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.gelu = GELU_ACTS[config.hidden_act]
        # q, k and v in one matmul: one read of the packed rows instead of three
        self.qkv = []
        for layer in self.base.encoder.layer:
            attn = layer.attention.self
            self.qkv.append((torch.cat([attn.query.weight, attn.key.weight, attn.value.weight]),
                             torch.cat([attn.query.bias, attn.key.bias, attn.value.bias])))

    def positions(self, flat: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        if not self.roberta:
            return batch.offsets
        # RoBERTa counts positions from pad_id + 1 and gives pad tokens pad_id (HF's
        # create_position_ids_from_input_ids), per input
        real = (flat != self.pad_id).long()
        counts = torch.cumsum(real, 0)
        before = (counts - real)[batch.firsts][batch.rows]  # real tokens in earlier inputs
        return (counts - before) * real + self.pad_id

    @torch.inference_mode()
    def hidden_states(self, flat: torch.Tensor, batch: PackedBatch, segments: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """[tokens] ids (and segment ids of pairs; None: all 0) -> [tokens, hidden] last-layer states."""
        emb = self.base.embeddings
        types = emb.token_type_embeddings.weight[0] if segments is None else emb.token_type_embeddings(segments)
        h = emb.word_embeddings(flat) + emb.position_embeddings(self.positions(flat, batch)) + types
        h = emb.LayerNorm(h)
        # each padded group's q, k, v layout, zeroed once: the layers write only the real slots, so
        # padding stays 0 (masked keys get weight 0, and 0 x garbage could be NaN)
        padded = [None if g.slots is None else h.new_zeros(g.size * g.longest, 3 * h.shape[1])
                  for g in batch.groups]
        for layer, (w_qkv, b_qkv) in zip(self.base.encoder.layer, self.qkv):
            qkv = F.linear(h, w_qkv, b_qkv)  # [tokens, 3 * hidden]
            if len(batch.groups) == 1:
                ctx = self.attention(qkv, batch.groups[0], padded[0])
            else:
                ctx = torch.cat([self.attention(qkv[g.start:g.stop], g, layout)
                                 for g, layout in zip(batch.groups, padded)])
            out = layer.attention.output
            h = out.LayerNorm(out.dense(ctx) + h)
            inner = F.gelu(layer.intermediate.dense(h), approximate=self.gelu)
            h = layer.output.LayerNorm(layer.output.dense(inner) + h)
        return h

    def attention(self, qkv: torch.Tensor, group: AttentionGroup, padded: torch.Tensor | None) -> torch.Tensor:
        """[group tokens, 3 * hidden] packed q, k, v -> [group tokens, hidden], in one SDPA call over
        the group's zero-padded layout `padded` ([size * longest, 3 * hidden]), or over the rows
        themselves when the group has no padding."""
        layout = qkv if group.slots is None else padded.index_copy_(0, group.slots, qkv)
        q, k, v = layout.view(group.size, group.longest, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=group.key_mask)  # [size, heads, longest, head_dim]
        ctx = ctx.transpose(1, 2).reshape(group.size * group.longest, -1)
        return ctx if group.slots is None else ctx.index_select(0, group.slots)

    @torch.inference_mode()
    def classify(self, h: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Sequence-classification logits [batch, labels] from the first token's state, by HF's head."""
        first = h[batch.firsts][:, None]  # [batch, 1, hidden]: the heads read position 0
        if self.roberta:
            return self.model.classifier(first)
        return self.model.classifier(self.base.pooler(first))
