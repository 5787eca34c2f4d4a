"""Gemma 3's text decoder (`Gemma3ForCausalLM`: gemma-3-1b, and text-only Gemma 3 checkpoints) on the
native path: the Llama family's attention and MLP modules (fused q/k/v and gate/up, the C++ kernels
op by op on CPU float32, LoRA adapters, CUDA graphs) in Gemma 3's layer, as transformers'
`modeling_gemma3` computes it:

- RMSNorm scales by (1 + weight), in float32 before the cast (`GemmaRMSNorm`); four a layer: each
  sub-block's input, and its output before the residual add;
- q/k norms, attention scaled by `query_pre_attn_scalar ** -0.5`;
- layers attend in a sliding window or to the whole context by `layer_types`, each kind with its own
  rope (base, scaling);
- the embedding is scaled by sqrt(hidden_size), rounded to the model's dtype; the MLP gates by GELU (tanh).

On CPU float32 each layer is one C++ op (`gemma_layer`, engine/csrc/gemma_layer.cpp: the per-op
path's kernels in its order, bit for bit). What this does not compute (logit soft-capping, bidirectional attention) is
refused by `gemma3_refusal`, and the generic backend serves the model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.lora import LoraStep
from engine.models.llama import (
    FUSED_LINEARS,
    MLP,
    Attention,
    DecoderShape,
    LlamaForCausalLM,
    RMSNorm,
    RotaryEmbedding,
)
from engine.packed_linear import PackedLinear, linear

GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM",)
SLIDING, FULL = "sliding_attention", "full_attention"


def gemma3_refusal(hf_config) -> str | None:
    """Why the native Gemma 3 layer does not compute this model; None if it does."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(hf_config, name, None) is not None:
            return f"{name} ({getattr(hf_config, name)})"
    if getattr(hf_config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    for layer_type, rope in (getattr(hf_config, "rope_parameters", None) or {}).items():
        if rope.get("rope_type", "default") not in ("default", "linear"):
            return f"rope type {rope['rope_type']!r} on {layer_type} layers"
    return None


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), in float32 and cast once (Gemma3RMSNorm); its checkpoint weight is w."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self._plus_one: torch.Tensor | None = None

    def plus_one(self) -> torch.Tensor:
        # float32 1 + w, as transformers computes it at every call; the weights do not change once loaded
        if self._plus_one is None or self._plus_one.device != self.weight.device:
            self._plus_one = 1.0 + self.weight.float()
        return self._plus_one

    def forward(self, x: torch.Tensor, kernels: Any = None) -> torch.Tensor:  # [rows, dim]
        if kernels is not None:  # CPU float32: the kernel's x * rsqrt(mean(x^2) + eps) * weight
            out = torch.empty_like(x)
            kernels.rms_norm(out, x.contiguous(), self.plus_one(), self.eps)
            return out
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.plus_one()).to(x.dtype)


