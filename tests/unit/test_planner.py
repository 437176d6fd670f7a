"""Planner end to end against a fake worker: budgets, chunking, admission,
preemption, prefix sharing, aborts -- with audit() after every step."""

import math
import random

import pytest

from scheduler_svc.kv.block_manager import KVCacheManager, LeakError
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.planner import Planner, PlannerConfig, QueueFull
from scheduler_svc.planning.validation import RequestRejected
from scheduler_svc.request import FinishReason, RequestStatus
from tests.helpers.fake_worker import FakeWorker, samples_of
from tests.helpers.planner_sim import BS, VOCAB, check_plan, reference, req, run, step


def make(num_blocks=64, caching=True, **config):
    config.setdefault("max_model_len", 4096)
    kv = KVCacheManager(BlockPool(num_blocks, BS, enable_prefix_caching=caching), BS, extra_keys=("m", "bf16"))
    return Planner(PlannerConfig(**config), kv), FakeWorker(num_blocks, BS, VOCAB)


def test_each_planner_numbers_its_steps_from_its_own_random_start():
    """A worker outlives its scheduler: the next one's steps must not reuse the ids the
    worker last ran (it matches a planned-ahead step's previous_step_id against them)."""
    firsts = set()
    for _ in range(3):
        planner, _worker = make()
        planner.add(req("a", [5, 6, 7], max_tokens=2))
        first = planner.schedule()
        firsts.add(first.step_id)
        assert planner.schedule().step_id == first.step_id + 1  # planned ahead, the next id
    assert len(firsts) == 3


# ---- config and admission validation --------------------------------------------
def test_config_defaults_and_validation():
    cfg = PlannerConfig()
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.chunk_size, cfg.block_size) == (8192, 256, 8192, 16)
    assert cfg.validate() is cfg
    for bad in (
        {"chunk_size": 0},
        {"chunk_size": -5},
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"max_model_len": 1},
        {"max_waiting": 0},
        {"block_size": 0},
        {"chunk_size": True},
    ):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=rf"{name} \(--{name.replace('_', '-')}\).*valid range"):
            PlannerConfig(**bad).validate()


def test_block_size_must_match_kv_cache():
    kv = KVCacheManager(BlockPool(8, 16), 16)
    with pytest.raises(ValueError, match="block_size"):
        Planner(PlannerConfig(block_size=32), kv)


def test_prompt_that_can_never_fit_is_rejected():
    planner, _ = make(num_blocks=8, max_model_len=100)  # pool holds 128 tokens
    with pytest.raises(RequestRejected, match="maximum context length is 100 tokens") as e:
        planner.add(req("a", range(100)))
    assert e.value.field == "prompt"
    planner2, _ = make(num_blocks=4, max_model_len=1000)  # pool holds 64 tokens
    with pytest.raises(RequestRejected, match=r"KV cache holds 64 tokens \(4 blocks x 16\)"):
        planner2.add(req("a", range(64)))
    assert not planner.has_work() and not planner2.has_work()


def test_largest_prompt_that_fits_gets_one_token():
    planner, worker = make(num_blocks=4, max_model_len=1000)
    r = req("a", range(63), max_tokens=10)
    planner.add(r)
    run(planner, worker)
    assert r.output_token_ids == reference(range(63), 1)
    assert r.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("field", "kwargs", "prompt"),
    [
        ("prompt", {}, []),
        ("prompt_token_ids", {}, [1, -2]),
        ("max_tokens", {"max_tokens": 0}, [1]),
        ("temperature", {"temperature": -1.0}, [1]),
        ("temperature", {"temperature": float("nan")}, [1]),
        ("top_p", {"top_p": 1.5}, [1]),
        ("top_k", {"top_k": -1}, [1]),
        ("seed", {"seed": -1}, [1]),
    ],
)
def test_bad_arguments_are_rejected(field, kwargs, prompt):
    planner, _ = make()
    kwargs.setdefault("max_tokens", 4)
    with pytest.raises(RequestRejected) as e:
        planner.add(req("a", prompt, **kwargs))
    assert e.value.field == field


