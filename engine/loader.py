"""Loads an HF model folder (or hub id), or a GGUF file (`engine.gguf`), into a decoder the runner
steps: config, tokenizer and weights. Two backends. Native (`engine.models.llama`, the families of
`SUPPORTED_ARCHITECTURES`, mixtures of experts among them): reads safetensors (sharded or not) or PyTorch
`.bin` checkpoints and fuses q/k/v and gate/up into its layout, for the fused CPU kernels. Generic
(`engine.models.generic`): any other causal LM that transformers' `AutoModelForCausalLM` builds, with its own
modelling code over our paged attention. What neither can serve fails here, at load, naming why."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from engine.block_panels import BlockEmbedding, QuantBlocks
from engine.cpu_kernels import CPU_KERNELS
from engine.gguf import GGUF_BLOCK, find_gguf, hf_folder_for, is_gguf_file, read_weights
from engine.load_progress import LoadProgress, ProgressCallback
from engine.models.gemma3 import GEMMA3_ARCHITECTURES, Gemma3ForCausalLM, gemma3_refusal
from engine.models.layout import fuse_weights
from engine.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM, native_refusal
from engine.packed_linear import PackedLinear, can_pack, pack_linears
from engine.processors import load_processor
from engine.quantization import Int4Groups, Int4Linear, Int8Linear, QuantizationSpec, quantize_model

log = structlog.get_logger(__name__)

if TYPE_CHECKING:
    from engine.models.generic import GenericCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = ("auto", "native", "generic")  # auto: native where the family has it, else generic


class ModelLoadError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    path: Path
    model: LlamaForCausalLM | GenericCausalLM  # GenericCausalLM: engine.models.generic
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    generation_config: dict[str, Any] = field(default_factory=dict)  # what generation_config.json sets
    architecture: str = ""  # config.json's, e.g. LlamaForCausalLM
    family: str = ""  # its model_type, e.g. llama, qwen3_moe, gemma3_text
    backend: str = "native"  # native | generic
    processor: Any = None  # a vision-language model's processor (transformers' AutoProcessor): images -> arrays
    images_refused: str = ""  # a vision-language model served text only: why its images are refused


def package_path(source: str) -> Path:
    """`pkg:PACKAGE/SUB`: a file or folder inside an installed package, found without importing it
    (a package may ship a model yet fail to import without its own, unneeded, dependencies)."""
    package, _, sub = source.removeprefix("pkg:").partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model source {source!r}: package {package!r} is not installed")
    path = Path(spec.submodule_search_locations[0]) / sub
    if not path.exists():
        raise ModelLoadError(f"model source {source!r}: {path} does not exist")
    return path


def resolve_model_path(source: str) -> Path:
    """A local folder or GGUF file as is, `pkg:` inside a package; anything else is treated as a
    hub id resolved by huggingface_hub."""
    if source.startswith("pkg:"):
        return package_path(source)
    path = Path(source).expanduser()
    if path.is_dir() or is_gguf_file(path):
        return path.resolve()
    if path.exists() or source.startswith((".", "/", "~")):
        raise ModelLoadError(f"model folder {source!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.model", "*.txt"]))
    except Exception as exc:
        raise ModelLoadError(f"could not fetch {source!r} from the hub: {exc}") from exc


def check_model_source(source: str) -> None:
    """ModelLoadError unless `source` names something to load: a local folder with a config.json, or
    a hub id in the local Hugging Face cache or on the hub (asked, 10 s at most). Nothing is downloaded,
    so a registration can refuse a source at once instead of failing every later request."""
    if source.startswith("pkg:"):
        package_path(source)
        return
    path = Path(source).expanduser()
    if is_gguf_file(path):
        return
    if path.is_dir():
        if not (path / "config.json").is_file() and find_gguf(path) is None:
            raise ModelLoadError(f"model folder {source!r} has no config.json (not a Hugging Face model folder) "
                                 "and no single .gguf file")
        return
    if path.exists() or source.startswith((".", "/", "~")):
        raise ModelLoadError(f"model folder {source!r} does not exist")
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, RepositoryNotFoundError

    try:
        if isinstance(try_to_load_from_cache(source, "config.json"), str):
            return
        HfApi().model_info(source, timeout=10)
    except HFValidationError as exc:
        raise ModelLoadError(f"{source!r} is neither a local model folder nor a hub id: {exc}") from exc
    except RepositoryNotFoundError as exc:
        raise ModelLoadError(f"{source!r} is not a local folder, and the hub has no such model") from exc
    except Exception as exc:
        raise ModelLoadError(f"{source!r} is not a local folder nor in the Hugging Face cache, and the hub could "
                             f"not be asked about it ({type(exc).__name__})") from exc


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ModelLoadError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def read_checkpoint(path: Path, progress: LoadProgress | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors (memory-mapped, `progress` per tensor) or `.bin` files."""
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        handles = [safe_open(file, framework="pt") for file in files]
        num_tensors = sum(len(handle.keys()) for handle in handles)
        for handle in handles:
            for name in handle.keys():
                if progress is not None:
                    progress.advance(len(tensors), num_tensors, tensors=f"{len(tensors)}/{num_tensors}")
                tensors[name] = handle.get_tensor(name)
    else:
        files = sorted(path.glob("pytorch_model*.bin"))
        if not files:
            raise ModelLoadError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
        for i, file in enumerate(files):
            if progress is not None:
                progress.advance(i, len(files), files=f"{i}/{len(files)}")
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    if progress is not None:
        progress.advance(1, 1, tensors=len(tensors))
    return tensors


