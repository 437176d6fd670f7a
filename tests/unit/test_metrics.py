"""Metrics: exact values on scripted planner/KV scenarios, the Prometheus
exposition (names, parseability, values), the Stats fields, rate windows,
request timings, the live view's rendering and JSON log lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
from types import SimpleNamespace

import pytest
import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from proto import serving_pb2
from scheduler_svc.api.serving import stats_to_proto
from scheduler_svc.engine.core import CoreCounters
from scheduler_svc.engine.stats import engine_stats
from scheduler_svc.engine.timing import RequestTiming
from scheduler_svc.engine.worker_client import StepResult, WorkerInfo
from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.observability.accounting import RateWindow, core_metrics, split_step_tokens
from scheduler_svc.observability.exposition import start_metrics_server
from scheduler_svc.observability.metrics import SchedulerMetrics, observe_step
from scheduler_svc.observability.names import METRIC_NAMES, VLLM_METRIC_NAMES
from scheduler_svc.observability.stats import stats_fields
from scheduler_svc.observability.top import pool_bar, render, split_cells
from scheduler_svc.planning.planner import Planner, PlannerConfig
from scheduler_svc.request import Request, SamplingOptions
from scheduler_svc.speculative.ngram import NgramConfig
from tests.helpers.fake_worker import FakeWorker

BS = 16
_seq = iter(range(1, 10**9))


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(num_blocks=16, **config):
    config.setdefault("max_model_len", 4096)
    kv = KVCacheManager(BlockPool(num_blocks, BS), BS, extra_keys=("m",))
    return Planner(PlannerConfig(**config), kv), FakeWorker(num_blocks, BS)


def req(rid, prompt, max_tokens=1):
    return Request(rid, next(_seq), list(prompt), SamplingOptions(max_tokens=max_tokens, temperature=0.0))


def info(address="127.0.0.1:7001", num_blocks=16, device="cpu"):
    return WorkerInfo(
        address=address,
        model_name="tiny",
        model_type="llama",
        vocab_size=1000,
        max_model_len=4096,
        block_size=BS,
        num_blocks=num_blocks,
        kv_dtype="fp16",
        dtype="float32",
        device=device,
        instance_id="i1",
        kv_bytes_per_block=BS * 2048,
        weight_format="gguf Q4_1+Q8_0",
        weights_bytes=97_000_000,
    )


def fake_core(planner, address="127.0.0.1:7001", device="cpu"):
    """What the collector and the Stats fields read of an EngineCore."""
    return SimpleNamespace(
        info=info(address, planner.kv.pool.num_blocks, device), planner=planner, counters=CoreCounters(), healthy=True
    )


def run_step(core, worker, metrics=None, forward_ms=2.0):
    """One engine step as the engine core runs it, with the step hook."""
    import time

    plan = core.planner.schedule()
    started = time.perf_counter()
    result = StepResult(worker.execute(plan), instance_id="i1", forward_ms=forward_ms)
    observe_step(core, plan, result, started, metrics=metrics)
    updates = core.planner.update(plan, result.samples)
    core.counters.steps_run += 1
    core.counters.generation_tokens += sum(u.token_id is not None for u in updates)
    return plan, updates


def scrape(engine, metrics=None) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from a fresh registry's text exposition."""
    metrics = metrics or SchedulerMetrics(CollectorRegistry())
    metrics.register_engine(engine)
    text = metrics.exposition().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


W = (("worker", "127.0.0.1:7001"),)


def blocks(state):
    return ("pagedserve_kv_cache_blocks", tuple(sorted({"worker": "127.0.0.1:7001", "state": state}.items())))


