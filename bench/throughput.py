"""Output tokens/s of one workload through our server, our engine and HF baselines, in one run.

Builds a seeded random-weight Llama of a real shape (default: SmolLM2-135M) and a tokenizer
whose every id decodes to ASCII text, saves both to a temp dir, then runs one workload
(N concurrent requests, P-token random prompts, O greedy output tokens, EOS ignored) through:

  a   our server over HTTP (streaming /v1/completions, subprocess)   a1  the same, one client
  b   our engine in-process, no HTTP                                 b1  the same, one request at a time
  c   HF `generate`, one request at a time (a subset, extrapolated)
  d   HF `generate` on the static batch of N
  e   the bare HF forward in a tight loop with DynamicCache (the "roofline")
  f   transformers' own continuous batching (`generate_batch`)

Modes run one after another, server modes first: the server is stopped before any
in-process mode runs. This module only measures; it never changes the server or the engine.

    python bench/throughput.py --quick
    python bench/throughput.py --modes a,b,e --json bench/results/run.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from engine.engine import LLMEngine  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.model_runner import CacheConfig  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from launch import EngineConfig, build_engine  # noqa: E402

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ALL_MODES = ("a", "a1", "b", "b1", "c", "d", "e", "f")
SERVER_MODES = ("a", "a1")
MODE_LABELS = {
    "a": "galley server, HTTP streaming, N concurrent",
    "a1": "galley server, HTTP streaming, 1 client",
    "b": "galley engine in-process, N at once",
    "b1": "galley engine in-process, 1 at a time",
    "c": "HF generate, 1 request at a time",
    "d": "HF generate, static batch of N",
    "e": "HF forward loop + DynamicCache (roofline)",
    "f": "HF generate_batch (continuous batching)",
}
RATIOS = (("a", "e"), ("a", "c"), ("a", "d"), ("a", "f"), ("b", "e"), ("a", "b"), ("a1", "c"), ("b1", "c"))


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 576
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    intermediate_size: int = 1536
    vocab_size: int = 49152

    def hf_config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
            rope_theta=100000.0,
            initializer_range=0.02,
            bos_token_id=None,
            eos_token_id=0,
            pad_token_id=0,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * (self.hidden_size // self.num_heads) * 4  # float32


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    prompt_len: int = 128
    output_len: int = 128
    seed: int = 0
    num_single_requests: int = 2  # a1, b1: requests sent one after another
    num_hf_sequential: int = 4  # c: requests measured, the rest extrapolated (0: all)
    max_num_batched_tokens: int = 2048

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        low = len(SPECIAL_TOKENS)
        return [[rng.randrange(low, vocab_size) for _ in range(self.prompt_len)] for _ in range(self.num_requests)]

    def kv_cache_gib(self, shape: ModelShape) -> float:
        """Room for every request's whole context, so neither engine nor server preempts."""
        num_tokens = self.num_requests * (self.prompt_len + self.output_len + 16)
        return round(max(1.0, 1.25 * num_tokens * shape.kv_bytes_per_token / 1024**3), 2)


@dataclass
class ModeResult:
    mode: str
    num_requests: int = 0
    num_output_tokens: int = 0
    wall_s: float = 0.0
    note: str = ""
    error: str | None = None
    cores_ours: float | None = None  # CPU time of the bench process (and server) / wall
    cores_others: float | None = None  # CPU time of every other process on the machine / wall
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # token ids per request, when known

    @property
    def tokens_per_s(self) -> float | None:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 and not self.error else None

    def summary(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("ttft_s", "itl_s", "outputs")}
        out.update(label=MODE_LABELS[self.mode], tokens_per_s=self.tokens_per_s)
        for name, values in (("ttft", self.ttft_s), ("itl", self.itl_s)):
            out[f"{name}_p50_ms"] = percentile_ms(values, 50)
            out[f"{name}_p99_ms"] = percentile_ms(values, 99)
        return out


