"""throughput.py's Hugging Face baselines on the same model and prompts: `generate` one request at
a time (c) and on the static batch (d), the bare forward in a tight loop with DynamicCache (e, the
"roofline"), and transformers' own continuous batching, `generate_batch` (f)."""

from __future__ import annotations

import time

import torch
from throughput_modes import BenchContext, CpuMeter, ModeResult
from transformers import DynamicCache, GenerationConfig, LlamaForCausalLM


def hf_generate(model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
    """Greedy, exactly `max_new_tokens` each; prompts share one length, so no padding is needed."""
    input_ids = torch.tensor(prompts)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,  # as ignore_eos: no stop at EOS, and no EOS masked (min_new_tokens would)
        pad_token_id=0,
    )
    return out[:, input_ids.shape[1] :]


def mode_hf_sequential(ctx: BenchContext) -> ModeResult:
    model, w = ctx.hf_model(), ctx.workload
    num_measured = min(w.num_hf_sequential or w.num_requests, w.num_requests)
    hf_generate(model, [ctx.prompts[0][:8]], 4)  # warmup
    result = ModeResult("c", num_requests=w.num_requests, num_output_tokens=w.output_len * w.num_requests)
    meter, start = CpuMeter(), time.perf_counter()
    for prompt in ctx.prompts[:num_measured]:
        result.outputs.append(hf_generate(model, [prompt], w.output_len)[0].tolist())
    measured_s = time.perf_counter() - start
    meter.stop(result)
    result.wall_s = measured_s * w.num_requests / num_measured
    if num_measured < w.num_requests:
        result.note = f"measured {num_measured} of {w.num_requests} ({measured_s:.1f} s), wall extrapolated"
    return result


def mode_hf_static_batch(ctx: BenchContext) -> ModeResult:
    model, w = ctx.hf_model(), ctx.workload
    hf_generate(model, [p[:8] for p in ctx.prompts[:2]], 4)  # warmup
    meter, start = CpuMeter(), time.perf_counter()
    tokens = hf_generate(model, ctx.prompts, w.output_len)
    result = ModeResult("d", num_requests=w.num_requests, wall_s=time.perf_counter() - start)
    meter.stop(result)
    result.outputs = tokens.tolist()
    result.num_output_tokens = tokens.numel()
    return result


@torch.inference_mode()
def forward_loop(model: LlamaForCausalLM, prompts: list[list[int]], num_tokens: int) -> torch.Tensor:
    """One batched prefill forward, then greedy decode steps on the cache; [batch, num_tokens]."""
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor(prompts), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    next_ids = logits[:, -1].argmax(-1, keepdim=True)  # [batch, 1]
    generated = [next_ids]
    for _ in range(num_tokens - 1):
        logits = model(input_ids=next_ids, past_key_values=cache, use_cache=True).logits
        next_ids = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(next_ids)
    return torch.cat(generated, dim=1)


def mode_roofline(ctx: BenchContext) -> ModeResult:
    model, w = ctx.hf_model(), ctx.workload
    forward_loop(model, [p[:8] for p in ctx.prompts[:2]], 4)  # warmup
    meter, start = CpuMeter(), time.perf_counter()
    tokens = forward_loop(model, ctx.prompts, w.output_len)
    result = ModeResult("e", num_requests=w.num_requests, wall_s=time.perf_counter() - start)
    meter.stop(result)
    result.outputs = tokens.tolist()
    result.num_output_tokens = tokens.numel()
    return result


def mode_hf_continuous(ctx: BenchContext) -> ModeResult:
    from transformers import ContinuousBatchingConfig

    model, w = ctx.hf_model(), ctx.workload
    page_size = 64
    pages_per_request = -(-(w.prompt_len + w.output_len) // page_size)
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=w.num_requests * pages_per_request + 4,  # CPU: nothing to infer it from
        max_batch_tokens=w.max_num_batched_tokens,
        max_requests_per_batch=w.num_requests,
        allow_block_sharing=False,
    )
    gen_config = GenerationConfig(max_new_tokens=w.output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batch = lambda prompts, **kw: model.generate_batch(  # noqa: E731
        inputs=prompts, generation_config=gen_config, continuous_batching_config=cb_config, warmup=False, **kw
    )
    batch([p[:8] for p in ctx.prompts[:2]], max_new_tokens=4)  # warmup
    meter, start = CpuMeter(), time.perf_counter()
    outputs = list(batch(ctx.prompts).values())  # in input order
    result = ModeResult("f", num_requests=len(outputs), wall_s=time.perf_counter() - start)
    meter.stop(result)
    errors = [o.error for o in outputs if o.error]
    if errors or len(outputs) != w.num_requests:
        result.error = f"{len(outputs)}/{w.num_requests} outputs; errors: {errors}"
    result.outputs = [list(o.generated_tokens) for o in outputs]
    result.num_output_tokens = sum(len(o) for o in result.outputs)
    result.note = f"attn={model.config._attn_implementation}, page_size={page_size}; timed call includes setup"
    return result
