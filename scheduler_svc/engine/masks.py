"""A plan's token masks (structured outputs), computed off the event loop by the
grammar engine's filler: those of the rows whose input is known, before the step
is sent (StepPlan.masks), and those of the rows planned ahead of their input
token (`mask_follows`), once the step in flight has been applied and its tokens
advanced the matchers: they go to the worker in a StepMasks call while the step
runs its forward, so a constrained row loses no overlap.

A row whose request has ended meanwhile, or whose grammar has not started yet
(a reasoning model still thinking), gets a row allowing everything: the worker
needs one for every row it was told to wait for, and such a sample is either
discarded or free."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from scheduler_svc.planning.plan import PlanMasks, StepPlan
from scheduler_svc.structured.fill import MaskFiller
from scheduler_svc.structured.matcher import GrammarMatcher


@dataclass(frozen=True, slots=True)
class MaskFailure:
    """A row's grammar failed while its mask was computed: its request ends with `error`."""

    request_id: str
    matcher: GrammarMatcher
    error: str


def inline_rows(plan: StepPlan) -> list[int]:
    """Rows whose mask can be computed now: a grammar that has started, its input known;
    and the drafting rows whose masks were computed when planned (position_masks)."""
    return [
        row
        for row, seq in enumerate(plan.seqs)
        if seq.position_masks is not None
        or (seq.grammar is not None and not seq.mask_follows and seq.grammar.needs_mask)
    ]


async def compute(
    filler: MaskFiller, plan: StepPlan, rows: list[int], live: Callable[[str], bool]
) -> tuple[PlanMasks, list[MaskFailure]]:
    """The masks of `rows` of `plan` (all-allowing for those whose request is no longer `live`
    or whose grammar needs none), and the rows whose grammar failed on the way. A drafting
    row's mask is that of its sampled position, after its drafts: computed when planned."""
    words = np.full((len(rows), filler.mask_words), -1, dtype=np.int32)
    seqs = [plan.seqs[row] for row in rows]
    for i, seq in enumerate(seqs):
        if seq.position_masks is not None:
            words[i] = seq.position_masks[-1]
    wanted = [(i, seq.grammar) for i, seq in enumerate(seqs) if seq.position_masks is None]
    filled = [(i, g) for i, g in wanted if g is not None and g.needs_mask and live(plan.seqs[rows[i]].request_id)]
    failures = []
    if filled:
        result = await filler.fill_async([g for _, g in filled])
        words[[i for i, _ in filled]] = result.bits
        for k, error in result.errors.items():
            i, matcher = filled[k]
            words[i] = -1
            failures.append(MaskFailure(plan.seqs[rows[i]].request_id, matcher, error))
    return PlanMasks(rows, words), failures


def allowing_all(plan: StepPlan, rows: list[int], mask_words: int) -> PlanMasks:
    """Masks allowing every token: for a step whose samples will be discarded."""
    return PlanMasks(rows, np.full((len(rows), mask_words), -1, dtype=np.int32))
