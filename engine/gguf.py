"""GGUF files (what llama.cpp and Ollama run) as a model source: config, tokenizer and weights.

A GGUF file carries everything: hyper-parameters, the tokenizer and chat template, and weights
that are mostly quantized (Q4_0, Q4_1, Q8_0, K-quants, ...). transformers converts the
metadata to a config and a fast tokenizer, which takes seconds (a 49k-token BPE is rebuilt in
Python), so the result is saved once per file in a cache folder (`GALLEY_CACHE_DIR`, default
`~/.cache/galley`) and later starts read plain HF files. Weights are read memory-mapped by the
`gguf` package and de-quantized tensor by tensor with its vectorised numpy kernels into the
HF names our loader fuses, undoing llama.cpp's rotary permutation of q/k for Llama models.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import structlog
import torch

log = structlog.get_logger(__name__)

GGUF_MAGIC = b"GGUF"
# GGUF tensor names -> Hugging Face names (per layer `blk.N.` -> `model.layers.N.`)
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PERMUTED_ARCHS = ("llama",)  # llama.cpp's converter permutes q/k rows of these for its rotary layout


def is_gguf_file(path: Path) -> bool:
    """A file that starts with the GGUF magic (`.gguf`, or an Ollama blob without a suffix)."""
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the only `.gguf` in a folder without a
    config.json; None when `path` is not a GGUF source."""
    if path.is_file():
        return path if is_gguf_file(path) else None
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
    return None


def cache_root() -> Path:
    return Path(os.environ.get("GALLEY_CACHE_DIR", "~/.cache/galley")).expanduser()


def hf_folder_for(gguf_file: Path) -> Path:
    """A folder with config.json and tokenizer files for `gguf_file`, converted on first use and
    kept under the cache root (keyed by the file's path, size and modification time)."""
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', gguf_file.stem)}-{key}"
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoConfig, AutoTokenizer

    log.info("converting GGUF metadata (once per file)", file=str(gguf_file), cache=str(folder))
    config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    config.architectures = config.architectures or [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights we load are de-quantized
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "gguf_source.json").write_text(json.dumps({"file": str(gguf_file.resolve())}))
    os.replace(tmp, folder)  # atomic: a half-written folder is never taken for a converted one
    return folder


def read_weights(gguf_file: Path, hf_config) -> dict[str, torch.Tensor]:
    """The file's tensors under HF names, de-quantized to float32."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_file)
    arch = reader.fields["general.architecture"].contents()
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            log.warning("skipping an unknown GGUF tensor", tensor=tensor.name)
            continue
        array = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weight = torch.from_numpy(array if array.flags.writeable else array.copy())  # F32 tensors are the mmap
        if arch in PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = unpermute(weight, heads if "q_proj" in name else kv_heads)
        out[name] = weight
    return out


def hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match and match.group(2) in LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{LAYER_TENSORS[match.group(2)]}.{suffix}"
    return None


def unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (rotary halves interleaved per head) back to HF's."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