# ---- the scenario --------------------------------------------------
def test_three_requests_of_20_33_16_tokens_fragmentation_then_cached_not_in_use():
    planner, worker = make(num_blocks=16)
    for rid, n, base in (("a", 20, 100), ("b", 33, 200), ("c", 16, 300)):
        planner.add(req(rid, range(base, base + n)))
    plan = planner.schedule()
    u = planner.kv.usage()
    assert (u.used_blocks, u.allocated_slots, u.unused_slots) == (6, 96, 12 + 15 + 0)
    assert u.fragmentation == 27 / 96
    assert u.used_fraction == 6 / 16
    assert (u.blocks_allocated, u.blocks_freed) == (6, 0)
    engine = SimpleNamespace(cores=[fake_core(planner)])
    got = scrape(engine)
    assert got[blocks("in_use")] == 6 and got[blocks("cached_free")] == 0 and got[blocks("free")] == 10
    assert got[("pagedserve_kv_cache_capacity_blocks", W)] == 16
    assert got[("pagedserve_kv_cache_fragmentation_ratio", W)] == 27 / 96
    assert got[("pagedserve_kv_cache_utilization_ratio", W)] == 6 / 16
    assert got[("pagedserve_kv_cache_allocated_slots", W)] == 96
    assert got[("pagedserve_kv_cache_unused_slots", W)] == 27
    assert got[("pagedserve_kv_blocks_allocated_total", W)] == 6

    # max_tokens=1: all three finish in this step. Their full blocks (1 + 2 + 1)
    # stay in the prefix index as cached-free blocks, not in use.
    planner.update(plan, worker.execute(plan))
    assert not planner.has_work()
    planner.audit()
    u = planner.kv.usage()
    assert (u.used_blocks, u.cached_free_blocks, u.free_blocks) == (0, 4, 16)
    assert (u.allocated_slots, u.unused_slots, u.fragmentation) == (0, 0, 0.0)
    assert (u.blocks_allocated, u.blocks_freed) == (6, 6)
    got = scrape(engine)
    assert (got[blocks("in_use")], got[blocks("cached_free")], got[blocks("free")]) == (0, 4, 12)
    assert got[("pagedserve_kv_cache_fragmentation_ratio", W)] == 0.0
    assert got[("pagedserve_kv_cache_utilization_ratio", W)] == 0.0
    assert got[("pagedserve_kv_blocks_freed_total", W)] == 6


def test_decode_fills_a_new_block_one_slot_at_a_time():
    planner, worker = make()
    core = fake_core(planner)
    planner.add(req("a", range(100, 116), max_tokens=3))  # exactly one full block
    run_step(core, worker)
    assert planner.kv.usage().unused_slots == 0
    run_step(core, worker)  # decode of token 17: a second block with one slot used
    u = planner.kv.usage()
    assert (u.used_blocks, u.unused_slots, u.fragmentation) == (2, 15, 15 / 32)
    run_step(core, worker)
    u = planner.kv.usage()
    assert u.used_blocks == 0 and u.blocks_allocated == u.blocks_freed == 2


def test_a_shared_block_is_counted_once_at_its_fullest_holder():
    planner, worker = make()
    sampling = SamplingOptions(max_tokens=4, temperature=0.0)
    prompt = list(range(100, 121))  # 21 tokens: the parent computes 20 = a full block + 4
    children = [Request(f"g/{i}", next(_seq), prompt, sampling, sample_index=i) for i in range(3)]
    parent = Request("g", next(_seq), prompt[:-1], sampling, prefill_only=True, children=children)
    planner.add(parent)
    plan = planner.schedule()
    planner.update(plan, worker.execute(plan))  # the parent's prefill: three children share its 2 blocks
    u = planner.kv.usage()
    assert u.used_blocks == 2 and u.tokens_held == 3 * 20
    assert (u.allocated_slots, u.unused_slots) == (32, 12)  # not 3 x 12: each block once
    plan = planner.schedule()  # each child writes token 21: copy-on-write of the shared partial block
    u = planner.kv.usage()
    assert u.used_blocks == 1 + 3  # shared full block + a private copy of the partial one each
    assert u.unused_slots == 3 * (16 - 5)
    planner.update(plan, worker.execute(plan))
    while planner.has_work():
        plan = planner.schedule()
        planner.update(plan, worker.execute(plan))
    planner.audit()


def test_prefix_hits_revive_cached_blocks_and_count_in_the_hit_rate():
    planner, worker = make()
    core = fake_core(planner)
    planner.add(req("a", range(100, 133)))  # 33 tokens: 2 full blocks cached after it ends
    run_step(core, worker)
    planner.add(req("b", [*range(100, 132), 7, 8, 9, 10, 11]))  # same 32-token prefix, 37 tokens
    plan = planner.schedule()
    u = planner.kv.usage()
    assert (u.prefix_queries, u.prefix_query_tokens, u.prefix_hit_tokens) == (2, 33 + 37, 32)
    assert u.prefix_hit_rate == 32 / 70
    # a: 3 blocks; b: 2 cached-free blocks taken back by the hit + 1 new one.
    assert u.blocks_allocated == 3 + 3 and u.used_blocks == 3 and u.blocks_freed == 3
    got = scrape(SimpleNamespace(cores=[core]))
    assert got[("pagedserve_prefix_cache_queries_total", W)] == 2
    assert got[("pagedserve_prefix_cache_query_tokens_total", W)] == 70
    assert got[("pagedserve_prefix_cache_hit_tokens_total", W)] == 32
    assert got[("pagedserve_prefix_cache_hit_ratio", W)] == 32 / 70
    planner.update(plan, worker.execute(plan))


