"""Logprobs, prompt logprobs and the sampling controls through REAL worker +
scheduler processes (float32 tiny Llama), against transformers in float32.

Two schedulers, one after the other in front of one worker: the default
(whole-prompt chunks, overlapped scheduling) and one that prefills in chunks of 8
tokens with strict alternation. Both must give transformers' numbers; the chunked
one the same prompt logprobs as one-shot.
"""

from __future__ import annotations

import grpc
import pytest

from tests.helpers.cluster import hf_greedy, scheduler_of, wait_idle
from tests.helpers.logprob_reference import LOGPROB_ATOL, position_logprobs, reference_greedy
from tests.helpers.procs import ServiceProcess

WAIT_S = 60.0
EOS = 2
PROMPT = [(37 * i + 11) % 700 + 4 for i in range(45)]  # 45 tokens: two full blocks and a partial one
CLUSTERS = {
    "one-shot, overlapped": [],
    "chunks of 8, strict": ["--chunk-size", "8", "--no-async-scheduling"],
}


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def worker(model_dir):
    """The module's worker (a worker's start is most of this file's time); its
    schedulers run one at a time, and none knows the blocks another left."""
    with ServiceProcess("worker_svc", ["--model", str(model_dir), "--dtype", "float32", "--num-blocks", "64"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def one_shot_prompt_logprobs(model_dir, worker):
    """Prompt logprobs from a scheduler that prefills the prompt in one chunk."""
    with scheduler_of(model_dir, [worker], "--max-model-len", "256") as (_, client):
        return client.generate(prompt_token_ids=PROMPT, max_tokens=0, prompt_logprobs=5, timeout=WAIT_S)


# one_shot_prompt_logprobs first: its scheduler has stopped before this one starts (two
# schedulers at once would both allocate the worker's blocks).
@pytest.fixture(scope="module", params=list(CLUSTERS))
def client(request, model_dir, worker, one_shot_prompt_logprobs):
    with scheduler_of(model_dir, [worker], "--max-model-len", "256", *CLUSTERS[request.param]) as (_, client):
        yield client
        stats = wait_idle(client)
        assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0), stats


def assert_entry(entry, token_id, row, top_n, tokenizer):
    """One serving.v1 TokenLogprob against the reference row of log-probabilities."""
    assert entry.token_id == token_id and entry.token == tokenizer.decode(
        [token_id], clean_up_tokenization_spaces=False
    )
    assert abs(entry.logprob - row[token_id].item()) < LOGPROB_ATOL
    values, ids = row.topk(top_n)
    assert [t.token_id for t in entry.top] == ids.tolist()
    assert max((abs(t.logprob - v) for t, v in zip(entry.top, values.tolist())), default=0) < LOGPROB_ATOL
    assert [t.token for t in entry.top] == [
        tokenizer.decode([i], clean_up_tokenization_spaces=False) for i in ids.tolist()
    ]


def test_logprobs_and_prompt_logprobs_equal_transformers(client, model, tokenizer):
    out = client.generate(
        prompt_token_ids=PROMPT,
        max_tokens=6,
        temperature=0.0,
        ignore_eos=True,
        logprobs=4,
        prompt_logprobs=3,
        timeout=WAIT_S,
    )
    assert out.token_ids == hf_greedy(model, PROMPT, 6)
    reference = position_logprobs(model, PROMPT + out.token_ids)
    first, *scored = out.prompt_logprobs
    assert first.token_id == PROMPT[0] and not first.HasField("logprob") and not first.top
    assert len(scored) == len(PROMPT) - 1
    for p, entry in enumerate(scored, start=1):
        assert_entry(entry, PROMPT[p], reference[p - 1], 3, tokenizer)
    assert len(out.token_logprobs) == 6
    for k, (entry, logprob) in enumerate(zip(out.token_logprobs, out.logprobs)):
        assert entry.logprob == logprob
        assert_entry(entry, out.token_ids[k], reference[len(PROMPT) + k - 1], 4, tokenizer)


def test_prompt_logprobs_ignore_a_cached_prefix(client, model, tokenizer):
    prompt = PROMPT[:40] + [5, 6, 7]
    client.generate(prompt_token_ids=prompt, max_tokens=1, timeout=WAIT_S)  # caches two blocks
    cached = client.generate(prompt_token_ids=prompt, max_tokens=1, timeout=WAIT_S)
    assert cached.cached_prompt_tokens == 32
    reference = position_logprobs(model, prompt)
    for extended in (prompt, prompt + [9, 10]):  # the cached prefix alone, and followed by more
        out = client.generate(
            prompt_token_ids=extended, max_tokens=2, temperature=0.0, prompt_logprobs=1, timeout=WAIT_S
        )
        assert out.cached_prompt_tokens == 0 and len(out.prompt_logprobs) == len(extended)
        for p in range(1, len(prompt)):
            assert_entry(out.prompt_logprobs[p], prompt[p], reference[p - 1], 1, tokenizer)
    assert client.generate(prompt_token_ids=prompt, max_tokens=1, timeout=WAIT_S).cached_prompt_tokens == 32


def test_chunked_prefill_gives_the_one_shot_prompt_logprobs(client, one_shot_prompt_logprobs):
    out = client.generate(prompt_token_ids=PROMPT, max_tokens=0, prompt_logprobs=5, timeout=WAIT_S)
    want = one_shot_prompt_logprobs
    assert out.finish_reason == want.finish_reason == "length" and out.completion_tokens == 0 and not out.token_ids
    assert [e.token_id for e in out.prompt_logprobs] == PROMPT
    for got, expected in zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert abs(got.logprob - expected.logprob) < 1e-5
        assert [t.token_id for t in got.top] == [t.token_id for t in expected.top]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got.top, expected.top)) < 1e-5


