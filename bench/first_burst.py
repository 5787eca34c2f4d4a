"""The first burst after a fresh start against the next ones (issue 34: "full speed from the first
request"): `python server.py` on a SmolLM2-135M-shaped random model, and as soon as `/ready` says
so, workload W (32 concurrent streams, 128-token prompts, 128 greedy tokens, EOS ignored) three
times over, fresh prompts each time, with no warm-up. Repeated over `--starts` fresh server starts.

    python bench/first_burst.py --starts 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import torch
from client import log, send_requests
from servers import REPO_ROOT, start_galley, stop_system, wait_ready
from synthetic import ModelShape, save_model


async def bursts(base_url: str, num: int, vocab: int, seed: int, args) -> list[dict]:
    out = []
    for i in range(num):
        gen = torch.Generator().manual_seed(seed * 100 + i)
        prompts = torch.randint(3, vocab, (args.streams, args.prompt_len), generator=gen).tolist()
        stats, wall = await send_requests(base_url, prompts, args.output_len, concurrent=True)
        tokens = sum(s.completion_tokens or len(s.texts) for s in stats)
        ttft = statistics.mean(s.chunk_s[0] - s.send_s for s in stats)
        out.append({"burst": i + 1, "tok_s": tokens / wall, "ttft_s": ttft})
        log(f"burst {i + 1}: {tokens / wall:.1f} tok/s, TTFT {ttft:.2f} s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=2)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    args = parser.parse_args()
    args.max_num_batched_tokens, args.galley_quantization, args.galley_dir = None, None, REPO_ROOT
    shape = ModelShape()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_model(shape, model_dir, seed=0)
        for start in range(args.starts):
            system = start_galley(args, model_dir, Path(tmp), max_num_seqs=args.streams)
            try:
                asyncio.run(wait_ready(f"http://127.0.0.1:{system.port}", system.proc))
                rows.append(asyncio.run(bursts(f"http://127.0.0.1:{system.port}", args.bursts, shape.vocab_size,
                                               start, args)))
            finally:
                stop_system(system)
    header = " | ".join(f"burst {i + 1} tok/s (TTFT s)" for i in range(args.bursts))
    print(f"\n| start | {header} | first / second |")
    print("|---|" + "---|" * (args.bursts + 1))
    for start, row in enumerate(rows):
        cells = " | ".join(f"{b['tok_s']:.0f} ({b['ttft_s']:.2f})" for b in row)
        print(f"| {start + 1} | {cells} | {row[0]['tok_s'] / row[1]['tok_s']:.2f} |")


if __name__ == "__main__":
    main()
