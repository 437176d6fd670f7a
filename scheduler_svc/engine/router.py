"""Which worker gets a new request: prefix-aware routing, plus round-robin and
least-loaded policies to compare it with (`--routing prefix|round-robin|least-loaded`).

Pure bookkeeping: no I/O, no asyncio, no torch. The engine describes each of
its cores as a `Candidate` (address, state, its KVCacheManager, queue lengths)
and asks `router.route(request, candidates)`; the answer is the chosen address
plus why. A request stays on the worker it was routed to for its whole life
(its KV lives there); the engine routes it again only if that worker fails.

Prefix-aware policy (`PrefixRouter`)
------------------------------------
1. Only SERVING candidates are eligible: a DRAINING worker finishes what it has
   but gets nothing new; an UNHEALTHY one gets nothing.
2. For each eligible worker, `kv.get_computed_blocks(request)` gives the longest
   prefix of the prompt that worker's prefix index holds (no side effects on
   the pool), in either KV tier (kv/tiers.py: a second-tier hit is copied up,
   not computed). That is ground truth, but only for blocks already *computed*.
3. Affinity, for prefixes not computed yet: a burst of requests with the same
   system prompt arriving in one instant would all miss in step 2 (nothing is
   computed before the first step runs) and be spread by load, each worker
   prefilling the same prompt. So the router remembers, for a short time
   (`affinity_ttl_s`, 10 s by default), "block hash -> worker" for the full
   prompt blocks of the requests it routed, and counts a match there as an
   expected hit. The hashes are the chained prefix hashes the KV manager uses,
   so a match at block i means the first i+1 blocks are equal. Only blocks at
   depths 1, 2, 4, 8, ... and the last full block are remembered (a handful per
   request, however long the prompt) and the table is an LRU bounded by
   `affinity_max_entries`. The affinity is only a hint: the real index wins when
   it knows more, a worker that leaves is forgotten (`forget`), and an entry
   older than the TTL is ignored -- by then the real index has taken over.
4. The worker with the longest expected prefix (max of 2 and 3) wins, if that
   prefix is at least `min_prefix_fraction` of the prompt (default 0: any full
   block counts). Among equal prefixes the one with fewer blocks in the second
   tier wins (each costs a copy up); ties -- and misses -- go to the least loaded worker: fewest
   running + waiting sequences, then most free blocks, then most free blocks
   that hold no cached prefix (so misses spread over idle workers instead of
   evicting one worker's cached prompts), then candidate order. A miss of a
   LoRA request goes to the least loaded worker that holds its adapter resident
   (no load, no eviction), unless the load guard (5) says it is overloaded.
   Its hits need no such rule: its blocks are salted by its adapter, so only a
   worker that ran it can hold them.
5. Load guard: a shared prefix must not pin all traffic on one worker. If the
   prefix winner has more than `balance_abs_threshold` sequences more than the
   least loaded worker *and* more than `balance_rel_threshold` times as many,
   the least loaded worker gets the request (it will compute the prefix once
   and from then on both workers hit). This is the rule SGLang's cache-aware
   router uses, with smaller defaults (16 sequences, 1.5x).

Workers whose prefix hashes use different extra keys (e.g. one bf16 and one
fp16 KV cache) are probed with a scratch copy of the request, so the request's
own hash cache never holds another pool's hashes.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from scheduler_svc.config import ROUTING_POLICIES
from scheduler_svc.kv.interface import KVManager
from scheduler_svc.request import LoraRef, Request

if TYPE_CHECKING:
    from scheduler_svc.engine.core import EngineCore


class WorkerState(enum.StrEnum):
    SERVING = "serving"  # takes new requests
    DRAINING = "draining"  # finishes its requests, takes no new ones, then is removed
    UNHEALTHY = "unhealthy"  # lost; its requests were re-queued or failed
    REMOVED = "removed"  # drained and gone (reported once, by DrainWorker with wait)


class NoWorkerAvailable(RuntimeError):
    """No candidate is SERVING (the engine maps this to WorkerUnavailable / UNAVAILABLE)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the router needs to know about one worker, read at routing time."""

    address: str
    kv: KVManager  # that worker's pool and prefix index in the scheduler
    num_running: int = 0
    num_waiting: int = 0
    state: WorkerState = WorkerState.SERVING
    adapters: Collection[LoraRef] = ()  # the LoRA adapters resident on the worker

    def holds(self, request: Request) -> bool:
        return request.lora is not None and request.lora in self.adapters

    @property
    def accepting(self) -> bool:
        return self.state is WorkerState.SERVING

    @property
    def num_seqs(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def free_blocks(self) -> int:
        return self.kv.pool.num_free_blocks

    @property
    def used_blocks(self) -> int:
        return self.kv.pool.num_used_blocks

    @property
    def uncached_free_blocks(self) -> int:
        """Free blocks holding no cached prefix: allocating them evicts nothing."""
        return self.kv.pool.num_free_blocks - self.kv.pool.num_cached_free_blocks

    def load_key(self) -> tuple[int, int, int]:
        """Smaller is less loaded: fewer sequences running or waiting, then more free
        blocks, then more of them uncached (a miss placed there evicts nothing)."""
        return self.num_seqs, -self.free_blocks, -self.uncached_free_blocks

    @classmethod
    def from_core(cls, core: EngineCore, state: WorkerState) -> Candidate:
        """Describe an EngineCore in `state` (the fleet's: engine/fleet.py)."""
        planner = core.planner
        return cls(
            address=core.info.address,
            kv=planner.kv,
            num_running=planner.num_running,
            num_waiting=planner.num_waiting,
            state=state,
            adapters=planner.adapters.resident if planner.adapters is not None else (),
        )


class RouteReason(enum.StrEnum):
    PREFIX = "prefix"  # longest computed prefix in that worker's index
    AFFINITY = "affinity"  # a recently routed request with the same prefix went there
    LOAD = "load"  # no usable prefix: least loaded
    BALANCE = "balance"  # the prefix winner was overloaded: least loaded instead
    ADAPTER = "adapter"  # no usable prefix: the least loaded worker holding the request's LoRA adapter
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    address: str
    reason: RouteReason
    cached_tokens: int  # prompt tokens the chosen worker's index holds now
    expected_cached_tokens: int  # cached_tokens, or more when the affinity expects a prefix in flight


@dataclass(slots=True)
class RouteCounters:
    """Per worker: how many requests were routed there and why."""

    routed: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    cached_tokens: int = 0  # sum of RoutingDecision.cached_tokens (prefix hits known at routing time)
    prompt_tokens: int = 0


class Router(Protocol):
    name: str
    counters: dict[str, RouteCounters]

    def route(self, request: Request, candidates: Sequence[Candidate]) -> RoutingDecision:
        """Choose a SERVING candidate; raises NoWorkerAvailable if there is none."""

    def forget(self, address: str) -> None:
        """The worker left (removed, or lost its cache): drop what the router remembers of it."""


class _BaseRouter:
    name = "base"

    def __init__(self) -> None:
        self.counters: dict[str, RouteCounters] = {}

    def forget(self, address: str) -> None:
        self.counters.pop(address, None)

    @staticmethod
    def _eligible(candidates: Sequence[Candidate]) -> list[Candidate]:
        eligible = [c for c in candidates if c.accepting]
        if not eligible:
            states = ", ".join(f"{c.address} {c.state}" for c in candidates) or "none configured"
            raise NoWorkerAvailable(f"no worker is available ({states})")
        return eligible

    @staticmethod
    def _least_loaded(candidates: Sequence[Candidate]) -> Candidate:
        return min(candidates, key=Candidate.load_key)  # min keeps the first of equals: candidate order

    def _record(self, request: Request, decision: RoutingDecision) -> RoutingDecision:
        c = self.counters.setdefault(decision.address, RouteCounters())
        c.routed += 1
        reason = str(decision.reason)
        c.by_reason[reason] = c.by_reason.get(reason, 0) + 1
        c.cached_tokens += decision.cached_tokens
        c.prompt_tokens += request.num_prompt_tokens
        return decision


class RoundRobinRouter(_BaseRouter):
    """Each SERVING worker in turn, whatever it caches (the baseline)."""

    name = "round-robin"

    def __init__(self) -> None:
        super().__init__()
        self._turn = itertools.count()

    def route(self, request: Request, candidates: Sequence[Candidate]) -> RoutingDecision:
        eligible = self._eligible(candidates)
        chosen = eligible[next(self._turn) % len(eligible)]
        cached = _cached_tokens(chosen, request)
        return self._record(request, RoutingDecision(chosen.address, RouteReason.ROUND_ROBIN, cached, cached))


class LeastLoadedRouter(_BaseRouter):
    """Fewest running + waiting sequences, then most free blocks (ignores prefixes)."""

    name = "least-loaded"

    def route(self, request: Request, candidates: Sequence[Candidate]) -> RoutingDecision:
        chosen = self._least_loaded(self._eligible(candidates))
        cached = _cached_tokens(chosen, request)
        return self._record(request, RoutingDecision(chosen.address, RouteReason.LOAD, cached, cached))


class PrefixRouter(_BaseRouter):
    """Longest cached (or recently routed) prompt prefix, then load. See the module doc."""

    name = "prefix"

    def __init__(
        self,
        affinity_ttl_s: float = 10.0,
        affinity_max_entries: int = 65536,
        min_prefix_fraction: float = 0.0,
        balance_abs_threshold: int = 16,
        balance_rel_threshold: float = 1.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if affinity_ttl_s < 0 or affinity_max_entries < 0:
            raise ValueError("affinity_ttl_s and affinity_max_entries must be >= 0")
        if not 0.0 <= min_prefix_fraction <= 1.0:
            raise ValueError(f"min_prefix_fraction must be in [0, 1], got {min_prefix_fraction}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        super().__init__()
        self.affinity_ttl_s = affinity_ttl_s
        self.affinity_max_entries = affinity_max_entries
        self.min_prefix_fraction = min_prefix_fraction
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._clock = clock
        # block hash -> (address, routed at); oldest first (LRU by last routing).
        self._affinity: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    # ---- routing --------------------------------------------------------
    def route(self, request: Request, candidates: Sequence[Candidate]) -> RoutingDecision:
        eligible = self._eligible(candidates)
        hashes, cached, below = self._probe(request, eligible)
        now = self._clock()
        affinity = self._affinity_hits(hashes, eligible[0].kv.block_size, now)
        expected = {c.address: max(cached[c.address], affinity.get(c.address, 0)) for c in eligible}
        best_tokens = max(expected.values())
        least = self._least_loaded(eligible)
        # A miss goes where its adapter is resident (no load, no eviction), unless that worker is overloaded.
        holder = self._least_loaded(holders) if (holders := [c for c in eligible if c.holds(request)]) else least
        miss = (holder, RouteReason.ADAPTER) if holder is not least and not self._overloaded(holder, least) else None
        if best_tokens > 0 and best_tokens >= self.min_prefix_fraction * request.num_prompt_tokens:
            best = [c for c in eligible if expected[c.address] == best_tokens]
            chosen = min(best, key=lambda c: (below[c.address], c.load_key()))
            reason = RouteReason.PREFIX if cached[chosen.address] == best_tokens else RouteReason.AFFINITY
            if chosen is not least and self._overloaded(chosen, least):
                chosen, reason = least, RouteReason.BALANCE
        else:
            chosen, reason = miss or (least, RouteReason.LOAD)
        self._remember(hashes, chosen.address, now)
        return self._record(
            request, RoutingDecision(chosen.address, reason, cached[chosen.address], expected[chosen.address])
        )

    def forget(self, address: str) -> None:
        super().forget(address)
        for key in [k for k, (addr, _) in self._affinity.items() if addr == address]:
            del self._affinity[key]

    def _overloaded(self, chosen: Candidate, least: Candidate) -> bool:
        return (
            chosen.num_seqs - least.num_seqs > self.balance_abs_threshold
            and chosen.num_seqs > self.balance_rel_threshold * least.num_seqs
        )

    def _probe(
        self, request: Request, eligible: Sequence[Candidate]
    ) -> tuple[list[bytes], dict[str, int], dict[str, int]]:
        """The prompt's block hashes (for the affinity), and per worker its cached prefix
        tokens (both tiers) and how many of those blocks are in the second tier."""
        groups: dict[tuple[int, tuple[object, ...]], list[Candidate]] = {}
        for c in eligible:
            groups.setdefault((c.kv.block_size, c.kv.extra_keys), []).append(c)
        # One key set (the normal case): probe with the request itself, so its hash
        # cache is filled once for the planner too. Several: scratch copies.
        shared = len(groups) == 1
        cached: dict[str, int] = {}
        below: dict[str, int] = {}
        hashes: list[bytes] | None = None
        for members in groups.values():
            probe = request if shared else _scratch_copy(request)
            for c in members:
                hits, cached[c.address] = c.kv.get_computed_blocks(probe)
                below[c.address] = sum(1 for b in hits if b < 0)  # tier2_handle ids
            if hashes is None:
                hashes = list(probe.block_hashes)
        return hashes or [], cached, below

    # ---- affinity -------------------------------------------------------
    def _affinity_hits(self, hashes: list[bytes], block_size: int, now: float) -> dict[str, int]:
        """Deepest remembered depth per worker, in tokens."""
        if not self.affinity_ttl_s or not hashes:
            return {}
        hits: dict[str, int] = {}
        for depth in _affinity_depths(len(hashes)):
            entry = self._affinity.get(hashes[depth - 1])
            if entry is None:
                break
            address, at = entry
            if now - at > self.affinity_ttl_s:
                break
            hits[address] = depth * block_size
        return hits

    def _remember(self, hashes: list[bytes], address: str, now: float) -> None:
        if not self.affinity_ttl_s or not self.affinity_max_entries:
            return
        for depth in _affinity_depths(len(hashes)):
            key = hashes[depth - 1]
            self._affinity[key] = (address, now)
            self._affinity.move_to_end(key)
        while len(self._affinity) > self.affinity_max_entries:
            self._affinity.popitem(last=False)
        # Drop expired entries from the old end so the table does not sit full of them.
        while self._affinity:
            key, (_, at) = next(iter(self._affinity.items()))
            if now - at <= self.affinity_ttl_s:
                break
            del self._affinity[key]


def make_router(policy: str, **options: Any) -> Router:
    """policy: one of ROUTING_POLICIES; options go to PrefixRouter."""
    if policy == "prefix":
        return PrefixRouter(**options)
    if policy == "round-robin":
        return RoundRobinRouter()
    if policy == "least-loaded":
        return LeastLoadedRouter()
    raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")


def _affinity_depths(num_blocks: int) -> list[int]:
    """1, 2, 4, ... below num_blocks, and num_blocks itself (1-based block counts)."""
    depths, d = [], 1
    while d < num_blocks:
        depths.append(d)
        d *= 2
    if num_blocks:
        depths.append(num_blocks)
    return depths


def _cached_tokens(candidate: Candidate, request: Request) -> int:
    return candidate.kv.get_computed_blocks(request)[1]


def _scratch_copy(request: Request) -> Request:
    """Same tokens and salt, an empty hash cache: probing it leaves `request` untouched."""
    return Request(
        request_id=request.request_id,
        seq_id=request.seq_id,
        prompt_token_ids=list(request.all_token_ids),
        cache_salt=request.cache_salt,
        lora=request.lora,
    )