def test_evictions_count_events_and_reclaimed_blocks():
    planner, worker = make(num_blocks=4)
    core = fake_core(planner)
    planner.add(req("a", range(100, 133)))  # 3 blocks; 2 stay cached-free after it ends
    run_step(core, worker)
    assert planner.kv.usage().cached_free_blocks == 2
    planner.add(req("b", range(500, 563)))  # 63 tokens: all 4 blocks, reclaiming both cached ones
    run_step(core, worker)
    u = planner.kv.usage()
    assert (u.eviction_events, u.blocks_reclaimed) == (1, 2)
    got = scrape(SimpleNamespace(cores=[core]))
    assert got[("pagedserve_kv_evictions_total", W)] == 1
    assert got[("pagedserve_kv_blocks_reclaimed_total", W)] == 2


def test_pinned_blocks_are_full_and_counted():
    planner, worker = make()
    core = fake_core(planner)
    prompt = list(range(100, 133))
    planner.add(req("a", prompt))
    run_step(core, worker)
    assert planner.kv.pin(req("p", prompt)) is not None
    u = planner.kv.usage()
    assert (u.pinned_blocks, u.used_blocks, u.unused_slots) == (2, 2, 0)
    assert scrape(SimpleNamespace(cores=[core]))[("pagedserve_kv_cache_pinned_blocks", W)] == 2


def test_preemption_and_prefill_decode_split():
    planner, worker = make(num_blocks=4, max_model_len=64)
    core = fake_core(planner)
    planner.add(req("a", range(100, 124), max_tokens=30))  # 24 tokens, grows to 54
    planner.add(req("b", range(200, 224), max_tokens=30))
    for _ in range(200):
        if not planner.has_work():
            break
        run_step(core, worker)
    assert planner.num_preemptions > 0
    cm = core_metrics(core)
    assert cm.decode_tokens + cm.prefill_tokens == sum(len(seq.token_ids) for plan in worker.steps for seq in plan.seqs)
    assert cm.prefill_tokens > 48  # both prompts, plus recomputation after preemptions
    got = scrape(SimpleNamespace(cores=[core]))
    assert got[("pagedserve_preemptions_total", W)] == planner.num_preemptions
    assert got[("pagedserve_prefill_tokens_total", W)] == cm.prefill_tokens
    assert got[("pagedserve_decode_tokens_total", W)] == cm.decode_tokens


def test_split_step_tokens_classifies_decodes_and_chunks():
    planner, _ = make()
    a = req("a", range(100, 120))
    planner.add(a)
    plan = planner.schedule()
    assert split_step_tokens(plan, planner.requests.get) == (20, 0, 1)
    plan.seqs[0].token_ids, plan.seqs[0].start_pos = [5], 20  # one token past the prompt: a decode
    assert split_step_tokens(plan, planner.requests.get) == (0, 1, 0)
    plan.seqs[0].start_pos = 19  # the last prompt token alone (a fork sample): prefill
    assert split_step_tokens(plan, planner.requests.get) == (1, 0, 1)


# ---- vLLM's names --------------------------------------------------------------
def vllm(got, name, model="tiny", engine="127.0.0.1:7001"):
    return got[(name, (("engine", engine), ("model_name", model)))]