def test_duplicate_request_id_and_queue_full():
    planner, _ = make(max_waiting=2)
    planner.add(req("a", [1]))
    with pytest.raises(RequestRejected, match="already in use"):
        planner.add(req("a", [1]))
    planner.add(req("b", [1]))
    with pytest.raises(QueueFull):
        planner.add(req("c", [1]))
    assert planner.num_waiting == 2


# ---- single request: exact tokens and lazy block growth ---------------------------
def test_single_request_matches_reference():
    planner, worker = make()
    r = req("a", range(1, 40), max_tokens=12)
    planner.add(r)
    plans = run(planner, worker)
    assert r.output_token_ids == reference(range(1, 40), 12)
    assert r.output_logprobs == [-t / VOCAB for t in r.output_token_ids]
    assert r.finish_reason is FinishReason.LENGTH and r.status is RequestStatus.FINISHED
    assert len(plans) == 12 and [len(p.seqs[0].token_ids) for p in plans] == [39] + [1] * 11


@pytest.mark.parametrize(
    ("prompt_len", "tables"),
    [
        (15, [[0], [0], [0, 1]]),  # positions 15 (block 0) then 16 (block 1)
        (16, [[0], [0, 1], [0, 1]]),
        (17, [[0, 1], [0, 1], [0, 1]]),
    ],
)
def test_block_boundaries_through_decode(prompt_len, tables):
    planner, worker = make()
    planner.add(req("a", range(prompt_len), max_tokens=3))
    plans = run(planner, worker)
    assert [p.seqs[0].block_table for p in plans] == tables
    assert [p.seqs[0].start_pos for p in plans] == [0, prompt_len, prompt_len + 1]


def test_lazy_allocation_long_context_limit():
    planner, worker = make(num_blocks=13000, max_model_len=200000)
    r = req("a", range(100), max_tokens=60)
    planner.add(r)
    step(planner, worker)  # prefill
    assert len(planner.kv.tables["a"]) == math.ceil(100 / 16) == 7
    grew_at = []
    while r.status is not RequestStatus.FINISHED:
        before = len(planner.kv.tables["a"])
        plan, _ = step(planner, worker)
        if r.status is not RequestStatus.FINISHED and len(planner.kv.tables["a"]) > before:
            grew_at.append(plan.seqs[0].start_pos)
    assert grew_at == [112, 128, 144]  # one new block per 16 decoded tokens, no more
    assert r.output_token_ids == reference(range(100), 60)


def test_finish_on_eos_unless_ignored_and_on_max_model_len():
    ref = reference(range(30), 10)
    planner, worker = make()
    r = req("a", range(30), max_tokens=10)
    r.eos_token_ids = frozenset({ref[2]})
    planner.add(r)
    run(planner, worker)
    assert r.output_token_ids == ref[:3] and r.finish_reason is FinishReason.STOP
    planner, worker = make()
    r = req("b", range(30), max_tokens=10, ignore_eos=True)
    r.eos_token_ids = frozenset({ref[2]})
    planner.add(r)
    run(planner, worker)
    assert r.output_token_ids == ref and r.finish_reason is FinishReason.LENGTH
    planner, worker = make(max_model_len=35)
    r = req("c", range(30), max_tokens=10)
    planner.add(r)
    run(planner, worker)
    assert r.output_token_ids == ref[:5] and r.num_tokens == 35 and r.finish_reason is FinishReason.LENGTH


