"""Tiny random-weight models and a byte-level BPE tokenizer, built from configs (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "Emoji time: 🚀🔥😀👍🏽 and flags 🇫🇷 with text around them 🎉.",
    "中文文本测试：我们的推理服务器支持流式输出。日本語のテキストも少し。한국어 문장.",
    "def main():\n    print('hello world')\n    return 42\n",
    "Numbers 0123456789 and punctuation !?.,;:-_()[]{}<>@#$%^&*",
]
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
)


def build_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_for(family: str, vocab_size: int, **overrides):
    kw = dict(COMMON, vocab_size=vocab_size, **overrides)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw, tie_word_embeddings=False))
    if family == "llama3-rope":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        return LlamaForCausalLM(LlamaConfig(**kw, rope_parameters=rope, tie_word_embeddings=True))
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(**{"sliding_window": 4096, **kw}))
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**kw, tie_word_embeddings=True))
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**kw, head_dim=32, tie_word_embeddings=True))
    raise ValueError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "llama3-rope")

# Families beyond the dense native ones: the config class and its overrides. gemma3 mixes sliding-window
# (of 8 tokens) and full layers; qwen3moe and mixtral are mixtures of experts (native, and generic when asked).
GENERIC_FAMILIES: dict[str, tuple[str, dict]] = {
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", dict(pad_token_id=0)),
    "qwen3moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    # a dense first layer, then experts whose top 2 weights are renormalised
    "qwen3moe-mixed": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              head_dim=16, mlp_only_layers=[0], norm_topk_prob=True)),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=8)),  # attention logit soft-capping
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)),  # GPT2LMHeadModel
    "opt": ("OPTConfig", dict(ffn_dim=128, word_embed_proj_dim=64)),
    # refused at load, each naming why
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8)),
    "llama4": ("Llama4TextConfig", dict(head_dim=16, num_local_experts=2, intermediate_size_mlp=128,
                                        attention_chunk_size=8)),
    "falcon": ("FalconConfig", {}),  # its own attention classes, no pluggable implementation
}


def save_generic_model(family: str, out: Path, seed: int = 0) -> Path:
    """A tiny random model of a family that only the generic backend serves, saved as an HF folder."""
    import transformers

    config_class, overrides = GENERIC_FAMILIES[family]
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = getattr(transformers, config_class)(**dict(COMMON, vocab_size=len(tokenizer), **overrides))
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_tiny_model(family: str, out: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = model_for(family, len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_scripted_model(out: Path, text: str) -> list[int]:
    """A Llama whose greedy output is scripted: from each token of `text` it predicts the next.

    Attention and MLP outputs are zeroed, so the last hidden state is the current token's
    embedding; the LM head row of each successor is its predecessor's embedding, and random
    64-d embeddings are near-orthogonal, so argmax picks the successor. Returns the ids of
    `text` (which must not repeat a token).
    """
    tokenizer = build_tokenizer()
    ids = tokenizer.encode(text)
    assert len(set(ids)) == len(ids), "scripted text must not repeat a token"
    torch.manual_seed(0)
    model = model_for("llama", len(tokenizer))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.randn(len(tokenizer), model.config.hidden_size)
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.randn(len(tokenizer), model.config.hidden_size) * 0.1
        for current, successor in zip(ids, ids[1:]):
            head[successor] = emb[current]
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return ids


def save_lora_adapter(base: Path, out: Path, target_modules: list[str], r: int = 4, seed: int = 0,
                      **config) -> Path:
    """A random PEFT LoRA adapter of `base` (A and B both random, so it changes the output), saved
    as PEFT saves one: adapter_config.json and adapter_model.safetensors."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    lora = LoraConfig(r=r, target_modules=target_modules, init_lora_weights=False, **config)
    get_peft_model(model, lora).save_pretrained(out)
    return out


