"""Plain data exchanged between the API, the scheduler and the engine.

Torch-free on purpose: `scheduling/` and `api/` import this module, and neither may pull in
torch. Nothing here does work; it only describes requests, sequences, batches and events.
"""

from __future__ import annotations

import enum
import io
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Priority(enum.IntEnum):
    """Lower value runs first; strict between classes (aging aside)."""

    HIGH = 0
    NORMAL = 1
    LOW = 2


# What a client hears when the engine fails its request: stable, with no exception text in it.
GENERATION_FAILED = "the model failed while generating this request (internal error)"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class GuidedSpec(NamedTuple):
    """A grammar the output must match (constrained decoding, `engine.guided`).

    `kind`: json (`value`: a JSON schema's text), regex, choice (`value`: a JSON list of the
    allowed strings) or lark (a Lark grammar, llguidance's dialect). A tuple, so it is hashable
    and stored params (JSON) read back as the same spec."""

    kind: str
    value: str


GREEDY_BELOW = 1e-5  # temperatures under this are greedy: dividing by one in float32 gives inf logits, NaN probs


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, range-checked by the API layer.

    Normalised here so every path (HTTP, WebSocket, batch jobs, recovery) means the same thing:
    a temperature below `GREEDY_BELOW` is greedy (0.0), `top_k` of 0 or less is no limit (None),
    and `stop_token_ids` is a frozenset (one membership test per token, whatever its length).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; N: chosen token plus N alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), sorted by id
    min_tokens: int = 0  # EOS and stop tokens are masked, stop strings ignored, until this many are out
    include_stop_str_in_output: bool = False  # the matched stop string (or stop token's text) stays in the text
    skip_special_tokens: bool = True  # special tokens' text is left out of the output
    guided: GuidedSpec | None = None  # the output must match this grammar
    speculative: bool = True  # may be sped up by speculative drafts when the model has them on (same output)

    def __post_init__(self) -> None:
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_k is not None and self.top_k <= 0:
            object.__setattr__(self, "top_k", None)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if self.guided is not None:
            object.__setattr__(self, "guided", GuidedSpec(*self.guided))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


@dataclass(frozen=True)
class ImageInputs:
    """A prompt's images as the model's processor made them: the arrays its vision encoder takes
    (`pixel_values`, and `image_sizes` or masks where the family has them; numpy) and a digest of
    each image, which keys the prefix cache of the prompt's image tokens."""

    arrays: dict[str, np.ndarray]
    digests: tuple[str, ...]

    def to_bytes(self) -> bytes:
        """The arrays and digests as one `.npz` (no pickles), kept with a stream to resume it."""
        out = io.BytesIO()
        np.savez(out, **{f"array_{name}": value for name, value in self.arrays.items()},
                 digests=np.array(self.digests, dtype=np.str_))
        return out.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> ImageInputs:
        with np.load(io.BytesIO(data), allow_pickle=False) as saved:
            arrays = {name.removeprefix("array_"): saved[name] for name in saved.files if name.startswith("array_")}
            return cls(arrays, tuple(str(d) for d in saved["digests"]))


