"""Encoder models (embeddings, classifiers): HF `AutoModel*` weights, packed forwards for the
BERT family (engine/models/bert.py), HF's padded forward otherwise.

No KV cache and no scheduler: each model gets a `DynamicBatcher`, run by its device's worker
thread between engine steps, whose `run_batch` is `Encoder.run`. Embedding models honour a
sentence-transformers folder: pooling from `1_Pooling/config.json` (cls / mean / max /
mean_sqrt_len / lasttoken), a `Normalize` module in `modules.json`, `max_seq_length` from
`sentence_bert_config.json`. A model source `pkg:PACKAGE/SUBDIR` is a folder inside an
installed Python package (how the default `minilm` ships), found through
`importlib.resources`, never downloaded.
"""

from __future__ import annotations

import importlib.resources
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from engine.batcher import Batching
from engine.length_groups import GroupCost, length_groups
from engine.loader import ModelLoadError, max_token_chars, resolve_dtype, resolve_model_path
from engine.models.bert import PackedBatch, PackedBert, supports_packed
from engine.worker import DeviceWorker, EncoderClient

KINDS = ("embed", "classify")
FORWARD_COST_TOKENS_CPU = 64  # measured on 2 cores with all-MiniLM-L6-v2: a forward's overhead ~ 64 tokens
POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len", "lasttoken")
KNOWN_MODULES = {"Transformer", "Pooling", "Normalize"}
POOLING_KEYS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
                "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens", "lasttoken": "pooling_mode_lasttoken",
                "weightedmean": "pooling_mode_weightedmean_tokens"}  # sentence-transformers' 1_Pooling/config.json


Pair = tuple[str, str]  # (query, document): a cross-encoder's input, tokenized as one sequence of two segments
EncoderInput = str | list[int] | Pair
# sentence-transformers' names for a cross-encoder's activation (its config.json `sentence_transformers`)
ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity",
               "torch.nn.Sigmoid": "sigmoid", "torch.nn.Identity": "identity"}


@dataclass(frozen=True)
class EncoderOutput:
    """One input's result: an embedding or a classifier's per-label scores, and its token count."""

    values: list[float]
    num_tokens: int


def resolve_encoder_path(source: str) -> Path:
    """`pkg:PACKAGE/SUBDIR` inside an installed package; else a local folder or a hub id."""
    if not source.startswith("pkg:"):
        return resolve_model_path(source)
    package, _, sub = source.removeprefix("pkg:").partition("/")
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError as exc:
        raise ModelLoadError(f"model source {source!r}: package {package!r} is not installed") from exc
    path = Path(str(root / sub)) if sub else Path(str(root))
    if not path.is_dir():
        raise ModelLoadError(f"model source {source!r}: {path} is not a folder")
    return path


@dataclass(frozen=True)
class SentenceConfig:
    """What a sentence-transformers folder says about turning token states into one vector."""

    pooling: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None


def read_sentence_config(path: Path) -> SentenceConfig:
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return SentenceConfig()
    modules = json.loads(modules_file.read_text())
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    unknown = [k for k in kinds if k not in KNOWN_MODULES]
    if unknown:
        raise ModelLoadError(f"{path}: sentence-transformers modules {unknown} are not supported "
                             f"(only {sorted(KNOWN_MODULES)})")
    pooling = "mean"
    for module in modules:
        if module["type"].endswith("Pooling"):
            pooling = pooling_mode(json.loads((path / module["path"] / "config.json").read_text()))
    bert_config = path / "sentence_bert_config.json"
    max_len = json.loads(bert_config.read_text()).get("max_seq_length") if bert_config.exists() else None
    return SentenceConfig(pooling, "Normalize" in kinds, max_len)


