"""A yes/no reranker served by real processes: the tiny Qwen3 (a causal LM, float32)
behind a scheduler with --runner pooling --classifier-from-token no,yes and a gateway
with the Qwen3-Reranker score template (docs/templates/qwen3_reranker.jinja). /v1/score
and /v1/rerank score each pair as transformers' logits of "yes" against "no" after the
templated prompt say (sigmoid of their difference, within 1e-5); the prompts run over
several prefill chunks, the documents of one query share its prefix in the cache, and
no decode block is ever taken. What a reranker does not serve is refused by name."""

from __future__ import annotations

import math

import grpc
import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from gateway_svc.chat_template import ChatTemplate
from proto import serving_pb2, serving_pb2_grpc
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import load_model
from tests.helpers.procs import REPO, Cluster

WAIT_S = 60.0
TEMPLATE = REPO / "docs" / "templates" / "qwen3_reranker.jinja"
CHUNK = 32  # the templated prompts are ~60-90 tokens: three prefill chunks each
SCHEDULER_ARGS = ["--runner", "pooling", "--classifier-from-token", "no,yes", "--chunk-size", str(CHUNK)]
WORKER_ARGS = ["--dtype", "float32", "--num-blocks", "64"]
QUERY = "which fruit is red"
DOCS = ["red apples grow on trees", "the sky is blue", "a lazy dog sleeps", "cherries are red too"]
pytestmark = pytest.mark.usefixtures("no_leak")


@pytest.fixture(scope="module")
def model_dir():
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def cluster(model_dir):
    gateway = ["--chat-template", str(TEMPLATE)]
    with Cluster(model_dir, WORKER_ARGS, SCHEDULER_ARGS, gateway=True, gateway_args=gateway) as c:
        yield c


@pytest.fixture(scope="module")
def want(model_dir):
    """transformers' score of (query, document): sigmoid(logit yes - logit no) at the last position."""
    model, tok = load_model(model_dir), AutoTokenizer.from_pretrained(model_dir)
    template = ChatTemplate(TEMPLATE.read_text())
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")

    def score(query: str, document: str) -> float:
        prompt = template.render([{"role": "query", "content": query}, {"role": "document", "content": document}])
        ids = tok(prompt)["input_ids"]
        assert len(ids) > 2 * CHUNK  # several chunks
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        return 1 / (1 + math.exp(-float(logits[yes] - logits[no])))

    return score


def test_score_is_the_yes_no_logits_of_each_pair(cluster, want):
    url = cluster.gateway_url
    reply = httpx.post(f"{url}/v1/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=WAIT_S)
    assert reply.status_code == 200, reply.text
    got = [d["score"] for d in reply.json()["data"]]
    np.testing.assert_allclose(got, [want(QUERY, d) for d in DOCS], atol=1e-5, rtol=0)
    assert len(set(np.round(got, 6))) == len(DOCS)  # the pairs are told apart
    # N x N: each query with its own document.
    pairs = httpx.post(f"{url}/v1/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]}, timeout=WAIT_S).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], [want(DOCS[0], DOCS[2]), want(DOCS[1], DOCS[3])],
                               atol=1e-5, rtol=0)  # fmt: skip


def test_rerank_orders_by_it_and_the_query_prefix_is_cached(cluster, want, grpc_client):
    # One pair first: the query's templated prefix is then in the cache for the documents.
    httpx.post(f"{cluster.gateway_url}/v1/score", json={"text_1": QUERY, "text_2": "x"}, timeout=WAIT_S)
    before = grpc_client.stats()
    body = {"query": QUERY, "documents": DOCS, "top_n": 3}
    reply = httpx.post(f"{cluster.gateway_url}/v1/rerank", json=body, timeout=WAIT_S)
    assert reply.status_code == 200, reply.text
    expected = [want(QUERY, d) for d in DOCS]
    order = np.argsort(expected)[::-1][:3].tolist()
    results = reply.json()["results"]
    assert [r["index"] for r in results] == order
    assert [r["document"]["text"] for r in results] == [DOCS[i] for i in order]
    np.testing.assert_allclose([r["relevance_score"] for r in results], [expected[i] for i in order], atol=1e-5)
    after = grpc_client.stats()
    assert after.prefix_cache_hit_tokens > before.prefix_cache_hit_tokens  # the scored query's prefix
    assert after.generation_tokens_total == before.generation_tokens_total  # nothing generated


@pytest.mark.parametrize(
    "path, body, names",
    [
        ("/v1/embeddings", {"input": "hello"}, "--classifier-from-token"),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}, "--runner pooling"),
    ],
)
def test_what_a_reranker_does_not_serve_is_refused_by_name(cluster, path, body, names):
    reply = httpx.post(f"{cluster.gateway_url}{path}", json=body, timeout=WAIT_S)
    assert reply.status_code == 400 and names in reply.json()["error"]["message"], reply.text


def test_an_embedding_scheduler_refuses_a_score_request(cluster):
    """serving.v1 Embed with score on a scheduler that embeds: FAILED_PRECONDITION naming the flag."""
    with Cluster(cluster.model_dir, WORKER_ARGS, ["--runner", "pooling"]) as embedder:
        with grpc.insecure_channel(embedder.address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                serving_pb2_grpc.SchedulerStub(channel).Embed(serving_pb2.EmbedRequest(prompt="hi", score=True))
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "--classifier-from-token" in err.value.details()
