"""Speculative decoding in the planner, against the fake worker (which verifies
drafts over its simulated paged cache, sampling each position as one-token
decoding would): the same tokens as plain decoding, with or without steps
planned ahead, for greedy, seeded sampled and processed (penalties, logit bias,
min_tokens) requests, EOS / max_tokens / length limits inside an accepted run,
exact block accounting (audit() around every step, an empty pool at the end),
and fewer steps where the text copies itself."""

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
        dict(temperature=0.0, logprobs=2),  # alternatives per verified position: not built
        dict(temperature=0.8, seed=1, logprobs=0),
    ],
)
def test_requests_that_cannot_be_verified_exactly_never_draft(sampling):
    prompt = PROMPT
    planner, worker = make(SPEC)
    planner.add(Request("r", 1, list(prompt), SamplingOptions(max_tokens=30, **sampling)))
    run(planner, worker, ahead=False)
    assert not any(s.num_drafts for p in worker.steps for s in p.seqs)
    assert planner.drafter.counters.drafts == 0


PROCESSED = {
    "seeded": dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=11),
    "presence": dict(temperature=0.0, presence_penalty=0.5),
    "frequency": dict(temperature=0.0, frequency_penalty=0.3),
    "repetition": dict(temperature=0.0, repetition_penalty=1.3),
    "bias": dict(temperature=0.0, logit_bias=((7, 5.0), (4, -100.0))),
    "min_tokens": dict(temperature=0.0, min_tokens=17),
    "everything": dict(temperature=0.7, seed=5, top_k=50, presence_penalty=0.2, logit_bias=((8, 2.0),), min_tokens=9),
}


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("case", list(PROCESSED))
def test_sampled_and_processed_requests_draft_and_keep_the_tokens_of_plain_decoding(case, ahead):
    """The fake worker samples every verified position under the row's options
    (seeded noise by position, blocked ids, bias, penalties counting the drafts
    before it), as the worker does: the planner must send what each position needs
    (penalty ids, min_tokens' blocked ids only where they hold at every position)."""
    # In the copied text: min_tokens blocks them, then they end the request.
    eos = frozenset({5, 9}) if PROCESSED[case].get("min_tokens") else frozenset()
    outputs = []
    for spec in (None, SPEC):
        planner, _ = make(spec, max_num_seqs=4)
        worker = FakeWorker(64, BS, VOCAB, model=cyclic, options=True)
        for i in range(3):
            options = SamplingOptions(max_tokens=25 + 7 * i, **PROCESSED[case])
            planner.add(Request(f"r{i}", i + 1, PROMPT[i:] + PROMPT[:i], options, eos_token_ids=eos))
        outputs.append(run(planner, worker, ahead)[0])
    assert outputs[1] == outputs[0]
    assert planner.drafter.counters.accepted_tokens > 0
    assert any(s.num_drafts for p in worker.steps for s in p.seqs)


@pytest.mark.parametrize("min_tokens", [3, 8, 20])
def test_drafts_before_min_tokens_stop_where_it_is_reached(min_tokens):
    """Until min_tokens the stop ids are blocked, and the worker blocks a row's ids at
    every verified position alike: a decode drafts on either side of min_tokens,
    never across it, and the output is plain decoding's (EOS, common in the copied
    text, ends it as soon as it may)."""
    prompt = PROMPT
    outputs = []
    for spec in (None, SPEC):
        planner, _ = make(spec)
        # The text is PROMPT's cycle by position, whatever was sampled: an EOS the block
        # replaced comes back a cycle later, and ends the request once min_tokens allows.
        worker = FakeWorker(64, BS, VOCAB, model=lambda context: PROMPT[len(context) % 7], options=True)
        options = SamplingOptions(temperature=0.0, max_tokens=40, min_tokens=min_tokens)
        planner.add(Request("r", 1, list(prompt), options, eos_token_ids=frozenset({5})))
        outputs.append(run(planner, worker, ahead=False)[0]["r"])
    assert outputs[1] == outputs[0]
    assert len(outputs[1]) > min_tokens and outputs[1][-1][0] == 5  # EOS ended it past min_tokens
    drafted = [s for p in worker.steps for s in p.seqs if s.num_drafts]
    generated_before = [s.start_pos + 1 - len(prompt) for s in drafted]
    assert any(g < min_tokens for g in generated_before) or min_tokens <= 3
    for s, g in zip(drafted, generated_before):
        assert g >= min_tokens or g + s.num_drafts < min_tokens, (g, s.num_drafts)
        assert bool(s.blocked_token_ids) == (g < min_tokens)


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