def test_vllm_series_count_as_vllm_does():
    planner, worker = make(num_blocks=8, chunk_size=16)
    core = fake_core(planner)
    engine = SimpleNamespace(cores=[core])
    planner.add(req("a", range(100, 140), max_tokens=3))  # 40 tokens: chunks of 16, 16, 8
    planner.add(req("b", range(300, 320), max_tokens=3))
    run_step(core, worker)  # a's first chunk, b's first 16 tokens
    got = scrape(engine)
    assert vllm(got, "vllm:num_requests_running") == 2 and vllm(got, "vllm:num_requests_waiting") == 0
    assert vllm(got, "vllm:kv_cache_usage_perc") == planner.kv.pool.num_used_blocks / 8
    assert vllm(got, "vllm:prompt_tokens_total") == 0  # nobody sampled yet
    while planner.requests["b"].num_output_tokens == 0:
        run_step(core, worker)
    # b's prompt counts once b samples its first token, the cached part included; a's not yet.
    assert planner.requests["a"].num_output_tokens == 0
    assert vllm(scrape(engine), "vllm:prompt_tokens_total") == 20
    while planner.has_work():
        run_step(core, worker)
    planner.add(req("c", [*range(100, 132), 1, 2], max_tokens=2))  # a's first 32 tokens are cached
    while planner.has_work():
        run_step(core, worker)
    got = scrape(engine)
    assert vllm(got, "vllm:prompt_tokens_total") == 40 + 20 + 34
    assert vllm(got, "vllm:generation_tokens_total") == 3 + 3 + 2
    assert vllm(got, "vllm:prefix_cache_queries_total") == 40 + 20 + 34  # tokens, not requests
    assert vllm(got, "vllm:prefix_cache_hits_total") == 32
    assert vllm(got, "vllm:num_requests_running") == 0 and vllm(got, "vllm:kv_cache_usage_perc") == 0


def test_vllm_prompt_tokens_once_per_request_despite_preemptions():
    planner, worker = make(num_blocks=4, max_model_len=64)
    core = fake_core(planner)
    planner.add(req("a", range(100, 124), max_tokens=30))
    planner.add(req("b", range(200, 224), max_tokens=30))
    while planner.has_work():
        run_step(core, worker)
    assert planner.num_preemptions > 0
    got = scrape(SimpleNamespace(cores=[core]))
    assert vllm(got, "vllm:num_preemptions_total") == planner.num_preemptions
    assert vllm(got, "vllm:prompt_tokens_total") == 48
    assert vllm(got, "vllm:generation_tokens_total") == core.counters.generation_tokens


def test_speculative_decoding_counts_drafts_and_accepted_tokens_both_ways():
    kv = KVCacheManager(BlockPool(16, BS), BS, extra_keys=("m",))
    spec = NgramConfig(num_speculative_tokens=3, ngram_min=1, ngram_max=2)
    planner = Planner(PlannerConfig(max_model_len=4096, speculative=spec), kv)
    worker = FakeWorker(16, BS, model=lambda context: context[-4])  # copies its last 4 tokens forever
    core = fake_core(planner)
    planner.add(req("a", [7, 8, 9, 10] * 3, max_tokens=20))
    while planner.has_work():
        run_step(core, worker)
    counters = planner.drafter.counters
    assert counters.drafts > 0 and counters.accepted_tokens == counters.draft_tokens  # the lookup is always right
    got = scrape(SimpleNamespace(cores=[core]))
    assert got[("pagedserve_spec_decode_drafts_total", W)] == vllm(got, "vllm:spec_decode_num_drafts_total")
    assert got[("pagedserve_spec_decode_draft_tokens_total", W)] == counters.draft_tokens
    assert vllm(got, "vllm:spec_decode_num_accepted_tokens_total") == counters.accepted_tokens
    assert got[("pagedserve_spec_decode_acceptance_ratio", W)] == 1.0
    assert core.counters.generation_tokens == 20 and core.counters.steps_run < 20
    # serving.v1 Stats: the same totals, summed over the workers (an idle second one adds zeros).
    idle = fake_core(make()[0], "127.0.0.1:7002")
    stats = stats_to_proto(engine_stats([core, idle]), {})
    assert (stats.spec_decode_drafts, stats.spec_decode_draft_tokens, stats.spec_decode_accepted_tokens) == (
        counters.drafts,
        counters.draft_tokens,
        counters.accepted_tokens,
    )
    assert stats.spec_decode_acceptance_rate == 1.0
    assert stats.spec_decode_mean_accepted_length == 1 + counters.accepted_tokens / counters.drafts > 1
    assert stats_to_proto(engine_stats([idle]), {}).spec_decode_mean_accepted_length == 0.0


