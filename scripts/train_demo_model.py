"""Train the tiny "demo" model that galley serves by default.

The demo model is a ~3.7M-parameter Llama-architecture causal LM trained from
scratch on the Tiny Shakespeare corpus in a few minutes on a CPU. It exists so
the server, its tests and its examples have a real Hugging Face model folder to
load without any network access. It writes bad-but-recognisable Shakespeare and
follows the ChatML chat template well enough to answer one turn and stop.

What the script does:

1. Trains a byte-level BPE tokenizer (vocab 2048) on the corpus with the special
   tokens ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>`` and wraps it as a
   ``PreTrainedTokenizerFast`` with a ChatML ``chat_template``.
2. Builds training samples: 128-token windows of plain text (~75%) and
   chat-formatted pairs of consecutive speaker turns (~25%), where one turn is
   the user message and the next the assistant reply, ended by ``<|im_end|>``.
3. Trains a ``LlamaForCausalLM`` (hidden 256, 4 layers, 8 heads, 4 KV heads,
   tied embeddings) with AdamW, linear warmup and cosine decay over the time or
   step budget, whichever ends first.
4. Saves model (bfloat16 safetensors), generation config and tokenizer to
   ``--out``, reloads the folder with the Auto classes and prints two samples.

Everything is seeded (model init, data order); the only source of run-to-run
variation is the number of steps that fit into the ``--minutes`` budget. Use
``--steps`` with a generous ``--minutes`` (e.g. 600) for a step-driven rerun.

Reproduce from the repository root with::

    python scripts/train_demo_model.py --data /path/to/tinyshakespeare.txt

The corpus is not part of the repository (it ships the trained weights only): pass its path
with ``--data`` (or ``--corpus``), or set ``GALLEY_CORPUS``; see docs/models.md.

Options: ``--data`` (corpus path), ``--out`` (output folder, default
``models/demo``), ``--minutes`` (training time budget, default 8), ``--steps``
(optional step cap), ``--seed``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

REPO_ROOT = Path(__file__).resolve().parents[1]

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]
VOCAB_SIZE = 2048
SEQ_LEN = 128
BATCH_SIZE = 16
CHAT_FRACTION = 0.25
LEARNING_RATE = 3e-3
WARMUP_STEPS = 100
LOG_EVERY = 50
VAL_FRACTION = 0.05

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Budget:
    """When to stop training: after ``seconds`` of training or ``steps`` steps."""

    seconds: float
    steps: int | None

    def progress(self, step: int, elapsed: float) -> float:
        """Fraction of the budget used, in [0, 1]; drives the LR schedule."""
        frac = elapsed / self.seconds
        if self.steps is not None:
            frac = max(frac, step / self.steps)
        return min(frac, 1.0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data",
        "--corpus",
        type=Path,
        default=os.environ.get("GALLEY_CORPUS"),
        required="GALLEY_CORPUS" not in os.environ,
        help="training corpus (tinyshakespeare.txt, not in the repository; default: $GALLEY_CORPUS); "
        "relative paths are resolved against the repo root",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("models/demo"),
        help="output folder; relative paths are resolved against the repo root",
    )
    parser.add_argument("--minutes", type=float, default=8.0, help="training time budget")
    parser.add_argument("--steps", type=int, default=None, help="optional cap on optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def resolve(path: Path) -> Path:
    """Resolve ``path`` against the repository root unless it is absolute."""
    return path if path.is_absolute() else (REPO_ROOT / path).resolve()


# --------------------------------------------------------------------- tokenizer


def train_tokenizer(text: str) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``text`` and wrap it for transformers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


# -------------------------------------------------------------------------- data


def split_turns(text: str) -> list[tuple[str, str]]:
    """Split the play into ``(speaker, speech)`` turns (blocks of "NAME:\\nlines")."""
    turns = []
    for block in text.split("\n\n"):
        head, _, body = block.strip().partition("\n")
        if head.endswith(":") and body.strip():
            turns.append((head[:-1], body.strip()))
    return turns


def chat_samples(turns: list[tuple[str, str]], tokenizer: PreTrainedTokenizerFast) -> list[list[int]]:
    """Token ids of ChatML conversations made from consecutive speaker turns.

    Turn ``i`` is the user message, turn ``i + 1`` the assistant reply (ended by
    ``<|im_end|>``). Pairs that do not fit in ``SEQ_LEN`` tokens are dropped so
    every sample keeps its closing ``<|im_end|>``.
    """
    samples = []
    for (_, user), (_, reply) in zip(turns, turns[1:]):
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=False, verbose=False).input_ids
        if len(ids) <= SEQ_LEN:
            samples.append(list(ids))
    return samples


class Batcher:
    """Seeded sampler mixing plain-text windows and padded chat samples."""

    def __init__(self, tokens: torch.Tensor, chats: list[list[int]], pad_id: int, seed: int) -> None:
        self.tokens = tokens
        self.chats = chats
        self.pad_id = pad_id
        self.gen = torch.Generator().manual_seed(seed)

    def _randint(self, high: int) -> int:
        return int(torch.randint(high, (1,), generator=self.gen))

    def _sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.rand((1,), generator=self.gen).item() < CHAT_FRACTION:
            ids = torch.tensor(self.chats[self._randint(len(self.chats))])
            inputs = torch.full((SEQ_LEN,), self.pad_id)
            labels = torch.full((SEQ_LEN,), -100)
            inputs[: len(ids)] = ids
            labels[: len(ids)] = ids
            return inputs, labels
        start = self._randint(len(self.tokens) - SEQ_LEN)
        window = self.tokens[start : start + SEQ_LEN]
        return window, window.clone()

    def batch(self, size: int = BATCH_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self._sample() for _ in range(size)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


# ------------------------------------------------------------------------- model


def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=[eot_id, im_end_id],
        pad_token_id=eot_id,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, progress: float) -> float:
    """Linear warmup over ``WARMUP_STEPS`` steps, then cosine decay to 10% by budget end."""
    if step < WARMUP_STEPS:
        return LEARNING_RATE * (step + 1) / WARMUP_STEPS
    return LEARNING_RATE * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, tokens: torch.Tensor, n_windows: int = 64) -> float:
    """Mean loss on evenly spaced held-out windows (deterministic)."""
    model.eval()
    starts = torch.linspace(0, len(tokens) - SEQ_LEN - 1, n_windows).long()
    x = torch.stack([tokens[s : s + SEQ_LEN] for s in starts])
    loss = float(model(input_ids=x, labels=x).loss)
    model.train()
    return loss


def train(model: LlamaForCausalLM, batcher: Batcher, budget: Budget) -> float:
    """Train until the budget is spent; return the mean loss of the last log window."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.1
    )
    model.train()
    start = time.monotonic()
    step, window_losses, last_mean = 0, [], float("nan")
    while True:
        elapsed = time.monotonic() - start
        progress = budget.progress(step, elapsed)
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, progress)
        inputs, labels = batcher.batch()
        loss = model(input_ids=inputs, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        window_losses.append(loss.item())
        if step % LOG_EVERY == 0:
            last_mean = sum(window_losses) / len(window_losses)
            window_losses = []
            print(
                f"step {step:5d}  loss {last_mean:.3f}  lr {optimizer.param_groups[0]['lr']:.2e}"
                f"  {elapsed / 60:5.1f} min",
                flush=True,
            )
    if window_losses:
        last_mean = sum(window_losses) / len(window_losses)
    print(f"trained {step} steps in {(time.monotonic() - start) / 60:.1f} min", flush=True)
    return last_mean


# ------------------------------------------------------------------- save/check


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    # Keep the chat template inside tokenizer_config.json (not a separate .jinja file).
    tokenizer.save_pretrained(out, save_jinja_files=False)


def sample(out: Path) -> tuple[str, str]:
    """Reload the saved folder in float32 and return greedy text and chat samples."""
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)

    def greedy(ids: torch.Tensor) -> str:
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=60, do_sample=False)
        new = gen[0, ids.shape[1] :]
        stop = " [stopped at eos]" if int(new[-1]) in model.generation_config.eos_token_id else ""
        return tokenizer.decode(new, skip_special_tokens=True) + stop

    prompt = "ROMEO:"
    text = prompt + greedy(tokenizer(prompt, return_tensors="pt").input_ids)
    messages = [{"role": "user", "content": "Good morrow, my lord."}]
    chat_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=False
    )
    return text, greedy(chat_ids)


