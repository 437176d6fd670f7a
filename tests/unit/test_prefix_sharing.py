"""Sharing blocks: forks of n samples with copy-on-write, pinning, eviction
policies, memory exactness, and random-operation invariants (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.kv.block_manager import KVCacheManager, PinLimitExceeded
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.planner import Planner, PlannerConfig
from scheduler_svc.request import Request, SamplingOptions
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.planner_sim import BS, VOCAB, reference, step

_ids = iter(range(10**6, 10**9))


def make(num_blocks=64, policy="lru", max_pinned=None, **config):
    config.setdefault("max_model_len", 4096)
    pool = BlockPool(num_blocks, BS, eviction_policy=policy)
    kv = KVCacheManager(pool, BS, extra_keys=("m",), max_pinned_blocks=max_pinned)
    return Planner(PlannerConfig(**config), kv), FakeWorker(num_blocks, BS, VOCAB)


def group(rid: str, prompt: list[int], n: int, max_tokens: int = 6) -> tuple[Request, list[Request]]:
    """What the server builds for n > 1: a prefill-only parent and n children."""
    sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.0)
    children = [Request(f"{rid}/{i}", next(_ids), list(prompt), sampling, sample_index=i) for i in range(n)]
    parent = Request(rid, next(_ids), list(prompt[:-1]), sampling, prefill_only=True, children=children)
    return parent, children


def run(planner, worker, max_steps=20000):
    """Step until idle; then only pinned blocks may still be in use."""
    for _ in range(max_steps):
        if not planner.has_work():
            planner.audit()
            assert planner.kv.pool.num_used_blocks == planner.kv.num_pinned_blocks
            return
        step(planner, worker)
    raise AssertionError("did not finish")


def outputs(children):
    return [c.output_token_ids for c in children]


def test_fork_shares_the_prompt_and_copies_the_partial_block_on_write():
    planner, worker = make()
    prompt = list(range(100, 121))  # 21 tokens: the parent computes 20 = one full block + 4
    parent, children = group("g", prompt, n=4)
    planner.add(parent)
    plan, updates = step(planner, worker)  # the parent's prefill
    assert [s.request_id for s in plan.seqs] == ["g"] and not plan.seqs[0].sample
    assert [u.forked for u in updates] == [True]
    b0, b1 = plan.seqs[0].block_table
    pool = planner.kv.pool
    assert (pool.ref_count(b0), pool.ref_count(b1)) == (4, 4)  # the parent let go; four children share
    assert all(planner.kv.tables[c.request_id] == [b0, b1] for c in children)

    plan, _ = step(planner, worker)  # each child computes the last prompt token at position 20, in b1
    assert len(plan.seqs) == 4 and all(s.start_pos == 20 and s.sample for s in plan.seqs)
    # The first three writers copy b1; the last one is its sole owner by then and writes in place.
    assert [src for src, _ in plan.copies] == [b1, b1, b1]
    copies = [dst for _, dst in plan.copies]
    assert [planner.kv.tables[c.request_id][1] for c in children] == copies + [b1]
    assert pool.ref_count(b0) == 4 and all(pool.ref_count(b) == 1 for b in copies + [b1])

    run(planner, worker)
    assert outputs(children) == [reference(prompt, 6)] * 4


def test_fork_at_a_block_boundary_needs_no_copy():
    planner, worker = make()
    prompt = list(range(200, 217))  # 17 tokens: the parent fills exactly one block
    parent, children = group("g", prompt, n=3)
    planner.add(parent)
    step(planner, worker)
    plan, _ = step(planner, worker)
    assert plan.copies == [] and len({s.block_table[1] for s in plan.seqs}) == 3
    run(planner, worker)
    assert outputs(children) == [reference(prompt, 6)] * 3


def test_aborting_every_child_ends_the_parent_and_frees_its_blocks():
    planner, worker = make()
    parent, children = group("g", list(range(300, 340)), n=2)
    planner.add(parent)
    for child in children:
        assert planner.abort(child.request_id)
    assert not planner.has_work() and planner.kv.pool.num_used_blocks == 0
    planner.audit()


def test_pinned_prefix_survives_pressure_and_unpins():
    planner, worker = make(num_blocks=12)
    system = list(range(400, 432))  # two full blocks
    pin_req = Request("pin", next(_ids), system + [1], SamplingOptions(max_tokens=1))
    planner.add(pin_req)
    run(planner, worker)
    pin_id, tokens = planner.kv.pin(Request("pin2", next(_ids), system, SamplingOptions()))
    assert tokens == 32 and planner.kv.num_pinned_blocks == 2
    pinned = planner.kv.pins[pin_id]
    # Unrelated requests need every unpinned block, evicting all other cached blocks.
    for i in range(4):
        planner.add(Request(f"r{i}", next(_ids), [500 + i] * 150, SamplingOptions(max_tokens=2)))
    run(planner, worker)
    assert planner.kv.pool.blocks_reclaimed > 0
    assert all(planner.kv.pool.blocks[b].block_hash is not None and planner.kv.pool.ref_count(b) == 1 for b in pinned)
    hit = Request("hit", next(_ids), system + [7, 8], SamplingOptions(max_tokens=2))
    planner.add(hit)
    step(planner, worker)
    assert hit.num_cached_prompt_tokens == 32
    run(planner, worker)
    assert planner.kv.unpin(pin_id) and not planner.kv.unpin(pin_id)
    assert planner.kv.pool.num_used_blocks == 0
    planner.audit()


def test_pin_limit_and_uncached_prefix():
    planner, worker = make(num_blocks=16, max_pinned=1)
    prefix = list(range(600, 632))
    assert planner.kv.pin(Request("p", next(_ids), prefix, SamplingOptions())) is None  # not computed yet
    planner.add(Request("warm", next(_ids), prefix + [1], SamplingOptions(max_tokens=1)))
    run(planner, worker)
    with pytest.raises(PinLimitExceeded):
        planner.kv.pin(Request("p", next(_ids), prefix, SamplingOptions()))
    assert planner.kv.num_pinned_blocks == 0
    planner.audit()


@pytest.mark.parametrize("policy,first_evicted", [("lru", "shared"), ("priority", "tail")])
def test_priority_policy_evicts_unshared_blocks_before_shared_prefixes(policy, first_evicted):
    planner, worker = make(num_blocks=8, policy=policy)
    shared = list(range(700, 716))  # one block two requests share
    planner.add(Request("a", next(_ids), shared + [1], SamplingOptions(max_tokens=1)))
    run(planner, worker)
    planner.add(Request("b", next(_ids), shared + [2], SamplingOptions(max_tokens=1)))
    run(planner, worker)  # b hit a's first block: it is now a shared prefix block
    tail = list(range(800, 816))
    planner.add(Request("c", next(_ids), tail + [3], SamplingOptions(max_tokens=1)))
    run(planner, worker)
    kv = planner.kv
    shared_block = kv.pool.get_cached_block(kv._block_hashes(Request("x", 0, shared + [0]), 1)[0])
    tail_block = kv.pool.get_cached_block(kv._block_hashes(Request("y", 0, tail + [0]), 1)[0])
    assert shared_block is not None and tail_block is not None
    # Ask for all but one free block: exactly one cached block survives.
    uncached = kv.pool.num_free_blocks - kv.pool.num_cached_free_blocks
    kv.pool.free(kv.pool.allocate(uncached + 1))
    survivors = {
        kv.pool.get_cached_block(kv._block_hashes(Request("x", 0, shared + [0]), 1)[0]),
        kv.pool.get_cached_block(kv._block_hashes(Request("y", 0, tail + [0]), 1)[0]),
    }
    evicted = "shared" if shared_block not in survivors else "tail"
    assert evicted == first_evicted


def test_eight_requests_sharing_a_512_token_prefix_use_prefix_plus_unique_blocks():
    planner, worker = make(num_blocks=128, max_num_batched_tokens=8192)
    prefix = list(range(1000, 1512))  # 32 full blocks
    first = Request("r0", next(_ids), prefix + [5] * 20, SamplingOptions(max_tokens=50))
    planner.add(first)
    step(planner, worker)  # r0 computes the prefix; the others will hit it
    requests = [
        Request(f"r{i}", next(_ids), prefix + [5 + i] * (20 + i), SamplingOptions(max_tokens=50)) for i in range(1, 8)
    ]
    for r in requests:
        planner.add(r)
    step(planner, worker)
    everyone = [first, *requests]
    unique = sum(len(planner.kv.tables[r.request_id]) - 32 for r in everyone)
    assert planner.kv.usage().used_blocks == 32 + unique
    assert all(r.num_cached_prompt_tokens == 512 for r in requests)
    assert planner.kv.usage().prefix_hit_tokens == 7 * 512
    run(planner, worker)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "fork", "step", "abort", "pin", "unpin"]),
            st.integers(0, 3),
            st.integers(1, 40),
            st.integers(1, 12),
        ),
        min_size=20,
        max_size=120,
    ),
    st.sampled_from(["lru", "priority"]),
)
def test_random_operations_keep_every_invariant(ops, policy):
    planner, worker = make(
        num_blocks=14, policy=policy, max_num_batched_tokens=40, chunk_size=24, max_model_len=200, max_pinned=4
    )
    prefixes = [list(range(2000 + 100 * i, 2000 + 100 * i + 32)) for i in range(4)]
    live: list[str] = []
    expected: dict[str, tuple[list[int], int, Request]] = {}
    pins: list[bytes] = []
    for i, (op, which, length, max_tokens) in enumerate(ops):
        prompt = prefixes[which][: 16 + length % 17] + [3000 + i] * (length % 9)
        if op == "add":
            r = Request(f"r{i}", next(_ids), prompt, SamplingOptions(max_tokens=max_tokens))
            planner.add(r)
            live.append(r.request_id)
            expected[r.request_id] = (prompt, max_tokens, r)
        elif op == "fork":
            parent, children = group(f"g{i}", prompt, n=1 + which, max_tokens=max_tokens)
            planner.add(parent)
            for c in children:
                live.append(c.request_id)
                expected[c.request_id] = (prompt, max_tokens, c)
        elif op == "abort" and live:
            rid = live.pop(which % len(live))
            planner.abort(rid)
            expected.pop(rid)
        elif op == "pin":
            try:
                pinned = planner.kv.pin(Request("p", 0, prefixes[which][:32]))
            except PinLimitExceeded:
                pinned = None
            if pinned:
                pins.append(pinned[0])
        elif op == "unpin" and pins:
            planner.kv.unpin(pins.pop(which % len(pins)))
        if op == "step" and planner.has_work():
            step(planner, worker)
        _check_invariants(planner)
    for pin_id in pins:
        planner.kv.unpin(pin_id)
    run(planner, worker)
    for prompt, max_tokens, r in expected.values():
        assert r.output_token_ids == reference(prompt, max_tokens, 200)
    assert planner.kv.pool.num_used_blocks == 0


def _check_invariants(planner):
    planner.audit()  # ref count == table + pin references; free queue == ref-0 blocks; index consistent
    pool = planner.kv.pool
    pinned = {b for blocks in planner.kv.pins.values() for b in blocks}
    assert all(pool.ref_count(b) >= 1 for b in pinned)
    assert all(pool.ref_count(b) == 0 for b in pool.free_block_ids())


@pytest.mark.parametrize("when", ["queued", "in flight", "after the step"])
def test_aborting_a_parent_before_the_fork_frees_everything(when):
    planner, worker = make()
    parent, children = group("g", list(range(900, 940)), n=3)
    planner.add(parent)
    if when == "queued":
        planner.abort("g")
    else:
        plan = planner.schedule()
        if when == "in flight":
            planner.abort("g")
        planner.update(plan, worker.execute(plan))
        if when == "after the step":
            # 39 tokens in one chunk: the fork already happened; abort the samples instead.
            for child in children:
                planner.abort(child.request_id)
    assert not planner.has_work() and not planner.requests
    assert planner.kv.pool.num_used_blocks == 0
    planner.audit()
