"""The Llama decoder family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3/4, and with the experts of
`engine.models.moe` Qwen3-MoE and Mixtral) over a packed batch.

Reads like the HF reference on purpose (same RMSNorm and rotary formulas), so greedy
outputs match `transformers`; differs in layout: fused qkv and gate/up projections, a flat
[num_tokens, hidden] batch with per-token positions, paged KV written in place, and the
residual add done by the next norm (so the C++ kernels of `engine.cpu_kernels`, passed in
the step's metadata on CPU float32, can fuse them; without them the same formulas run as
torch ops). Where the kernels can run every layer (packed linears, SiLU), each layer is one C++
op (`fused_layers`) that calls them in the order `DecoderLayer.forward` does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.lora import AdapterError, LoraStep, LoraWeights, PeftAdapter, check_shape, stack_parts
from engine.models.moe import MOE_ARCHITECTURES, Experts, SparseMoe
from engine.packed_linear import PackedLinear, linear

# the C++ decoder_layer op's linears, by the index its adapter slices name them with
FUSED_LINEARS = ("qkv", "o", "gate_up", "down")

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",  # Phi-3 and Phi-4: q/k/v and gate/up fused in the checkpoint already
    *MOE_ARCHITECTURES,
    "Gemma3ForCausalLM",  # its own layer: engine/models/gemma3.py
)
ROPE_TYPES = ("default", "linear", "llama3")


def native_refusal(architecture: str, hf_config) -> str | None:
    """Why the native decoder does not compute this model (the generic backend then serves it); None if it does."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        return f"architecture {architecture} is not one of {', '.join(SUPPORTED_ARCHITECTURES)}"
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        return f"rope type {rope['rope_type']!r} is not one of {', '.join(ROPE_TYPES)}"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return f"partial rotary embeddings (partial_rotary_factor {rope['partial_rotary_factor']})"
    return None


# The activations these families use, as transformers' ACT2FN computes them; others come from ACT2FN
# itself. Importing transformers' modelling utilities costs seconds of every server start.
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str):
    if name in ACTIVATIONS:
        return ACTIVATIONS[name]
    from transformers.activations import ACT2FN

    return ACT2FN[name]


