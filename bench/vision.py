"""Vision chat throughput: the engine (generic backend, image features merged into the paged prefill)
against HF `generate` on the same LLaVA, in-process, side by side in one run.

The model is a seeded random LLaVA: a SmolLM2-135M-shaped Llama (30 layers, hidden 576, vocab of the
demo tokenizer plus `<image>`) under a small CLIP encoder (224 px, 32 px patches: 49 image tokens,
hidden 384, 6 layers), with its processor. N requests each bring their own image and a short
question; O greedy tokens each, EOS ignored. The engine runs them at once (continuous batching);
HF `generate` runs them one at a time, as a server without batching would, and as one padded batch.

    python bench/vision.py
    python bench/vision.py --requests 16 --output-len 64
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/vision.py`

from engine.loader import load_model  # noqa: E402
from engine.types import GenerationRequest, ImageInputs, SamplingParams  # noqa: E402
from launch import EngineConfig, build_engine  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    "<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_llava(out: Path, num_layers: int) -> Path:
    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = transformers.LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                    intermediate_size=1536, num_hidden_layers=num_layers, vocab_size=len(tokenizer),
                                    max_position_embeddings=2048, tie_word_embeddings=True)
    vision = transformers.CLIPVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                                           num_attention_heads=6, image_size=224, patch_size=32, projection_dim=384)
    config = transformers.LlavaConfig(text_config=text, vision_config=vision,
                                      image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                                      vision_feature_layer=-1, vision_feature_select_strategy="default")
    transformers.LlavaForConditionalGeneration(config).save_pretrained(out)
    transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessorPil(size={"shortest_edge": 224},
                                                          crop_size={"height": 224, "width": 224}),
        tokenizer=tokenizer, patch_size=32, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token="<image>", chat_template=TEMPLATE).save_pretrained(out)
    return out


def requests(processor, n: int) -> list[tuple[dict, bytes]]:
    """(the processor's encoding, the image's PNG) of n chats with an image each."""
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        image = Image.fromarray(rng.integers(0, 255, (200 + 8 * i, 260, 3), dtype=np.uint8))
        png = io.BytesIO()
        image.save(png, format="PNG")
        chat = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": f"What do you see in picture {i}?"}]}]
        out.append((processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, return_tensors="np"), png.getvalue()))
    return out


def engine_run(path: Path, chats: list[tuple[dict, bytes]], output_len: int) -> tuple[float, float, list]:
    """(tok/s, mean TTFT s, outputs) of the chats at once through the engine."""
    engine = build_engine(load_model(str(path)), EngineConfig(max_num_seqs=len(chats)), num_blocks=4096)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    def run(batch, tag: str) -> tuple[list[list[int]], list[float]]:
        outputs = {f"{tag}{i}": [] for i in range(len(batch))}
        first: dict[str, float] = {}
        start = time.perf_counter()
        for i, (encoded, png) in enumerate(batch):
            arrays = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}
            engine.add_request(GenerationRequest(f"{tag}{i}", encoded["input_ids"][0].tolist(), params, images=(
                ImageInputs(arrays, (hashlib.sha256(png).hexdigest(),)))))
        while engine.has_work():
            for event in engine.step():
                first.setdefault(event.request_id, time.perf_counter() - start)
                outputs[event.request_id].extend(event.token_ids)
        return list(outputs.values()), list(first.values())

    run(chats[:2], "warm")
    start = time.perf_counter()
    outputs, ttft = run(chats, "run")
    return sum(map(len, outputs)) / (time.perf_counter() - start), float(np.mean(ttft)), outputs


@torch.inference_mode()
def hf_run(path: Path, chats: list[tuple[dict, bytes]], output_len: int) -> tuple[float, list]:
    model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()

    def generate(encoded: dict) -> list[int]:
        inputs = {k: torch.from_numpy(v) for k, v in encoded.items()}
        out = model.generate(**inputs, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    generate(chats[0][0])
    start = time.perf_counter()
    outputs = [generate(encoded) for encoded, _ in chats]
    return sum(map(len, outputs)) / (time.perf_counter() - start), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = save_llava(Path(tmp) / "llava", args.layers)
        processor = transformers.AutoProcessor.from_pretrained(path)
        chats = requests(processor, args.requests)
        ours, ttft, outputs = engine_run(path, chats, args.output_len)
        hf, reference = hf_run(path, chats, args.output_len)
    row = {"requests": args.requests, "output_len": args.output_len,
           "prompt_tokens": int(chats[0][0]["input_ids"].shape[1]),
           "engine_tok_s": ours, "engine_ttft_mean_s": ttft, "hf_one_at_a_time_tok_s": hf, "ratio": ours / hf,
           "greedy_equals_hf": outputs == reference}
    print(json.dumps(row))
    print(f"\n| requests x (prompt + image tokens) / output | engine tok/s | engine TTFT mean | HF one at a time tok/s "
          f"| engine / HF | greedy == HF |\n|---|---|---|---|---|---|\n| {args.requests} x {row['prompt_tokens']} / "
          f"{args.output_len} | {ours:.1f} | {ttft:.2f} s | {hf:.1f} | {ours / hf:.1f}x | {row['greedy_equals_hf']} |")
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
