"""Packed forward for BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa), on HF's own weights.

A padded batch spends most of its compute on padding: in a batch of mixed-length inputs
every linear layer runs over batch x longest tokens. Here the inputs are concatenated into
one `[total_tokens, hidden]` row set, so the linear layers, layer norms and GELUs (nearly
all the work for short inputs) see each real token once; only attention is laid out padded,
`[batch, heads, longest, head_dim]` with a key mask, and gathered back. The modules and
weights are the `transformers` model's (no copy), so outputs equal its padded forward up to
float summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACKED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
GELU_ACTS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def supports_packed(config) -> bool:
    """Whether `PackedBert` reproduces this config's HF forward (else the caller pads)."""
    return (config.model_type in PACKED_MODEL_TYPES
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and config.hidden_act in GELU_ACTS
            and not getattr(config, "is_decoder", False))


@dataclass(frozen=True)
class PackedBatch:
    """Where each input's tokens sit: in the packed rows and in the padded attention layout."""

    lengths: torch.Tensor  # [batch]
    rows: torch.Tensor  # [tokens]: the input each packed token belongs to
    slots: torch.Tensor  # [tokens]: its index in the flattened [batch * longest] padded layout
    firsts: torch.Tensor  # [batch]: the packed index of each input's first token
    longest: int

    @staticmethod
    def of(lengths: list[int], device: torch.device) -> PackedBatch:
        lens = torch.tensor(lengths, device=device)
        rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens)
        firsts = torch.cumsum(lens, 0) - lens
        offsets = torch.arange(rows.numel(), device=device) - firsts[rows]  # position within its input
        longest = max(lengths)
        return PackedBatch(lens, rows, rows * longest + offsets, firsts, longest)

    @property
    def offsets(self) -> torch.Tensor:
        return self.slots - self.rows * self.longest


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
        size, longest = len(batch.lengths), batch.longest
        key_mask = (torch.arange(longest, device=flat.device)[None, :] < batch.lengths[:, None])[:, None, None, :]
        for layer, (w_qkv, b_qkv) in zip(self.base.encoder.layer, self.qkv):
            qkv = F.linear(h, w_qkv, b_qkv)  # [tokens, 3 * hidden]
            padded = qkv.new_zeros(size * longest, qkv.shape[1])
            padded[batch.slots] = qkv
            q, k, v = padded.view(size, longest, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)  # [batch, heads, longest, head_dim]
            ctx = ctx.transpose(1, 2).reshape(size * longest, -1)[batch.slots]  # [tokens, hidden]
            out = layer.attention.output
            h = out.LayerNorm(out.dense(ctx) + h)
            inner = F.gelu(layer.intermediate.dense(h), approximate=self.gelu)
            h = layer.output.LayerNorm(layer.output.dense(inner) + h)
        return h

    @torch.inference_mode()
    def classify(self, h: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Sequence-classification logits [batch, labels] from the first token's state, by HF's head."""
        first = h[batch.firsts][:, None]  # [batch, 1, hidden]: the heads read position 0
        if self.roberta:
            return self.model.classifier(first)
        return self.model.classifier(self.base.pooler(first))
