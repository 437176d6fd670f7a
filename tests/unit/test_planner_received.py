"""Blocks a KV transfer wrote for a request (planning/received.py), over real block
managers and the FakeWorker's simulated cache: a prefill planner computes the prompt
and first token, its full blocks' slots are copied into blocks the decode planner
holds under a scratch id (what engine/disagg.py and worker.v1 FetchBlocks do), and
the request continues on the decode planner. Its admission there takes the received
blocks as its prefix, with or without prefix caching, and computes only the tail;
the output equals running alone, ref counts are exact and the audit is clean."""

from __future__ import annotations

import pytest

from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.planner import Planner, PlannerConfig
from scheduler_svc.request import FinishReason, Request
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.planner_sim import BS, VOCAB, reference, req, run, step


def make(caching: bool, num_blocks: int = 32) -> tuple[Planner, FakeWorker]:
    kv = KVCacheManager(BlockPool(num_blocks, BS, enable_prefix_caching=caching), BS, extra_keys=("m", "f32"))
    return Planner(PlannerConfig(max_model_len=1024), kv), FakeWorker(num_blocks, BS, VOCAB)


def prefill_and_move(src: Planner, src_worker: FakeWorker, dst: Planner, dst_worker: FakeWorker, request: Request):
    """Run `request` on src until its first token, copy its full blocks into blocks dst
    allocates under a scratch id, hand it off to dst: (scratch, the blocks it holds)."""
    src.add(request)
    while request.num_output_tokens == 0:
        step(src, src_worker)
    full = request.num_computed_tokens // BS
    scratch = Request(f"{request.request_id}#kv", 0, request.all_token_ids[: full * BS + 1])
    hits, hit_tokens = dst.kv.get_computed_blocks(scratch)
    assert dst.kv.allocate_slots(scratch, full * BS - hit_tokens, hits) is not None
    scratch.num_computed_tokens = full * BS
    dst_ids = dst.kv.block_table(scratch.request_id)
    for src_block, dst_block in zip(src.kv.block_table(request.request_id)[:full], dst_ids):
        for offset in range(BS):
            dst_worker.slots[dst_block * BS + offset] = src_worker.slots[src_block * BS + offset]
    taken = src.hand_off(request.request_id)
    dst.add(taken)
    dst.kv.cache_full_blocks(scratch, full * BS)
    dst.received.attach(taken.request_id, scratch)
    return scratch, list(dst_ids)


@pytest.mark.parametrize("caching", [False, True])
def test_moved_request_takes_its_received_blocks_and_computes_only_the_tail(caching):
    src, src_worker = make(caching)
    dst, dst_worker = make(caching)
    prompt = list(range(100, 170))  # 4 full blocks and 6 tokens
    request = req("r", prompt, max_tokens=6)
    scratch, held = prefill_and_move(src, src_worker, dst, dst_worker, request)
    assert len(held) == 4 and dst.received.held_ids == ["r#kv"]
    assert [dst.kv.pool.blocks[b].ref_cnt for b in held] == [1, 1, 1, 1]
    dst.audit()

    plan, _ = step(dst, dst_worker)  # admission: the received blocks are its prefix
    (seq,) = plan.seqs
    assert seq.start_pos == 4 * BS and len(seq.token_ids) == len(prompt) + 1 - 4 * BS
    assert dst.kv.block_table("r")[:4] == held
    assert [dst.kv.pool.blocks[b].ref_cnt for b in held] == [1, 1, 1, 1]  # the request's, the scratch's freed
    assert dst.received.held_ids == [] and dst.kv.block_table(scratch.request_id) == []
    assert dst._admission.resumed_tokens == 4 * BS and dst._admission.recomputed_tokens == len(prompt) + 1 - 4 * BS
    run(dst, dst_worker)
    assert request.output_token_ids == reference(prompt, 6)
    assert request.num_cached_prompt_tokens == 0  # a moved KV is no prefix hit of the request's


@pytest.mark.parametrize("caching", [False, True])
def test_received_blocks_are_freed_when_the_request_ends_or_the_cache_is_lost(caching):
    src, src_worker = make(caching)
    dst, dst_worker = make(caching)
    a, b = req("a", list(range(200, 240)), max_tokens=4), req("b", list(range(300, 340)), max_tokens=4)
    _, held_a = prefill_and_move(src, src_worker, dst, dst_worker, a)
    _, held_b = prefill_and_move(src, src_worker, dst, dst_worker, b)
    assert dst.received.held_ids == ["a#kv", "b#kv"] and dst.kv.pool.num_used_blocks == 4

    assert dst.abort("a") and a.finish_reason is FinishReason.ABORT
    assert dst.received.held_ids == ["b#kv"]
    assert [dst.kv.pool.blocks[x].ref_cnt for x in held_a] == [0, 0]
    dst.audit()

    dst.requeue_all()  # the decode worker restarted: nothing received is trusted
    assert dst.received.held_ids == [] and dst.kv.pool.num_used_blocks == 0
    dst.audit()
    # b recomputes its whole prompt, still exact.
    plan, _ = step(dst, dst_worker)
    assert plan.seqs[0].start_pos == 0
    run(dst, dst_worker)
    assert b.output_token_ids == reference(b.prompt_token_ids, 4)
