"""Any Hugging Face decoder (what `AutoModelForCausalLM` builds) over galley's paged KV cache: the generic backend.

The model runs its own modelling code from `transformers`; only attention is ours. We register
`engine.attention.paged_attention` as an attention implementation (transformers'
`AttentionInterface`, as vLLM's Transformers backend does) and feed the model the runner's packed
step as one sequence: `input_ids` [1, num_tokens], `position_ids` [1, num_tokens] (rotary
embeddings come out right per token), and the step's KV caches and metadata as an attention
keyword that the model's layers pass through to our function. A custom implementation gets no
mask from transformers (`masking_utils` skips it), so nothing of size num_tokens² is built; our
metadata knows which tokens see which. `logits_to_keep` takes the indices of the tokens that
sample, so the LM head runs on those rows only.

Logit soft-capping (Gemma 2) takes a slower exact path (`engine.attention.softcapped_attention`).
Never served wrong: a feature our attention does not compute (attention sinks, chunked attention,
a layer that is not attention) raises `UnsupportedModel`, and `check_against_reference`
runs a short prompt through the paged path (a prefill, a chunk over a cached prefix, a decode)
and through the model's own eager attention at load: a model whose logits differ is refused there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel

from engine.attention import AttentionMetadata, build_metadata, paged_attention, softcapped_attention
from engine.lora import AdapterError, LoraStep, LoraWeights, PeftAdapter, check_shape, stack_parts
from engine.packed_linear import linear

ATTENTION = "galley_paged"  # the attn_implementation name the model is loaded with
PROBE = "galley_probe"  # records each layer's key and value shapes (and attends to nothing)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
UNSUPPORTED_ATTENTION_KWARGS = {"s_aux": "attention sinks", "sinks": "attention sinks"}


def image_runs(token_ids: list[int], image_token_id: int) -> tuple[tuple[int, int], ...]:
    """The runs [a, b) of consecutive image tokens: one image's tokens each (HF's `block_sequence_ids`)."""
    runs: list[list[int]] = []
    for i, token in enumerate(token_ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return tuple((a, b) for a, b in runs)


# How a vision-language family's prompt tokens attend, as bidirectional spans of a prompt; the load's
# check with an image picks the first rule under which the paged path gives the model's own logits.
IMAGE_ATTENTION: dict[str, Callable[[list[int], int], tuple[tuple[int, int], ...]]] = {
    "causal": lambda ids, image_token_id: (),
    "both ways within each image": image_runs,  # Gemma 3
    "both ways within the prompt": lambda ids, image_token_id: ((0, len(ids)),),  # PaliGemma's prefix
}


class UnsupportedModel(ValueError):
    """A feature of the model that the paged attention does not compute; the message names it."""


@dataclass(frozen=True)
class GenericShape:
    """What the runner and the engine read of a model (the names of `DecoderShape`'s fields)."""

    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_window: int | None = None  # per layer, from each attention call


def language_model(hf_model: PreTrainedModel) -> PreTrainedModel:
    """The part our attention serves: a vision-language model's text model (its vision encoder keeps
    its own attention), else the model itself."""
    inner = getattr(hf_model, "model", None)
    return getattr(inner, "language_model", None) or getattr(inner, "text_model", None) or hf_model


def image_token_id(hf_model: PreTrainedModel) -> int | None:
    """The placeholder token a vision-language model's image features replace; None for a text model."""
    if not hasattr(getattr(hf_model, "model", None), "get_image_features"):
        return None
    config = hf_model.config
    return getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)


def probe_shape(hf_model: PreTrainedModel) -> GenericShape:
    """The KV cache's shape as the model's attention layers see it, from one token through them
    (configs name their head counts in too many ways to read them reliably)."""
    seen: dict[int, tuple[int, ...]] = {}
    language_model(hf_model).set_attn_implementation(PROBE)
    try:
        with torch.inference_mode():
            hf_model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=hf_model.device), use_cache=False,
                     galley_probe=seen)
    finally:
        language_model(hf_model).set_attn_implementation(ATTENTION)
    name, config = type(hf_model).__name__, hf_model.config.get_text_config()
    shapes = set(seen.values())
    if not seen or sorted(seen) != list(range(len(seen))):
        raise UnsupportedModel(f"{name}'s attention layers do not number themselves 0..n-1 (layer_idx)")
    if len(shapes) != 1:
        raise UnsupportedModel(f"{name}'s layers cache keys and values of different shapes: {sorted(shapes)}")
    [(num_kv_heads, key_dim, value_dim)] = shapes
    if key_dim != value_dim:
        raise UnsupportedModel(f"{name} has keys of {key_dim} and values of {value_dim} features per head")
    return GenericShape(
        vocab_size=config.vocab_size,
        num_layers=len(seen),
        num_kv_heads=num_kv_heads,
        head_dim=key_dim,
        max_position_embeddings=getattr(config, "max_position_embeddings", None) or 2048,
    )


