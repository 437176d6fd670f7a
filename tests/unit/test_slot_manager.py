"""The contiguous layout on the scheduler side: SlotManager under the real
planner against the fake worker (a slot is a block of max_seq_len tokens), with
audit() after every step; and both managers satisfy the KVManager protocol."""

import random

import pytest

from scheduler_svc.kv.block_manager import KVCacheManager, LeakError
from scheduler_svc.kv.block_pool import BlockPool, DoubleFreeError
from scheduler_svc.kv.interface import KVManager
from scheduler_svc.kv.slot_manager import SlotManager, SlotPool
from scheduler_svc.planning.planner import Planner, PlannerConfig
from scheduler_svc.planning.validation import RequestRejected
from scheduler_svc.request import Request, SamplingOptions
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.planner_sim import reference, req, step

SLOT_LEN = 256
VOCAB = 1000


def make(num_slots=4, slot_len=SLOT_LEN, **config):
    config.setdefault("max_model_len", slot_len)
    kv = SlotManager(num_slots, slot_len, extra_keys=("m", "bf16"))
    return Planner(PlannerConfig(block_size=slot_len, **config), kv), FakeWorker(num_slots, slot_len, VOCAB)


def run(planner, worker, max_steps=20000, on_step=None):
    for _ in range(max_steps):
        if not planner.has_work():
            planner.audit()
            assert planner.kv.pool.num_used_blocks == 0
            return
        step(planner, worker)
        if on_step:
            on_step(planner)
    raise AssertionError("did not finish")


def test_both_managers_satisfy_the_kv_pool_protocol():
    assert isinstance(SlotManager(2, 64), KVManager)
    assert isinstance(KVCacheManager(BlockPool(4, 16)), KVManager)


def test_a_sequence_holds_one_whole_slot_for_its_life():
    planner, worker = make(num_slots=2)
    r = req("a", range(10, 50), max_tokens=5)
    planner.add(r)
    plan, _ = step(planner, worker)
    (seq,) = plan.seqs
    slot = seq.block_table[0]
    assert seq.block_table == [slot]
    assert seq.slot_mapping == [slot * SLOT_LEN + p for p in range(40)]
    usage = planner.kv.usage()
    assert (usage.used_blocks, usage.free_blocks, usage.allocated_slots) == (1, 1, SLOT_LEN)
    assert usage.unused_slots == SLOT_LEN - 40  # internal fragmentation: the rest of the slot
    while planner.has_work():
        plan, _ = step(planner, worker)
        if plan.seqs:
            assert plan.seqs[0].block_table == [slot]  # never grows, never moves
    assert r.output_token_ids == reference(list(range(10, 50)), 5)
    assert planner.kv.usage().used_blocks == 0


def test_admission_waits_for_a_free_slot_and_concurrency_is_the_slot_count():
    planner, worker = make(num_slots=3, max_num_seqs=64)
    rng = random.Random(1)
    cases = {
        f"r{i}": ([rng.randrange(VOCAB) for _ in range(rng.randrange(2, 60))], rng.randrange(1, 20)) for i in range(12)
    }
    requests = [req(rid, p, max_tokens=n) for rid, (p, n) in cases.items()]
    for r in requests:
        planner.add(r)
    peak = []
    run(planner, worker, on_step=lambda p: peak.append(p.num_running))
    assert max(peak) == 3  # tokens would fit many more; slots do not
    assert planner.num_preemptions == 0  # a running sequence never needs more memory
    for r in requests:
        prompt, n = cases[r.request_id]
        assert r.output_token_ids == reference(prompt, n)


def test_chunked_prefill_stays_in_the_slot():
    planner, worker = make(num_slots=2, max_num_batched_tokens=32, chunk_size=16)
    prompt = list(range(100, 190))
    r = req("a", prompt, max_tokens=4)
    planner.add(r)
    run(planner, worker)
    assert r.output_token_ids == reference(prompt, 4)


def test_forks_copy_the_shared_slot_before_writing():
    planner, worker = make(num_slots=4)
    prompt = list(range(100, 121))
    sampling = SamplingOptions(max_tokens=6)
    children = [Request(f"g/{i}", 900 + i, list(prompt), sampling, sample_index=i) for i in range(3)]
    parent = Request("g", 899, list(prompt[:-1]), sampling, prefill_only=True, children=children)
    planner.add(parent)
    plan, updates = step(planner, worker)
    (slot,) = plan.seqs[0].block_table
    assert [u.forked for u in updates] == [True]
    assert planner.kv.pool.ref_count(slot) == 3  # the parent let go; three children share it
    plan, _ = step(planner, worker)
    # The first two writers copy the slot; the last owns it alone by then.
    assert [src for src, _ in plan.copies] == [slot, slot]
    assert sorted(s.block_table[0] for s in plan.seqs) == sorted([dst for _, dst in plan.copies] + [slot])
    run(planner, worker)
    assert [c.output_token_ids for c in children] == [reference(prompt, 6)] * 3


def test_forks_preempt_the_newest_when_slots_run_out():
    planner, worker = make(num_slots=2)
    prompt = list(range(200, 230))
    sampling = SamplingOptions(max_tokens=5)
    children = [Request(f"g/{i}", 800 + i, list(prompt), sampling, sample_index=i) for i in range(3)]
    parent = Request("g", 799, list(prompt[:-1]), sampling, prefill_only=True, children=children)
    planner.add(parent)
    run(planner, worker)
    assert planner.num_preemptions > 0  # three samples, two slots: one waits its turn
    assert [c.output_token_ids for c in children] == [reference(prompt, 5)] * 3


def test_a_prompt_longer_than_a_slot_is_rejected():
    planner, _ = make(num_slots=8, slot_len=64, max_model_len=4096)
    assert planner.max_len == 64
    with pytest.raises(RequestRejected, match=r"holds 64 tokens \(one slot of 64 per request\)"):
        planner.add(req("a", range(64)))


def test_aborts_and_requeue_free_every_slot():
    planner, worker = make(num_slots=3)
    for i in range(5):
        planner.add(req(f"r{i}", range(i, i + 30), max_tokens=50))
    for _ in range(3):
        step(planner, worker)
    planner.abort("r0")
    planner.requeue_all()
    planner.audit()
    assert planner.kv.pool.num_used_blocks == 0
    run(planner, worker)


def test_slot_pool_double_free_and_audit():
    pool = SlotPool(2, 16)
    slot = pool.allocate()
    pool.free(slot)
    with pytest.raises(DoubleFreeError):
        pool.free(slot)
    kv = SlotManager(2, 16)
    r = req("x", range(5))
    assert kv.allocate_slots(r, 5) == [0]
    kv.audit(["x"])
    with pytest.raises(LeakError, match="not live"):
        kv.audit([])
    kv.pool.refs[1] = 1  # a slot held by no table
    with pytest.raises(LeakError, match="slot 1"):
        kv.audit(["x"])


def test_no_prefix_sharing():
    kv = SlotManager(2, 64)
    r = req("x", range(40))
    assert kv.get_computed_blocks(r) == ([], 0)
    with pytest.raises(ValueError, match="shares no prefix"):
        kv.allocate_slots(r, 8, [1])
    assert kv.pin(r) is None and kv.unpin(b"x") is False and kv.reset_prefix_cache() == 0
