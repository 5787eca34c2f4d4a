"""Models beyond the dense native families, through the real app and the openai SDK: greedy text
equals HF `generate` on the same weights, `/v1/models` says how each model runs (a mixture of
experts natively, Gemma 3 on the generic backend, Qwen3 on either), and a model the
paged attention cannot compute fails its load with a message that names why (never served wrong)."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from storage.registry import ModelVersion
from tests.api.test_deployments import make_stack, register  # noqa: F401 (fixtures)
from tests.engine.test_reference import generate_greedy, prompts


def sdk_for(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(stack.client.session._base_url) + "v1", api_key=stack.key, max_retries=0)


async def test_generic_models_answer_as_hf_and_say_how_they_run(make_stack, generic_models, tiny_models):  # noqa: F811
    stack = await make_stack([
        ModelVersion("moe", "1", str(generic_models["qwen3moe"])),
        ModelVersion("gemma", "1", str(generic_models["gemma3"])),
        ModelVersion("olmo", "1", str(generic_models["olmo2"])),
        ModelVersion("qwen-generic", "1", str(tiny_models["qwen3"]), options={"backend": "generic"}),
        ModelVersion("qwen", "1", str(tiny_models["qwen3"])),
    ])
    sdk = sdk_for(stack)
    cards = {card.id: card.model_extra for card in (await sdk.models.list()).data}
    assert (cards["moe"]["architecture"], cards["moe"]["family"], cards["moe"]["backend"]) == (
        "Qwen3MoeForCausalLM", "qwen3_moe", "native")
    assert (cards["gemma"]["architecture"], cards["gemma"]["backend"]) == ("Gemma3ForCausalLM", "native")
    assert (cards["olmo"]["architecture"], cards["olmo"]["backend"]) == ("Olmo2ForCausalLM", "generic")
    assert (cards["qwen-generic"]["backend"], cards["qwen"]["backend"]) == ("generic", "native")

    for name, path in (("moe", generic_models["qwen3moe"]), ("gemma", generic_models["gemma3"]),
                       ("olmo", generic_models["olmo2"]), ("qwen-generic", tiny_models["qwen3"])):
        tokenizer = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(path).eval()
        batch = prompts(3, 300, lengths=[5, 30, 12], seed=2)
        answers = [sdk.completions.create(model=name, prompt=p, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True}) for p in batch]
        for prompt, answer in zip(batch, [await a for a in answers]):
            assert answer.choices[0].text == tokenizer.decode(generate_greedy(hf, prompt, 10)), name
        streamed = await sdk.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=8, temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True})
        text = "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices])
        whole = await sdk.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert text == whole.choices[0].message.content
    await sdk.close()


@pytest.mark.parametrize("family, why", [("gpt_oss", "attention sinks")])
async def test_a_model_the_paged_attention_cannot_compute_fails_its_load_naming_why(
        make_stack, generic_models, tiny_models, family, why):  # noqa: F811
    stack = await make_stack([ModelVersion("tiny", "1", str(tiny_models["llama"]))])
    await register(stack, "capped", "1", str(generic_models[family]))
    status, body = await stack.client.admin("POST", "/models/capped/versions/1/load")
    await stack.wait_state("capped@1", "failed")
    status, listed = await stack.client.admin("GET", "/models")
    [shown] = [v for v in listed["data"] if v["name"] == "capped"]
    assert why in shown["error"] and "cannot be served" in shown["error"]
    sdk = sdk_for(stack)
    with pytest.raises(openai.APIStatusError) as failed:
        await sdk.completions.create(model="capped", prompt="hi", max_tokens=2)
    assert failed.value.status_code == 503 and failed.value.body["code"] == "model_load_failed"  # details: admin only
    await sdk.close()
