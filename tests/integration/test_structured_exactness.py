"""Structured outputs, token-exact: a greedy constrained request through real
worker and scheduler processes equals transformers' greedy `generate` with the
same mask applied to its logits by a logits processor (the grammar engine's
numpy reference), in fp32 on a tiny random checkpoint, where the mask alone
decides what is valid. Constrained and free requests run side by side, with
chunked prefill, and samples of one constrained request (n > 1, each with its
own matcher) that outgrow the pool and preempt each other, in every scheduling
mode: planned ahead with late masks (the default), constrained rows held back,
strict alternation."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from proto import serving_pb2
from scheduler_svc.client import SchedulerClient
from scheduler_svc.structured import Constraint
from tests.helpers.cluster import SPEC_FLAGS, scheduler_of, wait_idle
from tests.helpers.grammar_reference import reference
from tests.helpers.sweeps import sweep
from tools.processes import Cluster, ServiceProcess

WAIT_S = 120.0
MODES = {"late masks": [], "held back": ["--no-constrained-ahead"], "sync": ["--no-async-scheduling"]}
# Small budgets: prompts are chunked and requests wait; 28 blocks of 16 for the crowded samples below.
SCHEDULER = ["--max-num-batched-tokens", "48", "--chunk-size", "32", "--max-num-seqs", "8"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}(-[0-9]{1,3})+"
CHOICES = ["red", "green", "blue sky"]
LARK = 'start: "(" item (", " item)* ")"\nitem: /[a-z]{1,5}/'
# (GenerateRequest fields, the same constraint for the reference, max_tokens)
CONSTRAINTS = [
    ({"json_schema": json.dumps(SCHEMA)}, Constraint.json_schema(SCHEMA), 60),
    ({"regex": REGEX}, Constraint.regex(REGEX), 30),
    ({"choice": serving_pb2.ChoiceList(choices=CHOICES)}, Constraint.choice(CHOICES), 10),
    ({"grammar": LARK}, Constraint.grammar(LARK), 40),
    ({}, None, 20),
]
# An order that cannot be complete within max_tokens: four greedy samples of 20 + 100 tokens need
# 1 shared + 4 x 7 own blocks > 28, so they preempt each other whatever the timing.
ORDER = {
    "type": "array",
    "minItems": 40,
    "items": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}},
}
# 4 samples of 20 + 140 tokens want 1 shared + 4 x 9 blocks, 37 of the 28: they must preempt
# each other, by a margin wider than one block. (A worker that refuses a call makes the
# scheduler fail over and recompute: exact tokens still, but no preemption counted.)
CROWDING_PROMPT, CROWDING_SAMPLES, CROWDING_TOKENS = list(range(40, 60)), 4, 140


def _cases() -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(26)
    return [(rng.integers(4, 700, rng.integers(3, 60)).tolist(), i % len(CONSTRAINTS)) for i in range(15)]


def _generate_all(client: SchedulerClient, cases: list[tuple[list[int], int]]) -> list:
    """Every case's greedy constrained reply, all requests in flight at once."""

    def run(case: tuple[list[int], int]):
        prompt, kind = case
        fields, _, max_tokens = CONSTRAINTS[kind]
        return client.generate(
            prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, timeout=WAIT_S, **fields
        )

    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(run, cases))


# The two mask paths in `make test`; the synchronous scheduler's is `make test-slow`'s (it
# sends every mask with its step, as "held back" does).
@pytest.fixture(scope="module")
def crowded_worker(model_dir):
    """28 blocks, shared by the modes' cases below (each with a scheduler of its own)."""
    with ServiceProcess("worker_svc", ["--model", str(model_dir), "--dtype", "float32", "--num-blocks", "28"]) as proc:
        yield proc


@pytest.mark.parametrize("mode", sweep(MODES, keep=["late masks", "held back"]))
def test_greedy_constrained_output_equals_transformers_with_the_mask(mode, model_dir, model, compiler, crowded_worker):
    cases = _cases()
    with scheduler_of(model_dir, [crowded_worker], *SCHEDULER, *MODES[mode]) as (scheduler, client):
        results = _generate_all(client, cases)
        samples: dict[int, list[int]] = {i: [] for i in range(CROWDING_SAMPLES)}
        for reply in client.stream(
            prompt_token_ids=CROWDING_PROMPT,
            max_tokens=CROWDING_TOKENS,
            temperature=0.0,
            n=CROWDING_SAMPLES,
            json_schema=json.dumps(ORDER),
            timeout=WAIT_S,
        ):
            samples[reply.index].extend(reply.token_ids)
        stats = wait_idle(client)
        log = scheduler.log()
    for (prompt, kind), got in zip(cases, results):
        _, constraint, max_tokens = CONSTRAINTS[kind]
        want = reference(model, compiler, prompt, constraint, max_tokens)
        assert got.token_ids == want, (mode, kind, prompt)
    crowded = reference(model, compiler, CROWDING_PROMPT, Constraint.json_schema(ORDER), CROWDING_TOKENS)
    assert len(crowded) == CROWDING_TOKENS and all(tokens == crowded for tokens in samples.values())
    assert stats.preemptions > 0, "samples that outgrow the pool must preempt each other"
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)
    assert "engine audit failed" not in log


# Forced, repeated text (the same object over and over): the n-gram lookup finds it and the
# mask makes the random model emit it, so constrained drafts get accepted; free text between
# (the names) gets some rejected or cut by the grammar.
REPEATED = {
    "type": "array",
    "minItems": 6,
    "maxItems": 6,
    "items": {
        "type": "object",
        "properties": {"kind": {"enum": ["point"]}, "name": {"type": "string", "maxLength": 3}},
        "required": ["kind", "name"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("mode", sweep(["async", "sync"], keep=["async"]))
def test_constrained_requests_draft_and_equal_transformers_with_the_mask(mode, model_dir, model, compiler):
    """Speculation on: constrained greedy requests draft under their grammars (the masks of
    every verified position) and still get transformers' tokens under the mask."""
    cases = [case for case in _cases() if CONSTRAINTS[case[1]][1] is not None][:8]
    repeated = Constraint.json_schema(REPEATED)
    flags = [*SCHEDULER, *SPEC_FLAGS, *([] if mode == "async" else ["--no-async-scheduling"])]
    with Cluster(model_dir, ["--dtype", "float32", "--num-blocks", "48"], flags) as cluster:
        with SchedulerClient(cluster.address) as client:
            results = _generate_all(client, cases)
            copied = client.generate(
                prompt_token_ids=CROWDING_PROMPT,
                max_tokens=150,
                temperature=0.0,
                json_schema=json.dumps(REPEATED),
                timeout=WAIT_S,
            )
            stats = wait_idle(client)
            log = cluster.scheduler.log()
    for (prompt, kind), got in zip(cases, results):
        _, constraint, max_tokens = CONSTRAINTS[kind]
        assert got.token_ids == reference(model, compiler, prompt, constraint, max_tokens), (mode, kind, prompt)
    assert copied.token_ids == reference(model, compiler, CROWDING_PROMPT, repeated, 150)
    assert stats.spec_decode_accepted_tokens > 0, "the repeated objects' drafts are accepted"
    assert stats.spec_decode_accepted_tokens < stats.spec_decode_draft_tokens
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)
    assert "engine audit failed" not in log
