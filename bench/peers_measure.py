"""peers.py's measurements: its workloads, and one workload's run on one server (client-side times,
the server's prefix-cache counters from /metrics where it has them, the CPU of every process
tree), with the warm-up before and the settling between runs."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp
from client import log, percentile_ms, stream_completion
from prometheus_client.parser import text_string_to_metric_families
from servers import GALLEY, LLAMA, READY_PATHS, VLLM, System, wait_ready
from synthetic import ids_from_text

PREFIX_COUNTERS = {  # (queries, hits), both in prompt tokens; llama-server exports none
    GALLEY: ("galley_prefix_cache_queries_total", "galley_prefix_cache_hits_total"),
    VLLM: ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
}


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
            "W16": Workload("W16", 4, 1, 32, 32),
            "S": Workload("S", 1, 3, 32, 32),
            "MT": Workload("MT", 4, 3, 48, 16, carry_history=True),
            "SP": Workload("SP", 8, 1, 16, 16, shared_prefix_len=128),
            "L": Workload("L", 4, 1, 256, 16),
        }
    return {
        "W": Workload("W", 32, 1, 128, 128),
        "W16": Workload("W16", 16, 1, 128, 128),  # issue 34's W against llama-server (--parallel 16)
        "S": Workload("S", 1, 6, 128, 128),
        "MT": Workload("MT", 8, 4, 192, 64, carry_history=True),
        "SP": Workload("SP", 32, 1, 64, 64, shared_prefix_len=512),
        "L": Workload("L", 16, 1, 1024, 64),  # issue 34's long prompts: prefill-bound, TTFT is the point
    }


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
    names = PREFIX_COUNTERS.get(system.name)
    if names is None:
        return None
    try:
        async with session.get(f"{system.base_url}/metrics") as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return None
    totals = dict.fromkeys(names, 0.0)
    found = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
                found.add(sample.name)
    return (totals[names[0]], totals[names[1]]) if len(found) == 2 else None


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
    session: aiohttp.ClientSession,
    system: System,
    systems: list[System],
    w: Workload,
    segments,
    repetition: int,
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
    # llama-server closes a kept-alive connection after a streamed answer; then every server gets a
    # new connection per request, so the client stays the same for all
    force_close = any(s.name == LLAMA for s in systems)
    connector = aiohttp.TCPConnector(limit=0, force_close=force_close)
    word_tokens = args.model_dir is None and args.gguf is None
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for system in systems:
            await wait_ready(
                system.base_url, system.proc, timeout_s=args.start_timeout_s, path=READY_PATHS[system.name]
            )
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
                    runs.append(await run_workload(session, system, systems, w, segments, rep, word_tokens))
                    r = runs[-1]
                    log(
                        f"rep {rep} {w.name:<3}{system.name:<10}"
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
