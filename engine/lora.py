"""LoRA adapters (PEFT's format) served over one copy of their base model's weights.

An adapter folder holds `adapter_config.json` and `adapter_model.safetensors` (never a pickle:
`.bin` adapters are refused). Each adapted linear `W` gets `x @ A.T @ B.T * scale` added to its
output, as PEFT's unmerged `LoraLayer` computes it in eval mode (no dropout): scale is
`lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA; `alpha_pattern` per module).

`read_adapter` reads and checks a folder; a model maps its modules to its own layout
(`LlamaForCausalLM.lora_weights`, `GenericCausalLM.lora_weights`); the runner holds the loaded
adapters and gives each step a `LoraStep`: the rows of the packed batch that belong to each
adapter in it. Rows of the base model (and of other adapters) get no delta, so requests to the
base and to many adapters share a step. A step's cost grows by a shrink and an expand per adapted
linear and adapter in the step, on its own rows (vLLM's punica kernels). On CPU float32 they run in
the C++ `lora_add` (inside the fused decoder layer op on the native backend), which reads each
adapter weight once a step: with many adapters in a step, that reading is most of their cost.

What PEFT can express and this does not compute is refused at load, naming it (DoRA, trained
biases, `modules_to_save`, embedding or fan-in-fan-out adapters, ...): never served wrong.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config.json keys whose non-default values change what the adapter computes, and why we refuse them
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers, as GPT-2's)",
    "modules_to_save": "modules_to_save (fully trained copies of base modules)",
    "lora_bias": "trained LoRA biases (lora_bias)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters (adapted parameters rather than modules)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}
KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter folder that cannot be served on this base; the message names why."""


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter as PEFT saved it: per adapted module (the base model's own module path, e.g.
    `model.layers.0.self_attn.q_proj`), its A [r, in], B [out, r] and scale."""

    path: Path
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    base_model: str  # adapter_config.json's base_model_name_or_path (what it was trained on; informative)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b, _ in self.modules.values())


def adapter_config(folder: Path) -> dict:
    """The folder's adapter_config.json, checked for what we cannot compute (AdapterError names it)."""
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except OSError as exc:
        raise AdapterError(f"{folder} has no {CONFIG_FILE} (not a PEFT adapter folder)") from exc
    except ValueError as exc:
        raise AdapterError(f"{folder / CONFIG_FILE} is not JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder} is a {config.get('peft_type')!r} adapter; only LoRA adapters are served")
    unsupported = [why for key, why in UNSUPPORTED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"trained biases (bias={config['bias']!r})")
    if config.get("layers_to_transform") is not None:
        unsupported.append("layers_to_transform")  # its adapted modules would be fine; refused until tested
    if unsupported:
        raise AdapterError(f"the adapter in {folder} uses {', '.join(unsupported)}, which galley does not compute")
    if not (folder / WEIGHTS_FILE).is_file():
        pickled = [p.name for p in folder.glob("*.bin")]
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE}" + (
            f" ({', '.join(pickled)} is a pickle, never loaded: convert it to safetensors)" if pickled else ""))
    return config


def check_adapter_folder(source: str) -> None:
    """AdapterError unless `source` is a folder with a LoRA adapter galley can serve (not reading its weights)."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {source!r} does not exist")
    adapter_config(folder)


def read_adapter(source: str) -> PeftAdapter:
    """The adapter's weights per module, on the CPU in their stored dtype, with their scales."""
    from safetensors.torch import load_file

    folder = Path(source).expanduser()
    check_adapter_folder(source)
    config = adapter_config(folder)
    tensors = load_file(folder / WEIGHTS_FILE)
    if embedding := next((name for name in tensors if "lora_embedding" in name), None):
        raise AdapterError(f"the adapter adapts an embedding ({embedding}), which galley does not compute")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = KEY.match(name)
        if match is None:
            raise AdapterError(f"the adapter holds {name}, which is not a LoRA A or B matrix of a linear layer")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise AdapterError(f"the adapter in {folder} adapts no module")
    modules = {}
    for module, pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"the adapter has lora_A without lora_B (or the reverse) for {module}")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{module}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} do not make a LoRA pair")
        modules[module] = (a, b, scale_of(config, module, a.shape[0]))
    return PeftAdapter(folder, modules, str(config.get("base_model_name_or_path") or ""))