def eos_token_ids(path: Path, hf_config, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    try:
        sources.append(GenerationConfig.from_pretrained(path).eos_token_id)
    except OSError:
        pass  # no generation_config.json
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)


def generation_config(path: Path) -> dict[str, Any]:
    """The keys `generation_config.json` sets (not `GenerationConfig`'s own defaults); {} without one."""
    try:
        return json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}


def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The longest token's spelling: no token covers more characters of input text, so a prompt of
    more than `max_model_len * max_token_chars` characters cannot fit the context (checked before
    tokenizing it). Byte-level and byte-fallback spellings are at least as long as the text they stand for."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def load_model(source: str, device: str = "cpu", dtype: str = "auto",
               quantization: str | QuantizationSpec | None = None,
               on_progress: ProgressCallback | None = None, backend: str = "auto") -> LoadedModel:
    """A Hugging Face folder or hub id, or a GGUF file (or a folder holding one: weights
    de-quantized to `dtype`, config and tokenizer from its metadata). `quantization` int8 | int4:
    the linears weight-only quantized (`engine.quantization`; GGUF 4-bit blocks kept as they are
    for int4 groups of 32); the rest stays in `dtype`. `on_progress(phase, fraction)` is called
    from this thread as the load moves (`engine.load_progress`), last with ("loaded", 1.0).
    `backend`: one of BACKENDS."""
    try:
        spec = QuantizationSpec.parse(quantization)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    progress = LoadProgress(source, on_progress)
    progress.enter("reading metadata")
    gguf_file = find_gguf(resolve_model_path(source))
    path = hf_folder_for(gguf_file) if gguf_file else resolve_model_path(source)
    hf_config = AutoConfig.from_pretrained(path)
    arch = (getattr(hf_config, "architectures", None) or ["unknown"])[0]
    if backend not in BACKENDS:
        raise ModelLoadError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    refusal = native_refusal(arch, hf_config)
    if arch in GEMMA3_ARCHITECTURES and not refusal:
        refusal = gemma3_refusal(hf_config) or ("a GGUF file's Gemma 3 tensors are not mapped natively"
                                                if gguf_file else None)
    if backend == "native" and refusal:
        raise ModelLoadError(f"{source!r} has no native backend: {refusal} (backend generic serves it)")
    torch_device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if backend == "generic" or refusal:
        model = load_generic(source, path, gguf_file, hf_config, spec, torch_device, torch_dtype, progress)
        return finish_load(path, model, hf_config, torch_dtype, torch_device, progress, arch, "generic")
    with torch.device("meta"):
        model = (Gemma3ForCausalLM if arch in GEMMA3_ARCHITECTURES else LlamaForCausalLM)(hf_config)
    int4_blocks = spec is not None and spec.gguf_blocks and spec.group_size == GGUF_BLOCK
    # the file's own blocks unless told "none" or quantizing; the CPU float32 kernels read them (where
    # they failed to build, the torch path would de-quantize every block at every step: floats instead)
    block_kernels = can_pack(torch_device, torch_dtype) and not CPU_KERNELS.failed
    keep_blocks = quantization is None and block_kernels
    quantized_blocks = spec is not None and spec.block_kernels and block_kernels  # int8/int4 on the block kernels
    progress.enter("reading weights")
    checkpoint = (read_weights(gguf_file, hf_config, int4_blocks=int4_blocks, blocks=keep_blocks, progress=progress)
                  if gguf_file else read_checkpoint(path, progress))
    weights = fuse_weights(checkpoint, model.shape.num_layers, model.shape.tie_word_embeddings)
    blocks = {name: weights.pop(name) for name, w in list(weights.items()) if isinstance(w, QuantBlocks)}
    int4_codes: dict[str, Int4Groups] = {}
    for name, weight in list(weights.items()):
        if isinstance(weight, Int4Groups):  # codes for int4 linears; exact floats for the rest
            if spec is not None and spec.method_for(name.removesuffix(".weight"), experts=quantized_blocks) == "int4":
                int4_codes[name.removesuffix(".weight")] = weights.pop(name)
            else:
                weights[name] = weight.dequantize(rounded=False)
    weights = {name: t.to(device=torch_device, dtype=torch_dtype) for name, t in weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [name for name in missing if name.removesuffix(".weight") not in int4_codes and name not in blocks]
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint of {source!r} does not fit its config: missing {missing}, unexpected {unexpected}"
        )
    if model.shape.tie_word_embeddings and "lm_head.weight" not in blocks:
        model.lm_head.weight = model.embed_tokens.weight
    place_blocks(model, blocks, torch_device)
    model.build_rotary(hf_config, torch_device)
    if spec is not None:
        progress.enter("quantizing")
        quantize_model(model, spec, prequantized=int4_codes, device=torch_device, blocks=quantized_blocks)
    if can_pack(torch_device, torch_dtype):  # what stays nn.Linear
        progress.enter("building kernels")
        pack_linears(model)
    model.eval()
    return finish_load(path, model, hf_config, torch_dtype, torch_device, progress, arch, "native")