def pooling_mode(cfg: dict) -> str:
    if "pooling_mode" in cfg:  # newer sentence-transformers write the mode by name
        mode = {"mean_sqrt_len_tokens": "mean_sqrt_len"}.get(cfg["pooling_mode"], cfg["pooling_mode"])
    else:
        flags = [mode for mode, key in POOLING_KEYS.items() if cfg.get(key)]
        if len(flags) != 1:
            raise ModelLoadError(f"pooling config {cfg}: exactly one pooling mode must be set, got {flags}")
        mode = flags[0]
    if mode not in POOLING_MODES:
        raise ModelLoadError(f"pooling mode {mode!r} is not supported (only {', '.join(POOLING_MODES)})")
    return mode


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """[batch, seq, dim] token states and [batch, seq] mask -> [batch, dim] (right padding)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)  # [batch, seq, 1]
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    if mode == "lasttoken":
        last = mask.sum(dim=1) - 1  # [batch]
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    summed = (hidden * m).sum(dim=1)
    counts = m.sum(dim=1).clamp(min=1e-9)
    return summed / (counts.sqrt() if mode == "mean_sqrt_len" else counts)


def pool_packed(h: torch.Tensor, batch: PackedBatch, mode: str) -> torch.Tensor:
    """[tokens, dim] packed states -> [batch, dim]: the same pooling as `pool` on a padded batch."""
    if mode == "cls":
        return h[batch.firsts]
    if mode == "lasttoken":
        return h[batch.firsts + batch.lengths - 1]
    size, dim = len(batch.lengths), h.shape[1]
    if mode == "max":
        index = batch.rows[:, None].expand(-1, dim)
        return h.new_zeros(size, dim).scatter_reduce(0, index, h, "amax", include_self=False)
    summed = h.new_zeros(size, dim).index_add_(0, batch.rows, h)
    counts = batch.lengths[:, None].to(h.dtype)
    return summed / (counts.sqrt() if mode == "mean_sqrt_len" else counts)


UNKNOWN_WORD_CHARS = 100  # WordPiece's max_input_chars_per_word: a longer word is one [UNK]


class Encoder:
    """A loaded encoder: tokenizer, model, and how its outputs become vectors or scores."""

    def __init__(self, path: Path, kind: str, device: str = "cpu", dtype: str = "auto") -> None:
        if kind not in KINDS:
            raise ModelLoadError(f"encoder kind must be one of {KINDS}, not {kind!r}")
        self.path, self.kind = path, kind
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.sentence = read_sentence_config(path) if kind == "embed" else SentenceConfig()
        self.config = AutoConfig.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        auto = AutoModel if kind == "embed" else AutoModelForSequenceClassification
        try:
            self.model = auto.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load {kind} model from {path}: {exc}") from exc
        limits = [n for n in (self.sentence.max_seq_length, getattr(self.config, "max_position_embeddings", None),
                              self.tokenizer.model_max_length) if n]
        self.max_seq_len = min(limits) if limits else 512
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # no token covers more input than its spelling, or a whole unknown word (WordPiece's 100 characters);
        # twice that leaves room for whitespace between tokens
        self.max_input_chars = self.max_seq_len * 2 * max(max_token_chars(self.tokenizer), UNKNOWN_WORD_CHARS)
        self.packed = PackedBert(self.model) if supports_packed(self.config) else None
        # a pair's segment ids matter to models that take them (BERT); others (RoBERTa, DistilBERT) read none
        self.takes_segments = "token_type_ids" in inspect.signature(self.model.forward).parameters
        self.group_cost = self._group_cost()  # the padded path's

    def _group_cost(self) -> GroupCost:
        """For the padded forward: what one over `n` inputs padded to `width` tokens costs, in
        tokens of work. On CPU compute follows tokens, so a batch of mixed lengths is split where
        padding costs more than a forward's fixed cost; on CUDA launches dominate (one forward)."""
        if self.device.type != "cpu":
            return lambda n, width: 1.0
        return lambda n, width: FORWARD_COST_TOKENS_CPU + n * width

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size

    @property
    def labels(self) -> list[str]:
        """Classifier labels by output index, from the config's id2label."""
        if self.kind != "classify":
            return []
        return [self.config.id2label.get(i, f"LABEL_{i}") for i in range(self.config.num_labels)]

    @property
    def multi_label(self) -> bool:
        return getattr(self.config, "problem_type", None) == "multi_label_classification"

    @property
    def score_activation(self) -> str:
        """How a cross-encoder's logit becomes a relevance score, as sentence-transformers' `CrossEncoder`
        decides: its config's `activation_fn`, else sigmoid for one label (identity for more)."""
        named = (getattr(self.config, "sentence_transformers", None) or {}).get("activation_fn")
        if named in ACTIVATIONS:
            return ACTIVATIONS[named]
        return "sigmoid" if self.config.num_labels == 1 else "identity"

    def token_ids(self, inputs: list[EncoderInput]) -> list[tuple[list[int], list[int] | None]]:
        """Each input's token ids and, for a pair, its segment ids (None: all 0). Strings are tokenized
        (special tokens, truncated to max_seq_len), pairs as two segments (truncating the longer first,
        as a cross-encoder's tokenizer call does); id lists are taken as given. A string is cut to
        `max_input_chars` first: truncation keeps only its start anyway, and tokenizing all of a
        megabyte input would hold this device's worker (and every stream on it) for seconds."""
        cut = self.max_input_chars
        texts = [i[:cut] for i in inputs if isinstance(i, str)]
        pairs = [i for i in inputs if isinstance(i, tuple)]
        singles = iter(self.tokenizer(texts, truncation=True, max_length=self.max_seq_len)["input_ids"]
                       if texts else [])
        if pairs:
            encoded = self.tokenizer([a[:cut] for a, _ in pairs], [b[:cut] for _, b in pairs], truncation=True,
                                     max_length=self.max_seq_len)
            types = encoded.get("token_type_ids") or [None] * len(pairs)
            paired = iter(zip(encoded["input_ids"], types))
        return [(next(singles), None) if isinstance(i, str) else next(paired) if isinstance(i, tuple)
                else (list(i), None) for i in inputs]

    def run(self, inputs: list[EncoderInput]) -> list[EncoderOutput]:
        """The batch's outputs, in order: one packed forward, or, padded, as few forwards of
        similar lengths as cost least (usually one; padding a short input to a long one costs more)."""
        encoded = self.token_ids(inputs)
        ids = [x for x, _ in encoded]
        types = [t for _, t in encoded] if self.takes_segments and any(t is not None for _, t in encoded) else None
        if self.packed is not None:
            return [EncoderOutput(row, len(x)) for row, x in zip(self.forward_packed(ids, types), ids)]
        rows: list[list[float]] = [[] for _ in ids]
        for group in length_groups([len(x) for x in ids], self.group_cost):
            group_types = None if types is None else [types[i] for i in group]
            for i, row in zip(group, self.forward([ids[i] for i in group], group_types)):
                rows[i] = row
        return [EncoderOutput(row, len(x)) for row, x in zip(rows, ids)]

    @torch.inference_mode()
    def forward(self, ids: list[list[int]], types: list[list[int] | None] | None = None) -> list[list[float]]:
        """One forward, padded on the right to the longest input: a vector or logits per input."""
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)  # [batch, seq]
        mask = torch.zeros((len(ids), width), dtype=torch.long)  # [batch, seq]
        segments = torch.zeros((len(ids), width), dtype=torch.long)  # [batch, seq]
        for row, x in enumerate(ids):
            input_ids[row, :len(x)] = torch.tensor(x, dtype=torch.long)
            mask[row, :len(x)] = 1
            if types is not None and types[row] is not None:
                segments[row, :len(x)] = torch.tensor(types[row], dtype=torch.long)
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        extra = {"token_type_ids": segments.to(self.device)} if types is not None else {}
        out = self.model(input_ids=input_ids, attention_mask=mask, **extra)
        if self.kind == "embed":
            return self.rows(pool(out.last_hidden_state, mask, self.sentence.pooling))  # [batch, dim]
        return self.rows(out.logits)  # [batch, num_labels]

    @torch.inference_mode()
    def forward_packed(self, ids: list[list[int]], types: list[list[int] | None] | None = None) -> list[list[float]]:
        """One packed forward (BERT family): the same outputs as `forward`, without padded linear work."""
        batch = PackedBatch.of([len(x) for x in ids], self.device)
        segments = None if types is None else batch.pack([t or [0] * len(x) for x, t in zip(ids, types)], self.device)
        h = self.packed.hidden_states(batch.pack(ids, self.device), batch, segments)
        if self.kind == "embed":
            return self.rows(batch.restore(pool_packed(h, batch, self.sentence.pooling)))
        return self.rows(batch.restore(self.packed.classify(h, batch)))

    def rows(self, values: torch.Tensor) -> list[list[float]]:
        """[batch, n] pooled vectors (normalised if the folder says so) or logits -> plain lists."""
        if self.kind == "embed" and self.sentence.normalize:
            values = torch.nn.functional.normalize(values, p=2, dim=1)
        return values.float().cpu().tolist()


def start_encoder(encoder_id: str, source: str, kind: str, worker: DeviceWorker, device: str, dtype: str,
                  batching: Batching) -> tuple[Encoder, EncoderClient]:
    """Load an encoder and attach it to the device's worker (blocking: run it off the event loop)."""
    encoder = Encoder(resolve_encoder_path(source), kind, device, dtype)
    encoder.run(["warm up"])  # the first forward is slow: pay for it before serving
    return encoder, worker.attach_encoder(encoder_id, batching.batcher(encoder_id, encoder.run))
