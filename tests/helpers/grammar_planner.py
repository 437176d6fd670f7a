"""Planner runs of constrained requests over the fake worker (tests/helpers/fake_worker.py):
the requests, their constraints over the tiny vocabulary, and the engine core's loop
with each constrained row sampling under its grammar's mask; shared by the planner's
grammar tests with and without speculative decoding."""

from __future__ import annotations

from collections import defaultdict, deque

from scheduler_svc.planning.planner import Planner, StepPlan
from scheduler_svc.request import Request, SamplingOptions
from scheduler_svc.structured import Constraint, GrammarMatcher, allowed_ids
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.grammar_walk import TINY_EOS
from tests.helpers.planner_sim import tokens_of

BS, VOCAB = 16, 768
EOS = frozenset({TINY_EOS})
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    Constraint.regex(r"[a-z]{2,5}-[0-9]{2}"),
    Constraint.json_schema(SCHEMA),
    Constraint.choice(["yes", "no", "maybe not"]),
]


def constrained(compiler, rid: str, seq_id: int, constraint: Constraint | None, max_tokens: int = 60, **options):
    prompt = [(seq_id * 37 + i * 11) % 700 + 10 for i in range(5 + seq_id % 7)]
    request = Request(rid, seq_id, prompt, SamplingOptions(max_tokens=max_tokens, **options), eos_token_ids=EOS)
    if constraint is not None:
        request.grammar = GrammarMatcher(compiler.compile(constraint))
    return request


def masked_run(worker: FakeWorker, plan: StepPlan):
    """The step on the fake worker, each constrained row sampling under the mask its grammar
    gives now: run in step order right before it is applied, as the worker samples a step
    planned ahead only once its late masks came (after the step before it was applied)."""
    allowed = {
        seq.seq_id: allowed_ids(seq.grammar.mask(), VOCAB).tolist()
        for seq in plan.seqs
        if seq.grammar is not None and seq.grammar.needs_mask
    }
    return worker.execute(plan, allowed)


def run(planner: Planner, worker: FakeWorker, ahead: bool) -> tuple[dict[str, list[int]], list[StepPlan]]:
    """The engine core's loop: with `ahead`, the next step is planned while one is in flight."""
    outputs: dict[str, list[int]] = defaultdict(list)
    sent: list[StepPlan] = []
    in_flight: deque[StepPlan] = deque()
    while planner.has_work() or in_flight:
        if not in_flight:
            in_flight.append(planner.schedule())
        if ahead and planner.can_plan_ahead and planner.has_work():
            next_plan = planner.schedule()
            if not next_plan.is_empty:
                in_flight.append(next_plan)
        plan = in_flight.popleft()
        sent.append(plan)
        samples = masked_run(worker, plan) if plan.seqs else None
        for update in planner.update(plan, samples) if samples else []:
            assert update.error is None, update.error
            outputs[update.request_id].extend(tokens_of(update))
        planner.audit()
    assert planner.kv.pool.num_used_blocks == 0
    return outputs, sent
