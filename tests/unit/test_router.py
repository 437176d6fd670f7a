"""Routing policies against real BlockPool/KVCacheManager objects and fake worker descriptors."""

from __future__ import annotations

import itertools
import random

import pytest

from scheduler_svc.engine.router import (
    ROUTING_POLICIES,
    Candidate,
    LeastLoadedRouter,
    NoWorkerAvailable,
    PrefixRouter,
    RoundRobinRouter,
    RouteReason,
    WorkerState,
    make_router,
)
from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.request import Request

BS = 16
_ids = itertools.count(1)


class FakeWorker:
    """One worker as the engine sees it: its pool/index and its queue lengths."""

    def __init__(self, address: str, num_blocks: int = 512, extra_keys: tuple = ("model", "bf16")):
        self.address = address
        self.kv = KVCacheManager(BlockPool(num_blocks, BS), extra_keys=extra_keys)
        self.running = 0
        self.waiting = 0
        self.state = WorkerState.SERVING

    def candidate(self) -> Candidate:
        return Candidate(self.address, self.kv, self.running, self.waiting, self.state)

    def compute(self, request: Request) -> int:
        """Run the request's prefill here as the planner would (prefix hits shared, the
        rest computed and indexed), then finish it. Returns the prefix hit tokens."""
        hits, hit_tokens = self.kv.get_computed_blocks(request)
        assert self.kv.allocate_slots(request, request.num_tokens - hit_tokens, hits) is not None
        self.kv.cache_full_blocks(request, request.num_tokens)
        self.kv.free(request)
        return hit_tokens


def req(tokens: list[int], salt: str | None = None) -> Request:
    n = next(_ids)
    return Request(request_id=f"r{n}", seq_id=n, prompt_token_ids=list(tokens), cache_salt=salt)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def route(router, workers: list[FakeWorker], request: Request, queue: bool = True):
    decision = router.route(request, [w.candidate() for w in workers])
    if queue:  # the request now waits on its worker: the load the next decision sees
        next(w for w in workers if w.address == decision.address).waiting += 1
    return decision


def by_address(workers):
    return {w.address: w for w in workers}


# ---- prefix-aware -----------------------------------------------------------
def test_longest_cached_prefix_wins_over_load():
    a, b = FakeWorker("a:1"), FakeWorker("b:1")
    system = tokens(1, 6 * BS)
    a.compute(req(system[: 2 * BS] + tokens(2, 5)))  # a holds 2 blocks of it
    b.compute(req(system + tokens(3, 5)))  # b holds all 6
    b.running = 3  # busier, but within the balance thresholds
    d = PrefixRouter().route(req(system + tokens(4, 9)), [a.candidate(), b.candidate()])
    assert (d.address, d.reason, d.cached_tokens) == ("b:1", RouteReason.PREFIX, 6 * BS)


def test_ties_and_misses_go_to_least_loaded():
    a, b = FakeWorker("a:1"), FakeWorker("b:1")
    system = tokens(5, 4 * BS)
    for w in (a, b):
        w.compute(req(system + tokens(6, 3)))
    router = PrefixRouter(affinity_ttl_s=0)
    a.running = 2
    d = router.route(req(system + tokens(7, 3)), [a.candidate(), b.candidate()])
    assert (d.address, d.reason, d.cached_tokens) == ("b:1", RouteReason.PREFIX, 4 * BS)
    d = router.route(req(tokens(8, 40)), [a.candidate(), b.candidate()])  # a miss everywhere
    assert (d.address, d.reason, d.cached_tokens) == ("b:1", RouteReason.LOAD, 0)
    # Equal sequence counts: the one with more free blocks.
    a.running = 0
    held = req(tokens(9, 10 * BS))
    assert b.kv.allocate_slots(held, held.num_tokens) is not None
    d = router.route(req(tokens(10, 40)), [a.candidate(), b.candidate()])
    assert d.address == "a:1"


def test_draining_and_unhealthy_workers_get_nothing():
    a, b, c = FakeWorker("a:1"), FakeWorker("b:1"), FakeWorker("c:1")
    system = tokens(11, 4 * BS)
    a.compute(req(system + [1]))
    b.compute(req(system + [2]))
    a.state, b.state = WorkerState.DRAINING, WorkerState.UNHEALTHY
    for router in (PrefixRouter(), RoundRobinRouter(), LeastLoadedRouter()):
        for _ in range(4):
            assert router.route(req(system + [3, 4]), [a.candidate(), b.candidate(), c.candidate()]).address == "c:1"
    c.state = WorkerState.DRAINING
    for router in (PrefixRouter(), RoundRobinRouter(), LeastLoadedRouter()):
        with pytest.raises(NoWorkerAvailable, match="a:1 draining"):
            router.route(req(system), [a.candidate(), b.candidate(), c.candidate()])
    with pytest.raises(NoWorkerAvailable):
        PrefixRouter().route(req(system), [])


