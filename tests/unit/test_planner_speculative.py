"""Speculative decoding in the planner, against the fake worker (which verifies
drafts greedily over its simulated paged cache): the same tokens as plain
decoding, with or without steps planned ahead, EOS / max_tokens / length limits
inside an accepted run, exact block accounting (audit() around every step, an
empty pool at the end), and fewer steps where the text copies itself."""

from __future__ import annotations

import random
from collections import defaultdict, deque

import pytest

from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.planner import Planner, PlannerConfig, StepPlan, StepSamples
from scheduler_svc.request import Request, SamplingOptions
from scheduler_svc.speculative.ngram import NgramConfig
from tests.helpers.fake_worker import FakeWorker, samples_of
from tests.helpers.planner_sim import tokens_of

PROMPT = [3, 1, 4, 1, 5, 9, 2] * 3  # cyclic copies it: long accepted runs

BS, VOCAB = 16, 1000
# Every running request drafts (the batch rule has its own test, at the end).
SPEC = NgramConfig(num_speculative_tokens=4, ngram_min=1, ngram_max=3, disable_by_batch_size=64)


def cyclic(context: list[int]) -> int:
    """A model that copies: it repeats the text 7 tokens back, except that every
    11th position it says something new (so some drafts are rejected)."""
    n = len(context)
    return (context[n - 1] * 31 + n) % VOCAB if n % 11 == 0 else context[n - 7]


def make(spec: NgramConfig | None, num_blocks: int = 64, **config) -> tuple[Planner, FakeWorker]:
    config.setdefault("max_model_len", 4096)
    kv = KVCacheManager(BlockPool(num_blocks, BS), BS, extra_keys=("m",))
    return Planner(PlannerConfig(speculative=spec, **config), kv), FakeWorker(num_blocks, BS, VOCAB, model=cyclic)


def requests(seed: int, count: int, eos: frozenset[int] = frozenset(), **sampling) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(8, 40))]
        options = SamplingOptions(temperature=0.0, max_tokens=rng.randrange(1, 60), **sampling)
        out.append(Request(f"r{i}", i + 1, prompt, options, eos_token_ids=eos))
    return out


def run(planner: Planner, worker: FakeWorker, ahead: bool) -> tuple[dict[str, list[tuple[int, float]]], int]:
    """((token, logprob) per request, steps run), keeping one step planned ahead if
    `ahead` (the fake worker runs each step as it is sent, in order, as the engine's worker)."""
    outputs: dict[str, list[tuple[int, float]]] = defaultdict(list)
    in_flight: deque[tuple[StepPlan, StepSamples]] = deque()
    steps = 0
    while planner.has_work() or in_flight:
        if not in_flight:
            plan = planner.schedule()
            in_flight.append((plan, worker.execute(plan) if plan.seqs else samples_of({})))
        if ahead and planner.can_plan_ahead and planner.has_work():
            if not (plan := planner.schedule()).is_empty:
                in_flight.append((plan, worker.execute(plan)))
        plan, sampled = in_flight.popleft()
        steps += bool(plan.seqs)
        for update in planner.update(plan, sampled):
            outputs[update.request_id].extend((t, update.logprob) for t in tokens_of(update))
        planner.audit()
    planner.audit()
    assert planner.kv.pool.num_used_blocks == 0
    return outputs, steps


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_speculation_gives_the_tokens_of_plain_decoding_in_fewer_steps(seed, ahead):
    eos = frozenset(range(5, VOCAB, 97))  # some requests end inside an accepted run
    config = dict(num_blocks=40, max_num_batched_tokens=48, chunk_size=32, max_num_seqs=6)
    planner, worker = make(None, **config)
    for r in requests(seed, 16, eos):
        planner.add(r)
    want, plain_steps = run(planner, worker, ahead)
    planner, worker = make(SPEC, **config)
    for r in requests(seed, 16, eos):
        planner.add(r)
    got, spec_steps = run(planner, worker, ahead)
    assert got == want
    counters = planner.drafter.counters
    assert 0 < counters.accepted_tokens < counters.draft_tokens  # accepted runs and rejections both happened
    assert spec_steps < plain_steps
    drafted = [s for p in worker.steps for s in p.seqs if s.num_drafts]
    assert drafted and all(not s.token_from_previous_step for s in drafted)


@pytest.mark.parametrize("max_tokens", range(1, 14))
def test_max_tokens_can_fall_inside_an_accepted_run(max_tokens):
    prompt = PROMPT
    for spec in (None, SPEC):
        planner, worker = make(spec)
        planner.add(Request("r", 1, list(prompt), SamplingOptions(temperature=0.0, max_tokens=max_tokens)))
        out, _ = run(planner, worker, ahead=False)
        assert len(out["r"]) == max_tokens
        if spec is None:
            want = out["r"]
    assert out["r"] == want
    assert all(s.start_pos + s.num_tokens <= len(prompt) + max_tokens for p in worker.steps for s in p.seqs)