def test_vllm_histograms_have_vllms_buckets_and_the_model_label():
    clock = FakeClock(100.0)
    metrics = SchedulerMetrics(CollectorRegistry(), clock=clock)
    planner, _ = make()
    RequestTiming(arrival=99.0, observer=metrics).on_tokens(1)  # before an engine: pagedserve's only
    metrics.register_engine(SimpleNamespace(cores=[fake_core(planner)]))
    timing = RequestTiming(arrival=99.5, observer=metrics)
    timing.on_tokens(1)  # 0.5 s
    clock.t = 100.03
    timing.on_tokens(1)  # 30 ms
    timing.finish("stop")
    g = metrics.registry.get_sample_value
    m = {"model_name": "tiny"}
    assert g("pagedserve_time_to_first_token_seconds_count") == 2
    assert g("vllm:time_to_first_token_seconds_count", m) == 1
    assert g("vllm:time_to_first_token_seconds_bucket", {**m, "le": "0.25"}) == 0
    assert g("vllm:time_to_first_token_seconds_bucket", {**m, "le": "0.5"}) == 1
    assert g("vllm:inter_token_latency_seconds_bucket", {**m, "le": "0.025"}) == 0
    assert g("vllm:inter_token_latency_seconds_bucket", {**m, "le": "0.05"}) == 1
    assert g("vllm:e2e_request_latency_seconds_sum", m) == pytest.approx(0.53)
    text = metrics.exposition().decode()
    ttft = [line for line in text.splitlines() if line.startswith("vllm:time_to_first_token_seconds_bucket")]
    les = [line.split('le="')[1].split('"')[0] for line in ttft]
    assert les[:3] == ["0.001", "0.005", "0.01"] and les[-2:] == ["2560.0", "+Inf"] and len(les) == 23
    e2e = [line for line in text.splitlines() if line.startswith("vllm:e2e_request_latency_seconds_bucket")]
    assert len(e2e) == 22 and 'le="7680.0"' in e2e[-2]


# ---- hook-fed histograms ----------------------------------------------------
def test_step_hook_observes_step_forward_tokens_and_chunks():
    metrics = SchedulerMetrics(CollectorRegistry())
    planner, worker = make()
    core = fake_core(planner)
    planner.add(req("a", range(100, 140), max_tokens=2))
    run_step(core, worker, metrics, forward_ms=3.0)  # prefill 40 tokens
    run_step(core, worker, metrics, forward_ms=1.0)  # decode
    g = metrics.registry.get_sample_value
    labels = {"worker": "127.0.0.1:7001"}
    assert g("pagedserve_step_duration_seconds_count", labels) == 2
    assert g("pagedserve_worker_forward_duration_seconds_sum", labels) == pytest.approx(0.004)
    assert g("pagedserve_step_tokens_sum", labels) == 41
    assert g("pagedserve_step_tokens_bucket", {**labels, "le": "1.0"}) == 1
    assert g("pagedserve_prefill_chunk_duration_seconds_count", labels) == 1


def test_request_timing_observes_ttft_itl_and_e2e():
    clock = FakeClock(100.0)
    metrics = SchedulerMetrics(CollectorRegistry(), clock=clock)
    timing = RequestTiming(arrival=99.5, observer=metrics)
    clock.t = 100.0
    timing.on_tokens(1)  # TTFT 0.5 s
    clock.t = 100.02
    timing.on_tokens(1)  # 20 ms
    clock.t = 100.08
    timing.on_tokens(2)  # 60 ms over two tokens: 30 ms each
    clock.t = 100.1
    timing.finish("length")
    timing.finish("length")  # once only
    g = metrics.registry.get_sample_value
    assert g("pagedserve_time_to_first_token_seconds_sum") == 0.5
    assert g("pagedserve_inter_token_latency_seconds_count") == 3
    assert g("pagedserve_inter_token_latency_seconds_sum") == pytest.approx(0.08)
    assert g("pagedserve_e2e_request_latency_seconds_sum") == pytest.approx(0.6)
    assert g("pagedserve_requests_finished_total", {"finish_reason": "length"}) == 1
    assert timing.ttft_s == 0.5 and timing.log_fields() == {
        "ttft_ms": 500.0,
        "e2e_ms": 600.0,
        "itl_ms_mean": pytest.approx(26.67, abs=0.01),
    }
    aborted = RequestTiming(arrival=100.0, observer=metrics)
    aborted.finish("abort")  # counted, but an abort's duration is not service latency
    assert g("pagedserve_requests_finished_total", {"finish_reason": "abort"}) == 1
    assert g("pagedserve_e2e_request_latency_seconds_count") == 1
    assert metrics.recent["ttft"].quantile(0.5, clock.t) == 0.5


