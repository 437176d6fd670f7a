"""Per-request state the planner owns: prompt, outputs, progress through the KV cache."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:  # the type only: kv/ and planning/ read requests without loading the grammar engine
    from scheduler_svc.structured.matcher import GrammarMatcher


@dataclass(slots=True, frozen=True)
class SamplingOptions:
    """What the worker needs to pick a token, plus the planner's stop limits."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off; the worker keeps tokens >= min_p x the top token's probability
    seed: int | None = None  # reproducible: the worker seeds from (seed, position)
    max_tokens: int = 16
    stop: tuple[str, ...] = ()  # text-level; the engine detects them and calls finish()
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives returned with each generated token
    prompt_logprobs: int | None = None  # set: every prompt token's logprob, with this many alternatives
    # Applied by the worker before sampling (OpenAI / vLLM semantics).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0  # EOS and stop_token_ids are blocked until this many tokens are generated
    stop_token_ids: tuple[int, ...] = ()  # end the request like EOS (not affected by ignore_eos)

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A token's logprob (None: the first prompt token, which nothing predicts) and the
    most likely tokens at its position, most likely first."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


class PoolingKind(enum.StrEnum):
    LAST = "last"  # the last prompt token's hidden state (a causal LM's summary of the prompt)
    MEAN = "mean"  # the mean over every prompt token's
    # A yes/no reranker on a causal LM (vLLM's classifier_from_token): the logits of two
    # tokens at the prompt's last position, as the worker returns a sampled row's.
    CLASSIFY = "classify"


@dataclass(slots=True, frozen=True)
class PoolingOptions:
    """A pooling request (--runner pooling): which reduction of the prompt's hidden
    states (the last layer, after the final norm), then the first `dimensions` of
    it (Matryoshka; None: all), then L2-normalised or not. CLASSIFY: the score of
    `classifier_token_ids` (NO, YES) instead."""

    kind: PoolingKind = PoolingKind.LAST
    normalize: bool = True
    dimensions: int | None = None
    classifier_token_ids: tuple[int, int] | None = None


@dataclass(slots=True, frozen=True)
class LoraRef:
    """The LoRA adapter a request runs through. The digest of its files is part of its
    identity: a name registered again with other weights is another adapter, so it
    never reuses the old one's worker slot or cached KV."""

    name: str
    digest: str


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)  # identity equality: lists of requests use `in`/remove
class Request:
    request_id: str
    seq_id: int  # the id the worker sees; unique among live requests
    prompt_token_ids: list[int]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    eos_token_ids: frozenset[int] = frozenset()
    # Separates prefix-cache namespaces (e.g. per tenant): equal prompts with
    # different salts never share blocks.
    cache_salt: str | None = None
    lora: LoraRef | None = None  # None: the base model alone
    # --scheduling-policy priority: lower values are admitted first and preempted last.
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_index: int = -1  # set by Planner.add: FIFO order among all requests
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # Tokens whose KV is in the cache (including prefix-cache hits). After a
    # preemption it drops to 0 and the request recomputes prompt + outputs.
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Parallel samples (n > 1): an internal prefill-only parent computes the
    # prompt minus its last token once, then its children fork off it sharing
    # every block; each child computes the last prompt token itself (copying the
    # shared partial block first) and samples on its own.
    prefill_only: bool = False
    children: list[Request] = field(default_factory=list, repr=False)
    sample_index: int = 0
    no_speculation: bool = False  # the client opted out of speculative decoding
    # A pooling request: prefill-only (sampling.max_tokens 0), it ends with its prompt's
    # embedding; mean pooling sums the chunks' hidden states here as they come back.
    pooling: PoolingOptions | None = None
    pooled_sum: NDArray[np.float64] | None = field(default=None, repr=False)
    # Content hashes of this request's full blocks, filled lazily by the
    # KVCacheManager so a long prompt is hashed once, not on every admission try.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # With sampling.prompt_logprobs: prompt tokens 1.. scored so far, in order.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)
    prompt_logprobs_sent: bool = False
    # Structured outputs: where the output is in its grammar (each sample of n > 1 has its
    # own); advanced by Planner.update with every token appended to the outputs.
    grammar: GrammarMatcher | None = field(default=None, repr=False)
    # Disaggregation (engine/disagg.py): on a prefill worker, the output count at which
    # the request leaves for a decode worker (0: it stays where it runs); and how many
    # times it has left a worker that way (its KV moved: not a prefix hit of its own).
    kv_handoff_at: int = 0
    kv_handoffs: int = 0
    # prompt + outputs, kept incrementally so a decode step does not copy the prompt.
    _all_token_ids: list[int] = field(init=False, repr=False)
    _distinct_prompt_ids: tuple[int, ...] | None = field(default=None, init=False, repr=False)

    def hands_off(self, pending: int = 0) -> bool:
        """Disaggregation: the token it leaves its prefill worker after is sampled (or, with
        `pending` samples in flight, being sampled): that worker plans it no further."""
        return 0 < self.kv_handoff_at <= self.num_output_tokens + pending

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids)
        self._all_token_ids.extend(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by generated tokens. Read-only by convention."""
        return self._all_token_ids

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Some prompt token's logprob is still to be computed."""
        wanted = self.sampling.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def max_cache_hit_tokens(self) -> int:
        """Known tokens that may be read from the prefix cache instead of computed: all
        but the last (its logits are needed), and with prompt logprobs still missing
        only the positions already scored (the cache holds KV, not logits); none for
        mean pooling."""
        limit = self.num_tokens - 1
        if self.pooling is not None and self.pooling.kind is PoolingKind.MEAN:
            return 0  # the cache holds KV, not the hidden states the mean needs
        if self.needs_prompt_logprobs:
            limit = min(limit, len(self.prompt_logprobs))
        return limit

    @property
    def distinct_prompt_ids(self) -> tuple[int, ...]:
        """The prompt's token ids, each once (the repetition penalty's prompt set)."""
        if self._distinct_prompt_ids is None:
            self._distinct_prompt_ids = tuple(sorted(set(self.prompt_token_ids)))
        return self._distinct_prompt_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self._all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Forget the outputs after the first `num_output_tokens` (a stop string ended an
        accepted run of drafts before its end); only for a request that ends now."""
        del self.output_token_ids[num_output_tokens:], self.output_logprobs[num_output_tokens:]
        del self._all_token_ids[self.num_prompt_tokens + num_output_tokens :]
