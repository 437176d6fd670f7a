"""A CPU worker's step budget follows its measured speed (issue 35, item 5): sized to
--step-target-ms within the flags' ceilings, one request's chunk at most half of it,
so a short request arriving behind a long prompt shares the next step."""

from __future__ import annotations

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.step_budget import INITIAL_BUDGET, MIN_BUDGET, SpeedBudget, step_budget
from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.planner import Planner, PlannerConfig
from scheduler_svc.request import Request, SamplingOptions
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.planner_sim import BS, VOCAB, reference, run, step


def test_only_a_cpu_worker_with_a_target_is_tuned():
    assert step_budget(PlannerConfig(), "cuda:0 (NVIDIA H100)", 1000.0, "w") is None
    assert step_budget(PlannerConfig(), "cpu", 0.0, "w") is None
    assert isinstance(step_budget(PlannerConfig(), "cpu", 1000.0, "w"), SpeedBudget)


def test_the_budget_fits_the_target_at_the_measured_speed():
    config = PlannerConfig(block_size=16)
    budget = SpeedBudget(config, 1000.0, "w")
    assert (config.max_num_batched_tokens, config.chunk_size) == (INITIAL_BUDGET, INITIAL_BUDGET // 2)
    budget.observe(200, 400.0)  # 2 ms a token: 500 tokens in 1 s
    assert (config.max_num_batched_tokens, config.chunk_size) == (500, 240)  # half, in whole blocks
    budget.observe(8, 900.0)  # decodes only: no news about prefill's cost
    assert config.max_num_batched_tokens == 500
    budget.observe(100, 600.0)  # 6 ms a token (late chunks of a long prompt cost more): the median, 4
    assert (config.max_num_batched_tokens, config.chunk_size) == (250, 112)
    budget.observe(50, 5000.0)  # one step slowed 50 times (a cold kernel, a burst of load): the median, 6
    assert config.max_num_batched_tokens == 166


def test_the_flags_stay_the_ceilings_and_the_floor_holds():
    config = PlannerConfig(max_num_batched_tokens=300, chunk_size=64, block_size=16)
    budget = SpeedBudget(config, 1000.0, "w")
    budget.observe(1000, 100.0)  # 0.1 ms a token: 10,000 would fit
    assert (config.max_num_batched_tokens, config.chunk_size) == (300, 64)
    budget.observe(100, 100_000.0)  # 1 s a token
    assert config.max_num_batched_tokens == MIN_BUDGET


def test_chunk_size_above_the_step_budget_is_clamped_to_it():
    config = SchedulerConfig(max_num_batched_tokens=2048)
    config.validate()
    assert config.chunk_size == 2048 and config.planner_config(4096, 16, 8).chunk_size == 2048


def test_only_the_default_budget_is_sized_an_operator_s_is_kept():
    assert SchedulerConfig().sized_step_target_ms == 1000.0
    assert SchedulerConfig(step_target_ms=0).sized_step_target_ms == 0.0
    assert SchedulerConfig(max_num_batched_tokens=512).sized_step_target_ms == 0.0
    assert SchedulerConfig(chunk_size=256).sized_step_target_ms == 0.0


def test_a_short_request_behind_a_long_prompt_runs_in_the_next_step():
    kv = KVCacheManager(BlockPool(1024, BS), BS, extra_keys=("m",))
    planner = Planner(PlannerConfig(max_model_len=8192, block_size=BS), kv)
    budget = SpeedBudget(planner.config, 1000.0, "w")
    budget.observe(256, 1000.0)  # ~4 ms a token, a slow CPU: 256-token steps
    worker = FakeWorker(1024, BS, VOCAB)
    running = Request("running", 1, [5, 6, 7], SamplingOptions(max_tokens=400))
    planner.add(running)
    step(planner, worker)
    long = Request("long", 2, [(i % 900) + 5 for i in range(4000)], SamplingOptions(max_tokens=1))
    planner.add(long)
    step(planner, worker)  # the long prompt's first chunk
    short = Request("short", 3, [9, 10, 11, 12, 13], SamplingOptions(max_tokens=1))
    planner.add(short)
    plan, _ = step(planner, worker)
    scheduled = {s.request_id: s.num_tokens for s in plan.seqs}
    assert scheduled == {"running": 1, "long": 128, "short": 5}  # all three share the step
    run(planner, worker)
    for r in (running, long, short):
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling.max_tokens)
