"""A checkpoint's tensors under HF names (or a GGUF file's, renamed by `engine.gguf`) to the native
decoder's layout: q/k/v and gate/up concatenated into one linear each (Phi-3 stores them so already),
a mixture's router and experts under one naming whatever the family's."""

from __future__ import annotations

from typing import Any

from engine.quantization import cat_rows

# a checkpoint's names of the router and of expert E's gate, up and down linears, per family
EXPERT_NAMES = {
    "qwen3_moe": ("mlp.gate", "mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj", "mlp.experts.{}.down_proj"),
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{}.w1", "block_sparse_moe.experts.{}.w3",
                "block_sparse_moe.experts.{}.w2"),
}


def fuse_weights(hf: dict[str, Any], num_layers: int, tied: bool) -> dict[str, Any]:
    """HF parameter names -> ours, concatenating q/k/v and gate/up (int4 codes stay codes if all are,
    a GGUF file's blocks stay blocks)."""
    hf = {name.removeprefix("model."): tensor for name, tensor in hf.items()}
    out = {"embed_tokens.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"]}
    out["lm_head.weight"] = hf["embed_tokens.weight"] if tied else hf["lm_head.weight"]
    for i in range(num_layers):
        p = f"layers.{i}."
        for suffix in ("weight", "bias"):
            for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                 ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
                if f"{p}{parts[0]}.{suffix}" in hf:
                    out[f"{p}{fused}.{suffix}"] = cat_rows([hf[f"{p}{part}.{suffix}"] for part in parts])
                elif f"{p}{fused}.{suffix}" in hf:  # fused in the checkpoint already (Phi-3)
                    out[f"{p}{fused}.{suffix}"] = hf[f"{p}{fused}.{suffix}"]
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                if f"{p}{name}.{suffix}" in hf:
                    out[f"{p}{name}.{suffix}"] = hf[f"{p}{name}.{suffix}"]
        fuse_expert_weights(hf, p, out)
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):  # the last two: Gemma 3's
            if f"{p}{name}.weight" in hf:
                out[f"{p}{name}.weight"] = hf[f"{p}{name}.weight"]
    return out


def fuse_expert_weights(hf: dict[str, Any], layer: str, out: dict[str, Any]) -> None:
    """A layer's router and experts from a checkpoint's names (`layer` is "layers.N."; either family's
    naming) to ours, each expert's gate and up concatenated as the dense MLP's are."""
    for router, gate, up, down in EXPERT_NAMES.values():
        if f"{layer}{router}.weight" not in hf:
            continue
        out[f"{layer}mlp.gate.weight"] = hf[f"{layer}{router}.weight"]
        expert = 0
        while f"{layer}{gate.format(expert)}.weight" in hf:
            e, ours = (lambda name, e=expert: hf[f"{layer}{name.format(e)}.weight"]), f"{layer}mlp.experts.{expert}."
            out[f"{ours}gate_up_proj.weight"] = cat_rows([e(gate), e(up)])
            out[f"{ours}down_proj.weight"] = e(down)
            expert += 1