def test_routing_has_no_side_effects_on_the_pools():
    a, b = FakeWorker("a:1"), FakeWorker("b:1")
    system = tokens(12, 5 * BS)
    a.compute(req(system + [1]))
    before = [(w.kv.pool.free_block_ids(), dict(w.kv.pool.cached), w.kv.usage()) for w in (a, b)]
    for router in (PrefixRouter(), RoundRobinRouter(), LeastLoadedRouter()):
        for i in range(6):
            router.route(req(system + [i]), [a.candidate(), b.candidate()])
    assert [(w.kv.pool.free_block_ids(), dict(w.kv.pool.cached), w.kv.usage()) for w in (a, b)] == before
    for w in (a, b):
        w.kv.audit(live_request_ids=())


def test_simultaneous_requests_with_a_shared_prompt_colocate_through_affinity():
    """Nothing is computed yet, so the index knows nothing; the affinity keeps each
    system prompt on one worker while different prompts still spread by load."""
    workers = [FakeWorker("a:1"), FakeWorker("b:1")]
    systems = [tokens(100 + i, 4 * BS + 5) for i in range(4)]
    router = PrefixRouter()
    placed: dict[int, set[str]] = {i: set() for i in range(4)}
    reasons = []
    for n in range(32):
        i = n % 4
        d = route(router, workers, req(systems[i] + tokens(1000 + n, 7)))
        placed[i].add(d.address)
        reasons.append(d.reason)
    assert all(len(addrs) == 1 for addrs in placed.values()), placed
    assert {next(iter(a)) for a in placed.values()} == {"a:1", "b:1"}
    assert [w.waiting for w in workers] == [16, 16]
    assert reasons[:4] == [RouteReason.LOAD] * 4 and set(reasons[4:]) == {RouteReason.AFFINITY}


def test_without_affinity_simultaneous_requests_spread_and_miss():
    workers = [FakeWorker("a:1"), FakeWorker("b:1")]
    system = tokens(200, 4 * BS)
    router = PrefixRouter(affinity_ttl_s=0)
    addrs = {route(router, workers, req(system + [n])).address for n in range(4)}
    assert addrs == {"a:1", "b:1"}


def test_affinity_expires_and_is_forgotten():
    now = [0.0]
    workers = [FakeWorker("a:1"), FakeWorker("b:1")]
    system = tokens(300, 3 * BS)
    router = PrefixRouter(affinity_ttl_s=5.0, clock=lambda: now[0])
    first = route(router, workers, req(system + [1])).address
    assert route(router, workers, req(system + [2])).address == first  # affinity, despite the load
    now[0] = 6.0  # past the TTL: back to load
    other = route(router, workers, req(system + [3]))
    assert other.address != first and other.reason is RouteReason.LOAD
    router.forget(other.address)
    assert all(addr != other.address for addr, _ in router._affinity.values())
    assert other.address not in router.counters


def test_real_index_beats_a_shorter_affinity_hint():
    a, b = FakeWorker("a:1"), FakeWorker("b:1")
    system = tokens(400, 8 * BS)
    router = PrefixRouter()
    a.running = 1  # so the first, short request goes to b
    assert route(router, [a, b], req(system[: 2 * BS] + [1])).address == "b:1"
    a.compute(req(system + [2]))  # a has all 8 blocks computed
    d = route(router, [a, b], req(system + [3]))
    assert (d.address, d.reason, d.cached_tokens) == ("a:1", RouteReason.PREFIX, 8 * BS)


def test_overloaded_prefix_winner_sheds_to_least_loaded():
    a, b = FakeWorker("a:1"), FakeWorker("b:1")
    system = tokens(500, 4 * BS)
    a.compute(req(system + [1]))
    router = PrefixRouter(balance_abs_threshold=4, balance_rel_threshold=1.5)
    a.running, b.running = 5, 1  # 4 more: not past the threshold
    assert router.route(req(system + [2]), [a.candidate(), b.candidate()]).address == "a:1"
    a.running = 6  # 5 more and 6x: shed
    d = router.route(req(system + [3]), [a.candidate(), b.candidate()])
    assert (d.address, d.reason, d.cached_tokens) == ("b:1", RouteReason.BALANCE, 0)