class Gemma3Layer(nn.Module):
    def __init__(self, shape: DecoderShape, index: int, window: int | None, query_pre_attn_scalar: float) -> None:
        super().__init__()
        self.lora_prefix = f"{index}."
        self.window = window  # None: the whole context
        self.input_layernorm = GemmaRMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.self_attn.q_norm = GemmaRMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.self_attn.k_norm = GemmaRMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.self_attn.scale = query_pre_attn_scalar**-0.5
        self.post_attention_layernorm = GemmaRMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)
        self.post_feedforward_layernorm = GemmaRMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def fused_weights(self) -> tuple | None:
        """The weights in the order the C++ `gemma_layer` op takes them (norms as 1 + w); None where it cannot
        run this layer (linears not packed for CPU float32, an activation other than GELU-tanh)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(layer, PackedLinear) for layer in linears) or mlp.act_name != "gelu_pytorch_tanh":
            return None
        return (self.input_layernorm.plus_one(), attn.qkv_proj.panels, attn.qkv_proj.bias, attn.q_norm.plus_one(),
                attn.k_norm.plus_one(), attn.o_proj.panels, attn.o_proj.bias, self.post_attention_layernorm.plus_one(),
                self.pre_feedforward_layernorm.plus_one(), mlp.gate_up_proj.panels, mlp.gate_up_proj.bias,
                mlp.down_proj.panels, mlp.down_proj.bias, self.post_feedforward_layernorm.plus_one())

    def fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache, meta: AttentionMetadata,
              weights: tuple, adapters: tuple) -> torch.Tensor:
        """`forward` as one C++ op (in place of x): the same kernels in the same order."""
        meta, s = meta.windowed(self.window), self.self_attn.shape
        step = (meta.slot_mapping, meta.num_decodes, meta.decode_block_tables, meta.decode_context_lens,
                meta.prefill_bounds, [chunk.block_table for chunk in meta.prefills], s.num_heads, s.rms_norm_eps,
                meta.block_size, self.self_attn.scale, meta.sliding_window or 0)
        meta.kernels.gemma_layer(x, cos, sin, *weights, *kv_cache, *step, *adapters)
        return x

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache, meta: AttentionMetadata,
                lora: LoraStep | None = None) -> torch.Tensor:
        kernels = meta.kernels
        h = self.self_attn(self.input_layernorm(x, kernels), cos, sin, kv_cache, meta.windowed(self.window), lora,
                           self.lora_prefix)
        x = x + self.post_attention_layernorm(h, kernels)
        h = self.mlp(self.pre_feedforward_layernorm(x, kernels), kernels, lora, self.lora_prefix)
        return x + self.post_feedforward_layernorm(h, kernels)


def rope_config(hf_config, layer_type: str):
    """The config as the Llama family's rope reads it: one kind of layer's rope parameters, flat."""
    config = copy.copy(hf_config)
    config.rope_parameters = dict(hf_config.rope_parameters[layer_type])
    return config


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's decoder; the Llama family's LoRA layout, loading and CUDA graphs, without its fused op."""

    def __init__(self, hf_config) -> None:
        nn.Module.__init__(self)
        self.shape = shape = DecoderShape.from_hf_config(hf_config)
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.embed_scale = hf_config.hidden_size**0.5
        window, scalar = hf_config.sliding_window, hf_config.query_pre_attn_scalar
        self.layers = nn.ModuleList(Gemma3Layer(shape, i, window if kind == SLIDING else None, scalar)
                                    for i, kind in enumerate(hf_config.layer_types))
        self.layer_types = list(hf_config.layer_types)
        self.norm = GemmaRMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(rope_config(hf_config, FULL), shape.head_dim)
        self.rotary_local = RotaryEmbedding(rope_config(hf_config, SLIDING), shape.head_dim)
        self.fused = True  # one C++ op a layer where the kernels can (False: op by op, to compare)
        self._fused_weights = None

    def build_rotary(self, hf_config, device: torch.device) -> None:
        self.rotary = RotaryEmbedding(rope_config(hf_config, FULL), self.shape.head_dim).to(device)
        self.rotary_local = RotaryEmbedding(rope_config(hf_config, SLIDING), self.shape.head_dim).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata,
                logits_indices: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale).to(x.dtype)  # Gemma3TextScaledWordEmbedding: the scale in the dtype
        ropes = {FULL: self.rotary(positions, x.dtype), SLIDING: self.rotary_local(positions, x.dtype)}
        weights = self.fused_weights() if self.fused and meta.kernels is not None else None
        if weights is not None:
            s = self.shape
            adapters = lora.layer_arguments(s.num_layers, FUSED_LINEARS) if lora else [([], [])] * s.num_layers
            for layer, kind, kv_cache, w, a in zip(self.layers, self.layer_types, kv_caches, weights, adapters,
                                                   strict=True):
                x = layer.fused(x, *ropes[kind], kv_cache, meta, w, a)
        else:
            for layer, kind, kv_cache in zip(self.layers, self.layer_types, kv_caches, strict=True):
                x = layer(x, *ropes[kind], kv_cache, meta, lora)
        x = self.norm(x[logits_indices], meta.kernels)
        return linear(self.lm_head, x, meta.kernels).float()
