"""Two tenants on one engine: per-tenant token share over time and B's TTFT, fair share vs FIFO.

Tenant A opens `--a-streams` long streams on an engine that runs at most `--max-num-seqs`
sequences; once A is running, tenant B opens `--b-streams`. Both policies run in this one
process on the same model (the demo model by default), one after the other.

    python bench/fairness.py [--weight-a 3] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.loader import load_model  # noqa: E402
from engine.model_runner import CacheConfig  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from launch import EngineConfig, build_engine  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run(args: argparse.Namespace, policy: str, loaded) -> dict:
    cfg = EngineConfig(max_num_seqs=args.max_num_seqs, policy=policy, cache=CacheConfig(kv_cache_gib=0.25))
    engine = build_engine(loaded, cfg)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompt = loaded.tokenizer.encode("KING HENRY:\n")
    for i in range(args.a_streams):
        engine.add_request(GenerationRequest(f"A{i}", prompt, params, tenant="A", weight=args.weight_a))
    for _ in range(args.warmup_steps):
        engine.step()
    sent = time.perf_counter()
    for i in range(args.b_streams):
        engine.add_request(GenerationRequest(f"B{i}", prompt, params, tenant="B", weight=args.weight_b))
    ttft: dict[str, float] = {}
    windows: list[tuple[int, int]] = []
    a = b = 0
    b_left = args.b_streams
    while engine.has_work() and b_left:
        for event in engine.step():
            if event.request_id.startswith("B"):
                ttft.setdefault(event.request_id, time.perf_counter() - sent)
                b += len(event.token_ids)
                b_left -= event.finished
            else:
                a += len(event.token_ids)
        if engine.num_steps % args.window_steps == 0:
            windows.append((a, b))
            a = b = 0
    windows.append((a, b))
    for request_id in list(engine.requests):
        engine.abort(request_id)
    total_a, total_b = sum(w[0] for w in windows), sum(w[1] for w in windows)
    return {"policy": policy, "windows": windows, "share_b": total_b / max(1, total_a + total_b),
            "ttft": list(ttft.values()), "preemptions": engine.scheduler.num_preemptions}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "demo"))
    p.add_argument("--a-streams", type=int, default=24)
    p.add_argument("--b-streams", type=int, default=4)
    p.add_argument("--output-len", type=int, default=300)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--weight-a", type=float, default=1.0)
    p.add_argument("--weight-b", type=float, default=1.0)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--window-steps", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="shorter streams")
    args = p.parse_args()
    if args.quick:
        args.output_len, args.window_steps = 120, 20
    loaded = load_model(args.model)
    expected = args.weight_b / (args.weight_a + args.weight_b)
    print(f"A: {args.a_streams} streams (weight {args.weight_a:g}), B: {args.b_streams} streams "
          f"(weight {args.weight_b:g}), {args.output_len} tokens each, max_num_seqs={args.max_num_seqs}")
    print(f"B's fair share while both are backlogged: {expected:.2f}\n")
    for policy in ("fair", "fifo"):
        result = run(args, policy, loaded)
        shares = " ".join(f"{b / max(1, a + b):.2f}" for a, b in result["windows"])
        ttft = result["ttft"]
        print(f"{policy:5} B share {result['share_b']:.3f}  B TTFT p50 {statistics.median(ttft):.2f}s "
              f"p99 {percentile(ttft, 99):.2f}s  preemptions {result['preemptions']}")
        print(f"      B share per {args.window_steps}-step window until B is done: {shares}")


if __name__ == "__main__":
    main()