REPEAT = {100: 10.0}  # a bias that makes token 100 win at every step: something for penalties to work on
# case -> (controls, the controls they must change the answer against)
CONTROLS = {
    "presence and frequency": (
        {"logit_bias": REPEAT, "presence_penalty": 1.5, "frequency_penalty": 1.0},
        {"logit_bias": REPEAT},
    ),
    "negative penalties": ({"presence_penalty": -2.0, "frequency_penalty": -1.0}, {}),
    "repetition": ({"logit_bias": REPEAT, "repetition_penalty": 2.0}, {"logit_bias": REPEAT}),
    "logit_bias": ({"logit_bias": {100: 6.0, 200: 5.5, 222: -100.0}}, {}),
    "min_tokens then EOS": ({"logit_bias": {EOS: 30.0}, "min_tokens": 5}, {"logit_bias": {EOS: 30.0}}),
    "all together": (
        {"logit_bias": REPEAT, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
        {"logit_bias": REPEAT},
    ),
}
REFERENCE_NAMES = {"presence_penalty": "presence", "frequency_penalty": "frequency", "repetition_penalty": "repetition"}


@pytest.mark.parametrize("case", list(CONTROLS))
def test_sampling_controls_equal_the_reference(client, model, case):
    params, baseline = CONTROLS[case]
    out = client.generate(prompt_token_ids=PROMPT, max_tokens=12, temperature=0.0, timeout=WAIT_S, **params)
    named = {REFERENCE_NAMES.get(k, k): v for k, v in params.items()}
    want, reason = reference_greedy(model, PROMPT, 12, eos_ids=[EOS], **named)
    assert out.token_ids == want and out.finish_reason == reason
    without = client.generate(prompt_token_ids=PROMPT, max_tokens=12, temperature=0.0, timeout=WAIT_S, **baseline)
    assert without.token_ids != out.token_ids  # the control changed the answer
    if case == "min_tokens then EOS":
        assert want[-1] == EOS and len(want) == 6  # EOS blocked for five tokens, then taken


def test_stop_token_ids_end_the_request_and_min_tokens_holds_them_back(client, model):
    plain, _ = reference_greedy(model, PROMPT, 10, ignore_eos=True)
    stop = plain[3]
    out = client.generate(
        prompt_token_ids=PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], timeout=WAIT_S
    )
    assert out.token_ids == plain[: plain.index(stop) + 1] and out.finish_reason == "stop"
    held = client.generate(
        prompt_token_ids=PROMPT,
        max_tokens=10,
        temperature=0.0,
        ignore_eos=True,
        stop_token_ids=[stop],
        min_tokens=6,
        timeout=WAIT_S,
    )
    want, reason = reference_greedy(model, PROMPT, 10, ignore_eos=True, stop_token_ids=[stop], min_tokens=6)
    assert held.token_ids == want and held.finish_reason == reason and len(want) > plain.index(stop) + 1


def test_seeded_sampling_with_penalties_is_reproducible(client):
    params = dict(temperature=1.0, seed=7, max_tokens=10, frequency_penalty=1.0, logit_bias={50: 3.0}, logprobs=2)
    first = client.generate(prompt_token_ids=PROMPT, timeout=WAIT_S, **params)
    again = client.generate(prompt_token_ids=PROMPT, timeout=WAIT_S, **params)
    assert first.token_ids == again.token_ids and len(first.token_logprobs) == 10


@pytest.mark.parametrize(
    "params, field",
    [
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {5: 200.0}}, "logit_bias"),
        ({"logit_bias": {10_000: 1.0}}, "logit_bias"),
        ({"stop_token_ids": [768]}, "stop_token_ids"),
        ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 2, "prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_bad_values_are_invalid_argument_naming_the_field(client, params, field):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt_token_ids=PROMPT, timeout=WAIT_S, **params)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()
