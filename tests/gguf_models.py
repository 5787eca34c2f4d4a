"""Tiny GGUF files of the test families (tests/models.py), laid out as llama.cpp's converter
(`convert_hf_to_gguf.py`) lays them out, written with the `gguf` package's writer and quantizers.

Why not llama.cpp's converter itself: it is not on PyPI, and it refuses a tokenizer it does not
recognise by hash, which every tiny test tokenizer is. What it does that matters here is small:
the metadata keys of each architecture, the byte-level BPE tokenizer (`gpt2`: tokens, types,
merges), llama.cpp's tensor names, q/k rows permuted for Llama's rotary layout, and each 2-D
weight quantized to the file type (norms and biases stay F32).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import quantize
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.models import COMMON, build_tokenizer, save_generic_model, save_tiny_model

ARCHITECTURES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
                 "phi3": gguf.MODEL_ARCH.PHI3, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE}
# transformers reads neither a qwen3 file's head_dim nor a qwen3moe file's expert width: their defaults
QWEN3_HEAD_DIM, QWEN3MOE_EXPERT_WIDTH = 128, 768


def save_hf_model(family: str, folder: Path, seed: int) -> None:
    torch.manual_seed(seed)
    if family == "qwen3":
        tokenizer = build_tokenizer()
        Qwen3ForCausalLM(Qwen3Config(**COMMON, vocab_size=len(tokenizer), head_dim=QWEN3_HEAD_DIM,
                                     tie_word_embeddings=True)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    elif family == "qwen3moe":  # llama.cpp renormalises the top experts' weights (transformers' GGUF default)
        tokenizer = build_tokenizer()
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, vocab_size=len(tokenizer), head_dim=16, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=QWEN3MOE_EXPERT_WIDTH,
                                           norm_topk_prob=True)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    else:
        (save_generic_model if family == "phi3" else save_tiny_model)(family, folder, seed)


def stacked_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, np.ndarray]]:
    """transformers' 3-D experts (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) as
    llama.cpp stores them: `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`, [E, rows, columns] each."""
    block = name.split(".")[2]
    data = tensor.float().numpy()
    if name.endswith("gate_up_proj"):
        gate, up = np.split(data, 2, axis=1)
        return [(f"blk.{block}.ffn_gate_exps.weight", gate), (f"blk.{block}.ffn_up_exps.weight", up)]
    return [(f"blk.{block}.ffn_down_exps.weight", data)]
CONTROL, NORMAL = 3, 1  # gguf.TokenType


def save_gguf_model(family: str, out: Path, qtype: str = "Q8_0", seed: int = 0) -> Path:
    """A tiny random `family` model as the GGUF file `out`, its linears and embedding in `qtype`."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_hf_model(family, folder, seed)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    config, arch = model.config, ARCHITECTURES[family]
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if family == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    specials = set(tokenizer.all_special_tokens) | {"<|im_start|>", "<|im_end|>"}
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([CONTROL if token in specials else NORMAL for token, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    writer.add_bos_token_id(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    writer.add_pad_token_id(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = data.reshape(heads, 2, -1, data.shape[1]).swapaxes(1, 2).reshape(data.shape)
        if ".mlp.experts." in name:
            tensors = stacked_experts(name, tensor)
        else:
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            tensors = [(gguf_name, data)]
        for gguf_name, data in tensors:  # linears (experts too) in the file's type; norms, biases, the router F32
            if data.ndim >= 2 and not name.endswith(("norm.weight", "mlp.gate.weight")):
                qt = gguf.GGMLQuantizationType[qtype]
                writer.add_tensor(gguf_name, quantize(np.ascontiguousarray(data), qt), raw_dtype=qt)
            else:
                writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