# ---- chunked prefill, budgets, decode first --------------------------------------
def test_exact_chunk_splits_when_alone():
    planner, worker = make(num_blocks=1300, max_model_len=32768)
    prompt = [i % 997 for i in range(20000)]
    r = req("a", prompt, max_tokens=2)
    planner.add(r)
    chunks, progress = [], []
    while r.num_output_tokens == 0:
        plan, updates = step(planner, worker)
        chunks.append([(s.start_pos, len(s.token_ids), s.sample) for s in plan.seqs])
        progress.append([(p.processed, p.total) for p in plan.prefill_progress])
        seq = plan.seqs[0]
        end = seq.start_pos + len(seq.token_ids)
        # every committed chunk reports progress; the sampling one closes it at (total, total)
        expected = (20000, 20000) if seq.sample else (end, 20000)
        assert updates[0].prefill_progress == expected
    assert chunks == [[(0, 8192, False)], [(8192, 8192, False)], [(16384, 3616, True)]]
    assert progress == [[(8192, 20000)], [(16384, 20000)], [(20000, 20000)]]
    assert len(planner.kv.tables["a"]) == 1250
    run(planner, worker)
    assert r.output_token_ids == reference(prompt, 2)


def test_chunk_size_caps_chunks():
    planner, worker = make(num_blocks=64, chunk_size=100, max_model_len=1024)
    planner.add(req("a", range(250), max_tokens=1))
    plans = run(planner, worker)
    assert [len(p.seqs[0].token_ids) for p in plans] == [100, 100, 50]


def test_decodes_first_and_prefill_takes_leftover_budget():
    planner, worker = make(num_blocks=64, max_num_batched_tokens=64)
    shorts = [req(f"s{i}", [i + 1] * 5, max_tokens=20) for i in range(3)]
    for r in shorts:
        planner.add(r)
    step(planner, worker)  # the three prefills (15 tokens)
    long = req("long", range(200), max_tokens=3)
    planner.add(long)
    shapes = []
    while long.num_output_tokens == 0:
        plan, _ = step(planner, worker)
        shapes.append([(s.request_id, len(s.token_ids)) for s in plan.seqs])
    decodes = [("s0", 1), ("s1", 1), ("s2", 1)]
    assert shapes == [decodes + [("long", 61)]] * 3 + [decodes + [("long", 17)]]
    run(planner, worker)
    for r in shorts:
        assert r.output_token_ids == reference(r.prompt_token_ids, 20)
    assert long.output_token_ids == reference(range(200), 3)


def test_max_num_seqs_and_budget_respected_every_step():
    planner, worker = make(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=50, chunk_size=32)
    reqs = [req(f"r{i}", [(i * 7 + j) % 50 for j in range(10 + 9 * i)], max_tokens=5 + i) for i in range(10)]
    for r in reqs:
        planner.add(r)
    plans = run(planner, worker)  # check_plan asserts the limits on every step
    assert max(len(p.seqs) for p in plans) == 4
    assert max(p.num_tokens for p in plans) == 50
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling.max_tokens)


# ---- retire -> free -> admit ---------------------------------------------------------
def test_retire_free_admit_in_one_step():
    planner, worker = make(num_blocks=4)
    a, b = req("a", range(40), max_tokens=2), req("b", range(100, 140), max_tokens=2)
    planner.add(a)
    planner.add(b)
    plan, _ = step(planner, worker)
    assert [s.request_id for s in plan.seqs] == ["a"] and planner.num_waiting == 1  # b does not fit
    plan, updates = step(planner, worker)
    assert updates[0].finished and updates[0].finish_reason is FinishReason.LENGTH
    assert planner.kv.pool.free_block_ids() == [3, 2, 1, 0]  # a's table [0,1,2] released tail first
    plan = planner.schedule()  # the very next schedule admits b into a's blocks
    assert [s.request_id for s in plan.seqs] == ["b"]
    assert plan.seqs[0].block_table == [3, 2, 1]
    planner.update(plan, worker.execute(plan))
    run(planner, worker)
    assert b.output_token_ids == reference(range(100, 140), 2)


def test_admission_never_overcommits_and_is_fifo():
    planner, worker = make(num_blocks=6)
    big, small = req("big", range(80), max_tokens=1), req("small", [5] * 3, max_tokens=1)
    holder = req("holder", range(200, 240), max_tokens=3)
    for r in (holder, big, small):
        planner.add(r)
    plan, _ = step(planner, worker)
    # big needs 5 blocks but 3 are free: admission stops, small does not jump the queue
    assert [s.request_id for s in plan.seqs] == ["holder"]
    assert planner.kv.pool.num_free_blocks == 3
    run(planner, worker)
    assert big.output_token_ids == reference(range(80), 1)


