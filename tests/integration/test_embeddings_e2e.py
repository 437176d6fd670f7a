"""Embeddings served by real processes (worker float32 + scheduler --runner pooling
+ gateway) through the official `openai` client, against transformers' hidden
states of the same checkpoint (the last layer after the final norm): single
inputs, batches of strings and token arrays, base64, Matryoshka dimensions,
prompts longer than a prefill chunk, the prefix cache, and a checkpoint's own
sentence-transformers pooling config (mean, normalised). Every test leaves the
scheduler idle with no block in use; a pooling request allocates only its
prompt's blocks."""

from __future__ import annotations

import base64
import json
import math
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.helpers.cluster import load_model, wait_idle
from tests.helpers.procs import Cluster

WAIT_S = 60.0
CHUNK = 16  # the scheduler's --chunk-size: a 40-token prompt takes three prefill steps
BLOCK = 16
SCHEDULER_ARGS = ["--runner", "pooling", "--chunk-size", str(CHUNK), "--max-num-batched-tokens", str(CHUNK)]
WORKER_ARGS = ["--dtype", "float32", "--num-blocks", "64"]
pytestmark = pytest.mark.usefixtures("no_leak")


@pytest.fixture(scope="module")
def cluster(model_dir):
    with Cluster(model_dir, WORKER_ARGS, SCHEDULER_ARGS, gateway=True) as c:
        yield c


def hidden(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def assert_same(got, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert got @ want / (np.linalg.norm(got) * np.linalg.norm(want)) >= 0.99999


def random_ids(model, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, model.config.vocab_size, n).tolist()


def test_a_string_is_its_last_tokens_hidden_state_normalised(oai, model, model_dir):
    """A causal LM without a pooling config: the last token, normalised (vLLM's default)."""
    text = "The quick brown fox jumps over the lazy dog"
    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    reply = oai.embeddings.create(model=model_dir.name, input=text)
    assert len(reply.data) == 1 and reply.data[0].index == 0 and reply.model == model_dir.name
    assert_same(reply.data[0].embedding, unit(hidden(model, ids)[-1]))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == len(ids)


def test_a_batch_of_token_arrays_over_several_chunks(oai, model, model_dir):
    prompts = [random_ids(model, n, seed) for seed, n in enumerate((40, 5, 17, 1))]
    reply = oai.embeddings.create(model=model_dir.name, input=prompts)
    assert [d.index for d in reply.data] == [0, 1, 2, 3]
    for prompt, d in zip(prompts, reply.data, strict=True):
        assert_same(d.embedding, unit(hidden(model, prompt)[-1]))
    assert reply.usage.prompt_tokens == sum(map(len, prompts))


def test_base64_and_dimensions(oai, model, model_dir, cluster):
    """The openai client asks for base64 unless told otherwise, and decodes it; the raw
    answer is base64 of little-endian float32 as asked, else floats."""
    prompt = random_ids(model, 23, 7)
    want = unit(hidden(model, prompt)[-1][:8])  # Matryoshka: truncate, then normalise
    assert_same(oai.embeddings.create(model=model_dir.name, input=[prompt], dimensions=8).data[0].embedding, want)
    for encoding in ("base64", "float"):
        body = {"input": [prompt], "dimensions": 8, "encoding_format": encoding}
        raw = httpx.post(f"{cluster.gateway_url}/v1/embeddings", json=body, timeout=WAIT_S).json()
        vector = raw["data"][0]["embedding"]
        if encoding == "base64":
            vector = np.frombuffer(base64.b64decode(vector), "<f4")
        assert_same(vector, want)


def test_a_repeated_prompt_is_read_from_the_prefix_cache_with_the_same_embedding(oai, model, model_dir, grpc_client):
    prompt = random_ids(model, 50, 11)
    before = grpc_client.stats()
    first = oai.embeddings.create(model=model_dir.name, input=[prompt]).data[0].embedding
    middle = wait_idle(grpc_client)
    # Only the prompt's blocks: no slot for a token after it.
    assert middle.blocks_allocated_total - before.blocks_allocated_total == math.ceil(len(prompt) / BLOCK)
    second = oai.embeddings.create(model=model_dir.name, input=[prompt]).data[0].embedding
    after = wait_idle(grpc_client)
    assert after.prefix_cache_hit_tokens - middle.prefix_cache_hit_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    assert_same(second, np.asarray(first, dtype=np.float64))
    assert_same(second, unit(hidden(model, prompt)[-1]))


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": "x", "dimensions": 100000}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
        ({"input": [[10**6]]}, "input"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(cluster, body, param):
    reply = httpx.post(f"{cluster.gateway_url}/v1/embeddings", json=body, timeout=WAIT_S)
    assert reply.status_code == 400, reply.text
    assert param in reply.json()["error"]["message"] or reply.json()["error"]["param"] == param, reply.text


def test_score_and_rerank_are_embedding_cosines(cluster, model, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    query, docs = "red apples", ["green pears", "red apples grow", "a lazy dog"]
    vectors = [unit(hidden(model, tok(t)["input_ids"])[-1]) for t in [query, *docs]]
    want = [float(vectors[0] @ v) for v in vectors[1:]]
    url = cluster.gateway_url
    score = httpx.post(f"{url}/v1/score", json={"text_1": query, "text_2": docs}, timeout=WAIT_S).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-5)
    rerank = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": docs, "top_n": 2}, timeout=WAIT_S)
    results = rerank.json()["results"]
    order = np.argsort(want)[::-1][:2].tolist()
    assert [r["index"] for r in results] == order
    assert [r["document"]["text"] for r in results] == [docs[i] for i in order]
    np.testing.assert_allclose([r["relevance_score"] for r in results], [want[i] for i in order], atol=1e-5)


def test_a_generating_scheduler_refuses_embeddings(tmp_path_factory, model_dir):
    with Cluster(model_dir, WORKER_ARGS, [], gateway=True) as c:
        reply = httpx.post(f"{c.gateway_url}/v1/embeddings", json={"input": "hello"}, timeout=WAIT_S)
    assert reply.status_code == 400 and "--runner pooling" in reply.json()["error"]["message"], reply.text


def test_a_checkpoints_mean_pooling_config_over_chunks(tmp_path_factory, model_dir):
    """sentence-transformers' modules.json + 1_Pooling/config.json (mean, then Normalize):
    the mean over every prompt token, the chunks' sums added up by the scheduler."""
    st = tmp_path_factory.mktemp("st") / model_dir.name
    shutil.copytree(model_dir, st)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (st / "modules.json").write_text(json.dumps(modules))
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    model = load_model(model_dir)
    prompts = [random_ids(model, n, 20 + n) for n in (41, 3)]
    with Cluster(st, WORKER_ARGS, SCHEDULER_ARGS, gateway=True) as c:
        client = openai.OpenAI(base_url=f"{c.gateway_url}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
        first = client.embeddings.create(model=st.name, input=prompts).data
        again = client.embeddings.create(
            model=st.name, input=prompts[:1]
        ).data  # cached blocks, no cached hidden states
        client.close()
    for prompt, d in zip(prompts, first, strict=True):
        assert_same(d.embedding, unit(hidden(model, prompt).mean(0)))
    assert_same(again[0].embedding, unit(hidden(model, prompts[0]).mean(0)))
