"""What the planner asks the worker for and hands back for logprobs, prompt
logprobs, min_tokens and penalties: per-chunk prompt-logprob targets delivered
once and in order, no prefix-cache read for positions still to be scored,
max_tokens 0, and the sample inputs (blocked ids, generated ids) in both
strict and overlapped (planned-ahead) scheduling. Plus the validation table."""

from __future__ import annotations

import pytest

from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.planner import Planner, PlannerConfig, StepPlan, StepSamples
from scheduler_svc.planning.validation import RequestRejected, check_num_samples, check_sampling
from scheduler_svc.request import FinishReason, Request, SamplingOptions
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.planner_sim import tokens_of

BS, VOCAB = 16, 1000
PROMPT = [(7 * i + 3) % VOCAB for i in range(40)]


def make(**config) -> tuple[Planner, FakeWorker]:
    config.setdefault("max_model_len", 4096)
    kv = KVCacheManager(BlockPool(64, BS), BS, extra_keys=("m",))
    return Planner(PlannerConfig(**config), kv), FakeWorker(64, BS, VOCAB)


def score(token_id: int, position: int) -> float:
    """The fake logprob of `token_id` after `position`."""
    return -(token_id + position) / 10_000


def scored(plan: StepPlan, samples: StepSamples) -> StepSamples:
    """`samples` with the prompt logprobs a worker returns for the plan's targets, with one alternative."""
    samples.prompt = {
        s.seq_id: [(score(t, s.start_pos + i), ((t + 1, -0.5),)) for i, t in enumerate(s.prompt_logprob_targets)]
        for s in plan.seqs
        if s.prompt_logprob_targets
    }
    return samples


def run(planner: Planner, worker: FakeWorker, plans: list[StepPlan] | None = None):
    updates = []
    while planner.has_work():
        plan = planner.schedule()
        if plans is not None:
            plans.append(plan)
        updates += planner.update(plan, scored(plan, worker.execute(plan)))
        planner.audit()
    return updates


def request(rid: str, prompt=PROMPT, seq_id: int = 1, eos=frozenset(), **sampling) -> Request:
    return Request(rid, seq_id, list(prompt), SamplingOptions(**sampling), eos_token_ids=eos)


def test_prompt_logprobs_are_asked_chunk_by_chunk_and_delivered_once_in_order():
    planner, worker = make(chunk_size=16)
    planner.add(request("a", max_tokens=3, prompt_logprobs=1))
    plans: list[StepPlan] = []
    updates = run(planner, worker, plans)
    asked = [(s.start_pos, s.prompt_logprob_targets) for p in plans for s in p.seqs]
    assert asked[:3] == [(0, PROMPT[1:17]), (16, PROMPT[17:33]), (32, PROMPT[33:40])]
    assert all(not targets for _, targets in asked[3:])  # decodes ask nothing
    delivered = [u.prompt_logprobs for u in updates if u.prompt_logprobs is not None]
    assert len(delivered) == 1
    [first_token] = [u for u in updates if u.token_id is not None][:1]
    assert first_token.prompt_logprobs is delivered[0]
    assert [(t.token_id, t.logprob, t.top) for t in delivered[0]] == [
        (PROMPT[p + 1], score(PROMPT[p + 1], p), ((PROMPT[p + 1] + 1, -0.5),)) for p in range(39)
    ]


def test_a_request_still_needing_prompt_logprobs_reads_no_cached_block():
    planner, worker = make()
    planner.add(request("warm", max_tokens=1))
    run(planner, worker)
    planner.add(request("scored", seq_id=2, max_tokens=1, prompt_logprobs=0))
    plan = planner.schedule()
    [seq] = plan.seqs
    assert seq.start_pos == 0 and planner.requests["scored"].num_cached_prompt_tokens == 0
    assert seq.prompt_logprob_targets == PROMPT[1:]
    planner.update(plan, scored(plan, worker.execute(plan)))
    planner.add(request("after", seq_id=3, max_tokens=1))  # the cache still serves everyone else
    run(planner, worker)
    assert worker.steps[-1].seqs[0].start_pos == 32