def main() -> None:
    args = parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    hf_logging.disable_progress_bar()
    data_path, out = resolve(args.data), resolve(args.out)

    text = data_path.read_text(encoding="utf-8")
    tokenizer = train_tokenizer(text)
    tokens = torch.tensor(tokenizer(text, verbose=False).input_ids)
    n_val = int(len(tokens) * VAL_FRACTION)
    train_tokens, val_tokens = tokens[:-n_val], tokens[-n_val:]
    chats = chat_samples(split_turns(text[: int(len(text) * (1 - VAL_FRACTION))]), tokenizer)
    print(
        f"corpus {len(text):,} chars -> {len(tokens):,} tokens "
        f"({len(text) / len(tokens):.2f} chars/token); {len(chats):,} chat samples",
        flush=True,
    )

    model = build_model(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    batcher = Batcher(train_tokens, chats, tokenizer.pad_token_id, args.seed)
    final_loss = train(model, batcher, Budget(seconds=args.minutes * 60, steps=args.steps))
    val_loss = evaluate(model, val_tokens)
    print(f"final train loss {final_loss:.3f}  held-out loss {val_loss:.3f}", flush=True)

    save(model, tokenizer, out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"saved to {out} ({size / 1e6:.2f} MB)", flush=True)

    text_sample, chat_sample = sample(out)
    print(f"--- greedy continuation of 'ROMEO:'\n{text_sample}")
    print(f"--- chat reply to 'Good morrow, my lord.'\n{chat_sample}")


if __name__ == "__main__":
    main()
