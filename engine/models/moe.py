"""Mixture-of-experts layers of the native decoder (Qwen3-MoE, Mixtral) over a packed batch.

Reads like transformers' `Qwen3MoeSparseMoeBlock` and `MixtralSparseMoeBlock`: a router linear,
softmax in float32, the top k experts of each token (their weights renormalised to sum to 1 where
the family does), each expert a SiLU MLP. Differs in layout: the step's (token, expert) pairs are
sorted by expert, so each expert runs once on all of its tokens as one GEMM pair (the fused
`silu_mlp` kernel on CPU float32), and its weighted outputs are added in expert order, the order
transformers' own loop adds them in. With the C++ kernels, `moe_mlp` does the whole layer in one op.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.packed_linear import PackedLinear, linear

if TYPE_CHECKING:
    from engine.models.llama import DecoderShape

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class Experts:
    """A model's mixture of experts, from its config; absent (None) for a dense model."""

    num_experts: int
    per_token: int  # top k
    intermediate_size: int  # of each expert
    normalize: bool  # renormalise the top k weights to sum to 1
    round_weights: bool  # the routing weights in the model's dtype before they scale an expert's output
    sparse_layers: frozenset[int]  # the layers with experts (the others keep a dense MLP)

    @classmethod
    def from_hf_config(cls, config) -> Experts | None:
        layers = range(config.num_hidden_layers)
        if config.model_type == "qwen3_moe" and config.num_experts > 0:
            skipped = set(config.mlp_only_layers or [])
            sparse = frozenset(i for i in layers if i not in skipped and (i + 1) % config.decoder_sparse_step == 0)
            return cls(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       config.norm_topk_prob, True, sparse)
        if config.model_type == "mixtral":
            return cls(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True, False,
                       frozenset(layers))
        return None


class SparseMoe(nn.Module):
    """The routed experts of one layer: `gate` is the router, each of `experts` a SiLU MLP."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        from engine.models.llama import MLP

        experts = shape.experts
        self.top_k, self.normalize, self.round_weights = experts.per_token, experts.normalize, experts.round_weights
        self.gate = nn.Linear(shape.hidden_size, experts.num_experts, bias=False)
        expert_shape = replace(shape, intermediate_size=experts.intermediate_size, mlp_bias=False)
        self.experts = nn.ModuleList(MLP(expert_shape) for _ in range(experts.num_experts))

    def route(self, x: torch.Tensor, kernels: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [tokens, k] and their weights, as transformers' router computes them."""
        probs = torch.softmax(linear(self.gate, x, kernels), dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.round_weights else weights), experts

    def forward(self, x: torch.Tensor, kernels: Any = None) -> torch.Tensor:  # [tokens, hidden]
        weights, experts = self.route(x, kernels)
        pairs = experts.flatten()
        order = torch.argsort(pairs, stable=True)  # the (token, k) pairs by expert, tokens in order within one
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        out, weights, start = torch.zeros_like(x), weights.flatten(), 0
        for expert, count in zip(self.experts, counts):
            if count:
                chosen = order[start:start + count]
                tokens = chosen // self.top_k
                out.index_add_(0, tokens, (expert(x[tokens], kernels) * weights[chosen, None]).to(x.dtype))
                start += count
        return out

    def fused_weights(self) -> tuple | None:
        """(router panels, [gate_up, down] panels of each expert) for the C++ `moe_mlp` op; None where
        a linear is not packed for the CPU float32 kernels."""
        linears = [self.gate, *(layer for e in self.experts for layer in (e.gate_up_proj, e.down_proj))]
        if not all(isinstance(layer, PackedLinear) for layer in linears):
            return None
        return self.gate.panels, [e.panels for e in linears[1:]]