def probe_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, galley_probe: dict | None = None, **kwargs) -> tuple[torch.Tensor, Any]:
    if galley_probe is None or getattr(module, "layer_idx", None) is None:
        raise UnsupportedModel(f"{type(module).__name__} does not pass attention keywords through, or has no "
                               "layer_idx")
    galley_probe[module.layer_idx] = (key.shape[1], key.shape[-1], value.shape[-1])
    return torch.zeros_like(query).transpose(1, 2), None  # only the shapes matter


@dataclass
class Step:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                            galley_step: Step | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, heads, tokens, head_dim], key/value [1, kv_heads,
    tokens, head_dim] (rotary applied); returns [1, tokens, heads, head_dim]."""
    for name, feature in UNSUPPORTED_ATTENTION_KWARGS.items():
        if kwargs.get(name) is not None or (name == "sinks" and getattr(module, "sinks", None) is not None):
            raise UnsupportedModel(f"{feature} ({type(module).__name__}) is not supported by the paged attention")
    if galley_step is None:
        raise UnsupportedModel(f"{type(module).__name__} does not pass attention keywords through to its "
                               "attention function")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise UnsupportedModel(f"{type(module).__name__} has no layer_idx, so its KV cache cannot be found")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    k_cache, v_cache = galley_step.kv_caches[layer]
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    meta = galley_step.meta.windowed(window)
    if kwargs.get("softcap") is not None:  # Gemma 2: explicit scores, capped
        out = softcapped_attention(q, k, v, k_cache, v_cache, meta, scale, kwargs["softcap"])
    else:
        out = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    return out[None], None


AttentionInterface.register(ATTENTION, paged_attention_forward)
AttentionInterface.register(PROBE, probe_attention)


class FlatLinear(nn.Module):
    """A 2-D linear of ours (packed panels, int8, int4) called with transformers' [batch, tokens,
    features] activations; it gets the step's C++ kernels from `step_kernels` where it takes them."""

    def __init__(self, inner: nn.Module, step_kernels: dict[str, Any]) -> None:
        super().__init__()
        self.inner = inner
        self.step_kernels = step_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(self.inner, x.reshape(-1, x.shape[-1]), self.step_kernels.get("ops"))
        return out.view(*x.shape[:-1], out.shape[-1])


def flatten_linears(model: nn.Module, replaced: tuple[type, ...], step_kernels: dict[str, Any]) -> None:
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, replaced)]:
        model.set_submodule(name, FlatLinear(module, step_kernels))


