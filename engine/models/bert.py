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
    """Inputs of similar lengths whose attention runs as one padded call."""

    tokens: torch.Tensor | None  # [group tokens]: their packed rows, input by input; None: every row, in order
    slots: torch.Tensor  # [group tokens]: each one's index in the flattened [size * longest] padded layout
    key_mask: torch.Tensor  # [size, 1, 1, longest] bool: real (not padding) keys
    size: int
    longest: int


@dataclass(frozen=True)
class PackedBatch:
    """Where each input's tokens sit: in the packed rows, and in its attention group's padded layout."""

    lengths: torch.Tensor  # [batch]
    rows: torch.Tensor  # [tokens]: the input each packed token belongs to
    offsets: torch.Tensor  # [tokens]: its position within its input
    firsts: torch.Tensor  # [batch]: the packed index of each input's first token
    groups: list[AttentionGroup]

    @staticmethod
    def of(lengths: list[int], device: torch.device) -> PackedBatch:
        """Inputs are split into attention groups of similar lengths where the padded query-key
        pairs saved pay for the extra call (a batch of near-equal lengths stays one group)."""
        lens = torch.tensor(lengths, device=device)
        rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens)
        firsts = torch.cumsum(lens, 0) - lens
        offsets = torch.arange(rows.numel(), device=device) - firsts[rows]
        cut = length_groups(lengths, lambda n, width: ATTENTION_CALL_PAIRS + n * width * width)
        if len(cut) == 1:
            groups = [attention_group(lens, None, offsets, rows)]
        else:
            groups = []
            for members in cut:
                inputs = torch.tensor(members, device=device)
                tokens = torch.cat([torch.arange(int(firsts[m]), int(firsts[m] + lens[m]), device=device)
                                    for m in members])
                local_rows = torch.repeat_interleave(torch.arange(len(members), device=device), lens[inputs])
                groups.append(attention_group(lens[inputs], tokens, offsets[tokens], local_rows))
        return PackedBatch(lens, rows, offsets, firsts, groups)


def attention_group(lengths: torch.Tensor, tokens: torch.Tensor | None, offsets: torch.Tensor,
                    rows: torch.Tensor) -> AttentionGroup:
    longest = int(lengths.max())
    key_mask = torch.arange(longest, device=lengths.device)[None, :] < lengths[:, None]
    return AttentionGroup(tokens, rows * longest + offsets, key_mask[:, None, None, :], len(lengths), longest)


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
    def hidden_states(self, flat: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """[tokens] ids -> [tokens, hidden] last-layer states."""
        emb = self.base.embeddings
        h = (emb.word_embeddings(flat) + emb.position_embeddings(self.positions(flat, batch))
             + emb.token_type_embeddings.weight[0])
        h = emb.LayerNorm(h)
        # each group's padded q, k, v layout, zeroed once: the layers write only the real slots, so
        # padding stays 0 (masked keys get weight 0, and 0 x garbage could be NaN)
        padded = [h.new_zeros(g.size * g.longest, 3 * h.shape[1]) for g in batch.groups]
        for layer, (w_qkv, b_qkv) in zip(self.base.encoder.layer, self.qkv):
            qkv = F.linear(h, w_qkv, b_qkv)  # [tokens, 3 * hidden]
            if len(batch.groups) == 1:
                ctx = self.attention(qkv, batch.groups[0], padded[0])
            else:
                ctx = torch.empty_like(h)
                for group, layout in zip(batch.groups, padded):
                    ctx[group.tokens] = self.attention(qkv[group.tokens], group, layout)
            out = layer.attention.output
            h = out.LayerNorm(out.dense(ctx) + h)
            inner = F.gelu(layer.intermediate.dense(h), approximate=self.gelu)
            h = layer.output.LayerNorm(layer.output.dense(inner) + h)
        return h

    def attention(self, qkv: torch.Tensor, group: AttentionGroup, padded: torch.Tensor) -> torch.Tensor:
        """[group tokens, 3 * hidden] packed q, k, v -> [group tokens, hidden], through the group's
        zero-padded layout `padded` ([size * longest, 3 * hidden]) for one SDPA call."""
        padded[group.slots] = qkv
        q, k, v = padded.view(group.size, group.longest, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=group.key_mask)  # [size, heads, longest, head_dim]
        return ctx.transpose(1, 2).reshape(group.size * group.longest, -1)[group.slots]

    @torch.inference_mode()
    def classify(self, h: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Sequence-classification logits [batch, labels] from the first token's state, by HF's head."""
        first = h[batch.firsts][:, None]  # [batch, 1, hidden]: the heads read position 0
        if self.roberta:
            return self.model.classifier(first)
        return self.model.classifier(self.base.pooler(first))
