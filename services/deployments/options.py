"""A model version's options: the one definition that the config file's `[[models]]` entries, the
`--model-option` flag, `POST /admin/api/models` (and its OpenAPI schema), the registry and
`GET /admin/api/models` all use.

An option is set per version and means the same wherever it was set. `check_options` is the only
validation; the admin API's schema is built from the same table (`api.admin.deployments`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.sampling import check_sampling_defaults

KINDS = ("generate", "embed", "classify", "onnx", "tabular", "image-classify", "torch")
GENERATE = ("generate",)
BATCHED = ("embed", "classify", "onnx", "tabular", "image-classify", "torch")  # behind the dynamic batcher
TORCH = ("generate", "embed", "classify", "image-classify")  # torch models: their weights have a dtype
DTYPES = ("auto", "float32", "bfloat16", "float16")
TOOL_PARSERS = ("hermes", "llama3_json", "mistral")  # services.answers.tool_parser's formats
REASONING_PARSERS = ("qwen3", "deepseek_r1", "none")  # services.answers.reasoning's
BACKENDS = ("auto", "native", "generic")  # engine.loader's: auto is native where the family has it
QUANTIZATIONS = ("int8", "int4", "none")  # engine.quantization's methods, and off
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",  # SpeculativeConfig's
                    "disable_by_batch_size", "max_lookup_tokens", "model", "quantization")


@dataclass(frozen=True)
class Option:
    name: str
    type: type  # bool, int, float (an int is taken too), str, dict or list (of `item`)
    help: str
    kinds: tuple[str, ...] = KINDS  # the model kinds it means something for
    choices: tuple[str, ...] = ()
    ge: float | None = None
    le: float | None = None
    item: type = str  # a list's items: non-empty strings, or ints within ge..le

    def problem(self, value: Any) -> str | None:
        """Why `value` is not one of this option's, or None."""
        types = (int, float) if self.type is float else (self.type,)
        if not isinstance(value, types) or (isinstance(value, bool) and self.type is not bool):
            return f"must be {'a number' if self.type is float else self.type.__name__}"
        if self.type is list:
            if self.item is int:
                if not value or not all(isinstance(item, int) and not isinstance(item, bool) for item in value):
                    return "must be a non-empty list of integers"
            elif not all(isinstance(item, str) and item for item in value):
                return "must be a list of non-empty strings"
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        for number in (value if self.type is list and self.item is int else [value]):
            if self.ge is not None and number < self.ge:
                return f"must be >= {self.ge:g}"
            if self.le is not None and number > self.le:
                return f"must be <= {self.le:g}"
        if self.name == "speculative":
            unknown = sorted(set(value) - set(SPECULATIVE_KEYS))
            return f"unknown key(s) {unknown}; known: {', '.join(SPECULATIVE_KEYS)}" if unknown else None
        if self.name == "sampling_defaults":
            return check_sampling_defaults(value)
        return None