VISION_TEMPLATE = (  # the tests' chat template, with images as content parts (Hugging Face's convention)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def save_vision_model(family: str, out: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    """A tiny random vision-language model with its processor (32 px images, 8 px patches), saved as
    an HF folder: `llava` (CLIP encoder, Llama text model: 16 image tokens an image), `idefics3`
    (SmolVLM's architecture: SigLIP-style encoder, pixel shuffle to 4 image tokens, framed by
    `<fake_token_around_image><global-img>`), `gemma3` (SigLIP, 4 image tokens that attend to each
    other both ways), `paligemma` (SigLIP, 16 image tokens, the whole prompt attending both ways),
    `paligemma2` (the same with Gemma 2's soft-capped text model),
    `qwen2_vl` or `qwen2_5_vl` (multi-axis rotary positions). `chat_template` replaces the processor's."""
    import transformers

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    extra = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>"] if family == "idefics3" else []
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", *extra]})
    tokenizer.chat_template = VISION_TEMPLATE
    text = LlamaConfig(**dict(COMMON, vocab_size=len(tokenizer)), tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    if family == "llava":
        config = transformers.LlavaConfig(
            text_config=text, vision_config=transformers.CLIPVisionConfig(**vision, projection_dim=32),
            image_token_index=image_token, vision_feature_layer=-1, vision_feature_select_strategy="default")
        model = transformers.LlavaForConditionalGeneration(config)
        processor = transformers.LlavaProcessor(
            image_processor=transformers.CLIPImageProcessorPil(size={"shortest_edge": 32},
                                                              crop_size={"height": 32, "width": 32}),
            tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1,
            image_token="<image>", chat_template=VISION_TEMPLATE)
    elif family == "idefics3":
        config = transformers.Idefics3Config(
            text_config=text.to_dict(), vision_config=transformers.Idefics3VisionConfig(**vision).to_dict(),
            image_token_id=image_token, scale_factor=2)
        model = transformers.Idefics3ForConditionalGeneration(config)
        processor = transformers.Idefics3Processor(
            image_processor=transformers.Idefics3ImageProcessorPil(
                do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32}),
            tokenizer=tokenizer, image_seq_len=4, chat_template=VISION_TEMPLATE)
    elif family == "gemma3":  # its image tokens attend to each other both ways
        template = VISION_TEMPLATE.replace("<image>", "<start_of_image>")
        tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<end_of_image>",
                                                                    "<image_soft_token>"]})
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
            chat_template=template,
            extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                  "image_token": "<image_soft_token>"})
        config = transformers.Gemma3Config(
            text_config=transformers.Gemma3TextConfig(**dict(COMMON, vocab_size=len(tokenizer)), head_dim=16,
                                                      sliding_window=8,
                                                      layer_types=["sliding_attention", "full_attention"]),
            vision_config=transformers.SiglipVisionConfig(**vision), mm_tokens_per_image=4,
            image_token_index=tokenizer.image_token_id, boi_token_index=tokenizer.boi_token_id,
            tie_word_embeddings=False)  # tied to its scaled embeddings, a tiny Gemma repeats its last token
        model = transformers.Gemma3ForConditionalGeneration(config)
        with torch.no_grad():  # transformers starts the projector and the (1 + w) norms at zero: images unseen
            for name, weight in model.named_parameters():
                if "multi_modal_projector" in name or "norm" in name and "vision_tower" not in name:
                    weight.normal_(0.0, 0.1)
        processor = transformers.Gemma3Processor(
            image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tokenizer,
            chat_template=template, image_seq_length=4)
    elif family in ("paligemma", "paligemma2"):  # its whole prompt (image and text) attends both ways: a prefix LM
        tokenizer.bos_token = "<|im_start|>"  # the processor puts it between the image and the text
        gemma = dict(COMMON, vocab_size=len(tokenizer), head_dim=16, tie_word_embeddings=False)
        if family == "paligemma2":  # Gemma 2's text model: scores and logits soft-capped (low caps: tanh bends
            # the tiny model's scores), every other layer a sliding window shorter than the prompt
            text_config = transformers.Gemma2Config(**gemma, sliding_window=8, attn_logit_softcapping=1.0,
                                                    final_logit_softcapping=3.0, query_pre_attn_scalar=16)
        else:
            text_config = transformers.GemmaConfig(**gemma)
        config = transformers.PaliGemmaConfig(
            text_config=text_config.to_dict(),
            vision_config=transformers.SiglipVisionConfig(**vision).to_dict(), image_token_index=image_token,
            projection_dim=64, tie_word_embeddings=False)
        model = transformers.PaliGemmaForConditionalGeneration(config)
        images = transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32})
        images.image_seq_length = 16
        processor = transformers.PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer,
                                                    chat_template=VISION_TEMPLATE)
    elif family in ("qwen2_vl", "qwen2_5_vl"):  # multi-axis rotary positions; 4 image tokens a 32 px square
        model = qwen_vision_model(family, tokenizer)
        model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        model.save_pretrained(out)
        return save_qwen_processor(family, tokenizer, out)
    else:
        raise ValueError(family)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(out)
    if chat_template is not None:
        processor.chat_template = chat_template
    processor.save_pretrained(out)
    return out


QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def qwen_vision_model(family: str, tokenizer):
    """Qwen2-VL (`qwen2_vl`) or Qwen2.5-VL (`qwen2_5_vl`, windowed vision attention and a gated MLP):
    8 px patches merged 2 x 2 into one image token; the text model's rotary split into (time, row,
    column) sections."""
    import transformers

    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VISION_TOKENS})
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(QWEN_VISION_TOKENS)))
    text_config = dict(COMMON, vocab_size=len(tokenizer), rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    common = dict(depth=2, num_heads=4, patch_size=8, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":
        config = transformers.Qwen2VLConfig(
            text_config=text_config, vision_config=dict(common, embed_dim=32, hidden_size=64, mlp_ratio=2), **ids)
        return transformers.Qwen2VLForConditionalGeneration(config)
    vision = dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=32,
                  fullatt_block_indexes=[1])
    return transformers.Qwen2_5_VLForConditionalGeneration(
        transformers.Qwen2_5_VLConfig(text_config=text_config, vision_config=vision, **ids))


def save_qwen_processor(family: str, tokenizer, out: Path) -> Path:
    """The processor's parts as Qwen's own folders hold them (`preprocessor_config.json` naming the
    processor class, `chat_template.json`). Its video part needs torchvision, which has no build for
    this machine's torch, so galley loads it without one (engine/processors.py)."""
    import transformers

    template = VISION_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    images = transformers.Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=64 * 64, patch_size=8,
                                                   merge_size=2, temporal_patch_size=2)
    images.save_pretrained(out)
    settings = json.loads((out / "preprocessor_config.json").read_text())
    name = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}[family]
    (out / "preprocessor_config.json").write_text(json.dumps({**settings, "processor_class": name}))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    return out
