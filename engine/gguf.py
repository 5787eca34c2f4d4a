"""GGUF files (what llama.cpp and Ollama run) as a model source: config, tokenizer and weights.

A GGUF file carries everything: hyper-parameters, the tokenizer and chat template, and weights
that are mostly quantized (Q4_0, Q4_1, Q8_0, K-quants, ...). transformers converts the
metadata to a config and a fast tokenizer, which takes seconds (a 49k-token BPE is rebuilt in
Python), so the result is saved once per file in a cache folder (`GALLEY_CACHE_DIR`, default
`~/.cache/galley`) and later starts read plain HF files. Weights are read memory-mapped (a
walk of the header that skips the tokenizer's arrays, `read_tensors`) and de-quantized tensor by
tensor with the `gguf` package's vectorised numpy kernels into the HF names our loader fuses,
undoing llama.cpp's rotary permutation of q/k for Llama models.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import structlog
import torch

from engine.block_panels import FORMATS, QuantBlocks, from_gguf, panel_bytes_per_weight
from engine.load_progress import LoadProgress
from engine.quantization import Int4Groups

log = structlog.get_logger(__name__)

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
# metadata value types (GGUF spec): fixed-size scalars by struct code; 8 is a string, 9 an array
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
GGUF_STRING, GGUF_ARRAY = 8, 9
GGUF_BLOCK = 32  # elements per scale in Q4_0, Q4_1, Q8_0 and Q4_K's sub-blocks
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
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
}
# a mixture's experts, stacked in one 3-D tensor per linear ([experts, rows, columns]), split per expert
EXPERT_TENSORS = {"ffn_gate_exps": "mlp.experts.{}.gate_proj", "ffn_up_exps": "mlp.experts.{}.up_proj",
                  "ffn_down_exps": "mlp.experts.{}.down_proj"}
# where an architecture's converter stores a fused linear under its own name (Phi-3's gate/up is `ffn_up`)
ARCH_LAYER_TENSORS = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
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
    try:
        os.replace(tmp, folder)  # atomic: a half-written folder is never taken for a converted one
    except OSError:  # another process converted the same file first (a non-empty folder is not replaced)
        if not (folder / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def read_weights(gguf_file: Path, hf_config, int4_blocks: bool = False, blocks: bool = False,
                 progress: LoadProgress | None = None) -> dict[str, torch.Tensor | Int4Groups | QuantBlocks]:
    """The file's tensors under HF names, de-quantized to float32; with `int4_blocks`, the linears'
    Q4_0/Q4_1/Q4_K tensors as their 4-bit codes and per-32 scales instead (exact, for int4); with
    `blocks`, the linears' and the embedding's tensors of `engine.block_panels.FORMATS` as they are.
    `progress` advances by the file's bytes (a tensor's de-quantizing time follows its size)."""
    arch, tensors = read_tensors(gguf_file)
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    out: dict[str, torch.Tensor | Int4Groups | QuantBlocks] = {}
    total_bytes, done_bytes = sum(t.n_bytes for t in tensors), 0
    for i, tensor in enumerate(tensors):
        if progress is not None:
            progress.advance(done_bytes, total_bytes, tensors=f"{i}/{len(tensors)}")
        done_bytes += tensor.n_bytes
        if experts := expert_names(tensor.name):  # each expert's slice, as a 2-D tensor of its own
            out.update((name, weight_of(data, tensor.tensor_type, name, int4_blocks, blocks))
                       for name, data in zip(experts(len(tensor.data)), tensor.data))
            continue
        name = hf_name(tensor.name, arch)
        if name is None:
            log.warning("skipping an unknown GGUF tensor", tensor=tensor.name)
            continue
        weight = weight_of(tensor.data, tensor.tensor_type, name, int4_blocks, blocks)
        if arch in PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            num_heads = heads if "q_proj" in name else kv_heads
            weight = (weight.map_rows(partial(unpermute, num_heads=num_heads))
                      if isinstance(weight, Int4Groups | QuantBlocks) else unpermute(weight, num_heads))
        out[name] = weight
    if progress is not None:
        progress.advance(total_bytes, total_bytes, tensors=f"{len(tensors)}/{len(tensors)}")
    return out


def weight_of(data: np.ndarray, qtype, name: str, int4_blocks: bool,
              blocks: bool) -> torch.Tensor | Int4Groups | QuantBlocks:
    """One 2-D tensor of the file under its HF `name`: codes or blocks where asked and the type allows,
    else de-quantized to float32."""
    from gguf.quants import dequantize

    weight = None
    if int4_blocks and name.endswith(("_proj.weight", "lm_head.weight")):
        weight = int4_groups(data, qtype.name)
    elif blocks and name.endswith(("_proj.weight", "lm_head.weight", "embed_tokens.weight")):
        weight = from_gguf(data, qtype.name)
    if weight is None:
        array = np.ascontiguousarray(dequantize(data, qtype), dtype=np.float32)
        weight = torch.from_numpy(array if array.flags.writeable else array.copy())  # F32 tensors are the mmap
    return weight


def expert_names(gguf_name: str):
    """For a stacked experts tensor (`blk.N.ffn_up_exps.weight`), a function of the number of experts
    giving each one's HF name; None for any other tensor."""
    base, _, suffix = gguf_name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match is None or match.group(2) not in EXPERT_TENSORS:
        return None
    template = f"model.layers.{match.group(1)}.{EXPERT_TENSORS[match.group(2)]}.{suffix}"
    return lambda count: [template.format(e) for e in range(count)]


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    n_bytes: int
    data: np.ndarray  # a view of the memory-mapped file: [rows..., bytes per row] for quantized types


