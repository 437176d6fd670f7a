"""A Planner stepped against the FakeWorker, every plan checked against the
config's limits and audit() run around each step, and the output any correct
schedule must produce."""

from __future__ import annotations

from scheduler_svc.request import Request, SamplingOptions
from tests.helpers.fake_worker import FakeWorker, samples_of

BS = 16
VOCAB = 1000

_seq_ids = iter(range(1, 10**9))


def req(rid, prompt, max_tokens=8, **sampling):
    return Request(rid, next(_seq_ids), list(prompt), SamplingOptions(max_tokens=max_tokens, **sampling))


def reference(prompt, max_tokens, max_len=10**9):
    """What any correct schedule must produce: the fake model run token by token."""
    worker, context, out = FakeWorker(1, BS, VOCAB), list(prompt), []
    while len(out) < max_tokens and len(context) < max_len:
        token = worker.next_token(context)
        out.append(token)
        context.append(token)
    return out


def check_plan(planner, plan, decoding: set[str]):
    """`decoding`: running requests with exactly one token left before this step."""
    cfg = planner.config
    assert plan.num_tokens <= cfg.max_num_batched_tokens
    assert len(plan.seqs) <= cfg.max_num_seqs and planner.num_running <= cfg.max_num_seqs
    assert all(len(s.token_ids) <= cfg.chunk_size for s in plan.seqs)
    # running decodes come before every prefill chunk
    kinds = [s.request_id in decoding for s in plan.seqs]
    assert kinds == sorted(kinds, reverse=True), "a decode was scheduled after a prefill chunk"


def step(planner, worker):
    decoding = {r.request_id for r in planner.running if r.num_tokens - r.num_computed_tokens == 1}
    plan = planner.schedule()
    check_plan(planner, plan, decoding)
    planner.audit()
    updates = planner.update(plan, worker.execute(plan) if plan.seqs else samples_of({}))
    planner.audit()
    return plan, updates


def run(planner, worker, max_steps=20000):
    plans = []
    for _ in range(max_steps):
        if not planner.has_work():
            planner.audit()
            assert planner.kv.pool.num_used_blocks == 0
            return plans
        plans.append(step(planner, worker)[0])
    raise AssertionError("did not finish")


def tokens_of(update) -> list[int]:
    """The tokens a RequestUpdate carries: the one sampled this step, if any."""
    return [] if update.token_id is None else [update.token_id]
