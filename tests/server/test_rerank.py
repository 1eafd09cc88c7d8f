"""/v1/score and /v1/rerank: the bodies vLLM's, Jina's and Cohere's clients send (the `cohere`
package's own v1 and v2 clients against the live server), scores equal to the cosine of the
embeddings (sentence-transformers' MiniLM as the reference on the real model)."""

import cohere
import httpx
import numpy as np
import pytest

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend, load_embedder

QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "Reranking is fun!", "Bananas are yellow.", "Paris is in France."]


@pytest.fixture(scope="module")
def fake(serve_module):
    model, embedder = fake_backend(step_ms=1.0)
    with serve_module(create_app(model, embedder, ServerConfig())) as url:
        yield url


def cosines(url, model, query, docs):
    r = httpx.post(url + "/v1/embeddings", json={"model": model, "input": [query, *docs]}).json()
    v = np.array([d["embedding"] for d in r["data"]])
    return v[1:] @ v[0] / np.linalg.norm(v[1:], axis=1) / np.linalg.norm(v[0])


def test_score_one_against_many_and_pairwise(fake):
    want = cosines(fake, "fake-embed", QUERY, DOCS)
    r = httpx.post(fake + "/v1/score", json={"model": "fake-embed", "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("score-") and body["usage"]["prompt_tokens"] > 0
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert {d["object"] for d in body["data"]} == {"score"}
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-6)
    pairwise = httpx.post(fake + "/score", json={"model": "fake-embed", "text_1": [QUERY, DOCS[1]],
                                                 "text_2": [DOCS[0], DOCS[2]]}).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               [cosines(fake, "fake-embed", QUERY, DOCS[:1])[0],
                                cosines(fake, "fake-embed", DOCS[1], DOCS[2:3])[0]], atol=1e-6)


@pytest.mark.parametrize("body,param", [
    ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ({"text_1": [], "text_2": "c"}, "text_1"),
    ({"text_1": "a", "text_2": "b", "model": "nope"}, "model"),
])
def test_bad_score_bodies_are_4xx_naming_the_field(fake, body, param):
    r = httpx.post(fake + "/v1/score", json={"model": "fake-embed", **body})
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param


def test_rerank_as_jina_and_vllm_send_it(fake):
    want = cosines(fake, "fake-embed", QUERY, DOCS)
    for path in ("/v1/rerank", "/rerank"):
        r = httpx.post(fake + path, json={"model": "fake-embed", "query": QUERY, "documents": DOCS, "top_n": 3,
                                          "return_documents": True})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == list(np.argsort(-want, kind="stable")[:3])
        np.testing.assert_allclose([x["relevance_score"] for x in results], np.sort(want)[::-1][:3], atol=1e-6)
        assert [x["document"]["text"] for x in results] == [DOCS[x["index"]] for x in results]
    bare = httpx.post(fake + "/v1/rerank", json={"model": "fake-embed", "query": QUERY, "documents": DOCS,
                                                 "return_documents": False}).json()["results"]
    assert len(bare) == len(DOCS) and all("document" not in x for x in bare)


def test_the_cohere_clients_rerank(fake):
    want = cosines(fake, "fake-embed", QUERY, DOCS)
    best = list(np.argsort(-want, kind="stable"))
    with httpx.Client() as http:  # the clients' own would be left open
        v1_client = cohere.Client(base_url=fake, api_key="unused", httpx_client=http)
        v2_client = cohere.ClientV2(api_key="unused", base_url=fake, httpx_client=http)
        v1 = v1_client.rerank(model="fake-embed", query=QUERY, documents=DOCS, top_n=2)
        v2 = v2_client.rerank(model="fake-embed", query=QUERY, documents=DOCS, max_tokens_per_doc=64)
        v1_docs = v1_client.rerank(model="fake-embed", query=QUERY, documents=[{"text": d} for d in DOCS],
                                   return_documents=True)
    assert [r.index for r in v1.results] == best[:2] and [r.index for r in v2.results] == best
    np.testing.assert_allclose([r.relevance_score for r in v2.results], want[best], atol=1e-6)
    assert [r.document.text for r in v1_docs.results] == [DOCS[i] for i in best]


def test_a_long_document_is_cut_and_a_long_query_refused(fake):
    long = "word " * 2000
    r = httpx.post(fake + "/v1/rerank", json={"model": "fake-embed", "query": QUERY, "documents": [long]})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] <= 512 + len(QUERY.encode())
    r = httpx.post(fake + "/v1/rerank", json={"model": "fake-embed", "query": long, "documents": DOCS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "query"


@pytest.mark.slow
def test_minilm_scores_equal_sentence_transformers(serve, minilm_dir):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    reference = sentence_transformers.SentenceTransformer(str(minilm_dir), device="cpu")
    want = reference.similarity(reference.encode([QUERY]), reference.encode(DOCS)).numpy()[0]
    model, _ = fake_backend()
    with serve(create_app(model, load_embedder("minilm"), ServerConfig())) as url:
        body = httpx.post(url + "/v1/score", json={"model": "minilm", "text_1": QUERY, "text_2": DOCS}).json()
        ranked = httpx.post(url + "/v1/rerank", json={"model": "minilm", "query": QUERY, "documents": DOCS}).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-5)
    assert [x["index"] for x in ranked["results"]] == list(np.argsort(-want, kind="stable"))