def test_shared_prefix_load_spreads_once_both_workers_hold_it():
    """One hot system prompt: the balance guard sends some to the idle worker, which
    then holds the prefix too; from then on ties go by load (both hit)."""
    workers = [FakeWorker("a:1"), FakeWorker("b:1")]
    system = tokens(600, 4 * BS)
    router = PrefixRouter(balance_abs_threshold=2, balance_rel_threshold=1.5)
    for n in range(20):
        d = route(router, workers, req(system + tokens(700 + n, 5)))
        by_address(workers)[d.address].compute(req(system + tokens(700 + n, 5)))
    assert abs(workers[0].waiting - workers[1].waiting) <= 3


def test_min_prefix_fraction_ignores_short_common_preambles():
    a, b = FakeWorker("a:1"), FakeWorker("b:1")
    preamble = tokens(800, BS)  # e.g. a chat template's fixed start
    a.compute(req(preamble + [1]))
    a.running = 1
    prompt = preamble + tokens(801, 10 * BS)
    assert PrefixRouter(min_prefix_fraction=0.0).route(req(prompt), [a.candidate(), b.candidate()]).address == "a:1"
    d = PrefixRouter(min_prefix_fraction=0.25).route(req(prompt), [a.candidate(), b.candidate()])
    assert (d.address, d.reason) == ("b:1", RouteReason.LOAD)


def test_salted_prompts_do_not_share_a_prefix():
    a, b = FakeWorker("a:1"), FakeWorker("b:1")
    system = tokens(900, 4 * BS)
    a.compute(req(system + [1], salt="tenant-1"))
    a.running = 1
    assert PrefixRouter().route(req(system + [2], salt="tenant-1"), [a.candidate(), b.candidate()]).address == "a:1"
    d = PrefixRouter().route(req(system + [2], salt="tenant-2"), [a.candidate(), b.candidate()])
    assert (d.address, d.cached_tokens) == ("b:1", 0)


def test_workers_with_other_hash_keys_are_probed_on_a_scratch_copy():
    a = FakeWorker("a:1", extra_keys=("model", "bf16"))
    b = FakeWorker("b:1", extra_keys=("model", "fp16"))
    system = tokens(1000, 4 * BS)
    b.compute(req(system + [1]))
    r = req(system + [2])
    d = PrefixRouter().route(r, [a.candidate(), b.candidate()])
    assert (d.address, d.cached_tokens) == ("b:1", 4 * BS)
    assert r.block_hashes == []  # not filled with either pool's keys
    # One key set: the request's own hash cache is filled once, for the planner to reuse.
    c = FakeWorker("c:1", extra_keys=("model", "fp16"))
    r2 = req(system + [3])
    PrefixRouter().route(r2, [b.candidate(), c.candidate()])
    assert len(r2.block_hashes) == 4


def test_a_retried_request_counts_its_generated_tokens():
    """A request re-routed after a worker failure has outputs; they are part of its prefix."""
    a, b = FakeWorker("a:1"), FakeWorker("b:1")
    r = req(tokens(1100, 3 * BS))
    for t in tokens(1101, 2 * BS):
        r.append_output(t, 0.0)
    b.compute(req(r.all_token_ids[: 5 * BS] + [7]))
    a.running = 0
    b.running = 1
    d = PrefixRouter().route(r, [a.candidate(), b.candidate()])
    assert (d.address, d.cached_tokens) == ("b:1", 4 * BS)  # more than the 3-block prompt


# ---- baselines ----------------------------------------------------------------
def test_round_robin_cycles_over_serving_workers():
    ws = [FakeWorker(f"w{i}:1") for i in range(3)]
    ws[1].state = WorkerState.DRAINING
    router = RoundRobinRouter()
    got = [route(router, ws, req([1] * 40)).address for _ in range(4)]
    assert got == ["w0:1", "w2:1", "w0:1", "w2:1"]


def test_least_loaded_ignores_prefixes():
    a, b = FakeWorker("a:1"), FakeWorker("b:1")
    system = tokens(1200, 4 * BS)
    a.compute(req(system + [1]))
    a.running = 1
    d = LeastLoadedRouter().route(req(system + [2]), [a.candidate(), b.candidate()])
    assert (d.address, d.reason, d.cached_tokens) == ("b:1", RouteReason.LOAD, 0)


def test_make_router_and_options():
    assert ROUTING_POLICIES == ("prefix", "round-robin", "least-loaded")
    assert isinstance(make_router("prefix", affinity_ttl_s=1.0), PrefixRouter)
    assert make_router("round-robin").name == "round-robin"
    assert make_router("least-loaded").name == "least-loaded"
    with pytest.raises(ValueError, match="routing policy must be one of"):
        make_router("random")
    with pytest.raises(ValueError):
        PrefixRouter(min_prefix_fraction=1.5)
    with pytest.raises(ValueError):
        PrefixRouter(balance_rel_threshold=0.5)


