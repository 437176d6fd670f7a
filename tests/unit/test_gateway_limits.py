"""The gateway's edge rules (issue 29) against the in-process fake scheduler: the
body limit (413 before reading), prompts per request, a request's calls admitted
piecewise, vLLM's `priority` passed on, and the cache salt derived from the
caller's API key."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway_svc.convert import tenant_salt
from tests.helpers.fake_scheduler import WAIT_S, assert_openai_error, chat_model_dir, running_gateway, sse_payloads


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("models"))


def gateway(fake_scheduler, model_dir, **config):
    return running_gateway(scheduler=fake_scheduler.address, model_dir=str(model_dir), **config)


def test_a_body_over_the_limit_is_413_whether_announced_or_chunked(fake_scheduler, model_dir):
    with gateway(fake_scheduler, model_dir, max_request_bytes=4096) as url, httpx.Client(base_url=url) as http:
        body = b'{"prompt": "' + b"x" * 5000 + b'"}'
        announced = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        chunked = http.post("/v1/completions", content=iter([body[:3000], body[3000:]]))
        for reply in (announced, chunked):
            error = assert_openai_error(reply, 413)
            assert "--max-request-bytes" in error["message"]
        assert not fake_scheduler.requests  # nothing reached the scheduler
        fits = http.post("/v1/completions", json={"prompt": "x" * 3000})
        assert fits.status_code == 200, fits.text


def test_prompts_per_request_are_limited(fake_scheduler, model_dir):
    with gateway(fake_scheduler, model_dir, max_prompts=3) as url, httpx.Client(base_url=url, timeout=WAIT_S) as http:
        error = assert_openai_error(http.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"]}), 400)
        assert error["param"] == "prompt" and "at most 3 prompts" in error["message"]
        assert http.post("/v1/completions", json={"prompt": ["a", "b", "c"]}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_requests_calls_run_at_most_a_window_at_once(fake_scheduler, model_dir, stream):
    """Six prompts x n=2 with --max-parallel-per-request 3: never more than three calls at
    the scheduler at once, and all twelve choices answered."""
    fake_scheduler.delay_s = 0.02
    config = dict(max_parallel_per_request=3, max_n=4)
    with gateway(fake_scheduler, model_dir, **config) as url, httpx.Client(base_url=url, timeout=WAIT_S) as http:
        body = {"prompt": [f"p{i}" for i in range(6)], "n": 2, "stream": stream}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        chunks = [json.loads(p) for p in sse_payloads(reply)[:-1]] if stream else [reply.json()]  # then [DONE]
    indexes = {c["index"] for chunk in chunks for c in chunk["choices"]}
    assert indexes == set(range(12)) and len(fake_scheduler.requests) == 12
    assert fake_scheduler.max_active == 3


def test_priority_is_passed_on(fake_scheduler, model_dir):
    with gateway(fake_scheduler, model_dir) as url, httpx.Client(base_url=url, timeout=WAIT_S) as http:
        assert http.post("/v1/completions", json={"prompt": "x", "priority": -3}).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "priority": 2**63}), 400)
    assert [r.priority for r in fake_scheduler.requests] == [-3, 0]


def test_the_cache_salt_comes_from_the_callers_key(fake_scheduler, model_dir):
    with (
        gateway(fake_scheduler, model_dir, cache_salt_from_api_key=True) as url,
        httpx.Client(base_url=url, timeout=WAIT_S) as http,
    ):
        for key, salt in (("key-a", None), ("key-a", "s"), ("key-b", "s"), (None, "s")):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            body = {"prompt": "x"} | ({"cache_salt": salt} if salt else {})
            assert http.post("/v1/completions", json=body, headers=headers).status_code == 200
    a, a_s, b_s, anonymous = (r.cache_salt for r in fake_scheduler.requests)
    assert a == tenant_salt("key-a", None) and a.startswith("key:") and "key-a" not in a
    assert a_s == f"{a}/s" and b_s == f"{tenant_salt('key-b', None)}/s" and b_s != a_s
    assert anonymous == "s"  # no key: the request's own salt
    # No salt one key's caller can choose is another key's: each starts with its own digest.
    assert not tenant_salt("key-a", "x").startswith(tenant_salt("key-b", None) + "/")
