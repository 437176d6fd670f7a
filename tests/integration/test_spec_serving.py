"""Speculative decoding as clients and operators see it, through real processes
(tiny Llama, fp32, greedy, --speculative-method ngram): serving.v1 Stats counts
the drafts, the tokens drafted and accepted; n > 1 samples forked from one
prompt draft each and each equals transformers' greedy and the opted-out run,
the pool audited clean after; the gateway's `no_speculation` extra body field
(the official openai client) opts a request out; and a tensor-parallel worker
(TP=2, gloo) verifies drafts to the same tokens.

The copy-heavy prompt: the tiny Llama's greedy continuation of a run of token 171
alternates 468, 171 for about 30 tokens, then breaks (found by searching the
checkpoint's trajectories; it is deterministic), so lookup drafts are accepted
along it. Were the checkpoint to change, the `want` fixture says so."""

from __future__ import annotations

import openai
import pytest

from scheduler_svc.client import SchedulerClient
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import SPEC_FLAGS, assert_pool_clean, hf_greedy, wait_idle
from tests.helpers.procs import Cluster

COPY = [171] * 21  # a full 16-token block the forks share, and a partial one
MAX_TOKENS = 32
WORKER = ["--dtype", "float32", "--num-blocks", "48"]
WAIT_S = 120.0
MODEL = "llama"  # the gateway's model id: the tiny checkpoint's directory name


@pytest.fixture(scope="module")
def cluster(model_dir):
    with Cluster(model_dir, WORKER, SPEC_FLAGS, gateway=True) as c:
        yield c


@pytest.fixture(scope="module")
def want(model) -> list[int]:
    tokens = hf_greedy(model, COPY, MAX_TOKENS)
    assert tokens[:6] == [468, 171] * 3, "the tiny checkpoint changed: find another copying prompt"
    return tokens


def spec_delta(before, after) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted tokens) between two Stats replies."""
    return (
        after.spec_decode_drafts - before.spec_decode_drafts,
        after.spec_decode_draft_tokens - before.spec_decode_draft_tokens,
        after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens,
    )


def samples(client: SchedulerClient, n: int, **params) -> list[list[int]]:
    """Each of the n samples' tokens, by index; each finished exactly once, with its usage."""
    replies = list(
        client.stream(prompt_token_ids=COPY, max_tokens=MAX_TOKENS, temperature=0.0, n=n, timeout=WAIT_S, **params)
    )
    out = []
    for index in range(n):
        mine = [r for r in replies if r.index == index]
        assert [r.finished for r in mine].count(True) == 1 and mine[-1].finished
        assert mine[-1].usage.completion_tokens == MAX_TOKENS
        out.append([t for r in mine for t in r.token_ids])
    return out


def test_stats_count_the_drafts_of_a_copying_run(grpc_client, want):
    before = grpc_client.stats()
    got = grpc_client.generate(prompt_token_ids=COPY, max_tokens=MAX_TOKENS, temperature=0.0, timeout=WAIT_S)
    after = wait_idle(grpc_client)
    assert got.token_ids == want
    drafts, drafted, accepted = spec_delta(before, after)
    assert drafts > 0 and drafted >= accepted >= MAX_TOKENS // 2, (drafts, drafted, accepted)  # most came as drafts
    assert after.steps_run - before.steps_run < MAX_TOKENS // 2  # the plain run takes a step per token
    # Rates over the totals since start, SpecCounters' definitions.
    assert after.spec_decode_acceptance_rate == pytest.approx(
        after.spec_decode_accepted_tokens / after.spec_decode_draft_tokens
    )
    assert after.spec_decode_mean_accepted_length == pytest.approx(
        1 + after.spec_decode_accepted_tokens / after.spec_decode_drafts
    )
    assert after.spec_decode_mean_accepted_length > 2


@pytest.mark.parametrize("n", [2, 3, 4])
def test_parallel_greedy_samples_draft_and_each_equals_transformers(grpc_client, cluster, want, n):
    before = grpc_client.stats()
    drafted = samples(grpc_client, n)
    middle = wait_idle(grpc_client)
    plain = samples(grpc_client, n, no_speculation=True)
    after = wait_idle(grpc_client)
    assert drafted == plain == [want] * n
    drafts, _, accepted = spec_delta(before, middle)
    assert drafts >= n and accepted >= n * MAX_TOKENS // 2, (drafts, accepted)  # every fork drafted
    assert spec_delta(middle, after) == (0, 0, 0)  # opted out: not one draft
    assert middle.requests_finished - before.requests_finished == n
    assert_pool_clean(grpc_client, cluster)


def test_the_gateway_opts_a_request_out_of_speculation(oai, grpc_client, cluster, want):
    """The official openai client, `extra_body={"no_speculation": true}`: the same text,
    not one draft; without it the same request drafts."""
    text = grpc_client.generate(prompt_token_ids=COPY, max_tokens=MAX_TOKENS, temperature=0.0, no_speculation=True)
    assert text.token_ids == want

    def complete(**extra):
        before = grpc_client.stats()
        reply = oai.completions.create(
            model=MODEL, prompt=COPY, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=extra or None
        )
        return reply.choices[0].text, spec_delta(before, wait_idle(grpc_client))

    opted_out, none = complete(no_speculation=True)
    drafting, some = complete()
    also_drafting, more = complete(no_speculation=False)
    assert opted_out == drafting == also_drafting == text.text
    assert none == (0, 0, 0) and some[2] > 0 and more[2] > 0
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0.0,
        extra_body={"no_speculation": True},
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt=COPY, max_tokens=4, extra_body={"no_speculation": "sometimes"})
    assert err.value.body["param"] == "no_speculation"
    assert_pool_clean(grpc_client, cluster)


def test_a_tensor_parallel_worker_verifies_drafts_to_the_same_tokens(model, want):
    """TP=2 (gloo on CPU): only rank 0 verifies; the tokens equal transformers' greedy,
    the opted-out run's and, with n = 2 forks, each fork's; drafts were accepted."""
    # The torch attention ops: a rank needs no C++ kernel build or load (seconds, not a minute, on a busy CPU).
    tp = [*WORKER, "--tensor-parallel-size", "2", "--attention-backend", "torch"]
    with Cluster(tiny_checkpoint("llama"), tp, SPEC_FLAGS) as cluster, SchedulerClient(cluster.address) as client:
        before = client.stats()
        got = client.generate(prompt_token_ids=COPY, max_tokens=MAX_TOKENS, temperature=0.0, timeout=WAIT_S)
        forks = samples(client, 2)
        middle = wait_idle(client)
        plain = client.generate(
            prompt_token_ids=COPY, max_tokens=MAX_TOKENS, temperature=0.0, no_speculation=True, timeout=WAIT_S
        )
        after = wait_idle(client)
        assert got.token_ids == plain.token_ids == want and forks == [want, want]
        drafts, drafted, accepted = spec_delta(before, middle)
        assert drafts > 0 and drafted >= accepted >= MAX_TOKENS // 2, (drafts, drafted, accepted)
        assert spec_delta(middle, after) == (0, 0, 0)
        assert_pool_clean(client, cluster)