def scale_of(config: dict, module: str, rank: int) -> float:
    """PEFT's `scaling` for one module: its alpha (alpha_pattern's, else lora_alpha) over r, or over
    sqrt(r) with rsLoRA. Patterns match a module's name or its dotted tail, as PEFT's do."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{pattern}$", module):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


@dataclass(frozen=True)
class LoraWeights:
    """One adapted linear of a model, in its own layout: shrink = x @ A.T to the rank, then each part's
    expand, (B * scale).T, into its own output columns (punica's shrink and expand). A fused linear (the
    native q/k/v, gate/up) stacks its parts' A rows in `shrink` and keeps each part's B to itself, so
    no zeros between the parts are stored, read or multiplied."""

    shrink: torch.Tensor  # [rank, in_features]: A, the parts' rows one after another
    expand: torch.Tensor  # the parts' expands [part rank, part columns], flat and one after another
    parts: torch.Tensor  # int64 [num_parts, 4] on the CPU: rank start, rank end, first column, end column
    expands: tuple[tuple[slice, slice, torch.Tensor], ...]  # (ranks, columns, expand as a matrix) per part

    @property
    def num_bytes(self) -> int:
        return self.shrink.numel() * self.shrink.element_size() + self.expand.numel() * self.expand.element_size()


def stack_parts(parts: list[tuple[slice, torch.Tensor, torch.Tensor, float]], device: torch.device,
                dtype: torch.dtype) -> LoraWeights:
    """`parts`: (output columns of the fused linear, A, B, scale) of each adapted part."""
    shrink = torch.cat([a.float() for _, a, _, _ in parts]).to(device=device, dtype=dtype).contiguous()
    flat = torch.cat([(b.float() * scale).T.reshape(-1) for _, _, b, scale in parts]).to(device=device, dtype=dtype)
    spans, expands, rank, offset = [], [], 0, 0
    for columns, a, _, _ in parts:
        ranks, width = slice(rank, rank + a.shape[0]), columns.stop - columns.start
        spans.append((ranks.start, ranks.stop, columns.start, columns.stop))
        expands.append((ranks, columns, flat[offset:offset + a.shape[0] * width].view(a.shape[0], width)))
        rank, offset = ranks.stop, offset + a.shape[0] * width
    return LoraWeights(shrink, flat, torch.tensor(spans, dtype=torch.long), tuple(expands))


def check_shape(module: str, a: torch.Tensor, b: torch.Tensor, in_features: int, out_features: int) -> None:
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise AdapterError(f"the adapter's {module} maps {a.shape[1]} -> {b.shape[0]} features, the base model's "
                           f"{in_features} -> {out_features}: it was trained for another model")


@dataclass
class LoraAdapter:
    """An adapter loaded on one replica: its weights keyed as the model's `LoraStep.add` calls name them
    (`{layer}.{linear}`)."""

    name: str
    weights: dict[str, LoraWeights]
    _by_layer: dict[tuple[int, int], LoraWeights] | None = field(default=None, repr=False, compare=False)

    def by_layer(self, linears: tuple[str, ...]) -> dict[tuple[int, int], LoraWeights]:
        """The weights keyed (layer, index of the linear in `linears`), worked out once: a step asks each layer."""
        if self._by_layer is None:
            self._by_layer = {}
            for key, weights in self.weights.items():
                layer, linear = key.split(".", 1)
                self._by_layer[int(layer), linears.index(linear)] = weights
        return self._by_layer

    @property
    def num_bytes(self) -> int:
        return sum(w.num_bytes for w in self.weights.values())


class LoraStep:
    """The adapters of one step and the rows of the packed batch each one owns: slices, since the runner
    packs each adapter's rows together (at most one slice among the decodes and one among the prefills)."""

    def __init__(self, groups: list[tuple[LoraAdapter, list[tuple[int, int]]]]) -> None:
        self.groups = groups  # (adapter, its (start, end) row slices)

    def add(self, out: torch.Tensor, x: torch.Tensor, key: str, kernels: Any = None) -> torch.Tensor:
        """`out` (a linear's output for `x`, [rows, out]) plus each adapter's delta on its own rows, in place:
        by the C++ `lora_add` where the step has the kernels (CPU, float32), else by torch's GEMMs."""
        for adapter, slices in self.groups:
            weights = adapter.weights.get(key)
            if weights is None:
                continue
            for start, end in slices:
                if kernels is not None:
                    kernels.lora_add(out, x, weights.shrink, weights.expand, weights.parts, start, end)
                    continue
                rows = out[start:end]  # a view: the add lands in `out`
                shrunk = x[start:end].to(weights.shrink.dtype) @ weights.shrink.T  # [rows, rank]
                for ranks, columns, expand in weights.expands:
                    if rows.dtype == expand.dtype:
                        rows[:, columns].addmm_(shrunk[:, ranks], expand)  # the expand and the add in one op
                    else:  # half-precision rows, float32 adapter: added in float32 and rounded once, as PEFT does
                        rows[:, columns] = (rows[:, columns].float() + shrunk[:, ranks] @ expand).to(rows.dtype)
        return out

    def layer_arguments(self, num_layers: int, linears: tuple[str, ...]) -> list[tuple[list[torch.Tensor], list[int]]]:
        """Per layer, the step's adapters as the fused C++ layer op takes them: [shrink, expand, parts, ...]
        of each adapted linear, and (linear's index in `linears`, start, end, entry) per row slice."""
        out: list[tuple[list[torch.Tensor], list[int]]] = [([], []) for _ in range(num_layers)]
        for adapter, slices in self.groups:
            for (layer, index), weights in adapter.by_layer(linears).items():
                tensors, rows = out[layer]
                entry = len(tensors) // 3
                tensors += (weights.shrink, weights.expand, weights.parts)
                for start, end in slices:
                    rows += (index, start, end, entry)
        return out

    def touches(self, key: str) -> bool:
        return any(key in adapter.weights for adapter, _ in self.groups)
