"""Planning one step ahead of the step in flight (overlapped scheduling) against
the fake worker, which resolves token_from_previous_step from its own last
step: same outputs as strict alternation, exact block accounting throughout."""

from __future__ import annotations

import random
from collections import defaultdict, deque

import pytest

from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.planner import Planner, PlannerConfig, StepPlan
from scheduler_svc.request import FinishReason, Request, SamplingOptions
from tests.helpers.fake_worker import FakeWorker, samples_of
from tests.helpers.planner_sim import tokens_of

BS, VOCAB = 16, 1000


def make(num_blocks: int = 64, **config) -> tuple[Planner, FakeWorker]:
    config.setdefault("max_model_len", 4096)
    kv = KVCacheManager(BlockPool(num_blocks, BS), BS, extra_keys=("m",))
    return Planner(PlannerConfig(**config), kv), FakeWorker(num_blocks, BS, VOCAB)


def requests(seed: int, count: int, eos: frozenset[int] = frozenset()) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(40)]
    out = []
    for i in range(count):
        prompt = (shared[: rng.randrange(0, 40)] if i % 3 == 0 else []) + [
            rng.randrange(VOCAB) for _ in range(rng.randrange(1, 60))
        ]
        out.append(Request(f"r{i}", i + 1, prompt, SamplingOptions(max_tokens=rng.randrange(1, 30)), eos_token_ids=eos))
    return out


def run_sync(planner: Planner, worker: FakeWorker) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = defaultdict(list)
    while planner.has_work():
        plan = planner.schedule()
        for update in planner.update(plan, worker.execute(plan) if plan.seqs else samples_of({})):
            outputs[update.request_id].extend(tokens_of(update))
        planner.audit()
    return outputs


def run_ahead(planner: Planner, worker: FakeWorker, on_update=None) -> tuple[dict[str, list[int]], int]:
    """Like the engine core: keep one step planned ahead while one is in flight.
    The fake worker runs each step as it is sent, in order."""
    outputs: dict[str, list[int]] = defaultdict(list)
    in_flight: deque[tuple[StepPlan, dict]] = deque()
    ahead_plans = 0
    while planner.has_work() or in_flight:
        if not in_flight:
            plan = planner.schedule()
            in_flight.append((plan, worker.execute(plan) if plan.seqs else samples_of({})))
        if planner.can_plan_ahead and planner.has_work():
            ahead = planner.schedule()
            if not ahead.is_empty:
                assert ahead.previous_step_id == in_flight[-1][0].step_id
                ahead_plans += 1
                in_flight.append((ahead, worker.execute(ahead)))
        plan, sampled = in_flight.popleft()
        for update in planner.update(plan, sampled):
            outputs[update.request_id].extend(tokens_of(update))
            if on_update:
                on_update(planner, update)
        planner.audit()
    assert planner.kv.pool.num_used_blocks == 0
    return outputs, ahead_plans


@pytest.mark.parametrize("seed", range(6))
def test_planning_ahead_gives_the_tokens_of_strict_alternation(seed):
    eos = frozenset(range(0, VOCAB, 23))  # ~4% of tokens end a request: speculative decodes get discarded
    planner, worker = make(num_blocks=48, max_num_batched_tokens=64, chunk_size=32, max_num_seqs=8)
    for r in requests(seed, 24, eos):
        planner.add(r)
    want = run_sync(planner, worker)
    planner, worker = make(num_blocks=48, max_num_batched_tokens=64, chunk_size=32, max_num_seqs=8)
    for r in requests(seed, 24, eos):
        planner.add(r)
    got, ahead_plans = run_ahead(planner, worker)
    assert got == want
    assert ahead_plans > 20  # most steps were planned ahead
    assert any(s.token_from_previous_step for p in worker.steps for s in p.seqs)


def test_a_request_ending_in_flight_discards_its_speculative_token_and_frees_its_blocks():
    planner, worker = make()
    first = FakeWorker(1, BS, VOCAB).next_token(list(range(5, 25)))
    r = Request("a", 1, list(range(5, 25)), SamplingOptions(max_tokens=10), eos_token_ids=frozenset({first}))
    planner.add(r)
    n = planner.schedule()
    ahead = planner.schedule()  # decodes the token n samples, not knowing it is EOS
    assert ahead.seqs[0].token_from_previous_step and ahead.previous_step_id == n.step_id
    (update,) = planner.update(n, worker.execute(n))
    assert update.finished and update.finish_reason is FinishReason.STOP and update.token_id == first
    assert planner.kv.pool.num_used_blocks == 2, "its blocks stay until the step in flight that holds them is done"
    assert planner.update(ahead, worker.execute(ahead)) == []  # the speculative token is dropped
    assert planner.kv.pool.num_used_blocks == 0 and r.output_token_ids == [first]
    planner.audit()


def test_nothing_is_planned_past_max_tokens():
    planner, worker = make()
    planner.add(Request("a", 1, list(range(5, 25)), SamplingOptions(max_tokens=1)))
    planner.schedule()
    assert planner.schedule().is_empty  # its one token is being sampled: nothing to plan after it


def test_an_abort_while_two_steps_are_in_flight_frees_after_the_last():
    planner, worker = make()
    planner.add(Request("a", 1, list(range(5, 40)), SamplingOptions(max_tokens=10)))
    n = planner.schedule()
    ahead = planner.schedule()
    assert planner.abort("a")
    assert planner.kv.pool.num_used_blocks == 3 and not planner.idle
    assert planner.update(n, worker.execute(n)) == []
    assert planner.kv.pool.num_used_blocks == 3
    assert planner.update(ahead, worker.execute(ahead)) == []
    assert planner.kv.pool.num_used_blocks == 0 and planner.idle
    planner.audit()


def test_a_plan_ahead_never_preempts_it_defers():
    # 6 blocks: two requests of 40 tokens fill them; the next decode needs a 7th block.
    planner, worker = make(num_blocks=6)
    for rid, seq_id in (("a", 1), ("b", 2)):
        planner.add(Request(rid, seq_id, list(range(seq_id, seq_id + 47)), SamplingOptions(max_tokens=20)))
    plan = planner.schedule()
    planner.update(plan, worker.execute(plan))  # both prompts: 3 blocks each, full at 48 tokens after a decode
    n = planner.schedule()  # decodes at position 47: the last slot of each third block
    ahead = planner.schedule()  # position 48 needs a fourth block each, and none is free
    assert ahead.deferred and not ahead.preempted and planner.num_preemptions == 0
    assert not planner.can_plan_ahead or ahead.is_empty
    planner.update(n, worker.execute(n))
    if ahead.seqs:
        planner.update(ahead, worker.execute(ahead))
    plan = planner.schedule()  # nothing in flight: now it may preempt
    assert plan.preempted == ["b"]
    planner.update(plan, worker.execute(plan))
    planner.audit()