@dataclass(frozen=True)
class DecoderShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    max_position_embeddings: int
    experts: Experts | None = None  # a mixture of experts' routing (engine.models.moe); None: dense

    @classmethod
    def from_hf_config(cls, config) -> DecoderShape:
        arch = (getattr(config, "architectures", None) or ["?"])[0]
        model_type = config.model_type
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        sliding = getattr(config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(config, "use_sliding_window", False) or model_type == "gemma3_text":
            sliding = None  # Gemma 3: a window on some layers only, which its layers apply
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            hidden_act=getattr(config, "hidden_act", None) or config.hidden_activation,  # Gemma names it so
            qkv_bias=qkv_bias,
            o_bias=model_type not in ("qwen2", "qwen3") and bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text")
            or arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=sliding,
            max_position_embeddings=config.max_position_embeddings,
            experts=Experts.from_hf_config(config),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: Any = None) -> torch.Tensor:  # [rows, dim]
        if kernels is not None:
            out = torch.empty_like(x)
            kernels.rms_norm(out, x.contiguous(), self.weight, self.eps)
            return out
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, kernels: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the kernel computes both in place of x and residual."""
        if kernels is not None:
            kernels.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


class RotaryEmbedding(nn.Module):
    """cos/sin per position, from transformers' own rope init (covers linear, llama3, ...)."""

    def __init__(self, hf_config, head_dim: int) -> None:
        super().__init__()
        rope = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            base = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.attention_scaling = 1.0
        elif rope_type in ("linear", "llama3"):
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
        else:
            raise ValueError(f"rope type {rope_type!r} is not supported (none, linear, llama3 are)")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def adapted(layer: nn.Module, x: torch.Tensor, kernels: Any, lora: LoraStep | None, key: str) -> torch.Tensor:
    """`linear(layer, x)`, plus the step's adapter deltas for it."""
    out = linear(layer, x, kernels)
    return out if lora is None else lora.add(out, x, key, kernels)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              kernels: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if kernels is not None:
        kernels.rotary_embedding(q, k, cos, sin)  # in place, also through views of the qkv output
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class Attention(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.qkv_proj = nn.Linear(shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=shape.o_bias)
        if shape.qk_norm:
            self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
            self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.scale = shape.head_dim**-0.5

    def forward(self, x, cos, sin, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                lora: LoraStep | None = None, prefix: str = ""):
        n, s = x.shape[0], self.shape
        qkv = adapted(self.qkv_proj, x, meta.kernels, lora, prefix + "qkv")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, s.num_heads, s.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(n, s.num_kv_heads, s.head_dim)
        v = v.view(n, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q = self.q_norm(q.reshape(-1, s.head_dim), meta.kernels).view(n, s.num_heads, s.head_dim)
            k = self.k_norm(k.reshape(-1, s.head_dim), meta.kernels).view(n, s.num_kv_heads, s.head_dim)
        q, k = rotate_qk(q, k, cos, sin, meta.kernels)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return adapted(self.o_proj, out.reshape(n, self.q_size), meta.kernels, lora, prefix + "o")


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.intermediate_size = shape.intermediate_size
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=shape.mlp_bias)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=shape.mlp_bias)
        self.act, self.act_name = activation(shape.hidden_act), shape.hidden_act
        self.silu = shape.hidden_act == "silu"

    def forward(self, x: torch.Tensor, kernels: Any = None, lora: LoraStep | None = None,
                prefix: str = "") -> torch.Tensor:
        gate_up_proj, down_proj = self.gate_up_proj, self.down_proj
        if lora is not None and (lora.touches(prefix + "gate_up") or lora.touches(prefix + "down")):
            gate_up = adapted(gate_up_proj, x, kernels, lora, prefix + "gate_up")
            return adapted(down_proj, self.gated(gate_up, kernels), kernels, lora, prefix + "down")
        if kernels is not None and self.silu and isinstance(gate_up_proj, PackedLinear) and isinstance(
            down_proj, PackedLinear
        ):  # the whole MLP in one op, a chunk of rows at a time
            out = x.new_empty(x.shape[0], down_proj.out_features)
            kernels.silu_mlp(out, x.contiguous(), gate_up_proj.panels, gate_up_proj.bias, down_proj.panels,
                             down_proj.bias)
            return out
        return linear(self.down_proj, self.gated(linear(gate_up_proj, x, kernels), kernels), kernels)

    def gated(self, gate_up: torch.Tensor, kernels: Any) -> torch.Tensor:
        """act(gate) * up for rows [gate | up]."""
        if kernels is not None and self.silu:  # one pass instead of silu, then mul
            out = gate_up.new_empty(gate_up.shape[0], self.intermediate_size)
            kernels.silu_and_mul(out, gate_up)
            return out
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.act(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape, index: int = 0) -> None:
        super().__init__()
        self.lora_prefix = f"{index}."  # its linears' names in an adapter's `LoraAdapter.weights`
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        sparse = shape.experts is not None and index in shape.experts.sparse_layers
        self.mlp = SparseMoe(shape) if sparse else MLP(shape)

    def forward(self, x, residual, cos, sin, kv_cache, meta, lora: LoraStep | None = None):
        """x: the previous layer's output, residual: the stream before it (None at the first layer);
        returns the same pair for this layer (the add happens in the next norm)."""
        if residual is None:
            x, residual = self.input_layernorm(x, meta.kernels), x
        else:
            x, residual = self.input_layernorm.add_forward(x, residual, meta.kernels)
        x = self.self_attn(x, cos, sin, kv_cache, meta, lora, self.lora_prefix)
        x, residual = self.post_attention_layernorm.add_forward(x, residual, meta.kernels)
        if isinstance(self.mlp, SparseMoe):
            return self.mlp(x, meta.kernels), residual
        return self.mlp(x, meta.kernels, lora, self.lora_prefix), residual

    def fused_weights(self) -> tuple[tuple, tuple] | None:
        """The weights in the order the C++ `decoder_layer` op takes them, and its MLP's experts (router
        panels, each expert's panels, top k, whether to renormalise; None, [], 0, False for a dense MLP);
        None where it cannot run this layer (linears not packed for CPU float32, an activation other than SiLU)."""
        attn, mlp = self.self_attn, self.mlp
        if not all(isinstance(layer, PackedLinear) for layer in (attn.qkv_proj, attn.o_proj)):
            return None
        if isinstance(mlp, SparseMoe):
            experts = mlp.fused_weights()
            if experts is None or not mlp.experts[0].silu:
                return None
            dense, routing = (None, None, None, None), (*experts, mlp.top_k, mlp.normalize)
        elif mlp.silu and all(isinstance(layer, PackedLinear) for layer in (mlp.gate_up_proj, mlp.down_proj)):
            dense = (mlp.gate_up_proj.panels, mlp.gate_up_proj.bias, mlp.down_proj.panels, mlp.down_proj.bias)
            routing = (None, [], 0, False)
        else:
            return None
        qk_norm = (attn.q_norm.weight, attn.k_norm.weight) if attn.shape.qk_norm else (None, None)
        return (self.input_layernorm.weight, attn.qkv_proj.panels, attn.qkv_proj.bias, *qk_norm, attn.o_proj.panels,
                attn.o_proj.bias, self.post_attention_layernorm.weight, *dense), routing


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        self.shape = shape = DecoderShape.from_hf_config(hf_config)
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.rotary = RotaryEmbedding(hf_config, shape.head_dim)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.fused = True  # one C++ op per decoder layer where the kernels can (False: per op, to compare)
        self._fused_weights: list[tuple] | None = None

    def build_rotary(self, hf_config, device: torch.device) -> None:
        """The rope tables, rebuilt on `device` once the weights are loaded (built on meta before)."""
        self.rotary = RotaryEmbedding(hf_config, self.shape.head_dim).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_samples] which tokens' logits are needed
        lora: LoraStep | None = None,  # the step's adapters, whose deltas each layer adds to its linears
    ) -> torch.Tensor:  # [num_samples, vocab_size] float32
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        weights = self.fused_weights() if self.fused and meta.kernels is not None else None
        if weights is not None:
            x, residual = self.fused_layers(x, cos, sin, kv_caches, meta, weights, lora)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, cos, sin, kv_cache, meta, lora)
        x = self.norm(residual[logits_indices] + x[logits_indices], meta.kernels)
        return linear(self.lm_head, x, meta.kernels).float()

    def lora_weights(self, adapter: PeftAdapter, device: torch.device, dtype: torch.dtype) -> dict[str, LoraWeights]:
        """An adapter's weights in this layout: q/k/v parts into the fused qkv rows, gate/up into gate_up
        (`engine.lora.stack_parts`), keyed `{layer}.{qkv|o|gate_up|down}`; AdapterError for a module we do not have."""
        s = self.shape
        q, kv, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
        places = {"self_attn.q_proj": ("qkv", slice(0, q)), "self_attn.k_proj": ("qkv", slice(q, q + kv)),
                  "self_attn.v_proj": ("qkv", slice(q + kv, q + 2 * kv)),
                  "self_attn.o_proj": ("o", slice(0, s.hidden_size)),
                  "mlp.gate_proj": ("gate_up", slice(0, inter)), "mlp.up_proj": ("gate_up", slice(inter, 2 * inter)),
                  "mlp.down_proj": ("down", slice(0, s.hidden_size))}
        inputs = {"qkv": s.hidden_size, "o": q, "gate_up": s.hidden_size, "down": inter}
        parts: dict[str, list] = {}
        for module, (a, b, scale) in adapter.modules.items():
            match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
            if match is None or match[2] not in places or int(match[1]) >= s.num_layers:
                raise AdapterError(f"the adapter adapts {module}, not a linear of {type(self).__name__} that galley "
                                   "adapts (q/k/v/o_proj, gate/up/down_proj of model.layers.N)")
            fused, rows = places[match[2]]
            if fused in ("gate_up", "down") and isinstance(self.layers[int(match[1])].mlp, SparseMoe):
                raise AdapterError(f"the adapter adapts {module}, but layer {match[1]} routes to experts: galley "
                                   "adapts the attention of a mixture of experts")
            check_shape(module, a, b, inputs[fused], rows.stop - rows.start)
            parts.setdefault(f"{match[1]}.{fused}", []).append((rows, a, b, scale))
        return {key: stack_parts(p, device, dtype) for key, p in parts.items()}

    def fused_weights(self) -> list[tuple] | None:
        """Each layer's weights for the fused op, gathered on first use (they do not change once
        loaded); None unless the op can run every layer."""
        if self._fused_weights is None:
            weights = [layer.fused_weights() for layer in self.layers]
            self._fused_weights = weights if all(w is not None for w in weights) else []
        return self._fused_weights or None

    def fused_layers(self, x, cos, sin, kv_caches, meta: AttentionMetadata, weights: list[tuple],
                     lora: LoraStep | None = None):
        """The layers' formulas and kernels as `DecoderLayer.forward` runs them, one C++ call per layer:
        at one decoding sequence the per-op path's Python took a fifth of the step. The first layer's
        norm adds the embeddings to a zero residual, which gives the same stream; both change in place.
        The step's adapters go in as each layer's (weights, slices) (`LoraStep.layer_arguments`)."""
        s, residual, x = self.shape, x, torch.zeros_like(x)
        step = (meta.slot_mapping, meta.num_decodes, meta.decode_block_tables, meta.decode_context_lens,
                meta.prefill_bounds, [chunk.block_table for chunk in meta.prefills], s.num_heads, s.rms_norm_eps,
                meta.block_size, s.head_dim**-0.5, meta.sliding_window or 0)
        adapters = lora.layer_arguments(s.num_layers, FUSED_LINEARS) if lora is not None else [([], [])] * s.num_layers
        for (layer_weights, routing), (k_cache, v_cache), (lora_weights, lora_slices) in zip(
                weights, kv_caches, adapters, strict=True):
            meta.kernels.decoder_layer(x, residual, cos, sin, *layer_weights, k_cache, v_cache, *step, lora_weights,
                                       lora_slices, *routing)
        return x, residual