def test_request_stream_drives_its_timing():
    from scheduler_svc.engine.streams import RequestStream
    from scheduler_svc.planning.planner import RequestUpdate
    from scheduler_svc.request import FinishReason
    from scheduler_svc.text.tokenizer import load_tokenizer
    from tests.helpers.checkpoints import tiny_checkpoint

    tokenizer = load_tokenizer(tiny_checkpoint("llama"))
    clock = FakeClock(10.0)
    metrics = SchedulerMetrics(CollectorRegistry(), clock=clock)
    request = req("s", tokenizer.encode("Hello there"), max_tokens=3)
    stream = RequestStream(request, tokenizer)
    stream.timing = RequestTiming(arrival=9.0, observer=metrics)
    stream.on_update(RequestUpdate("s", prefill_progress=(5, 10)))  # progress only: no token yet
    assert stream.timing.first_token is None
    for t, token in ((10.0, 42), (10.05, 43), (10.1, 44)):
        clock.t = t
        request.append_output(token, -1.0)
        last = token == 44
        stream.on_update(
            RequestUpdate("s", token, -1.0, finished=last, finish_reason=FinishReason.LENGTH if last else None)
        )
    g = metrics.registry.get_sample_value
    assert g("pagedserve_time_to_first_token_seconds_sum") == 1.0
    assert g("pagedserve_inter_token_latency_seconds_count") == 2
    assert g("pagedserve_e2e_request_latency_seconds_sum") == pytest.approx(1.1)
    assert g("pagedserve_requests_finished_total", {"finish_reason": "length"}) == 1


# ---- rates and Stats fields -------------------------------------------------
def test_rate_window_is_exact_over_the_window():
    w = RateWindow(window_s=10.0)
    w.observe(0.0, (0,))
    w.observe(5.0, (50,))
    assert w.rates(5.0, (50,)) == (10.0,)  # before a full window: since the first sample
    w.observe(10.0, (100,))
    w.observe(20.0, (150,))
    assert w.rates(20.0, (150,)) == (5.0,)  # (150 - 100) / 10 s
    # Idle for a minute: nothing changed within the last 10 s.
    assert w.rates(80.0, (150,)) == (0.0,)
    # A burst after a long idle: counted over the window, not over the idle minute.
    w.observe(85.0, (250,))
    assert w.rates(86.0, (250,)) == (10.0,)
    assert len(w.samples) <= 4


def test_stats_fields_and_proto():
    clock = FakeClock(50.0)
    metrics = SchedulerMetrics(CollectorRegistry(), clock=clock)
    planner, worker = make()
    core = fake_core(planner)
    engine = SimpleNamespace(cores=[core])
    stats_fields(engine, metrics)  # the rate window's first sample: nothing allocated yet
    for rid, n, base in (("a", 20, 100), ("b", 33, 200), ("c", 16, 300)):
        planner.add(req(rid, range(base, base + n), max_tokens=2))
    clock.t = 52.0
    run_step(core, worker, metrics)  # 6 blocks for the prompts
    fields = stats_fields(engine, metrics)
    assert fields["fragmentation"] == (12 + 15 + 0) / 96
    assert fields["block_utilization"] == 6 / 16
    assert (fields["kv_slots_allocated"], fields["kv_slots_unused"]) == (96, 27)
    assert fields["blocks_allocated_total"] == 6 and fields["blocks_freed_total"] == 0
    assert fields["blocks_allocated_per_s"] == 6 / 2.0  # 6 blocks in the 2 s since the first sample
    assert fields["tokens_per_s"] == 69 / 2.0 and fields["prefill_tokens_total"] == 69
    assert fields["kv_bytes_per_token"] == 2048
    (w,) = fields["workers"]
    assert (w["address"], w["blocks_used"], w["blocks_total"], w["device"]) == ("127.0.0.1:7001", 6, 16, "cpu")
    extra = {k: v for k, v in fields.items() if k != "workers"}
    reply = serving_pb2.StatsResponse(
        blocks_total=16, blocks_used=6, blocks_free=10, workers=fields["workers"], **extra
    )
    assert reply.workers[0].fragmentation == 27 / 96 and reply.kv_slots_unused == 27
    for number in (f.number for f in serving_pb2.StatsResponse.DESCRIPTOR.fields if f.name in fields):
        assert number >= 30


