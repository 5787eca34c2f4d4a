"""Rerank and score over HTTP (`/v1/rerank`, `/v2/rerank`, `/rerank`, `/v1/score`, `/score`): a tiny random
BERT cross-encoder's relevance scores equal sentence-transformers' `CrossEncoder.predict` on the same
folder (packed and padded forwards, pairs read as two segments), an embedding model scores by cosine
as sentence-transformers computes it, results come sorted with `index` and `relevance_score`, and bad
requests get a 400 naming the field."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from launch import unload_encoder
from storage.registry import ModelVersion
from tests.api.test_encoders import MINILM, minilm_folder, post, router_with
from tests.encoder_models import save_tiny_classifier, save_tiny_cross_encoder
from tests.helpers import load_encoder_alone, make_app

QUERY = "what do rivers carry to the sea"
DOCUMENTS = ["rivers carry water and sand to the sea", "def main(): print('hello world')",
             "the sea is salty and rivers are not", "numbers 0123456789", "music and tea on a quiet evening"]


@pytest.fixture(scope="module")
def scorers(tmp_path_factory):
    root = tmp_path_factory.mktemp("scorers")
    cross = save_tiny_cross_encoder(root / "cross")
    served = {"cross": load_encoder_alone(ModelVersion("cross", "1", str(cross), "classify")),
              "minilm": load_encoder_alone(ModelVersion("minilm", "1", MINILM, "embed")),
              "clf": load_encoder_alone(ModelVersion("clf", "1", str(save_tiny_classifier(root / "clf")), "classify"))}
    yield cross, served
    for encoder in served.values():
        unload_encoder(encoder)


@pytest.fixture
async def http(aiohttp_server, scorers):
    server = await aiohttp_server(make_app(router_with(scorers[1])))
    async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
        yield session


def cross_encoder_scores(folder, pairs) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), device="cpu").predict(pairs)


async def test_rerank_equals_cross_encoder_predict_sorted_best_first(http, scorers):
    folder, _ = scorers
    want = cross_encoder_scores(folder, [(QUERY, d) for d in DOCUMENTS])
    order = list(np.argsort(-want))
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        status, body = await post(http, path, {"model": "cross", "query": QUERY, "documents": DOCUMENTS})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == order
        assert np.allclose([r["relevance_score"] for r in body["results"]], want[order], atol=1e-5)
        assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order]
        assert body["model"] == "cross" and body["id"].startswith("rerank-") and body["usage"]["total_tokens"] > 0
    status, body = await post(http, "/v1/rerank", {"model": "cross", "query": QUERY, "top_n": 2,
                                                   "return_documents": False,
                                                   "documents": [{"text": d} for d in DOCUMENTS]})
    assert status == 200 and [r["index"] for r in body["results"]] == order[:2]
    assert all("document" not in r for r in body["results"])


async def test_many_concurrent_rerank_requests_are_batched_and_each_correct(http, scorers):
    folder, served = scorers
    queries = [f"{QUERY} {i}" for i in range(12)]
    bodies = await asyncio.gather(*(post(http, "/v1/rerank", {"model": "cross", "query": q, "documents": DOCUMENTS,
                                                              "galley": {"cache": False}}) for q in queries))
    for query, (status, body) in zip(queries, bodies):
        want = cross_encoder_scores(folder, [(query, d) for d in DOCUMENTS])
        got = {r["index"]: r["relevance_score"] for r in body["results"]}
        assert status == 200 and np.allclose([got[i] for i in range(len(DOCUMENTS))], want, atol=1e-5)


async def test_score_pairs_one_to_many_and_pairwise(http, scorers):
    folder, _ = scorers
    status, body = await post(http, "/v1/score", {"model": "cross", "text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200, body
    want = cross_encoder_scores(folder, [(QUERY, d) for d in DOCUMENTS])
    assert [d["index"] for d in body["data"]] == list(range(5)) and body["object"] == "list"
    assert np.allclose([d["score"] for d in body["data"]], want, atol=1e-5)
    firsts = ["rivers", "code", "numbers"]
    status, body = await post(http, "/score", {"model": "cross", "text_1": firsts, "text_2": DOCUMENTS[:3]})
    assert status == 200
    assert np.allclose([d["score"] for d in body["data"]], cross_encoder_scores(folder, list(zip(firsts, DOCUMENTS))),
                       atol=1e-5)


async def test_the_padded_forward_reads_segments_as_the_packed_one(scorers):
    """The packed BERT path and HF's padded forward give the same pair scores (and the segment ids
    matter: reading a pair as one segment gives other scores)."""
    folder, _ = scorers
    from engine.encoders import Encoder

    encoder = Encoder(folder, "classify")
    pairs = [(QUERY, d) for d in DOCUMENTS]
    packed = [o.values[0] for o in encoder.run(pairs)]
    encoder.packed = None
    assert np.allclose([o.values[0] for o in encoder.run(pairs)], packed, atol=1e-5)
    encoder.takes_segments = False
    assert not np.allclose([o.values[0] for o in encoder.run(pairs)], packed, atol=1e-3)


async def test_an_embedding_model_scores_by_cosine(http):
    from sentence_transformers import SentenceTransformer

    status, body = await post(http, "/v1/rerank", {"model": "minilm", "query": QUERY, "documents": DOCUMENTS})
    assert status == 200, body
    model = SentenceTransformer(minilm_folder(), device="cpu")
    want = (model.encode(DOCUMENTS) @ model.encode([QUERY])[0])  # normalized embeddings: dot = cosine
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert np.allclose([got[i] for i in range(len(DOCUMENTS))], want, atol=1e-5)
    assert body["results"][0]["index"] == 0  # the river sentence


@pytest.mark.parametrize("body, field", [
    ({"model": "cross", "query": QUERY, "documents": []}, "documents"),
    ({"model": "cross", "query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n"),
    ({"model": "cross", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ({"model": "clf", "query": QUERY, "documents": DOCUMENTS}, "model"),
    ({"model": "cross", "query": QUERY, "documents": DOCUMENTS, "rank_fields": ["x"]}, "rank_fields"),
])
async def test_bad_requests_get_a_400_naming_the_field(http, body, field):
    path = "/v1/score" if "text_1" in body else "/v1/rerank"
    status, answer = await post(http, path, body)
    assert status == 400, answer
    assert (answer["error"]["param"] or "").startswith(field), answer
