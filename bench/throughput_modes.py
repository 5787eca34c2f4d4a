"""throughput.py's modes and what they share (the workload, a mode's result, the CPU meter, the
context that builds the model once): our server over HTTP (a, a1) and our engine in-process (b, b1).
The Hugging Face baselines (c, d, e, f) are in hf_baselines.py."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from client import StreamStats, log, percentile_ms, send_requests
from servers import REPO_ROOT, free_port, start_server, stop_server, wait_ready
from synthetic import SPECIAL_TOKENS, ModelShape
from transformers import AutoModelForCausalLM, LlamaForCausalLM

sys.path.insert(0, str(REPO_ROOT))

from engine.engine import LLMEngine  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.model_runner import CacheConfig  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from launch import EngineConfig, build_engine  # noqa: E402

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
