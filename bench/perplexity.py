"""Perplexity of one model, float vs weight-only int8 vs int4, through our decoder's forward.

Text: the last 5% of the Tiny Shakespeare corpus, `--data PATH` (the slice the demo model's training
held out; SmolLM2 was not tuned on it, and a relative comparison needs only the same text for
every variant). It is tokenized once and cut into non-overlapping windows of `--window` tokens;
each window is one prefill of `engine.models.llama.LlamaForCausalLM` over a paged KV cache
(`engine.attention.build_metadata`) with logits at every position, on the C++ kernels as the
server runs it (on CPU in float32; `--torch` for the torch path: a file's blocks de-quantized),
and the perplexity is exp(mean next-token NLL) over all windows. `--score-from N` scores only the
predictions of positions N + 1 onwards in each window, as llama.cpp's `llama-perplexity` does with
N = half its context (`-c 512`: N = 256), so the two tools' figures on one file compare directly
(`--dump-text PATH` writes the held-out slice for its `-f`).

    python bench/perplexity.py --data PATH                      # fp32,int8,int4 on SmolLM2-135M
    python bench/perplexity.py --data PATH --variants fp32,blocks --score-from 256   # = llama-perplexity -c 512
    python bench/perplexity.py --data PATH --variants fp32,int8,int8-nohead,int4,int4-g64,int4-nohead --windows 32

Variant names as in bench/quantization.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.quantization import SMOLLM2, parse_variant  # noqa: E402
from engine.attention import build_metadata  # noqa: E402
from engine.cpu_kernels import CPU_KERNELS  # noqa: E402
from engine.loader import LoadedModel, load_model  # noqa: E402

HELD_OUT_FRACTION = 0.05  # scripts/train_demo_model.py's VAL_FRACTION
BLOCK_SIZE = 16


def held_out_text(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    return text[int(len(text) * (1 - HELD_OUT_FRACTION)):]


def held_out_windows(loaded: LoadedModel, path: Path, window: int, max_windows: int) -> list[list[int]]:
    ids = loaded.tokenizer(held_out_text(path), add_special_tokens=False)["input_ids"]
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)][:max_windows]


@torch.inference_mode()
def window_nll(loaded: LoadedModel, tokens: list[int], score_from: int = 0, kernels: Any = None) -> tuple[float, int]:
    """(sum of next-token NLL, count) of one window run as a single prefill, over the predictions
    made at positions score_from onwards."""
    model, device, n = loaded.model, loaded.device, len(tokens)
    num_blocks = -(-n // BLOCK_SIZE)
    s = model.shape
    kv_caches = [tuple(torch.zeros(num_blocks * BLOCK_SIZE, s.num_kv_heads, s.head_dim, device=device,
                                   dtype=loaded.dtype) for _ in range(2)) for _ in range(s.num_layers)]
    table = list(range(num_blocks))
    meta = build_metadata([], [(table, 0, n)], list(range(n)), BLOCK_SIZE, s.sliding_window, device, kernels)
    ids = torch.tensor(tokens, device=device)
    logits = model(ids, torch.arange(n, device=device), kv_caches, meta, torch.arange(score_from, n - 1, device=device))
    return F.cross_entropy(logits.float(), ids[score_from + 1:], reduction="sum").item(), n - 1 - score_from


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--variants", default="fp32,int8,int4")
    p.add_argument("--data", type=Path, required=True, help="tinyshakespeare.txt (not in the repo: docs/testing.md)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--windows", type=int, default=16, help="at most this many windows")
    p.add_argument("--score-from", type=int, default=0, help="score each window's predictions from this position")
    p.add_argument("--torch", action="store_true", help="the torch path instead of the C++ kernels")
    p.add_argument("--dump-text", type=Path, help="write the held-out slice here (for llama-perplexity -f) and exit")
    args = p.parse_args()
    if args.dump_text:
        args.dump_text.write_text(held_out_text(args.data), encoding="utf-8")
        return
    results: dict[str, float] = {}
    for name in args.variants.split(","):
        loaded = load_model(args.model, quantization=parse_variant(name))
        windows = held_out_windows(loaded, args.data, args.window, args.windows)
        on_kernels = not args.torch and loaded.device.type == "cpu" and loaded.dtype == torch.float32
        kernels = CPU_KERNELS.ops if on_kernels and CPU_KERNELS.wait() else None
        started = time.perf_counter()
        total, count = 0.0, 0
        for tokens in windows:
            nll, n = window_nll(loaded, tokens, args.score_from, kernels)
            total, count = total + nll, count + n
        results[name] = math.exp(total / count)
        print(f"{name}: perplexity {results[name]:.3f} over {count} tokens ({len(windows)} windows of "
              f"{args.window}, {'C++ kernels' if kernels is not None else 'torch path'}) "
              f"in {time.perf_counter() - started:.0f} s", flush=True)
        del loaded
    base_name = next(iter(results))
    print(f"\n| variant | perplexity | vs {base_name} |\n|---|---|---|")
    for name, ppl in results.items():
        print(f"| {name} | {ppl:.3f} | {100 * (ppl / results[base_name] - 1):+.2f}% |")


if __name__ == "__main__":
    main()