def test_per_worker_labels_with_two_workers():
    p1, w1 = make()
    p2, _ = make(num_blocks=8)
    c1, c2 = fake_core(p1, "127.0.0.1:1"), fake_core(p2, "127.0.0.1:2", device="cuda:0 (NVIDIA H100)")
    p1.add(req("a", range(100, 120)))
    run_step(c1, w1)
    got = scrape(SimpleNamespace(cores=[c1, c2]))
    cap = {k[1]: v for k, v in got.items() if k[0] == "pagedserve_kv_cache_capacity_blocks"}
    assert cap == {(("worker", "127.0.0.1:1"),): 16, (("worker", "127.0.0.1:2"),): 8}
    infos = {dict(k[1])["worker"]: dict(k[1]) for k in got if k[0] == "pagedserve_worker_info"}
    assert infos["127.0.0.1:2"]["device"] == "cuda:0 (NVIDIA H100)" and infos["127.0.0.1:1"]["kv_dtype"] == "fp16"
    assert got[("pagedserve_worker_kv_cache_bytes_per_token", (("worker", "127.0.0.1:1"),))] == 2048
    # What the worker's Info said of its weights, per worker (issue 38)
    assert got[("pagedserve_worker_weights_bytes", (("worker", "127.0.0.1:2"),))] == 97_000_000
    assert infos["127.0.0.1:1"]["weight_format"] == "gguf Q4_1+Q8_0"


# ---- the exposition ---------------------------------------------------------
def test_every_documented_name_is_served_and_parses():
    metrics = SchedulerMetrics(CollectorRegistry())
    planner, worker = make()
    core = fake_core(planner)
    planner.add(req("a", range(100, 120), max_tokens=2))
    run_step(core, worker, metrics)
    metrics.register_engine(SimpleNamespace(cores=[core]))
    timing = RequestTiming(observer=metrics)
    timing.on_tokens(1)
    timing.on_tokens(1)
    timing.finish("stop")
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    for name in METRIC_NAMES:
        assert name.removesuffix("_total") in families, name  # the text parser names counters without _total
    assert families["pagedserve_time_to_first_token_seconds"].type == "histogram"
    assert families["pagedserve_kv_blocks_allocated"].type == "counter"
    assert families["pagedserve_kv_cache_blocks"].type == "gauge"
    assert families["pagedserve_worker_info"].type == "gauge"  # info metrics are gauges in the text format
    # Nothing undocumented: pagedserve's names and vLLM's, nothing else.
    documented = {name.removesuffix("_total") for name in (*METRIC_NAMES, *VLLM_METRIC_NAMES)}
    assert {name for name in families if not name.endswith("_created")} == documented
    assert families["vllm:prompt_tokens"].type == "counter"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"