def percentile_ms(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))] * 1000


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class CpuMeter:
    """CPU time spent by us (this process plus an optional child) and by everyone else, from /proc.

    The cores may be shared with other work; each figure says how busy the rest was.
    """

    def __init__(self, child_pid: int | None = None) -> None:
        self.child_pid = child_pid
        self.start = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        tick_s = 1 / os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            jiffies = [int(x) for x in f.readline().split()[1:]]
        busy_s = (sum(jiffies) - jiffies[3] - jiffies[4]) * tick_s  # all but idle and iowait
        child_s = 0.0
        if self.child_pid is not None:
            with open(f"/proc/{self.child_pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            child_s = (int(stat[11]) + int(stat[12])) * tick_s  # utime + stime
        own = os.times()
        return busy_s, own.user + own.system + child_s, time.perf_counter()

    def stop(self, result: ModeResult) -> None:
        try:
            busy_s, ours_s, now_s = self._sample()
        except OSError:
            return
        wall_s = now_s - self.start[2]
        ours_s -= self.start[1]
        result.cores_ours = ours_s / wall_s
        result.cores_others = max(0.0, busy_s - self.start[0] - ours_s) / wall_s


# ---- model and tokenizer ---------------------------------------------------------------


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE whose every id decodes to 1-3 printable ASCII characters.

    So each sampled id is complete text and streams as its own chunk, as English mostly does
    with a real tokenizer. (Random byte tokens end mid-UTF-8 most of the time and the server
    rightly holds such text back, which hides the real time to first token.) No merges:
    prompts are token ids, only decoding matters.
    """
    symbols = [chr(c) for c in range(0x21, 0x7F)] + ["\u0120"]  # ByteLevel spells a space U+0120
    strings = itertools.chain.from_iterable(
        ("".join(t) for t in itertools.product(symbols, repeat=n)) for n in (1, 2, 3)
    )
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for token in itertools.islice(strings, vocab_size - len(vocab)):
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0])


def save_model(shape: ModelShape, out: Path, seed: int, tokenizer: PreTrainedTokenizerFast | None = None) -> None:
    tokenizer = tokenizer or build_tokenizer(shape.vocab_size)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(shape.hf_config())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    num_params = sum(p.numel() for p in model.parameters())
    log(f"model: {num_params / 1e6:.1f}M params, tokenizer {len(tokenizer)} ids, saved to {out}")


@dataclass
class BenchContext:
    model_dir: Path
    shape: ModelShape
    workload: Workload
    prompts: list[list[int]]
    server_args: list[str]
    _hf_model: LlamaForCausalLM | None = None
    _engine: LLMEngine | None = None

    def hf_model(self) -> LlamaForCausalLM:
        if self._hf_model is None:
            self._hf_model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        return self._hf_model

    def engine(self) -> LLMEngine:
        if self._engine is None:
            w = self.workload
            loaded = load_model(str(self.model_dir), device="cpu", dtype="float32")
            cfg = EngineConfig(
                max_num_seqs=w.num_requests,
                max_num_batched_tokens=w.max_num_batched_tokens,
                cache=CacheConfig(kv_cache_gib=w.kv_cache_gib(self.shape)),
            )
            self._engine = build_engine(loaded, cfg)
        return self._engine


# ---- (a, a1) our server over HTTP ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    model_dir: Path,
    server_args: list[str],
    port: int,
    log_path: Path,
    root: Path = REPO_ROOT,
    config_text: str = "models = []\n",
    model_flag: bool = True,
) -> subprocess.Popen:
    """`server.py` of the checkout at `root`, serving only `bench` (the model at `model_dir`; without
    `model_flag`, `config_text` declares it)."""
    # An empty model list: the embedded defaults also load models/demo, which may not exist.
    config_path = log_path.with_name(f"{log_path.stem}.toml")
    config_path.write_text(config_text)
    cmd = [
        sys.executable,
        "server.py",
        "--config",
        str(config_path),
        *(["--model", f"bench={model_dir}"] if model_flag else []),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        *server_args,
    ]
    log(f"starting server: {' '.join(cmd)}")
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the same threads as in-process
    with log_path.open("wb") as sink:
        return subprocess.Popen(cmd, cwd=root, stdout=sink, stderr=subprocess.STDOUT, env=env)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log("server ignored SIGTERM for 30 s; killing it")
            proc.kill()
            proc.wait()
    log(f"server exited with {proc.returncode}")


async def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float = 600, path: str = "/ready") -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before {path}")
            try:
                async with session.get(f"{base_url}{path}") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


@dataclass
class StreamStats:
    send_s: float
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk that carries text
    texts: list[str] = field(default_factory=list)  # the text of each of those chunks
    completion_tokens: int | None = None  # from the final usage chunk


async def stream_completion(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> StreamStats:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stats = StreamStats(send_s=time.perf_counter())
    # the response cache would answer a repeated greedy prompt without running the engine
    async with session.post(url, json=body, headers={"Cache-Control": "no-cache"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        if resp.headers.get("X-Cache") == "hit":
            raise RuntimeError("answered from the response cache: the engine did not run")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if text := "".join(choice.get("text") or "" for choice in chunk.get("choices") or []):
                stats.chunk_s.append(time.perf_counter())
                stats.texts.append(text)
            if chunk.get("usage"):
                stats.completion_tokens = chunk["usage"]["completion_tokens"]
    return stats


def stream_result(mode: str, all_stats: list[StreamStats], wall_s: float) -> ModeResult:
    result = ModeResult(mode, num_requests=len(all_stats), wall_s=wall_s)
    result.num_output_tokens = sum(s.completion_tokens or len(s.chunk_s) for s in all_stats)
    for s in all_stats:
        if s.chunk_s:
            result.ttft_s.append(s.chunk_s[0] - s.send_s)
            result.itl_s.extend(b - a for a, b in itertools.pairwise(s.chunk_s))
    result.note = f"{sum(len(s.chunk_s) for s in all_stats)} text chunks for {result.num_output_tokens} tokens"
    if missing := sum(s.completion_tokens is None for s in all_stats):
        result.note += f"; {missing} streams without usage (counted chunks)"
    return result


async def send_requests(
    base_url: str, prompts: list[list[int]], max_tokens: int, concurrent: bool
) -> tuple[list[StreamStats], float]:
    url = f"{base_url}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.perf_counter()
        if concurrent:
            stats = list(await asyncio.gather(*(stream_completion(session, url, p, max_tokens) for p in prompts)))
        else:
            stats = [await stream_completion(session, url, p, max_tokens) for p in prompts]
        return stats, time.perf_counter() - start


async def server_session(
    ctx: BenchContext, modes: list[str], base_url: str, proc: subprocess.Popen
) -> list[ModeResult]:
    await wait_ready(base_url, proc)
    w = ctx.workload
    await send_requests(base_url, [ctx.prompts[0][:8]], 4, concurrent=False)  # warmup
    results = []
    for mode in modes:
        log(f"mode {mode}: {MODE_LABELS[mode]}")
        prompts = ctx.prompts if mode == "a" else ctx.prompts[: w.num_single_requests]
        meter = CpuMeter(proc.pid)
        try:
            stats, wall_s = await send_requests(base_url, prompts, w.output_len, concurrent=mode == "a")
            results.append(stream_result(mode, stats, wall_s))
        except Exception as exc:
            results.append(ModeResult(mode, error=f"{type(exc).__name__}: {exc}"))
        meter.stop(results[-1])
    return results


def run_server_modes(ctx: BenchContext, modes: list[str]) -> list[ModeResult]:
    if not (REPO_ROOT / "server.py").exists():
        return [ModeResult(m, error="server.py does not exist") for m in modes]
    log_path = ctx.model_dir.with_name("server.log")
    port = free_port()
    proc = start_server(ctx.model_dir, ctx.server_args, port, log_path)
    try:
        results = asyncio.run(server_session(ctx, modes, f"http://127.0.0.1:{port}", proc))
    except Exception as exc:
        results = [ModeResult(m, error=f"{type(exc).__name__}: {exc}") for m in modes]
    finally:
        stop_server(proc)
    if any(r.error for r in results):
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        log("server log tail:\n" + "\n".join(tail))
    return results


# ---- (b, b1) our engine in-process -----------------------------------------------------


@dataclass
class EngineRun:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)


def drive_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> EngineRun:
    """Adds every prompt at once and steps until all are done, timing each request's tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    run, last_s = EngineRun(), {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"{tag}-{i}", list(prompt), params))
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter()
        for event in events:
            if event.error:
                raise RuntimeError(f"request {event.request_id} failed: {event.error}")
            gaps = run.itl_s if event.request_id in last_s else run.ttft_s
            gaps.append(now - last_s.get(event.request_id, start))
            last_s[event.request_id] = now
            run.outputs.setdefault(event.request_id, []).extend(event.token_ids)
    return run


def mode_engine(ctx: BenchContext, mode: str) -> ModeResult:
    engine, w = ctx.engine(), ctx.workload
    drive_engine(engine, [ctx.prompts[0][:8]], 4, f"warmup-{mode}")
    groups = [ctx.prompts] if mode == "b" else [[p] for p in ctx.prompts[: w.num_single_requests]]
    result = ModeResult(mode)
    steps_before, preemptions_before = engine.num_steps, engine.scheduler.num_preemptions
    meter, start = CpuMeter(), time.perf_counter()
    for g, prompts in enumerate(groups):
        run = drive_engine(engine, prompts, w.output_len, f"{mode}-{g}")
        result.outputs += [run.outputs[f"{mode}-{g}-{i}"] for i in range(len(prompts))]
        result.ttft_s += run.ttft_s
        result.itl_s += run.itl_s
    result.wall_s = time.perf_counter() - start
    meter.stop(result)
    result.num_requests = len(result.outputs)
    result.num_output_tokens = sum(len(o) for o in result.outputs)
    result.note = (
        f"{engine.num_steps - steps_before} steps, {engine.scheduler.num_preemptions - preemptions_before} preemptions"
    )
    return result


# ---- (c, d, e, f) Hugging Face baselines -----------------------------------------------


def hf_generate(model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
    """Greedy, exactly `max_new_tokens` each; prompts share one length, so no padding is needed."""
    input_ids = torch.tensor(prompts)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
    )
    return out[:, input_ids.shape[1] :]


def mode_hf_sequential(ctx: BenchContext) -> ModeResult:
    model, w = ctx.hf_model(), ctx.workload
    num_measured = min(w.num_hf_sequential or w.num_requests, w.num_requests)
    hf_generate(model, [ctx.prompts[0][:8]], 4)  # warmup
    result = ModeResult("c", num_requests=w.num_requests, num_output_tokens=w.output_len * w.num_requests)
    meter, start = CpuMeter(), time.perf_counter()
    for prompt in ctx.prompts[:num_measured]:
        result.outputs.append(hf_generate(model, [prompt], w.output_len)[0].tolist())
    measured_s = time.perf_counter() - start
    meter.stop(result)
    result.wall_s = measured_s * w.num_requests / num_measured
    if num_measured < w.num_requests:
        result.note = f"measured {num_measured} of {w.num_requests} ({measured_s:.1f} s), wall extrapolated"
    return result


def mode_hf_static_batch(ctx: BenchContext) -> ModeResult:
    model, w = ctx.hf_model(), ctx.workload
    hf_generate(model, [p[:8] for p in ctx.prompts[:2]], 4)  # warmup
    meter, start = CpuMeter(), time.perf_counter()
    tokens = hf_generate(model, ctx.prompts, w.output_len)
    result = ModeResult("d", num_requests=w.num_requests, wall_s=time.perf_counter() - start)
    meter.stop(result)
    result.outputs = tokens.tolist()
    result.num_output_tokens = tokens.numel()
    return result


@torch.inference_mode()
def forward_loop(model: LlamaForCausalLM, prompts: list[list[int]], num_tokens: int) -> torch.Tensor:
    """One batched prefill forward, then greedy decode steps on the cache; [batch, num_tokens]."""
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor(prompts), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    next_ids = logits[:, -1].argmax(-1, keepdim=True)  # [batch, 1]
    generated = [next_ids]
    for _ in range(num_tokens - 1):
        logits = model(input_ids=next_ids, past_key_values=cache, use_cache=True).logits
        next_ids = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(next_ids)
    return torch.cat(generated, dim=1)


def mode_roofline(ctx: BenchContext) -> ModeResult:
    model, w = ctx.hf_model(), ctx.workload
    forward_loop(model, [p[:8] for p in ctx.prompts[:2]], 4)  # warmup
    meter, start = CpuMeter(), time.perf_counter()
    tokens = forward_loop(model, ctx.prompts, w.output_len)
    result = ModeResult("e", num_requests=w.num_requests, wall_s=time.perf_counter() - start)
    meter.stop(result)
    result.outputs = tokens.tolist()
    result.num_output_tokens = tokens.numel()
    return result


def mode_hf_continuous(ctx: BenchContext) -> ModeResult:
    from transformers import ContinuousBatchingConfig

    model, w = ctx.hf_model(), ctx.workload
    page_size = 64
    pages_per_request = -(-(w.prompt_len + w.output_len) // page_size)
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=w.num_requests * pages_per_request + 4,  # CPU: nothing to infer it from
        max_batch_tokens=w.max_num_batched_tokens,
        max_requests_per_batch=w.num_requests,
        allow_block_sharing=False,
    )
    gen_config = GenerationConfig(max_new_tokens=w.output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batch = lambda prompts, **kw: model.generate_batch(  # noqa: E731
        inputs=prompts, generation_config=gen_config, continuous_batching_config=cb_config, warmup=False, **kw
    )
    batch([p[:8] for p in ctx.prompts[:2]], max_new_tokens=4)  # warmup
    meter, start = CpuMeter(), time.perf_counter()
    outputs = list(batch(ctx.prompts).values())  # in input order
    result = ModeResult("f", num_requests=len(outputs), wall_s=time.perf_counter() - start)
    meter.stop(result)
    errors = [o.error for o in outputs if o.error]
    if errors or len(outputs) != w.num_requests:
        result.error = f"{len(outputs)}/{w.num_requests} outputs; errors: {errors}"
    result.outputs = [list(o.generated_tokens) for o in outputs]
    result.num_output_tokens = sum(len(o) for o in result.outputs)
    result.note = f"attn={model.config._attn_implementation}, page_size={page_size}; timed call includes setup"
    return result


# ---- orchestration and report ----------------------------------------------------------


IN_PROCESS_MODES: dict[str, Callable[[BenchContext], ModeResult]] = {
    "b": lambda ctx: mode_engine(ctx, "b"),
    "b1": lambda ctx: mode_engine(ctx, "b1"),
    "c": mode_hf_sequential,
    "d": mode_hf_static_batch,
    "e": mode_roofline,
    "f": mode_hf_continuous,
}


def run_in_process(ctx: BenchContext, mode: str) -> ModeResult:
    log(f"mode {mode}: {MODE_LABELS[mode]}")
    try:
        result = IN_PROCESS_MODES[mode](ctx)
    except Exception as exc:
        result = ModeResult(mode, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    log(f"mode {mode}: {fmt(result.tokens_per_s, '.1f')} tok/s {result.error or ''}")
    return result


def run_all(ctx: BenchContext, modes: list[str]) -> list[ModeResult]:
    server_modes = [m for m in modes if m in SERVER_MODES]
    results = run_server_modes(ctx, server_modes) if server_modes else []
    return results + [run_in_process(ctx, m) for m in modes if m in IN_PROCESS_MODES]


def agreement(result: ModeResult, reference: ModeResult | None) -> str:
    """How many requests' greedy outputs equal the roofline's, and the mean common prefix."""
    if reference is None or result is reference or not result.outputs or not reference.outputs:
        return ""
    pairs = list(zip(result.outputs, reference.outputs, strict=False))  # c times only the first few
    same = sum(a == b for a, b in pairs)
    prefix = [common_prefix_len(a, b) for a, b in pairs]
    return f"{same}/{len(pairs)}, prefix {sum(prefix) / len(prefix):.0f}"


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(results: list[ModeResult], ctx: BenchContext) -> str:
    by_mode = {r.mode: r for r in results}
    w, s = ctx.workload, ctx.shape
    lines = [
        f"model: Llama hidden={s.hidden_size} layers={s.num_layers} heads={s.num_heads}/{s.num_kv_heads} "
        f"ffn={s.intermediate_size} vocab={s.vocab_size}, float32, random weights",
        f"workload: N={w.num_requests} prompt={w.prompt_len} output={w.output_len} (greedy, ignore_eos); "
        f"a1/b1: {w.num_single_requests} requests one after another",
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"threads={torch.get_num_threads()}, cpus={os.cpu_count()}, load avg {os.getloadavg()[0]:.1f}",
        "",
        f"{'mode':<5}{'what':<44}{'tok/s':>8}{'wall s':>9}{'tokens':>8}{'cores':>10}  {'same as e':<19}note",
    ]
    for r in results:
        cores = f"{fmt(r.cores_ours, '.1f')}/{fmt(r.cores_others, '.1f')}"
        lines.append(
            f"{r.mode:<5}{MODE_LABELS[r.mode]:<44}{fmt(r.tokens_per_s, '.1f'):>8}"
            f"{fmt(r.wall_s or None, '.2f'):>9}{r.num_output_tokens:>8}{cores:>10}  "
            f"{agreement(r, by_mode.get('e')):<19}{f'ERROR {r.error}' if r.error else r.note}"
        )
    lines.append("cores: CPU cores busy during the timed part, ours (bench + server) / other processes")
    lines += ["", f"{'latency ms':<12}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}"]
    for r in results:
        if r.ttft_s:
            cells = [percentile_ms(v, p) for v in (r.ttft_s, r.itl_s) for p in (50, 99)]
            lines.append(f"{r.mode:<12}" + "".join(f"{fmt(c, '.1f'):>10}" for c in cells))
    lines += ["", "ratios of tok/s"]
    for num, den in RATIOS:
        a, b = by_mode.get(num), by_mode.get(den)
        if a and b and a.tokens_per_s and b.tokens_per_s:
            lines.append(
                f"  {num + '/' + den:<6}{a.tokens_per_s / b.tokens_per_s:7.2f}   "
                f"{MODE_LABELS[num]}  /  {MODE_LABELS[den]}"
            )
    return "\n".join(lines)


def write_json(path: Path, results: list[ModeResult], ctx: BenchContext) -> None:
    doc = {
        "shape": dataclasses.asdict(ctx.shape),
        "workload": dataclasses.asdict(ctx.workload),
        "server_args": ctx.server_args,
        "env": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "results": [r.summary() for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 requests, 32/32 tokens, 4 layers (unless set)")
    p.add_argument("--hidden-size", type=int, default=576)
    p.add_argument("--layers", type=int, default=None, help="default 30 (4 with --quick)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--intermediate-size", type=int, default=1536)
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--concurrency", type=int, default=None, help="N requests (default 32, 8 with --quick)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (32 with --quick)")
    p.add_argument("--output-len", type=int, default=None, help="default 128 (32 with --quick)")
    p.add_argument("--single-requests", type=int, default=None, help="a1/b1 requests (default 2; 1 quick)")
    p.add_argument("--hf-sequential", type=int, default=None, help="c: requests timed, 0: all (default 4; 2 quick)")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget of one step (b, f, server)")
    p.add_argument("--modes", default=",".join(ALL_MODES), help=f"comma list of {','.join(ALL_MODES)}")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads, in-process and in the server (OMP_NUM_THREADS); default: all cores",
    )
    p.add_argument("--server-args", default="", help="extra flags for server.py, as one string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if unknown := set(args.modes.split(",")) - set(ALL_MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {','.join(ALL_MODES)}")
    return args


def make_context(args: argparse.Namespace, model_dir: Path) -> BenchContext:
    pick = lambda value, full, quick: value if value is not None else (quick if args.quick else full)  # noqa: E731
    shape = ModelShape(
        args.hidden_size,
        pick(args.layers, 30, 4),
        args.heads,
        args.kv_heads,
        args.intermediate_size,
        args.vocab_size,
    )
    w = Workload(
        num_requests=pick(args.concurrency, 32, 8),
        prompt_len=pick(args.prompt_len, 128, 32),
        output_len=pick(args.output_len, 128, 32),
        seed=args.seed,
        num_single_requests=pick(args.single_requests, 2, 1),
        num_hf_sequential=pick(args.hf_sequential, 4, 2),
        max_num_batched_tokens=args.max_batched_tokens,
    )
    server_args = [
        "--dtype",
        "float32",
        "--data-dir",
        str(model_dir.with_name("server-data")),
        "--log-format",
        "console",
        "--max-num-seqs",
        str(w.num_requests),
        "--max-num-batched-tokens",
        str(w.max_num_batched_tokens),
        "--kv-cache-gib",
        str(w.kv_cache_gib(shape)),
        *args.server_args.split(),
    ]
    return BenchContext(model_dir, shape, w, w.prompts(shape.vocab_size), server_args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    modes = [m for m in ALL_MODES if m in args.modes.split(",")]  # server modes come first
    with tempfile.TemporaryDirectory(prefix="galley-bench-") as tmp:
        ctx = make_context(args, Path(tmp) / "model")
        save_model(ctx.shape, ctx.model_dir, args.seed)
        results = run_all(ctx, modes)
    report = render(results, ctx)
    if args.json:
        write_json(args.json, results, ctx)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