OPTIONS: dict[str, Option] = {option.name: option for option in (
    Option("dtype", str, "weights' dtype; auto: float32 on CPU, bfloat16 on CUDA", TORCH, choices=DTYPES),
    Option("device", str, "one of the configured devices; default: every configured device "
           "(encoders: the first)"),
    Option("replicas", int, "how many of its devices' workers it loads on (data parallel); default: all of them. "
           "POST /api/v1/deployments' resources.replicas sets it", GENERATE, ge=1, le=1024),
    Option("pinned", bool, "stays loaded: never unloaded for idleness or memory"),
    Option("keep_alive", float, "seconds idle before it unloads; 0: never", ge=0, le=10**9),
    Option("preload", bool, "false: loads on its first request instead of at start"),
    Option("max_model_len", int, "cap on prompt + output tokens; default: [engine] max_model_len, else the "
           "model's own", GENERATE, ge=1, le=1 << 20),
    Option("shared_prefix_cache", bool, "tenants may reuse each other's cached prompt prefixes", GENERATE),
    Option("tool_parser", str, "default: detected from the chat template", GENERATE, choices=TOOL_PARSERS),
    Option("reasoning_parser", str, "default: detected from the chat template", GENERATE,
           choices=REASONING_PARSERS),
    Option("backend", str, "native: our fused decoder (Llama, Mistral, Qwen2, Qwen3); generic: the model's own "
           "transformers code over the paged cache (any *ForCausalLM); auto (default): native where it can",
           GENERATE, choices=BACKENDS),
    Option("quantization", str, "weight-only linears; unset: off, a GGUF file's own blocks kept on CPU; "
           "none: off, a GGUF file de-quantized", GENERATE, choices=QUANTIZATIONS),
    Option("speculative", dict, "a [speculative] table (method, model, ...) replacing the server's", GENERATE),
    Option("sampling_defaults", dict, "what a request that leaves a field out gets: temperature, top_p, top_k, "
           "min_p, repetition_penalty, frequency_penalty, presence_penalty, max_tokens; over the model's "
           "generation_config.json", GENERATE),
    Option("base", str, "makes this version a LoRA adapter (its source a PEFT adapter folder) served over the "
           "weights of this generate model (`name`: its stable version at load; or `name@version`)", GENERATE),
    Option("trusted_types", list, "a tabular .skops model (or allowed pickle): the types beyond skops' own trusted "
           "set that an admin has reviewed and lets it load (e.g. mypackage.MyTransformer)", ("tabular",)),
    Option("allow_pickle", bool, "an admin's opt-in for a scikit-learn .pkl/.pickle/.joblib file: loaded through a "
           "restricted unpickler that builds only scikit-learn classes, numpy arrays and trusted_types", ("tabular",)),
    Option("max_batch", int, "most inputs (requests of a tensor model) in one forward (default 32)", BATCHED, ge=1,
           le=65536),
    Option("max_wait_ms", float, "how long a batch waits to fill (default 5)", BATCHED, ge=0, le=1000),
    Option("max_queue_delay_microseconds", int, "Triton's name for the wait: max_wait_ms in microseconds", BATCHED,
           ge=0, le=10**6),
    Option("preferred_batch_size", list, "batch sizes run as soon as enough inputs wait, largest first, as Triton's "
           "dynamic batcher does (each at most max_batch)", BATCHED, ge=1, le=65536, item=int),
)}


# what an adapter takes from its base's engine, so cannot set for itself
BASE_ONLY = ("dtype", "device", "replicas", "max_model_len", "backend", "quantization", "speculative")


def check_options(options: Mapping[str, Any], kind: str | None = None) -> dict[str, Any]:
    """The options, checked; ValueError names the first bad one (as `options.NAME: why`). With a
    `kind`, an option that means nothing for it is refused too."""
    if "base" in options:
        if set_here := [name for name in BASE_ONLY if name in options]:
            raise ValueError(f"options.{set_here[0]}: an adapter runs on its base's engine; set it on the base")
        if not isinstance(options["base"], str) or not options["base"].strip("@") or options["base"].count("@") > 1:
            raise ValueError("options.base: must be a model name or name@version")
    if "max_wait_ms" in options and "max_queue_delay_microseconds" in options:
        raise ValueError("options.max_queue_delay_microseconds: set the wait once, as it or as max_wait_ms")
    for name, value in options.items():
        option = OPTIONS.get(name)
        if option is None:
            raise ValueError(f"options.{name}: unknown option; known: {', '.join(OPTIONS)}")
        if (problem := option.problem(value)) is not None:
            raise ValueError(f"options.{name}: {problem}")
        if kind is not None and kind not in option.kinds:
            raise ValueError(f"options.{name}: only for {' and '.join(option.kinds)} models, not {kind}")
    if max(options.get("preferred_batch_size") or [0]) > options.get("max_batch", 32):
        raise ValueError(f"options.preferred_batch_size: each size must be at most max_batch "
                         f"({options.get('max_batch', 32)})")
    return dict(options)