def test_metrics_endpoint_serves_text_on_the_event_loop():
    metrics = SchedulerMetrics(CollectorRegistry())
    planner, _ = make()
    engine = SimpleNamespace(cores=[fake_core(planner)])

    async def get(port: int, path: str) -> tuple[str, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        raw = await reader.read()
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        return head.decode().split("\r\n")[0], body

    async def main():
        server = await start_metrics_server(engine, "127.0.0.1", 0, metrics)
        port = server.port
        try:
            return await get(port, "/metrics"), await get(port, "/nope")
        finally:
            server.close()
            await server.wait_closed()

    (status, body), (missing, _) = asyncio.run(main())
    assert status == "HTTP/1.1 200 OK" and missing.startswith("HTTP/1.1 404")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert "pagedserve_kv_cache_blocks" in names


# ---- the live view ----------------------------------------------------------
def test_split_cells_is_exact_and_keeps_small_parts_visible():
    assert split_cells([6, 4, 6], 50) == [19, 12, 19]
    assert split_cells([1, 0, 2047], 50) == [1, 0, 49]
    assert split_cells([0, 0, 0], 10) == [0, 0, 10]
    assert sum(split_cells([3, 5, 7], 37)) == 37
    assert pool_bar(6, 4, 6, 16).plain == "[" + "█" * 6 + "▒" * 4 + "░" * 6 + "]"


def test_top_renders_a_frame():
    stats = serving_pb2.StatsResponse(
        num_workers=1,
        blocks_total=16,
        blocks_used=6,
        blocks_cached_free=4,
        blocks_free=10,
        running=3,
        block_utilization=6 / 16,
        fragmentation=27 / 96,
        kv_slots_unused=27,
        kv_slots_allocated=96,
        prefix_cache_hit_rate=0.25,
        tokens_per_s=123.4,
        ttft_ms_p50=45.0,
        workers=[dict(address="127.0.0.1:7001", device="cpu", model="tiny")],
    )
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(render(stats, "127.0.0.1:50051"))
    text = out.getvalue()
    assert "spec " not in text  # no drafts made: no speculative decoding line
    stats.MergeFrom(
        serving_pb2.StatsResponse(
            spec_decode_drafts=10,
            spec_decode_draft_tokens=40,
            spec_decode_accepted_tokens=30,
            spec_decode_acceptance_rate=0.75,
            spec_decode_mean_accepted_length=4.0,
        )
    )
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(render(stats, "127.0.0.1:50051"))
    assert "drafts 10   accepted 30/40 tokens (75.0%)   tokens per drafting step 4.00" in out.getvalue()
    assert "[" + "█" * 19 + "▒" * 12 + "░" * 19 + "]" in text
    for needle in (
        "utilization 37.5%",
        "fragmentation 28.1% (27/96 slots unused)",
        "hit rate 25.0%",
        "running 3",
        "waiting 0",
        "computed 123.4",
        "TTFT p50 45.0 ms",
        "in use 6",
        "cached 4",
        "free 6",
    ):
        assert needle in text, needle


# ---- logs -------------------------------------------------------------------
def test_json_log_lines_are_json_and_library_logs_too(capsys):
    from svc_common.log_setup import configure_logging

    saved = structlog.get_config()
    root = logging.getLogger()
    saved_level, saved_handlers = root.level, list(root.handlers)
    try:
        configure_logging("json", "debug")
        structlog.get_logger("t").info("request finished", request_id="r1", ttft_ms=12.5)
        structlog.get_logger("t").debug("step", step_id=7)
        logging.getLogger("some.library").warning("from %s", "stdlib")
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    finally:
        structlog.configure(**saved)
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        logging.captureWarnings(False)
    records = [json.loads(line) for line in lines]
    assert records[0]["request_id"] == "r1" and records[0]["event"] == "request finished"
    assert records[1]["step_id"] == 7 and records[1]["level"] == "debug"
    assert records[2]["logger"] == "some.library" and records[2]["level"] == "warning"
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml")
    assert sys.stderr is not None


# ---- disaggregation ---------------------------------------------------------
def test_kv_transfers_per_worker_moved_into_in_metrics_and_stats():
    planner, _ = make(num_blocks=16)
    core = fake_core(planner)
    moved = core.counters.kv_transfers
    moved.handoffs, moved.transfers, moved.failed, moved.in_flight = 3, 2, 1, 1
    moved.blocks, moved.blocks_skipped, moved.bytes, moved.seconds = 10, 4, 10 * 4096, 0.25
    got = scrape(SimpleNamespace(cores=[core]))
    key = (("direction", "prefill_to_decode"), ("worker", "127.0.0.1:7001"))
    assert got[("pagedserve_kv_handoffs_total", key)] == 3
    assert got[("pagedserve_kv_transfer_bytes_total", key)] == 40960
    assert got[("pagedserve_kv_transfer_blocks_total", key)] == 10
    assert got[("pagedserve_kv_transfer_blocks_skipped_total", key)] == 4
    assert got[("pagedserve_kv_transfer_seconds_total", key)] == 0.25
    assert got[("pagedserve_kv_transfers_failed_total", key)] == 1
    assert got[("pagedserve_kv_transfer_queue_depth", key)] == 1
    fields = stats_fields(SimpleNamespace(cores=[core, fake_core(make(num_blocks=16)[0], "127.0.0.1:7002")]))
    assert (fields["kv_handoffs"], fields["kv_transfer_blocks"], fields["kv_transfer_queue_depth"]) == (3, 10, 1)
    assert fields["workers"][0]["kv_role"] == "both"
