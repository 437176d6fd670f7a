"""--scheduling-policy priority (vLLM's): the waiting request with the lowest
`priority` (then the earliest) is admitted first, and a step that runs out of
blocks preempts the least urgent running request (highest priority value, then
the latest), not simply the newest; with fcfs a priority other than 0 is refused."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.planner import Planner, PlannerConfig
from scheduler_svc.planning.validation import RequestRejected
from scheduler_svc.request import RequestStatus
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.planner_sim import BS, VOCAB, reference, req, run, step


def make(num_blocks=64, policy="priority", **config):
    config.setdefault("max_model_len", 4096)
    kv = KVCacheManager(BlockPool(num_blocks, BS), BS, extra_keys=("m", "bf16"))
    return Planner(PlannerConfig(scheduling_policy=policy, **config), kv), FakeWorker(num_blocks, BS, VOCAB)


def with_priority(rid, prompt, priority, **kw):
    return dataclasses.replace(req(rid, prompt, **kw), priority=priority)


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    planner, worker = make(max_num_seqs=1)
    for rid, priority in (("a", 5), ("b", 0), ("c", 5), ("d", -1)):
        planner.add(with_priority(rid, range(10), priority, max_tokens=2))
    started: list[str] = []
    for plan in run(planner, worker):
        started += [s.request_id for s in plan.seqs if s.request_id not in started]
    assert started == ["d", "b", "a", "c"]


def test_fcfs_admits_in_arrival_order_and_refuses_a_priority():
    planner, worker = make(policy="fcfs", max_num_seqs=1)
    for rid in "abc":
        planner.add(req(rid, range(10), max_tokens=2))
    started: list[str] = []
    for plan in run(planner, worker):
        started += [s.request_id for s in plan.seqs if s.request_id not in started]
    assert started == ["a", "b", "c"]
    with pytest.raises(RequestRejected, match="--scheduling-policy priority") as err:
        planner.add(with_priority("p", range(10), 3))
    assert err.value.field == "priority" and not planner.has_work()


def test_the_least_urgent_running_request_is_preempted_not_the_newest():
    """The pool holds 4 blocks; a and b take 2 each. When a needs a third block, fcfs
    would preempt b (the newest); here b is the more urgent, so a gives way itself."""
    planner, worker = make(num_blocks=4)
    a = with_priority("a", range(31), 10, max_tokens=5)
    b = with_priority("b", range(500, 531), 0, max_tokens=5)
    planner.add(a)
    planner.add(b)
    step(planner, worker)  # both prefilled: 2 blocks each, the pool full
    step(planner, worker)  # decode at position 31: still inside block 1
    plan, _ = step(planner, worker)  # position 32: a needs a block
    assert plan.preempted == ["a"] and [s.request_id for s in plan.seqs] == ["b"]
    assert a.status is RequestStatus.WAITING and b.status is RequestStatus.RUNNING
    run(planner, worker)
    assert a.output_token_ids == reference(range(31), 5) and b.output_token_ids == reference(range(500, 531), 5)


def test_the_newest_gives_way_when_it_is_the_least_urgent():
    """The same pool, priorities the other way round: b (newest, priority 10) is preempted for a."""
    planner, worker = make(num_blocks=4)
    a = with_priority("a", range(31), 0, max_tokens=5)
    b = with_priority("b", range(500, 531), 10, max_tokens=5)
    planner.add(a)
    planner.add(b)
    step(planner, worker)
    step(planner, worker)
    plan, _ = step(planner, worker)
    assert plan.preempted == ["b"] and [s.request_id for s in plan.seqs] == ["a"]
    run(planner, worker)
    assert b.output_token_ids == reference(range(500, 531), 5)


def test_an_unknown_policy_is_a_config_error():
    with pytest.raises(ValueError, match="--scheduling-policy"):
        PlannerConfig(scheduling_policy="lifo").validate()