@dataclass
class GenerationRequest:
    """What the API hands to an engine: token ids in, token events out."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float = field(default_factory=time.monotonic)
    tenant: str = "default"
    priority: Priority = Priority.NORMAL
    weight: float = 1.0  # the tenant's fair-share weight
    resume_token_ids: list[int] = field(default_factory=list)  # output already emitted before a restart
    cache_salt: str = ""  # prefix-cache namespace: only requests with the same salt share cached KV
    adapter: str = ""  # a LoRA adapter loaded on the engine (its name there); "": the base model alone
    images: ImageInputs | None = None  # a vision-language model's prompt images, one run of image tokens each


class Sequence:
    """One request's tokens and KV bookkeeping, as the scheduler and runner see it.

    Invariant: `num_computed_tokens <= len(token_ids)`; the KV cache holds exactly the first
    `num_computed_tokens` tokens, in the blocks listed by `block_table`.
    """

    def __init__(self, request: GenerationRequest) -> None:
        self.request_id = request.request_id
        self.params = request.params
        self.arrival_s = request.arrival_s
        self.tenant = request.tenant
        self.priority = request.priority
        self.weight = request.weight
        self.enqueued_s = request.arrival_s  # when it last started waiting (aging)
        self.num_output_at_admission = 0  # for the fair-share quantum
        self.num_prompt_tokens_charged = 0  # fair-share service already counted for the prompt
        self.token_ids: list[int] = [*request.prompt_token_ids, *request.resume_token_ids]
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # an adapter's KV differs from its base's for the same tokens: a namespace of its own
        self.cache_salt = f"lora:{request.adapter}\x00{request.cache_salt}" if request.adapter else request.cache_salt
        if request.images is not None:  # image tokens are one id whatever the image: the images are the namespace
            self.cache_salt = f"images:{','.join(request.images.digests)}\x00{self.cache_salt}"
        self.adapter = request.adapter
        self.images = request.images
        # a multi-axis rotary's prompt positions and later tokens' offset (the runner's, at its first step)
        self.rope_positions: tuple[np.ndarray, int] | None = None
        # prompt position runs [a, b) whose tokens see each other both ways (a Gemma 3 image's): set by the engine
        self.bidirectional_spans: tuple[tuple[int, int], ...] = ()
        self.block_hashes: list[bytes] = []  # prefix-cache hashes of full blocks, computed as needed
        self.num_cached_blocks = 0  # leading blocks of `block_table` registered in the prefix cache
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0
        self.first_scheduled_s: float | None = None  # monotonic; when it first ran (queue wait ends)
        self.num_cached_tokens = 0  # prompt tokens its first admission found in the prefix cache
        self.draft_token_ids: list[int] = []  # speculative guesses of the tokens after the last one

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def chunk_len(self, budget: int) -> int:
        """How many uncomputed tokens to compute with `budget` tokens left in a step: all that fit, but a
        chunk never ends inside a bidirectional span (its tokens need each other's keys). It ends before
        the span, or, where it starts at or in the span, takes the rest of it whatever the budget."""
        start = self.num_computed_tokens
        end = start + min(self.num_uncomputed_tokens, budget)
        for a, b in self.bidirectional_spans:
            if a < end < b:
                return (a if a > start else b) - start
        return end - start

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )


@dataclass
class ScheduledSeq:
    """`num_new_tokens` counts the drafts too: a decode with k drafts runs 1 + k tokens."""

    seq: Sequence
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)  # verified by this step, after the last token
    # sequences of this step computing blocks this one reads (a prefix they fill in the same step)
    reads_from: list[Sequence] = field(default_factory=list)

    @property
    def completes_prefill(self) -> bool:
        """True when this chunk reaches the last known token, so its logits give a sample."""
        return self.seq.num_computed_tokens + self.num_known_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """One new token of the sequence itself (plus any drafts after it): attention runs each
        as a decode row, so a drafted position is computed as the plain decode would compute it."""
        return self.num_known_tokens == 1

    @property
    def num_known_tokens(self) -> int:
        """Tokens of the sequence itself this step computes (the drafts are only guesses)."""
        return self.num_new_tokens - len(self.draft_token_ids)

    @property
    def num_logits(self) -> int:
        """Positions whose logits the step returns: the last one, and one per draft."""
        return 1 + len(self.draft_token_ids) if self.completes_prefill else 0


@dataclass
class ScheduledBatch:
    """One step's work: every scheduled sequence with how many new tokens it runs."""

    seqs: list[ScheduledSeq]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TokenEvent:
    """Output of one step for one request: new tokens, the text they complete, maybe the end."""

    request_id: str
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str | None = None  # with `error`: a stable code for clients when the cause is known (a shutdown)
    scheduled_s: float | None = None  # monotonic time the sequence first ran: arrival -> here is queue wait
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage's cached_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one replica's engine for metrics; read across threads, so only numbers."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    num_steps: int
    num_batched_tokens: int  # summed over all steps
    num_step_errors: int = 0  # steps in which something raised; only the requests it hit failed
    waiting_by_class: dict[tuple[str, str], int] = field(default_factory=dict)  # (priority, tenant) -> count
    batch_token_counts: tuple[int, ...] = ()  # steps per BATCH_TOKEN_BOUNDS bucket (not cumulative; last: +Inf)
    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    device_memory_used_bytes: int | None = None  # CUDA only: allocated by torch on the replica's device
    device_memory_total_bytes: int | None = None
    prefix_cache_query_tokens: int = 0  # prompt tokens of admitted sequences looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # of those, tokens served from cached KV blocks
    prefix_cache_blocks: int = 0  # blocks holding a reusable prefix now
    spec_num_draft_tokens: int = 0  # speculative draft tokens verified by the model
    spec_num_accepted_tokens: int = 0  # of those, tokens the model's own sampling agreed with
    num_graph_steps: int = 0  # decode steps replayed from a CUDA graph (engine/cuda_graphs.py)


# Upper bounds of the per-step batch token histogram (`galley_batch_tokens`).
BATCH_TOKEN_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


# The Open Inference Protocol's tensor datatypes and the numpy dtypes that hold them (BYTES: objects, each bytes),
# for the tensor models (engine.predictors) and the protocol's tensors (services.inference.tensors)
TENSOR_DATATYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
                    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
                    "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_}
