"""Chunked prefill policy: dynamic chunk sizes, fairness between long prompts,
decodes never starved, resume through the prefix index after preemption."""

from __future__ import annotations

import pytest

from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.planner import Planner, PlannerConfig
from scheduler_svc.request import Request, SamplingOptions
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.planner_sim import BS, VOCAB, reference, run, step

_ids = iter(range(2 * 10**6, 10**9))


def make(num_blocks, **config):
    config.setdefault("max_model_len", 300_000)
    kv = KVCacheManager(BlockPool(num_blocks, BS), BS, extra_keys=("m",))
    return Planner(PlannerConfig(**config), kv), FakeWorker(num_blocks, BS, VOCAB)


def request(rid, n_tokens, max_tokens=4, start=0):
    return Request(
        rid, next(_ids), [(start + i) % 900 + 5 for i in range(n_tokens)], SamplingOptions(max_tokens=max_tokens)
    )


def test_dynamic_chunk_size_follows_free_blocks():
    cfg = PlannerConfig(dynamic_chunking=True)
    assert [cfg.chunk_limit(f) for f in (0.0, 0.5, 1.0)] == [512, 1280, 2048]
    assert all(cfg.chunk_limit(f / 10) % BS == 0 for f in range(11))
    assert PlannerConfig(chunk_size=300).chunk_limit(0.0) == 300  # off: the fixed chunk size


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"chunk_size": 0}, "--chunk-size"),
        ({"chunk_size": -5}, "--chunk-size"),
        ({"dynamic_chunk_min": 4096, "dynamic_chunk_max": 1024}, "--dynamic-chunk-min"),
        ({"dynamic_chunk_min": 0}, "--dynamic-chunk-min"),
    ],
)
def test_bad_chunk_settings_name_the_flag_and_the_valid_range(kwargs, flag):
    with pytest.raises(ValueError, match="valid range") as err:
        PlannerConfig(**kwargs).validate()
    assert flag in str(err.value)


def test_chunks_shrink_as_the_pool_fills():
    planner, worker = make(num_blocks=1024, dynamic_chunking=True, max_num_batched_tokens=4096)
    long = request("long", 12_000, max_tokens=1)
    planner.add(long)
    sizes = []
    while planner.has_work():
        plan, _ = step(planner, worker)
        sizes += [s.num_tokens for s in plan.seqs if s.request_id == "long" and s.num_tokens > 1]
    assert sizes[0] == 2048 and sizes == sorted(sizes, reverse=True) and sizes[-2] < sizes[0]
    assert long.output_token_ids == reference(long.prompt_token_ids, 1)


def test_long_prompts_share_the_budget_and_decodes_are_never_skipped():
    # chunk_size caps one request's prefill per step: two long prompts both advance every step.
    planner, worker = make(num_blocks=2048, max_num_batched_tokens=1024, chunk_size=500)
    decoders = [request(f"d{i}", 10, max_tokens=200, start=100 * i) for i in range(8)]
    for d in decoders:
        planner.add(d)
    step(planner, worker)  # the short prompts are prefilled
    longs = [request("a", 6000, max_tokens=2, start=7), request("b", 6000, max_tokens=2, start=9)]
    for r in longs:
        planner.add(r)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in longs):
        plan, _ = step(planner, worker)
        scheduled = {s.request_id: s.num_tokens for s in plan.seqs}
        assert all(scheduled.get(d.request_id) == 1 for d in decoders), "a decode missed a step"
        assert scheduled.get("a", 0) > 0 and scheduled.get("b", 0) > 0, "a long prompt starved"
        assert plan.num_tokens <= 1024
    run(planner, worker)
    for r in decoders + longs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling.max_tokens)


def test_preempted_prefill_resumes_from_its_committed_chunks():
    # 40 blocks = 640 slots: a 600-token prompt prefilled in 256-token chunks
    # beside a decoding request that keeps growing must be preempted part way.
    planner, worker = make(num_blocks=40, max_num_batched_tokens=256, chunk_size=256)
    old = request("old", 30, max_tokens=200, start=500)
    planner.add(old)
    step(planner, worker)
    long = request("long", 600, max_tokens=1)
    planner.add(long)
    computed_before = scheduled_after = 0
    while planner.has_work():
        before = long.num_computed_tokens
        plan, _ = step(planner, worker)
        if long.num_preemptions and not computed_before:
            computed_before = before
        elif long.num_preemptions:
            scheduled_after += sum(s.num_tokens for s in plan.seqs if s.request_id == "long")
    assert long.num_preemptions == 1 and computed_before >= 256
    # On readmission the committed full blocks still in the index come back;
    # only the rest is computed again, and the counters say exactly that.
    assert planner.resumed_tokens > 0 and planner.resumed_tokens % BS == 0
    assert planner.resumed_tokens + planner.recomputed_tokens == long.num_prompt_tokens
    assert scheduled_after == planner.recomputed_tokens < long.num_prompt_tokens
    assert long.output_token_ids == reference(long.prompt_token_ids, 1)
    assert old.output_token_ids == reference(old.prompt_token_ids, 200)