def loaded_bytes(gguf_file: Path, keep_blocks: bool = True) -> int:
    """What the file's tensors take once loaded, a pre-load memory estimate from the header walk alone
    (no weights read): as the kernels' block panels for the types kept as blocks (`keep_blocks`, the
    default on CPU), else de-quantized to float32 (a Q4 file grows ~7x)."""
    from gguf import GGML_QUANT_SIZES

    _, tensors = read_tensors(gguf_file)
    total = 0.0
    for t in tensors:
        block_size, type_size = GGML_QUANT_SIZES[t.tensor_type]
        elements = t.n_bytes // type_size * block_size
        kept = keep_blocks and t.tensor_type.name in FORMATS
        total += elements * (panel_bytes_per_weight(t.tensor_type.name) if kept else 4)
    return int(total)


def read_tensors(gguf_file: Path) -> tuple[str, list[GGUFTensor]]:
    """The file's architecture and tensors, memory-mapped. Why not `gguf.GGUFReader`: it parses every
    metadata array element into numpy views (SmolLM2's 49k-token vocabulary and merges: 3.5 s of a
    7.6 s load here); this walks past them with struct and reads only what the weights need."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    # a plain ndarray over the map: np.memmap views cost a Python hook per slice in gguf's kernels
    mm = np.memmap(gguf_file, dtype=np.uint8, mode="r").view(np.ndarray)
    buf = memoryview(mm)
    magic, version, num_tensors, num_fields = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != GGUF_MAGIC or version not in (2, 3):
        raise ValueError(f"{gguf_file}: not a little-endian GGUF v2/v3 file (version {version})")
    offset, fields = 24, {}
    for _ in range(num_fields):
        key, offset = read_string(buf, offset)
        (value_type,), offset = struct.unpack_from("<I", buf, offset), offset + 4
        value, offset = read_value(buf, offset, value_type)
        if key in ("general.architecture", "general.alignment"):
            fields[key] = value
    infos = []
    for _ in range(num_tensors):
        name, offset = read_string(buf, offset)
        (num_dims,) = struct.unpack_from("<I", buf, offset)
        dims = struct.unpack_from(f"<{num_dims}Q", buf, offset + 4)
        type_id, data_offset = struct.unpack_from("<IQ", buf, offset + 4 + 8 * num_dims)
        offset += 4 + 8 * num_dims + 12
        infos.append((name, dims, GGMLQuantizationType(type_id), data_offset))
    alignment = int(fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    start = -(-offset // alignment) * alignment  # tensor data begins at the next aligned offset
    tensors = []
    for name, dims, qtype, data_offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        shape, n_bytes = tuple(reversed(dims)), int(np.prod(dims)) * type_size // block_size
        raw = mm[start + data_offset:start + data_offset + n_bytes]
        if qtype.name in ("F32", "F16"):
            data = raw.view(np.float32 if qtype.name == "F32" else np.float16).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
        tensors.append(GGUFTensor(name, qtype, n_bytes, data))
    return fields["general.architecture"], tensors


def read_string(buf: memoryview, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, offset)
    return bytes(buf[offset + 8:offset + 8 + length]).decode(), offset + 8 + length


def read_value(buf: memoryview, offset: int, value_type: int) -> tuple[object, int]:
    """A metadata value and the offset after it; arrays are skipped (None), strings walked past."""
    if value_type == GGUF_STRING:
        return read_string(buf, offset)
    if value_type in GGUF_SCALARS:
        code = "<" + GGUF_SCALARS[value_type]
        return struct.unpack_from(code, buf, offset)[0], offset + struct.calcsize(code)
    if value_type != GGUF_ARRAY:
        raise ValueError(f"unknown GGUF metadata type {value_type} at byte {offset}")
    item_type, count = struct.unpack_from("<IQ", buf, offset)
    offset += 12
    if item_type in GGUF_SCALARS:
        return None, offset + count * struct.calcsize("<" + GGUF_SCALARS[item_type])
    if item_type == GGUF_STRING:  # the vocabulary and merges: tens of thousands, skipped undecoded
        for _ in range(count):
            offset += 8 + struct.unpack_from("<Q", buf, offset)[0]
        return None, offset
    for _ in range(count):
        _, offset = read_value(buf, offset, item_type)
    return None, offset


def int4_groups(data: np.ndarray, qtype: str) -> Int4Groups | None:
    """A Q4_0, Q4_1 or Q4_K tensor ([N, bytes per row] blocks) as int4 codes in groups of 32 with
    w = (q - 8) * scale + zero; None for other types (they are de-quantized and quantized again)."""
    blocks = from_gguf(data, qtype)
    if blocks is None or blocks.bits != 4:
        return None
    return Int4Groups(blocks.codes, blocks.scale, blocks.min + 8 * blocks.scale)


def hf_name(gguf_name: str, arch: str = "") -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    names = {**LAYER_TENSORS, **ARCH_LAYER_TENSORS.get(arch, {})}
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{suffix}"
    return None


def unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (rotary halves interleaved per head) back to HF's."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