def place_blocks(model: LlamaForCausalLM, blocks: dict[str, QuantBlocks], device: torch.device) -> None:
    """The weights kept as a GGUF file's blocks (`engine.block_panels`): linears as block panels, the
    embedding as a block table; a shape the panels do not take is de-quantized."""
    for name, weight in blocks.items():
        module_name = name.removesuffix(".weight")
        module = model.get_submodule(module_name)
        if isinstance(module, nn.Embedding):
            model.set_submodule(module_name, BlockEmbedding(weight))
        elif weight.can_pack():
            model.set_submodule(module_name, PackedLinear(module, weight))
        else:
            module.weight = nn.Parameter(weight.dequantize().to(device), requires_grad=False)


def finish_load(path: Path, model: LlamaForCausalLM | GenericCausalLM, hf_config, dtype: torch.dtype,
                device: torch.device, progress: LoadProgress, architecture: str, backend: str) -> LoadedModel:
    progress.enter("loading tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = getattr(model, "processor", None)  # a vision-language model's, loaded and checked by load_generic
    progress.enter("loaded")
    return LoadedModel(
        path=path,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(path, hf_config, tokenizer),
        max_model_len=model.shape.max_position_embeddings,
        dtype=dtype,
        device=device,
        generation_config=generation_config(path),
        architecture=architecture,
        family=getattr(hf_config, "model_type", ""),
        backend=backend,
        processor=processor,
        images_refused=getattr(model, "images_refused", ""),
    )


def load_generic(source: str, path: Path, gguf_file: Path | None, hf_config, spec: QuantizationSpec | None,
                 device: torch.device, dtype: torch.dtype, progress: LoadProgress) -> GenericCausalLM:
    """The model's own transformers class with our paged attention plugged in (`engine.models.generic`);
    GGUF files through transformers' own GGUF conversion."""
    import transformers  # the generic backend's modelling code: seconds to import
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    from engine.models.generic import (
        ATTENTION,
        GenericCausalLM,
        UnsupportedModel,
        check_against_reference,
        check_images_against_reference,
        check_supported,
        flatten_linears,
        language_model,
    )

    arch = (getattr(hf_config, "architectures", None) or ["unknown"])[0]
    vision = arch in set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values())
    if not vision and arch not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        raise ModelLoadError(f"architecture {arch} of {source!r} is not a causal language model transformers "
                             f"knows (AutoModelForCausalLM, or AutoModelForImageTextToText for vision-language "
                             f"models); native: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        check_supported(getattr(transformers, arch), hf_config)  # before reading any weight
    except UnsupportedModel as exc:
        raise ModelLoadError(f"{source!r} cannot be served: {exc}") from exc
    progress.enter("reading weights")
    where = (gguf_file.parent, {"gguf_file": gguf_file.name}) if gguf_file else (path, {})
    try:
        if vision:  # the vision encoder keeps transformers' attention; the text model gets ours. Asked for
            # by sub-config: "sdpa" for the whole model fails where the text model has none (Gemma 2's, PaliGemma 2)
            attention = {"text_config": ATTENTION} if "text_config" in hf_config.sub_configs else "sdpa"
            hf = AutoModelForImageTextToText.from_pretrained(where[0], dtype=dtype, attn_implementation=attention,
                                                             **where[1])
            language_model(hf).set_attn_implementation(ATTENTION)
        else:
            hf = AutoModelForCausalLM.from_pretrained(where[0], dtype=dtype, attn_implementation=ATTENTION,
                                                      **where[1])
        model = GenericCausalLM(hf.to(device).eval())
    except (UnsupportedModel, RuntimeError) as exc:
        raise ModelLoadError(f"{source!r} cannot be served: {exc}") from exc
    except (ValueError, OSError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"transformers could not build {arch} from {source!r}: {exc}") from exc
    text = language_model(hf) if vision else hf  # a vision encoder runs outside the step: transformers' linears
    if spec is not None:
        progress.enter("quantizing")
        quantize_model(text, spec, device=device)
    if can_pack(device, dtype):
        progress.enter("building kernels")
        pack_linears(text)
    flatten_linears(text, (PackedLinear, Int8Linear, Int4Linear), model.step_kernels)
    progress.enter("checking attention")
    try:
        check_against_reference(model, device, dtype, low_precision=spec is not None)
    except (UnsupportedModel, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"{source!r} cannot be served: {exc}") from exc
    if vision:  # and with an image, through the model's processor (kept for serving); failing that, text only
        try:
            processor = load_processor(path, arch)
            check_images_against_reference(model, processor, device, dtype, low_precision=spec is not None)
            model.processor = processor
        except (ModelLoadError, UnsupportedModel, RuntimeError, ValueError, TypeError) as exc:
            model.images_refused = str(exc)
            log.warning("serving text only: images are refused", source=source, why=str(exc))
    return model
