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
import dataclasses
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from client import common_prefix_len, log, percentile_ms
from hf_baselines import mode_hf_continuous, mode_hf_sequential, mode_hf_static_batch, mode_roofline
from servers import NEIGHBOURS, neighbour
from synthetic import ModelShape, save_model
from throughput_modes import (
    ALL_MODES,
    MODE_LABELS,
    SERVER_MODES,
    BenchContext,
    ModeResult,
    Workload,
    mode_engine,
    run_server_modes,
)

RATIOS = (("a", "e"), ("a", "c"), ("a", "d"), ("a", "f"), ("b", "e"), ("a", "b"), ("a1", "c"), ("b1", "c"))


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
    p.add_argument("--neighbour", default="none", choices=list(NEIGHBOURS),
                   help="one busy process beside every mode while it is measured (nice 0 or nice 19)")
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
        with neighbour(args.neighbour):
            results = run_all(ctx, modes)
    report = render(results, ctx)
    if args.json:
        write_json(args.json, results, ctx)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