class GenericCausalLM(nn.Module):
    """The runner's model interface (`shape`, forward over a packed step) around a transformers model."""

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__()
        self.hf = hf_model
        self.shape = probe_shape(hf_model)
        self.step_kernels: dict[str, Any] = {}  # FlatLinear reads the step's kernels here
        self.lora: LoraStep | None = None  # the step's adapters, read by the hooks on the linears they adapt
        self.lora_hooked: set[str] = set()
        self.image_token_id = image_token_id(hf_model)
        # what get_image_features takes of a processor's arrays (not its token types), read once
        self.image_args = (frozenset(inspect.signature(hf_model.model.get_image_features).parameters)
                           if self.image_token_id is not None else frozenset())
        # a multi-axis rotary's position arguments (Qwen2-VL and kin: see `prompt_positions`), else None
        rope_index = getattr(hf_model.model, "get_rope_index", None) if self.image_token_id is not None else None
        self.rope_args = (frozenset(inspect.signature(rope_index).parameters) - {"input_ids", "mm_token_type_ids",
                          "attention_mask"} if rope_index is not None else None)
        self.processor: Any = None  # a vision-language model's (set by the loader)
        self.image_attention = "causal"  # a key of IMAGE_ATTENTION: the rule its load's check found
        self.images_refused = ""  # or why it serves text only

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens], or [3, num_tokens] for a multi-axis rotary
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_samples]
        lora: LoraStep | None = None,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,  # (rows of the step, their image features)
    ) -> torch.Tensor:  # [num_samples, vocab_size] float32
        self.step_kernels["ops"] = meta.kernels
        self.lora = lora
        tokens: dict[str, torch.Tensor] = {"input_ids": input_ids[None]}
        if images is not None:  # as the model's own forward merges them: embeddings, image rows replaced
            rows, features = images
            embeds = self.hf.get_input_embeddings()(input_ids)
            tokens = {"inputs_embeds": embeds.index_copy(0, rows, features.to(embeds.dtype))[None]}
        try:
            out = self.hf(**tokens, position_ids=positions.unsqueeze(-2), use_cache=False,
                          logits_to_keep=logits_indices, galley_step=Step(kv_caches, meta))
        finally:
            self.lora = None
        return out.logits[0].float()

    def image_features(self, arrays: dict[str, Any]) -> torch.Tensor:
        """A prompt's image features, one row per image token, from its processor's arrays (numpy), through
        the model's own vision encoder and projector (`get_image_features`, as its forward calls it)."""
        device = self.hf.device
        kwargs = {name: torch.from_numpy(array).to(device) for name, array in arrays.items() if name in self.image_args}
        kwargs["pixel_values"] = kwargs["pixel_values"].to(self.hf.dtype)
        features = self.hf.model.get_image_features(**kwargs, return_dict=True).pooler_output
        if isinstance(features, (list, tuple)):
            features = torch.cat(list(features))
        return features.reshape(-1, features.shape[-1])

    def prompt_positions(self, token_ids: list[int], arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, int]:
        """A multi-axis rotary's positions for a prompt with images, [3, num_tokens]: an image token's
        (time, row, column) in its image's grid, a text token's next position on all three axes, from
        the model's own `get_rope_index`; and the offset from index to position of every token after
        the prompt (negative: an image takes fewer positions than tokens)."""
        ids = torch.tensor(token_ids)[None]
        kinds = (ids == self.image_token_id).int()  # text 0, image 1, video 2: as the processor marks them
        if (video := getattr(self.hf.config, "video_token_id", None)) is not None:
            kinds[ids == video] = 2
        kwargs = {name: torch.from_numpy(array) for name, array in arrays.items() if name in self.rope_args}
        positions, offset = self.hf.model.get_rope_index(ids, mm_token_type_ids=kinds, **kwargs)
        return positions[:, 0].numpy(), int(offset)

    def bidirectional_spans(self, prompt: list[int]) -> tuple[tuple[int, int], ...]:
        """The runs of a prompt with images whose tokens see each other both ways (`IMAGE_ATTENTION`)."""
        return IMAGE_ATTENTION[self.image_attention](prompt, self.image_token_id)

    def lora_weights(self, adapter: PeftAdapter, device: torch.device, dtype: torch.dtype) -> dict[str, LoraWeights]:
        """An adapter's weights keyed by the transformers module each adapts (PEFT's own names), each such
        linear given a forward hook that adds the step's deltas (once per module, whatever the adapter)."""
        weights = {}
        for name, (a, b, scale) in adapter.modules.items():
            try:
                module = self.hf.get_submodule(name)
            except AttributeError:
                raise AdapterError(f"the adapter adapts {name}, which {type(self.hf).__name__} does not have") from None
            if not isinstance(module, (nn.Linear, FlatLinear)):
                raise AdapterError(f"the adapter adapts {name}, a {type(module).__name__}; galley adapts linear "
                                   "layers only")
            inner = module.inner if isinstance(module, FlatLinear) else module
            check_shape(name, a, b, inner.in_features, inner.out_features)
            weights[name] = stack_parts([(slice(0, inner.out_features), a, b, scale)], device, dtype)
        for name in weights.keys() - self.lora_hooked:
            self.hf.get_submodule(name).register_forward_hook(partial(self._add_lora, name))
            self.lora_hooked.add(name)
        return weights

    def _add_lora(self, name: str, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if self.lora is None:
            return None
        flat = output.reshape(-1, output.shape[-1])
        return self.lora.add(flat, args[0].reshape(-1, args[0].shape[-1]), name).view(output.shape)


def check_supported(model_class: type[PreTrainedModel], hf_config) -> None:
    """UnsupportedModel naming what the paged attention cannot serve, seen from the class and config
    alone: before any weight is read."""
    config, name = hf_config.get_text_config(), model_class.__name__
    if getattr(hf_config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{name} is an encoder-decoder model")
    if not model_class._supports_attention_backend:
        raise UnsupportedModel(f"{name}'s modelling code does not take a pluggable attention implementation")
    kinds = set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES
    if kinds:
        raise UnsupportedModel(f"{name} has layers of kind {', '.join(sorted(kinds))}; only full and sliding-window "
                               "attention layers are supported")
    if chunk := getattr(config, "attention_chunk_size", None):
        raise UnsupportedModel(f"{name} uses chunked attention (attention_chunk_size={chunk}), which the paged "
                               "attention does not compute")


def empty_caches(shape: GenericShape, num_slots: int, device: torch.device,
                 dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed key and value caches of `num_slots` slots per layer, for a check's own prompts."""
    return [(torch.zeros(num_slots, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype),
             torch.zeros(num_slots, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype))
            for _ in range(shape.num_layers)]


def agrees(paged: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype, low_precision: bool) -> bool:
    """The paged logits equal the reference's to float32's precision (relative to the largest logit), or
    bfloat16's where the weights or `low_precision` say so: quantized linears compute in bfloat16, so the
    two paths' last-bit differences in attention can round apart (a Gemma 3 in int4 differed by 0.016)."""
    tolerance = 1e-3 if dtype == torch.float32 and not low_precision else 5e-2
    return (paged - reference).abs().max().item() <= tolerance * reference.abs().max().clamp(min=1.0).item()


@torch.inference_mode()
def check_against_reference(model: GenericCausalLM, device: torch.device, dtype: torch.dtype,
                            block_size: int = 16, num_tokens: int = 24, low_precision: bool = False) -> None:
    """UnsupportedModel unless a short prompt gives the same logits through the paged path (a
    prefill, a chunk over the cached prefix, a decode) as through the model's own eager attention
    (the reference every transformers model has: soft-capping, sinks and all), to float32's
    precision, or bfloat16's where the weights or `low_precision` (quantized linears) say so."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.shape.vocab_size, (num_tokens,), generator=gen).to(device)
    hf = model.hf
    language_model(hf).set_attn_implementation("eager")
    try:
        reference = hf(input_ids=ids[None], use_cache=False).logits[0].float()
    finally:
        language_model(hf).set_attn_implementation(ATTENTION)
    num_blocks = -(-num_tokens // block_size)
    caches = empty_caches(model.shape, num_blocks * block_size, device, dtype)
    table = list(range(num_blocks))
    first, second = num_tokens // 2, num_tokens - 1  # a prefill, a chunk after it, then one decode
    rows = []
    for start, end in ((0, first), (first, second), (second, num_tokens)):
        decode = end - start == 1
        meta = build_metadata([(table, end)] if decode else [], [] if decode else [(table, start, end - start)],
                              list(range(start, end)), block_size, None, device)
        positions = torch.arange(start, end, device=device)
        rows.append(model(ids[start:end], positions, caches, meta, torch.arange(end - start, device=device)))
    paged = torch.cat(rows)
    if not agrees(paged, reference, dtype, low_precision):
        worst = (paged - reference).abs().max().item()
        raise UnsupportedModel(f"{type(hf).__name__} gives other logits through the paged attention than through its "
                               f"own (max difference {worst:.3g}): some feature of its attention is not supported")


@torch.inference_mode()
def check_images_against_reference(model: GenericCausalLM, processor, device: torch.device, dtype: torch.dtype,
                                   block_size: int = 16, low_precision: bool = False) -> None:
    """UnsupportedModel unless a prompt with an image gives the same logits through the paged path
    (image features merged into one prefill, positions 0..n-1 or the multi-axis rotary's) as through
    the model's own forward with the image, under one of `IMAGE_ATTENTION`'s rules (kept as the
    model's `image_attention`): what a family does otherwise with image tokens shows here, at load."""
    from PIL import Image

    chat = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (64, 48), (90, 140, 200))},
                                         {"type": "text", "text": "What is in the picture?"}]}]
    try:
        encoded = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                return_tensors="np")
    except Exception as exc:  # no chat template, or one that cannot show an image
        raise UnsupportedModel(f"its processor cannot render a chat with an image: {exc}") from exc
    ids = torch.from_numpy(encoded["input_ids"][0]).to(device)
    arrays = {name: value for name, value in encoded.items() if name not in ("input_ids", "attention_mask")}
    hf = model.hf
    language_model(hf).set_attn_implementation("eager")
    try:
        tensors = {name: torch.from_numpy(value).to(device) for name, value in encoded.items()}
        tensors["pixel_values"] = tensors["pixel_values"].to(dtype)
        reference = hf(**tensors, use_cache=False).logits[0].float()
    finally:
        language_model(hf).set_attn_implementation(ATTENTION)
    n = ids.shape[0]
    num_blocks = -(-n // block_size)
    rows = (ids == model.image_token_id).nonzero().flatten()
    features = model.image_features(arrays)
    positions = (torch.arange(n) if model.rope_args is None
                 else torch.from_numpy(model.prompt_positions(ids.tolist(), arrays)[0])).to(device)
    worst = []
    for rule, spans_of in IMAGE_ATTENTION.items():  # one prefill under each rule, until one gives HF's logits
        caches = empty_caches(model.shape, num_blocks * block_size, device, dtype)
        meta = build_metadata([], [(list(range(num_blocks)), 0, n)], list(range(n)), block_size, None, device,
                              prefill_spans=[spans_of(ids.tolist(), model.image_token_id)])
        paged = model(ids, positions, caches, meta, torch.arange(n, device=device), images=(rows, features))
        if agrees(paged, reference, dtype, low_precision):
            model.image_attention = rule
            return
        worst.append(f"{rule}: {(paged - reference).abs().max().item():.3g}")
    raise UnsupportedModel(f"{type(hf).__name__} gives other logits for a prompt with an image through the paged "
                           f"attention than through its own forward (max difference {', '.join(worst)}): its image "
                           "tokens attend or are positioned in a way galley does not compute yet")