def test_a_resumed_request_reads_only_the_blocks_already_scored():
    planner, worker = make(chunk_size=16)
    planner.add(request("a", max_tokens=2, prompt_logprobs=0))
    plan = planner.schedule()
    planner.update(plan, scored(plan, worker.execute(plan)))  # positions 0..15 scored, block 0 cached
    planner.requeue_all(reset_prefix_cache=False)  # as when the worker is lost
    plan = planner.schedule()
    [seq] = plan.seqs
    assert seq.start_pos == 16 and seq.prompt_logprob_targets == PROMPT[17:33]
    planner.update(plan, scored(plan, worker.execute(plan)))
    updates = run(planner, worker)
    [delivered] = [u.prompt_logprobs for u in updates if u.prompt_logprobs is not None]
    assert [t.token_id for t in delivered] == PROMPT[1:]
    assert [t.logprob for t in delivered] == [score(PROMPT[p + 1], p) for p in range(39)]


def test_max_tokens_zero_scores_the_prompt_and_samples_nothing():
    planner, worker = make(chunk_size=16)
    planner.add(request("a", max_tokens=0, prompt_logprobs=2))
    plans: list[StepPlan] = []
    updates = run(planner, worker, plans)
    assert not any(s.sample for p in plans for s in p.seqs) and len(plans) == 3
    last = updates[-1]
    assert last.finished and last.finish_reason is FinishReason.LENGTH and last.token_id is None
    assert len(last.prompt_logprobs) == 39
    assert planner.kv.pool.num_used_blocks == 0


def _sample_inputs(ahead: bool, **sampling):
    """Per sample: (blocked ids, generated ids carried, input taken from the step in
    flight); and the tokens generated, in order."""
    planner, worker = make()
    planner.add(request("a", eos=frozenset({7}), **sampling))
    seen, outputs = [], []
    in_flight: list[tuple[StepPlan, dict]] = []
    while planner.has_work() or in_flight:
        if not in_flight:
            plan = planner.schedule()
            in_flight.append((plan, worker.execute(plan)))
        if ahead and planner.can_plan_ahead and planner.has_work():
            plan = planner.schedule()
            if plan.seqs:
                in_flight.append((plan, worker.execute(plan)))
        plan, sampled = in_flight.pop(0)
        seen += [(s.blocked_token_ids, s.penalty_output_ids, s.token_from_previous_step) for s in plan.seqs if s.sample]
        outputs += [t for u in planner.update(plan, sampled) for t in tokens_of(u)]
    return seen, outputs


@pytest.mark.parametrize("ahead", [False, True])
def test_min_tokens_blocks_eos_and_stop_ids_until_reached(ahead):
    seen, _ = _sample_inputs(ahead, max_tokens=6, min_tokens=3, stop_token_ids=(9, 2))
    assert [blocked for blocked, _, _ in seen] == [(2, 7, 9)] * 3 + [()] * 3
    seen, _ = _sample_inputs(ahead, max_tokens=4, min_tokens=2, ignore_eos=True, stop_token_ids=(9,))
    assert [blocked for blocked, _, _ in seen] == [(9,)] * 2 + [()] * 2


@pytest.mark.parametrize("ahead", [False, True])
def test_penalised_samples_carry_the_tokens_generated_before_them(ahead):
    seen, outputs = _sample_inputs(ahead, max_tokens=8, ignore_eos=True, frequency_penalty=0.5)
    assert len(seen) == len(outputs) == 8
    for k, (_, carried, from_previous) in enumerate(seen):
        # A planned-ahead decode's input is the sample still in flight: the worker counts it.
        assert len(carried) + from_previous == k and list(carried) == outputs[: len(carried)]
    assert any(from_previous for _, _, from_previous in seen) == ahead
    plain, _ = _sample_inputs(ahead, max_tokens=3)
    assert all(carried == () and blocked == () for blocked, carried, _ in plain)


@pytest.mark.parametrize(
    "field, value",
    [
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.5),
        ("logit_bias", ((5, 100.5),)),
        ("logit_bias", tuple((i, 1.0) for i in range(1025))),
        ("min_tokens", 17),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("min_p", float("nan")),
        ("min_tokens", -1),
        ("stop_token_ids", tuple(range(65))),
        ("max_tokens", 0),
    ],
)
def test_sampling_values_out_of_range_are_rejected_naming_the_field(field, value):
    with pytest.raises(RequestRejected) as err:
        check_sampling(SamplingOptions(**{field: value}))
    assert err.value.field == field


def test_max_tokens_zero_needs_prompt_logprobs_and_one_sample():
    check_sampling(SamplingOptions(max_tokens=0, prompt_logprobs=0))
    with pytest.raises(RequestRejected, match="prompt_logprobs"):
        check_num_samples(2, 10, SamplingOptions(prompt_logprobs=0))