def test_eos_inside_an_accepted_run_ends_the_request_there():
    prompt = PROMPT
    outputs = []
    for spec in (None, SPEC):
        planner, worker = make(spec)
        options = SamplingOptions(temperature=0.0, max_tokens=40)
        planner.add(Request("r", 1, list(prompt), options, eos_token_ids=frozenset({5})))
        outputs.append(run(planner, worker, ahead=False)[0]["r"])
    assert outputs[0] == outputs[1] and outputs[1][-1][0] == 5 and len(outputs[1]) < 40
    # The EOS was a draft with drafts after it: the run was cut there.
    last = worker.steps[-1].seqs[0]
    assert last.num_drafts and 5 in last.token_ids[1:-1]


def test_the_length_limit_bounds_the_drafts():
    prompt = PROMPT
    planner, worker = make(SPEC, max_model_len=len(prompt) + 6)
    planner.add(Request("r", 1, list(prompt), SamplingOptions(temperature=0.0, max_tokens=100)))
    out, _ = run(planner, worker, ahead=False)
    assert len(out["r"]) == 6
    assert all(s.start_pos + s.num_tokens <= len(prompt) + 6 for p in worker.steps for s in p.seqs)


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.8, seed=1),  # sampled: greedy-only verification
        dict(temperature=0.0, logprobs=2),
        dict(temperature=0.0, presence_penalty=0.5),
        dict(temperature=0.0, logit_bias=((7, 1.0),)),
    ],
)
def test_requests_that_cannot_be_verified_exactly_never_draft(sampling):
    prompt = PROMPT
    planner, worker = make(SPEC)
    planner.add(Request("r", 1, list(prompt), SamplingOptions(max_tokens=30, **sampling)))
    run(planner, worker, ahead=False)
    assert not any(s.num_drafts for p in worker.steps for s in p.seqs)
    assert planner.drafter.counters.drafts == 0


def test_no_drafts_before_min_tokens():
    """Until min_tokens, EOS is blocked at every position: the worker would not verify
    that, so the request decodes plainly until then and drafts after."""
    prompt = PROMPT
    planner, worker = make(SPEC)
    planner.add(Request("r", 1, list(prompt), SamplingOptions(temperature=0.0, max_tokens=40, min_tokens=20)))
    run(planner, worker, ahead=False)
    drafted = [s for p in worker.steps for s in p.seqs if s.num_drafts]
    assert drafted and all(s.start_pos + 1 - len(prompt) >= 20 for s in drafted)


def test_a_request_can_opt_out():
    prompt = PROMPT
    planner, worker = make(SPEC)
    r = Request("r", 1, list(prompt), SamplingOptions(temperature=0.0, max_tokens=30), no_speculation=True)
    planner.add(r)
    run(planner, worker, ahead=False)
    assert planner.drafter.counters.drafts == 0


def test_rejected_drafts_leave_no_block_behind_and_never_reach_the_prefix_index():
    """Drafts that cross block boundaries and get rejected: their blocks go back to
    the free queue (audit), and every indexed block holds exactly its request's tokens."""
    planner, worker = make(SPEC, num_blocks=24)
    for r in requests(7, 10):
        planner.add(r)
    out, _ = run(planner, worker, ahead=True)
    for block in planner.kv.pool.blocks:
        assert block.ref_cnt == 0
    assert planner.drafter.counters.draft_tokens > planner.drafter.counters.accepted_tokens
    # Every full block a request computed is indexed under its own tokens: a rejected draft in one
    # would make a second request with the same prompt + outputs miss (or hit wrong tokens).
    r = requests(7, 10)[3]
    generated = [t for t, _ in out[r.request_id]]
    _, tokens = planner.kv.get_computed_blocks(Request("again", 99, r.prompt_token_ids + generated))
    assert tokens == (len(r.prompt_token_ids) + len(generated) - 1) // BS * BS


@pytest.mark.parametrize("limit", [2, 5])
def test_nobody_drafts_while_more_requests_run_than_the_batch_rule(limit):
    """--speculative-disable-by-batch-size: five copying requests draft only when at most
    `limit` of them run; the tokens stay plain decoding's either way."""
    spec = NgramConfig(num_speculative_tokens=4, ngram_min=1, ngram_max=3, disable_by_batch_size=limit)
    outputs = {}
    for config in (None, spec):
        planner, worker = make(config, max_num_seqs=5)
        for i in range(5):
            planner.add(Request(f"r{i}", i + 1, PROMPT, SamplingOptions(temperature=0.0, max_tokens=20 + 5 * i)))
        drafting_at: list[int] = []
        tokens: dict[str, list[int]] = defaultdict(list)
        while planner.has_work():
            running = len(planner.running)
            plan = planner.schedule()
            if any(s.num_drafts for s in plan.seqs):
                drafting_at.append(running)
            for update in planner.update(plan, worker.execute(plan)):
                tokens[update.request_id].extend(tokens_of(update))
            planner.audit()
        outputs[config] = tokens
    assert outputs[spec] == outputs[None]
    assert drafting_at and max(drafting_at) <= limit
    assert (limit >= 5) == (max(drafting_at) == 5)  # with room for all five, they draft from the start
