"""A pure-Python stand-in for worker_svc: executes StepPlans over a simulated paged cache.

It keeps, per physical slot, the (position, token id) written there and builds
each sequence's context by reading its block table, exactly as paged attention
would. The next token is a deterministic function of that context, so a wrong
block table, slot mapping or shared block shows up as different output tokens.
A row with drafts is verified as worker_svc/sampling/verify.py does: each
position is sampled as a one-token decode of it would be, the drafts equal to
those samples are kept, then the sample after them; a constrained row's each
position under its own mask (ScheduledSeq.position_masks).

With `options=True` a sample also follows the row's sampling options, in a
deterministic stand-in for the worker's logit processing and sampling: a
temperature shifts the model's token by one at one position in five (a hash of
(seed, position)), a positive logit bias wins every ninth position, blocked ids
(min_tokens) and negatively biased ids are never picked, and with penalties a
token already generated four times is skipped. What a position sees is what the worker's sees: the blocked
ids and bias the row carries, and the generated ids its penalties count (the
step's, its input when it comes from the previous step, and the drafts before
the position).

LoRA: `load_adapter(slot, name)` puts an adapter in a slot; a row naming a slot
(`lora_slot`) samples the model's token shifted by its adapter's name, and may read
only KV written under the same adapter (a block shared across adapters, or between
an adapter and the base, fails an assertion).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence

from scheduler_svc.planning.plan import ScheduledSeq, StepPlan, StepSamples
from scheduler_svc.structured import allowed_ids


class FakeWorker:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        vocab_size: int = 1000,
        model: Callable[[list[int]], int] | None = None,
        options: bool = False,
    ) -> None:
        """`model`: context -> next token, instead of the default order-sensitive hash;
        `options`: samples follow the rows' sampling options (the module doc)."""
        self.model = model
        self.options = options
        self.rng = random.Random(0)  # unseeded sampled rows
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (position, token id)
        self.steps: list[StepPlan] = []
        # The last step's samples, for decodes that take their input from it (overlapped scheduling).
        self.last_step_id: int | None = None
        self.last_sampled: dict[int, tuple[int, float]] = {}
        self.adapters: dict[int, str] = {}  # LoRA slot -> the adapter loaded there
        self.kv_adapter: dict[int, str] = {}  # KV slot -> the adapter it was written under ("": the base)

    def load_adapter(self, slot: int, name: str) -> None:
        assert slot >= 1, "slot 0 is the base model"
        self.adapters[slot] = name

    def adapter(self, seq) -> str:
        """The adapter a row runs through ("": the base); its slot must hold one."""
        slot = getattr(seq, "lora_slot", 0)
        assert slot == 0 or slot in self.adapters, f"seq {seq.seq_id}: lora slot {slot} holds no adapter"
        return self.adapters[slot] if slot else ""

    def restart(self) -> None:
        """Lose the whole cache, as a restarted worker would."""
        self.slots.clear()
        self.adapters.clear()
        self.kv_adapter.clear()
        self.last_step_id, self.last_sampled = None, {}

    def next_token(self, context: list[int]) -> int:
        """Order-sensitive, so a block with the right tokens in the wrong place is caught."""
        if self.model is not None:
            return self.model(context)
        return (sum((pos + 1) * tok for pos, tok in enumerate(context)) + len(context)) % self.vocab_size

    def execute(self, plan: StepPlan, allowed: Mapping[int, Sequence[int]] | None = None) -> StepSamples:
        """`allowed`: seq_id -> the ids its mask allows (structured outputs); such a row
        samples the allowed id its context picks."""
        self.steps.append(plan)
        for src, dst in plan.copies:
            for offset in range(self.block_size):
                entry = self.slots.get(src * self.block_size + offset)
                if entry is not None:
                    self.slots[dst * self.block_size + offset] = entry
                    self.kv_adapter[dst * self.block_size + offset] = self.kv_adapter.get(
                        src * self.block_size + offset, ""
                    )
        seq_ids = [seq.seq_id for seq in plan.seqs]
        assert len(seq_ids) == len(set(seq_ids)), f"step {plan.step_id}: a seq scheduled twice"
        for seq in plan.seqs:
            self._check_shape(seq)
        inputs = {seq.seq_id: self._inputs(plan, seq) for seq in plan.seqs}
        written = [slot for seq in plan.seqs for slot in seq.slot_mapping]
        written_now = set(written)
        assert len(written) == len(written_now), f"step {plan.step_id}: a slot written twice"
        # No sequence may read (as cached context) a slot that this step writes.
        contexts = [
            self._read(seq.block_table, seq.start_pos, written_now, self.adapter(seq)) + inputs[seq.seq_id]
            for seq in plan.seqs
        ]
        for seq in plan.seqs:
            for i, slot in enumerate(seq.slot_mapping):
                self.slots[slot] = (seq.start_pos + i, inputs[seq.seq_id][i])
                self.kv_adapter[slot] = self.adapter(seq)
        sampled, accepted, draft_logprobs = {}, {}, {}
        for seq, context in zip(plan.seqs, contexts):
            if seq.sample:
                # A plan's row, or a worker.v1 row (fake_worker_server): alternatives or a mask.
                asks = getattr(seq, "top_logprobs", 0) or (seq.sampling.logprobs if hasattr(seq, "sampling") else 0)
                masked = allowed is not None and seq.seq_id in allowed
                per_position = getattr(seq, "position_masks", None)  # a constrained drafting row's
                assert not (seq.num_drafts and (asks or (masked and per_position is None))), (
                    f"seq {seq.seq_id}: drafts the worker refuses"
                )
                known = len(context) - seq.num_drafts  # the context before the drafts
                generated = self._generated(seq, inputs[seq.seq_id]) if self.options else []

                ids_at = self._allowed_at(seq, allowed[seq.seq_id] if masked else None, per_position)

                # Position by position, each sampled once (an unseeded row's noise is drawn per sample).
                n, token = 0, _pick(ids_at[0], self.sample(seq, context[:known], generated))
                while n < seq.num_drafts and context[known + n] == token:
                    n += 1
                    token = self.sample(seq, context[: known + n], generated + context[known : known + n])
                    token = _pick(ids_at[n], token)
                sampled[seq.seq_id], accepted[seq.seq_id] = (token, -float(token) / self.vocab_size), n
                draft_logprobs[seq.seq_id] = [-float(t) / self.vocab_size for t in context[known : known + n]]
        self.last_step_id, self.last_sampled = plan.step_id, sampled
        if not any(s.num_drafts for s in plan.seqs):
            return samples_of(sampled)
        return samples_of(sampled, accepted, draft_logprobs)

    def sample(self, seq: ScheduledSeq, context: list[int], generated: list[int]) -> int:
        """The token after `context` under the row's options (the module doc)."""
        token = self.next_token(context)
        if adapter := self.adapter(seq):
            token = (token + 1 + sum(adapter.encode()) % (self.vocab_size - 1)) % self.vocab_size
        if not self.options:
            return token
        o = seq.sampling
        position = len(context)  # of the token sampled: a seeded row's noise key, as on the worker
        if o.temperature > 0:
            key = o.seed if o.seed is not None else self.rng.randrange(2**32)
            token += (key * 1_000_003 + position * 7_919) % 5 == 0  # the model's token 4 times in 5
        bias = dict(o.logit_bias)
        favoured = [t for t, b in sorted(bias.items(), key=lambda tb: -tb[1]) if b > 0] if position % 9 == 0 else []
        for candidate in [*favoured, *((token + j) % self.vocab_size for j in range(self.vocab_size))]:
            blocked = candidate in seq.blocked_token_ids or bias.get(candidate, 0.0) < 0
            penalized = o.has_penalties and generated.count(candidate) >= 4
            if not (blocked or penalized):
                return candidate
        raise AssertionError(f"seq {seq.seq_id}: every token is blocked")

    def _allowed_at(self, seq, allowed: Sequence[int] | None, per_position) -> list[list[int] | None]:
        """The ids each chunk position may sample (None: any): a drafting row's own per
        position, else the row's one mask at every position."""
        if per_position is not None:
            return [allowed_ids(words, self.vocab_size).tolist() for words in per_position]
        return [None if allowed is None else list(allowed)] * (seq.num_drafts + 1)

    @staticmethod
    def _generated(seq: ScheduledSeq, inputs: list[int]) -> list[int]:
        """The ids the row's penalties count before its first sampled position: those
        the step carries, and its input when that is the previous step's sample."""
        return [*seq.penalty_output_ids, *(inputs if seq.token_from_previous_step else [])]

    def _inputs(self, plan: StepPlan, seq) -> list[int]:
        if not seq.token_from_previous_step:
            return list(seq.token_ids)
        assert plan.previous_step_id == self.last_step_id, (
            f"step {plan.step_id} names step {plan.previous_step_id}'s samples; "
            f"the last step run was {self.last_step_id}"
        )
        assert seq.seq_id in self.last_sampled, f"seq {seq.seq_id}: sampled nothing in step {self.last_step_id}"
        return [self.last_sampled[seq.seq_id][0]]

    def _check_shape(self, seq) -> None:
        bs, end = self.block_size, seq.start_pos + len(seq.token_ids)
        assert seq.token_ids, f"seq {seq.seq_id}: no tokens"
        assert len(seq.block_table) == math.ceil(end / bs), (
            f"seq {seq.seq_id}: table of {len(seq.block_table)} blocks for {end} tokens"
        )
        assert all(0 <= b < self.num_blocks for b in seq.block_table), f"seq {seq.seq_id}: block id out of range"
        assert len(set(seq.block_table)) == len(seq.block_table), f"seq {seq.seq_id}: block repeated in table"
        expected = [seq.block_table[p // bs] * bs + p % bs for p in range(seq.start_pos, end)]
        assert list(seq.slot_mapping) == expected, f"seq {seq.seq_id}: slot_mapping does not match block_table"

    def _read(self, block_table: list[int], num_tokens: int, written_now: set[int], adapter: str = "") -> list[int]:
        """Tokens at positions [0, num_tokens) as stored in the cache (written under `adapter`)."""
        bs, context = self.block_size, []
        for pos in range(num_tokens):
            slot = block_table[pos // bs] * bs + pos % bs
            assert slot not in written_now, f"position {pos}: slot {slot} is overwritten in this same step"
            entry = self.slots.get(slot)
            assert entry is not None and entry[0] == pos, f"position {pos}: cache holds {entry}"
            written_under = self.kv_adapter.get(slot, "")
            assert written_under == adapter, f"position {pos}: KV of adapter {written_under!r} read under {adapter!r}"
            context.append(entry[1])
        return context


def _pick(ids: list[int] | None, token: int) -> int:
    """The sample under a mask: the allowed id the token picks."""
    return token if ids is None else ids[token % len(ids)]


def samples_of(
    sampled: dict[int, tuple[int, float]],
    accepted: dict[int, int] | None = None,
    draft_logprobs: dict[int, list[float]] | None = None,
) -> StepSamples:
    """(token id, logprob) per seq_id as a step's sampled columns; `accepted` and
    `draft_logprobs`: drafts accepted per seq_id and their logprobs, when the step
    carried drafts."""
    num_accepted = [accepted[seq_id] for seq_id in sampled] if accepted is not None else []
    flat = [lp for seq_id in sampled for lp in (draft_logprobs or {}).get(seq_id, [])]
    tokens, logprobs = [token for token, _ in sampled.values()], [lp for _, lp in sampled.values()]
    return StepSamples(list(sampled), tokens, logprobs, num_accepted=num_accepted, draft_logprobs=flat)
