"""Observability over real processes: two workers and a scheduler with
`--metrics-port` and JSON logs. The Prometheus endpoint serves parseable text
with every documented name (per-worker labels), agreeing with the Stats RPC;
every log line is JSON and request/step lines carry their ids; `top --once`
renders a frame."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler_svc.client import SchedulerClient
from scheduler_svc.observability.names import METRIC_NAMES
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import wait_idle
from tests.helpers.procs import REPO, Cluster, free_port

NUM_BLOCKS = 64
NUM_REQUESTS = 6


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    logs = ["--log-format", "json", "--log-level", "debug"]
    with Cluster(
        tiny_checkpoint("llama"),
        ["--dtype", "float32", "--num-blocks", str(NUM_BLOCKS), *logs],
        ["--metrics-port", str(port), "--chunk-size", "16", *logs],
        num_workers=2,
    ) as c:
        c.metrics_url = f"http://127.0.0.1:{port}/metrics"
        with SchedulerClient(c.address) as client:

            def run(i):
                return client.generate(
                    prompt_token_ids=[5 + i, *range(40, 40 + 10 * i)],
                    max_tokens=6,
                    temperature=0.0,
                    ignore_eos=True,
                    timeout=120,
                )

            with ThreadPoolExecutor(NUM_REQUESTS) as pool:
                c.results = list(pool.map(run, range(NUM_REQUESTS)))
            wait_idle(client)
        yield c


def scrape(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families, name, **labels) -> float:
    """Sum of the samples called `name` (e.g. a histogram's _count, a counter's _total) matching `labels`."""
    hits = [
        s.value
        for family in families.values()
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert hits, f"no sample {name} {labels}"
    return sum(hits)


def test_prometheus_endpoint_serves_every_documented_name_per_worker(cluster):
    families = scrape(cluster.metrics_url)
    for name in METRIC_NAMES:
        assert name.removesuffix("_total") in families, name
    workers = [w.address for w in cluster.workers]
    for worker in workers:
        assert value(families, "pagedserve_kv_cache_capacity_blocks", worker=worker) == NUM_BLOCKS
        states = [
            value(families, "pagedserve_kv_cache_blocks", worker=worker, state=s)
            for s in ("in_use", "cached_free", "free")
        ]
        assert sum(states) == NUM_BLOCKS and states[0] == 0  # idle: nothing in use
        assert value(families, "pagedserve_worker_info", worker=worker) == 1
        assert value(families, "pagedserve_worker_kv_cache_bytes_per_token", worker=worker) > 0
        assert value(families, "pagedserve_worker_healthy", worker=worker) == 1
    info = [s.labels for s in families["pagedserve_worker_info"].samples]
    assert {i["worker"] for i in info} == set(workers) and all(i["device"] == "cpu" for i in info)
    # Request-level histograms: one TTFT and one e2e per request, 5 gaps each.
    assert value(families, "pagedserve_time_to_first_token_seconds_count") == NUM_REQUESTS
    assert value(families, "pagedserve_e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert value(families, "pagedserve_inter_token_latency_seconds_count") == NUM_REQUESTS * 5
    assert value(families, "pagedserve_requests_finished_total", finish_reason="length") == NUM_REQUESTS
    assert value(families, "pagedserve_generation_tokens_total") == NUM_REQUESTS * 6
    assert value(families, "pagedserve_decode_tokens_total") == NUM_REQUESTS * 5
    # --chunk-size 16: the longer prompts take several chunks.
    assert value(families, "pagedserve_prefill_chunk_duration_seconds_count") > NUM_REQUESTS
    allocated = value(families, "pagedserve_kv_blocks_allocated_total")
    assert allocated == value(families, "pagedserve_kv_blocks_freed_total") > 0


def test_stats_agrees_with_the_endpoint(cluster):
    with SchedulerClient(cluster.address) as client:
        stats = client.stats()
    families = scrape(cluster.metrics_url)
    assert stats.blocks_total == value(families, "pagedserve_kv_cache_capacity_blocks") == 2 * NUM_BLOCKS
    assert stats.blocks_cached_free == value(families, "pagedserve_kv_cache_blocks", state="cached_free") > 0
    assert stats.blocks_allocated_total == value(families, "pagedserve_kv_blocks_allocated_total")
    assert stats.prefill_tokens_total == value(families, "pagedserve_prefill_tokens_total")
    assert stats.prefix_cache_hit_tokens == value(families, "pagedserve_prefix_cache_hit_tokens_total")
    assert (stats.block_utilization, stats.fragmentation, stats.kv_slots_allocated) == (0.0, 0.0, 0)
    assert [w.address for w in stats.workers] == [w.address for w in cluster.workers]
    assert all(w.device == "cpu" and w.blocks_total == NUM_BLOCKS and w.kv_bytes_per_token > 0 for w in stats.workers)
    assert stats.ttft_ms_p50 > 0 and stats.ttft_ms_p95 >= stats.ttft_ms_p50 and stats.e2e_ms_p50 > 0


def test_stats_while_a_request_runs(cluster):
    with SchedulerClient(cluster.address) as client:
        stream = client.stream(
            prompt_token_ids=list(range(100, 120)), max_tokens=400, temperature=0.0, ignore_eos=True, timeout=120
        )
        next(stream)
        stats = client.stats()
        stream.cancel()
        wait_idle(client)
    assert stats.running == 1 and stats.blocks_used >= 2
    assert stats.kv_slots_allocated == 16 * stats.blocks_used
    assert 0 <= stats.kv_slots_unused < 16 and stats.fragmentation == stats.kv_slots_unused / stats.kv_slots_allocated
    assert stats.block_utilization == stats.blocks_used / stats.blocks_total
    assert stats.tokens_per_s > 0 and stats.blocks_allocated_per_s > 0


def test_vllm_series_move_with_the_load_as_vllm_counts(cluster):
    """vLLM's names beside ours: deltas over a known load are exact, and the
    gauges follow a request while it runs."""
    model = Path(tiny_checkpoint("llama")).resolve().name  # the workers' model name
    workers = [w.address for w in cluster.workers]
    before = scrape(cluster.metrics_url)
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total"):
        samples = [s for f in before.values() for s in f.samples if s.name == name]
        assert {s.labels["engine"] for s in samples} == set(workers), name
        assert {s.labels["model_name"] for s in samples} == {model}, name
    shared = list(range(300, 332))
    with SchedulerClient(cluster.address) as client:
        first = client.generate(prompt_token_ids=[*shared, 7, 8, 9], max_tokens=4, temperature=0.0, ignore_eos=True)
        second = client.generate(prompt_token_ids=[*shared, 1, 2], max_tokens=5, temperature=0.0, ignore_eos=True)
        assert (first.cached_prompt_tokens, second.cached_prompt_tokens) == (0, 32)  # routed to the blocks
        wait_idle(client)
        done = scrape(cluster.metrics_url)
        stream = client.stream(prompt_token_ids=list(range(400, 450)), max_tokens=400, temperature=0.0, ignore_eos=True)
        # Chunks of 16: prefill progress messages come before the first token.
        next(reply for reply in stream if reply.token_ids)
        during = scrape(cluster.metrics_url)
        stream.cancel()
        wait_idle(client)
    after = scrape(cluster.metrics_url)

    def delta(name, since=before, until=done):
        return value(until, name) - value(since, name)

    assert delta("vllm:prompt_tokens_total") == 35 + 34
    assert delta("vllm:prefix_cache_queries_total") == 35 + 34
    assert delta("vllm:prefix_cache_hits_total") == 32
    assert delta("vllm:generation_tokens_total") == 4 + 5
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 3 + 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:num_preemptions_total") == 0
    assert value(during, "vllm:num_requests_running") == 1 and value(during, "vllm:num_requests_waiting") == 0
    usage = [s.value for s in during["vllm:kv_cache_usage_perc"].samples]
    assert max(usage) > 0 and min(usage) == 0 and all(0 <= u <= 1 for u in usage)  # one worker busy
    # The cancelled stream: its prompt counted at its first token; no e2e (an abort is not service latency).
    assert delta("vllm:prompt_tokens_total", done, after) == 50
    assert delta("vllm:time_to_first_token_seconds_count", done, after) == 1
    assert delta("vllm:e2e_request_latency_seconds_count", done, after) == 0
    assert value(after, "vllm:num_requests_running") == 0
    assert all(s.value == 0 for s in after["vllm:kv_cache_usage_perc"].samples)
    assert after["vllm:time_to_first_token_seconds"].type == "histogram"
    buckets = [s.labels["le"] for s in after["vllm:e2e_request_latency_seconds"].samples if s.name.endswith("_bucket")]
    assert buckets[0] == "0.3" and buckets[-2:] == ["7680.0", "+Inf"]


def read_json_lines(path) -> list[dict]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"{path}: not a JSON line: {line!r}")
    return records


def test_json_logs_carry_request_and_step_ids(cluster):
    records = read_json_lines(cluster.scheduler.log_path)
    assert records and all(isinstance(r, dict) and "event" in r and "level" in r for r in records)
    received = [r for r in records if r["event"] == "request received"]
    finished = [r for r in records if r["event"] == "request finished"]
    assert len(received) >= NUM_REQUESTS and len(finished) >= NUM_REQUESTS
    for r in received:
        assert r["request_id"] and r["prompt_tokens"] > 0
    for r in finished:
        assert r["request_id"] and r["prompt_tokens"] > 0 and r["cached_tokens"] >= 0
        assert r["output_tokens"] >= 1 and r["finish_reason"] in ("stop", "length", "abort")
        assert r["ttft_ms"] is None or r["ttft_ms"] > 0
    assert {r["request_id"] for r in received} >= {r["request_id"] for r in finished}
    assert any(r["finish_reason"] == "length" and r["output_tokens"] == 6 and r["ttft_ms"] > 0 for r in finished)
    steps = [r for r in records if r["event"] == "step"]
    assert steps and all(isinstance(r["step_id"], int) for r in steps)
    for r in records:
        if r["event"].startswith(("request ", "request_")):  # lines about one request
            assert r.get("request_id"), r
    for worker in cluster.workers:
        wrecords = read_json_lines(worker.log_path)
        done = [r for r in wrecords if r["event"] == "step done"]
        assert done and all(isinstance(r["step_id"], int) for r in done)


def test_top_once_renders_a_frame(cluster):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler_svc.observability.top",
            "--target",
            cluster.address,
            "--once",
            "--width",
            "120",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    frame = out.stdout
    assert "KV blocks [" in frame and f"{2 * NUM_BLOCKS} total" in frame
    for needle in (
        "utilization",
        "fragmentation",
        "hit rate",
        "running 0",
        "waiting 0",
        "tokens/s",
        *(w.address for w in cluster.workers),
    ):
        assert needle in frame, needle
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler_svc.observability.top",
            "--target",
            "127.0.0.1:1",
            "--once",
            "--timeout",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "UNAVAILABLE" in bad.stdout
