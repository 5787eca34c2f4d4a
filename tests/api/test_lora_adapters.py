"""LoRA adapters as models of their own, through the real app: registered over a base with the admin
API, addressed by name with the openai SDK, several of them and the base answering at once, each
equal to PEFT's unmerged model on HF `generate`; the registry's lifecycle (versions, traffic splits,
rollback, unloading) applies to them; what cannot be served is refused, naming why."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from transformers import AutoTokenizer

from storage.registry import ModelVersion
from tests.api.test_auth import ADMIN, assert_error
from tests.api.test_deployments import DEPLOYMENTS, make_stack  # noqa: F401 (fixture)
from tests.engine.test_lora import peft_greedy
from tests.engine.test_reference import hf_greedy
from tests.helpers import wait_until
from tests.models import save_lora_adapter

PROMPT = "The quick brown fox jumps over the lazy dog, and then " * 4  # a few KV blocks: prefix hits


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("api-adapters")
    base = tiny_models["llama"]
    return {"a": save_lora_adapter(base, root / "a", ["q_proj", "v_proj"], r=4, lora_alpha=32, seed=1),
            "b": save_lora_adapter(base, root / "b", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"], r=8, lora_alpha=64, seed=2, use_rslora=True)}


def sdk_for(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(stack.client.session._base_url) + "v1", api_key=stack.key, max_retries=0)


async def add_adapter(stack, name: str, folder, version: str = "1", **body) -> dict:
    status, made = await stack.client.admin("POST", "/models", json={"name": name, "version": version,
                                                                     "source": str(folder), "base": "tiny", **body})
    assert status == 201, made
    return made


def expected(base, folder, text: str = PROMPT, n: int = 8) -> str:
    tokenizer = AutoTokenizer.from_pretrained(base)
    prompt = tokenizer.encode(text)
    tokens = hf_greedy(base, prompt, n) if folder is None else peft_greedy(base, folder, prompt, n)
    return tokenizer.decode(tokens)


async def complete(sdk, model: str, prompt: str = PROMPT) -> str:
    answer = await sdk.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    return answer.choices[0].text


async def test_adapters_and_their_base_answer_together_each_as_peft(make_stack, tiny_models, adapters):  # noqa: F811
    base = tiny_models["llama"]
    stack = await make_stack([ModelVersion("tiny", "1", str(base))])
    made = await add_adapter(stack, "tiny-a", adapters["a"])
    assert made["options"] == {"base": "tiny"}
    await add_adapter(stack, "tiny-b", adapters["b"], options={"sampling_defaults": {"max_tokens": 5}})
    want = {"tiny": expected(base, None), "tiny-a": expected(base, adapters["a"]),
            "tiny-b": expected(base, adapters["b"])}
    assert len(set(want.values())) == 3  # the adapters change the answer
    sdk = sdk_for(stack)
    # the same prompt to all three at once, then a longer one: its prefix is a hit, each in its own
    # model's cache (a hit on another's KV would change the answer)
    names = ["tiny", "tiny-a", "tiny-b"]
    assert await asyncio.gather(*(complete(sdk, name) for name in names)) == [want[name] for name in names]
    longer = PROMPT + "once more"
    answers = await asyncio.gather(*(complete(sdk, name, longer) for name in names))
    assert answers == [expected(base, None, longer), expected(base, adapters["a"], longer),
                       expected(base, adapters["b"], longer)]
    assert stack.metric("galley_prefix_cache_hits_total") >= 3 * 32
    assert stack.metric("galley_requests_total", model="tiny-a") >= 2
    assert stack.metric("galley_adapters_loaded", model="tiny", version="1") == 2

    cards = {card.id: card.model_extra for card in (await sdk.models.list()).data}
    assert cards["tiny"]["adapters"] == ["tiny-a", "tiny-b"] and cards["tiny"]["parent"] is None
    assert (cards["tiny-a"]["parent"], cards["tiny-a"]["backend"], cards["tiny-a"]["ready"]) == ("tiny", "native", True)
    assert cards["tiny-b"]["sampling_defaults"]["max_tokens"] == 5  # its own options over the base's
    chat = await sdk.chat.completions.create(model="tiny-b", messages=[{"role": "user", "content": "hi"}],
                                             temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5

    # unloading the base unloads its adapters first; the next request loads both again
    status, _ = await stack.client.admin("POST", "/models/tiny/versions/1/unload")
    await stack.wait_state("tiny@1", "unloaded")
    assert stack.manager.versions["tiny-a@1"].state == "unloaded"
    assert await complete(sdk, "tiny-a") == want["tiny-a"]
    assert stack.manager.versions["tiny@1"].state == "ready"
    await sdk.close()


async def test_adapter_versions_roll_out_and_back(make_stack, tiny_models, adapters):  # noqa: F811
    base = tiny_models["llama"]
    stack = await make_stack([ModelVersion("tiny", "1", str(base))])
    await add_adapter(stack, "tuned", adapters["a"])
    await add_adapter(stack, "tuned", adapters["b"], version="2")
    sdk = sdk_for(stack)
    assert await complete(sdk, "tuned") == expected(base, adapters["a"])
    status, body = await stack.client.call("POST", DEPLOYMENTS, ADMIN,
                                           json={"model_name": "tuned", "version": "2", "traffic_percent": 100})
    assert status == 201, body
    await wait_until(lambda: stack.router.deployments["tuned"].stable == "2", what="v2 to take the traffic")
    assert await complete(sdk, "tuned") == expected(base, adapters["b"])
    status, body = await stack.client.call("POST", f"{DEPLOYMENTS}/tuned/rollback", ADMIN)
    assert status == 200, body
    assert await complete(sdk, "tuned") == expected(base, adapters["a"])
    await sdk.close()


async def test_what_cannot_be_served_is_refused_naming_why(make_stack, tiny_models, adapters, tmp_path):  # noqa: F811
    stack = await make_stack([ModelVersion("tiny", "1", str(tiny_models["llama"]))])
    post = lambda body: stack.client.admin("POST", "/models", json=body)  # noqa: E731
    folder = str(adapters["a"])
    assert_error(*await post({"name": "x", "source": folder, "base": "nope"}), 400, "invalid_request_error")
    assert_error(*await post({"name": "x", "source": folder, "base": "tiny", "options": {"dtype": "float32"}}),
                 400, "invalid_request_error")
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters["a"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    status, body = await post({"name": "x", "source": str(dora), "base": "tiny"})
    assert status == 400 and "DoRA" in body["error"]["message"]

    other = save_lora_adapter(tiny_models["qwen3"], tmp_path / "qwen3", ["q_proj", "v_proj"])
    await add_adapter(stack, "misfit", other)
    sdk = sdk_for(stack)
    with pytest.raises(openai.APIStatusError) as failed:
        await complete(sdk, "misfit")
    assert failed.value.status_code == 503 and failed.value.body["code"] == "model_load_failed"
    status, listed = await stack.client.admin("GET", "/models")
    [shown] = [v for v in listed["data"] if v["name"] == "misfit"]
    assert shown["state"] == "failed" and "trained for another model" in shown["error"]
    assert await complete(sdk, "tiny") == expected(tiny_models["llama"], None)  # the base is unharmed
    await sdk.close()


def test_a_config_file_serves_an_adapter_and_names_a_bad_one(tiny_models, adapters, tmp_path):
    """`base = ...` in a [[models]] entry: the start-up check takes an adapter folder where a model folder
    would be refused, and names what is wrong with one it cannot serve."""
    from config import load_config
    from server import model_source_problem

    toml = (f'[[models]]\nname = "tiny"\npath = "{tiny_models["llama"]}"\n'
            f'[[models]]\nname = "tuned"\npath = "{adapters["a"]}"\nbase = "tiny"\n')
    (tmp_path / "c.toml").write_text(toml)
    cfg = load_config(tmp_path / "c.toml")
    assert [m.options for m in cfg.models] == [{}, {"base": "tiny"}] and model_source_problem(cfg) is None
    (tmp_path / "c.toml").write_text(toml.replace(str(adapters["a"]), str(tiny_models["llama"])))
    assert "adapter_config.json" in model_source_problem(load_config(tmp_path / "c.toml"))