# ---- preemption ----------------------------------------------------------------------
def test_decode_preempts_newest_running_request():
    planner, worker = make(num_blocks=4)
    a, b = req("a", range(31), max_tokens=5), req("b", range(500, 531), max_tokens=5)
    planner.add(a)
    planner.add(b)
    step(planner, worker)  # both prefilled: 2 blocks each, pool full
    step(planner, worker)  # decode position 31: still inside block 1
    plan, _ = step(planner, worker)  # position 32: a needs a block, b is newest
    assert plan.preempted == ["b"] and [s.request_id for s in plan.seqs] == ["a"]
    assert planner.num_preemptions == 1 and b.num_preemptions == 1
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == reference(range(500, 531), 2)  # outputs are kept
    assert planner.waiting[0] is b
    plans = run(planner, worker)
    resume = next(s for p in plans for s in p.seqs if s.request_id == "b")
    # b's tail block was evicted for a; its first block is a prefix hit
    assert resume.start_pos == 16 and len(resume.token_ids) == 33 - 16
    assert a.output_token_ids == reference(range(31), 5)
    assert b.output_token_ids == reference(range(500, 531), 5)


def test_request_that_is_itself_newest_just_waits():
    planner, worker = make(num_blocks=4)
    a, b = req("a", range(20), max_tokens=4), req("b", range(500, 531), max_tokens=4)
    planner.add(a)
    planner.add(b)
    step(planner, worker)
    step(planner, worker)
    plan, _ = step(planner, worker)  # b reaches position 32 and needs a block; a does not
    assert plan.preempted == ["b"] and [s.request_id for s in plan.seqs] == ["a"]
    assert planner.waiting[0] is b and planner.kv.tables["a"] == [0, 1]
    run(planner, worker)
    assert b.output_token_ids == reference(range(500, 531), 4)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize(("budget", "chunk"), [(8192, 8192), (48, 32), (20, 7)])
def test_tiny_pool_preempts_yet_every_request_matches_running_alone(caching, budget, chunk):
    planner, worker = make(num_blocks=12, caching=caching, max_num_batched_tokens=budget, chunk_size=chunk)
    rng = random.Random(7)
    shared = [rng.randrange(VOCAB) for _ in range(32)]
    reqs = []
    for i in range(8):
        prompt = (shared if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randrange(5, 60))]
        reqs.append(req(f"r{i}", prompt, max_tokens=rng.randrange(10, 60)))
        planner.add(reqs[-1])
    run(planner, worker)
    assert planner.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling.max_tokens), r.request_id
        assert r.finish_reason is FinishReason.LENGTH


def test_partial_prefill_shrinks_its_chunk_instead_of_preempting():
    planner, worker = make(num_blocks=9, max_num_batched_tokens=64, chunk_size=64)
    a = req("a", range(40), max_tokens=30)
    planner.add(a)
    step(planner, worker)  # a holds 3 blocks
    big = req("big", range(1000, 1100), max_tokens=1)
    planner.add(big)
    plan, _ = step(planner, worker)
    assert [(s.request_id, len(s.token_ids)) for s in plan.seqs] == [("a", 1), ("big", 63)]
    assert planner.kv.pool.num_free_blocks == 2
    plan, _ = step(planner, worker)  # big wants 37 more; 1 slot of slack + 2 free blocks = 33
    assert plan.preempted == []
    assert [(s.request_id, len(s.token_ids)) for s in plan.seqs] == [("a", 1), ("big", 33)]
    run(planner, worker)
    assert big.output_token_ids == reference(range(1000, 1100), 1)
    assert a.output_token_ids == reference(range(40), 30)