def test_candidate_from_core_duck_types_an_engine_core():
    class Planner:
        num_running, num_waiting = 2, 3
        kv = KVCacheManager(BlockPool(8, BS))
        adapters = None  # no --enable-lora

    class Info:
        address = "h:9"

    class Core:
        info, planner = Info(), Planner()

    core = Core()
    c = Candidate.from_core(core, WorkerState.SERVING)
    assert (c.address, c.num_seqs, c.free_blocks, c.state, c.accepting) == ("h:9", 5, 8, WorkerState.SERVING, True)
    assert not Candidate.from_core(core, WorkerState.DRAINING).accepting
    assert not Candidate.from_core(core, WorkerState.UNHEALTHY).accepting


def test_affinity_table_is_bounded():
    workers = [FakeWorker("a:1"), FakeWorker("b:1")]
    router = PrefixRouter(affinity_max_entries=10)
    for n in range(50):
        route(router, workers, req(tokens(2000 + n, 40 * BS)), queue=False)
    assert len(router._affinity) <= 10


# ---- the workload: 32 requests, 4 shared system prompts, 2 workers -----
def simulate(policy: str, burst: bool, seed: int = 0):
    """32 requests, 8 per system prompt (5 blocks + 3 tokens), in a shuffled order,
    each with its own 20-token question. burst: all 32 are routed before any is
    computed (they arrive in the same instant); otherwise each is computed (and
    finishes) before the next arrives. Returns (prefix hit rate over prompt tokens,
    the workers each prompt went to, requests per worker)."""
    workers = [FakeWorker("a:1"), FakeWorker("b:1")]
    systems = [tokens(3000 + i, 5 * BS + 3) for i in range(4)]
    order = [i for i in range(4) for _ in range(8)]
    random.Random(seed).shuffle(order)
    router = make_router(policy)
    placed: dict[int, set[str]] = {i: set() for i in range(4)}
    per_worker = {w.address: 0 for w in workers}
    hit = total = 0
    batch = []
    for n, i in enumerate(order):
        r = req(systems[i] + tokens(5000 + n, 20))
        d = route(router, workers, r)
        placed[i].add(d.address)
        per_worker[d.address] += 1
        batch.append((by_address(workers)[d.address], r))
        if not burst or n == len(order) - 1:
            for w, r in batch:
                hit += w.compute(r)
                total += r.num_prompt_tokens
                w.waiting -= 1
            batch = []
    for w in workers:
        w.kv.audit(live_request_ids=())
    return hit / total, placed, per_worker


@pytest.mark.parametrize("burst", [True, False], ids=["burst", "one-by-one"])
@pytest.mark.parametrize("seed", range(5))
def test_four_prompt_workload_prefix_vs_round_robin(burst, seed):
    prefix_rate, placed, per_worker = simulate("prefix", burst, seed)
    rr_rate, rr_placed, _ = simulate("round-robin", burst, seed)
    ll_rate, _, _ = simulate("least-loaded", burst, seed)
    assert all(len(a) == 1 for a in placed.values()), placed  # each prompt stays on one worker
    assert set(per_worker.values()) != {0, 32} and min(per_worker.values()) >= 8  # and the load spreads
    # Each prompt is computed once: its 7 other requests hit all 5 system blocks.
    assert prefix_rate == pytest.approx(28 * 5 * BS / (32 * (5 * BS + 23)))
    assert any(len(a) == 2 for a in rr_placed.values())  # round-robin computes prompts on both workers
    assert prefix_rate > rr_rate and prefix_rate >= ll_rate
    print(
        f"\n{'burst' if burst else 'one-by-one'} seed {seed}: prefix hit rate prefix {prefix_rate:.3f}, "
        f"round-robin {rr_rate:.3f}, least-loaded {ll_rate:.3f}; requests per worker {per_worker}"
    )


def test_counters_per_worker():
    workers = [FakeWorker("a:1"), FakeWorker("b:1")]
    system = tokens(4000, 3 * BS)
    router = PrefixRouter()
    for n in range(4):
        route(router, workers, req(system + [n]))
    workers[0].compute(req(system + [9]))
    route(router, workers, req(system + [10]))
    a = router.counters["a:1"]
    assert (a.routed, a.by_reason, a.cached_tokens, a.prompt_tokens) == (
        5,
        {"load": 1, "affinity": 3, "prefix": 1},
        3 * BS,
        5 * (3 * BS + 1),
    )
    assert "b:1" not in router.counters