# ---- prefix caching -------------------------------------------------------------------
def test_prefix_hit_shares_blocks_and_skips_cached_tokens():
    planner, worker = make(num_blocks=16)
    a = req("a", range(40), max_tokens=6)
    planner.add(a)
    step(planner, worker)
    b = req("b", list(range(32)) + [900] * 4, max_tokens=6)
    planner.add(b)
    plan, _ = step(planner, worker)
    sb = next(s for s in plan.seqs if s.request_id == "b")
    assert sb.start_pos == 32 and sb.token_ids == [900] * 4
    assert sb.block_table == [0, 1, 3] and planner.kv.tables["a"] == [0, 1, 2]
    assert [planner.kv.pool.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert b.num_cached_prompt_tokens == 32 and a.num_cached_prompt_tokens == 0
    run(planner, worker)
    assert b.output_token_ids == reference(b.prompt_token_ids, 6)


def test_fully_cached_prompt_still_computes_its_last_block():
    planner, worker = make(num_blocks=16)
    a = req("a", range(32), max_tokens=2)
    planner.add(a)
    run(planner, worker)
    c = req("c", range(32), max_tokens=2)
    planner.add(c)
    plan, _ = step(planner, worker)
    assert plan.seqs[0].start_pos == 16 and plan.seqs[0].token_ids == list(range(16, 32))
    assert c.num_cached_prompt_tokens == 16
    run(planner, worker)
    assert c.output_token_ids == a.output_token_ids == reference(range(32), 2)


def test_interrupted_chunked_prefill_resumes_from_index():
    planner, worker = make(num_blocks=32, chunk_size=64)
    r = req("a", range(200), max_tokens=2)
    planner.add(r)
    step(planner, worker)
    step(planner, worker)  # 128 tokens computed = 8 full hashed blocks
    planner.requeue_all(reset_prefix_cache=False)  # e.g. the step after was lost
    plan, _ = step(planner, worker)
    assert (plan.seqs[0].start_pos, len(plan.seqs[0].token_ids)) == (128, 64)
    run(planner, worker)
    assert r.output_token_ids == reference(range(200), 2)


def test_worker_restart_forgets_cached_blocks():
    planner, worker = make(num_blocks=16)
    a = req("a", range(40), max_tokens=10)
    planner.add(a)
    for _ in range(4):
        step(planner, worker)
    worker.restart()  # empty cache: trusting old blocks would fail the worker's reads
    planner.requeue_all()
    assert planner.kv.pool.num_cached_blocks == 0
    plan, _ = step(planner, worker)
    assert plan.seqs[0].start_pos == 0 and len(plan.seqs[0].token_ids) == 44  # prompt + 4 outputs
    run(planner, worker)
    assert a.output_token_ids == reference(range(40), 10)


# ---- abort / finish ------------------------------------------------------------------------
def test_abort_waiting_and_running_frees_immediately():
    planner, worker = make(num_blocks=8)
    a, b = req("a", range(40), max_tokens=50), req("b", range(100, 200), max_tokens=5)
    planner.add(a)
    planner.add(b)
    step(planner, worker)
    assert planner.num_running == 1 and planner.num_waiting == 1
    assert planner.abort("b") and planner.num_waiting == 0
    assert planner.abort("a") and planner.kv.pool.num_used_blocks == 0
    assert a.finish_reason is FinishReason.ABORT and a.status is RequestStatus.FINISHED
    assert not planner.abort("a") and not planner.has_work()
    planner.audit()


def test_abort_in_flight_ignores_result_and_frees_within_the_step():
    planner, worker = make(num_blocks=8)
    a, b = req("a", range(40), max_tokens=5), req("b", range(100, 120), max_tokens=5)
    planner.add(a)
    planner.add(b)
    plan = planner.schedule()
    assert planner.abort("a")
    planner.audit()  # a's blocks are still owned while its step runs
    assert planner.kv.tables["a"] == [0, 1, 2]
    updates = planner.update(plan, worker.execute(plan))
    assert [u.request_id for u in updates] == ["b"]
    assert "a" not in planner.kv.tables and a.output_token_ids == []
    assert planner.kv.pool.num_used_blocks == 2
    planner.add(req("a", range(5)))  # the id is free again
    run(planner, worker)
    assert b.output_token_ids == reference(range(100, 120), 5)


def test_finish_for_stop_string():
    planner, worker = make()
    r = req("a", range(10), max_tokens=20)
    planner.add(r)
    step(planner, worker)
    step(planner, worker)
    assert planner.finish("a", FinishReason.STOP)
    assert r.finish_reason is FinishReason.STOP and r.num_output_tokens == 2
    assert planner.kv.pool.num_used_blocks == 0 and not planner.has_work()


# ---- protocol misuse --------------------------------------------------------------------------
def test_update_protocol_is_enforced():
    planner, worker = make()
    planner.add(req("a", range(10), max_tokens=5))
    plan = planner.schedule()
    ahead = planner.schedule()  # one step may be planned ahead of the result of the one in flight...
    assert ahead.previous_step_id == plan.step_id and ahead.seqs[0].token_from_previous_step
    with pytest.raises(RuntimeError, match="in flight"):
        planner.schedule()  # ...but not two
    with pytest.raises(RuntimeError, match="oldest step in flight"):
        planner.update(ahead, worker.execute(plan))  # results apply in order
    with pytest.raises(ValueError, match="no sampled token"):
        planner.update(plan, samples_of({}))
    planner.update(plan, worker.execute(plan))  # the failed update changed nothing
    with pytest.raises(RuntimeError):
        planner.update(plan, samples_of({}))
    empty_planner, _ = make()
    empty = empty_planner.schedule()
    assert empty.is_empty and empty_planner.update(empty, {}) == []


def test_audit_catches_a_leaked_table():
    planner, worker = make()
    planner.add(req("a", range(10)))
    step(planner, worker)
    planner.running.clear()  # the planner "forgets" a running request
    with pytest.raises(LeakError, match="not live"):
        planner.audit()


def test_drain_hands_requests_to_another_planner():
    planner, worker = make(num_blocks=16)
    a, b = req("a", range(40), max_tokens=6), req("b", range(70, 90), max_tokens=6)
    planner.add(a)
    planner.add(b)
    step(planner, worker)
    step(planner, worker)
    moved = planner.drain()
    assert moved == [a, b] and not planner.has_work() and planner.kv.pool.num_used_blocks == 0
    other, other_worker = make(num_blocks=16)
    for r in moved:
        other.add(r)
    run(other, other_worker)
    assert a.output_token_ids == reference(range(40), 6)
    assert b.output_token_ids == reference(range(70, 90), 6)


# ---- randomized soak -------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_with_aborts(seed):
    rng = random.Random(seed)
    planner, worker = make(
        num_blocks=rng.choice([10, 16, 40]),
        max_num_seqs=rng.choice([2, 5, 64]),
        max_num_batched_tokens=rng.choice([16, 64, 512]),
        chunk_size=rng.choice([8, 32, 512]),
    )
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 48))] for _ in range(3)]
    pending = []
    for i in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
        pending.append(req(f"r{i}", prompt, max_tokens=rng.randrange(1, 40)))
    live, aborted = [], set()
    while pending or planner.has_work():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                live.append(pending.pop(0))
                planner.add(live[-1])
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            if planner.abort(victim.request_id):
                aborted.add(victim.request_id)
        decoding = {r.request_id for r in planner.running if r.num_tokens - r.num_computed_tokens == 1}
        plan = planner.schedule()
        check_plan(planner, plan, decoding)
        if plan.seqs and rng.random() < 0.1:  # abort while in flight
            rid = rng.choice(plan.seqs).request_id
            planner.abort(rid)
            aborted.add(rid)
        planner.audit()
        sampled = worker.execute(plan) if plan.seqs else samples_of({})
        planner.update(plan, sampled)
        planner.audit()
    assert planner.kv.pool.num_used_blocks == 0
    for r in live:
        if r.request_id not in aborted:
            assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling.max_tokens), r.request_id
