"""Every metric name the scheduler's /metrics endpoint serves, with its help
text (histograms also serve _bucket/_count/_sum, counters _total and _created,
info metrics _info). Names follow the Prometheus conventions: `pagedserve_`
prefix, base units (seconds, bytes), `_total` for counters, `_ratio` for 0..1
fractions. Documented in docs/guide/operations.md.

VLLM_METRIC_NAMES are vLLM's own names and meanings (vllm/v1/metrics/loggers.py),
for routers and autoscalers that read them (the Gateway API Inference
Extension, llm-d): per worker with labels `model_name` and `engine` (the
worker's address; vLLM numbers its data-parallel engines), the request
histograms engine-wide with `model_name` (a request can move between workers)."""

from __future__ import annotations

METRIC_NAMES = {
    # block pool (gauges per worker; state = in_use | cached_free | free, which partition the pool)
    "pagedserve_kv_cache_capacity_blocks": "KV blocks in the worker's pool",
    "pagedserve_kv_cache_blocks": "KV blocks by state: in_use (ref > 0), cached_free (free, still a prefix hit), "
    "free (free, empty); they sum to the capacity",
    "pagedserve_kv_cache_pinned_blocks": "blocks held by pinned prefixes",
    "pagedserve_kv_cache_utilization_ratio": "blocks in use / capacity",
    "pagedserve_kv_cache_fragmentation_ratio": "internal fragmentation: unused token slots in blocks in use / "
    "their slots (each block once)",
    "pagedserve_kv_cache_allocated_slots": "token slots of the blocks in use (blocks in use x block size)",
    "pagedserve_kv_cache_unused_slots": "token slots of blocks in use that hold no token",
    "pagedserve_kv_cache_tokens": "tokens live requests' block tables cover",
    "pagedserve_kv_blocks_allocated_total": "blocks taken from the free queue (new allocations and cached-free "
    "blocks revived by a prefix hit)",
    "pagedserve_kv_blocks_freed_total": "blocks returned to the free queue",
    "pagedserve_kv_evictions_total": "allocations that reclaimed cached-free blocks",
    "pagedserve_kv_blocks_reclaimed_total": "cached-free blocks reclaimed (their prefix-cache entry dropped)",
    # prefix cache
    "pagedserve_prefix_cache_queries_total": "admissions that looked up the prefix index",
    "pagedserve_prefix_cache_query_tokens_total": "prompt tokens those lookups covered",
    "pagedserve_prefix_cache_hit_tokens_total": "prompt tokens found cached",
    "pagedserve_prefix_cache_hit_ratio": "hit tokens / query tokens since start",
    # the second KV tier (--kv-offload-gb; 0 without one)
    "pagedserve_kv_offload_capacity_blocks": "blocks of the worker's second KV tier",
    "pagedserve_kv_offload_cached_blocks": "second-tier blocks holding a copy of an evicted cached block",
    "pagedserve_kv_offload_hit_tokens_total": "prompt tokens found in the second tier (copied up, not computed); "
    "tier 1's hits are pagedserve_prefix_cache_hit_tokens_total minus these",
    "pagedserve_kv_offload_bytes_total": "bytes copied between the tiers, by direction (offload: down, onload: up)",
    "pagedserve_kv_offload_seconds_total": "the worker's time copying between the tiers, by direction",
    # scheduling
    "pagedserve_requests_running": "requests running (holding blocks)",
    "pagedserve_requests_waiting": "requests queued",
    "pagedserve_preemptions_total": "running requests preempted for lack of blocks",
    "pagedserve_steps_total": "engine steps run",
    "pagedserve_prefill_tokens_total": "tokens computed in prefill chunks (recomputation included)",
    "pagedserve_decode_tokens_total": "tokens computed by decodes",
    "pagedserve_prompt_tokens_total": "prompt tokens of the requests received",
    "pagedserve_generation_tokens_total": "tokens generated",
    "pagedserve_requests_finished_total": "requests ended, by finish_reason (stop, length, abort, error)",
    "pagedserve_step_duration_seconds": "wall time of one engine step (the Step RPC included)",
    "pagedserve_step_tokens": "tokens computed per step",
    "pagedserve_prefill_chunk_duration_seconds": "time of the step that computed a prefill chunk, per chunk",
    # speculative decoding (--speculative-method)
    "pagedserve_spec_decode_drafts_total": "decodes that carried drafts",
    "pagedserve_spec_decode_draft_tokens_total": "draft tokens sent for verification",
    "pagedserve_spec_decode_accepted_tokens_total": "draft tokens the worker accepted",
    "pagedserve_spec_decode_acceptance_ratio": "accepted / drafted tokens since start",
    # prefill/decode disaggregation (engine/disagg.py): per worker moved into, direction=prefill_to_decode
    "pagedserve_kv_handoffs_total": "requests moved from a prefill worker to a decode worker after their first token",
    "pagedserve_kv_transfer_bytes_total": "KV bytes moved between workers",
    "pagedserve_kv_transfer_blocks_total": "KV blocks moved between workers",
    "pagedserve_kv_transfer_blocks_skipped_total": "KV blocks not moved: the decode worker's prefix cache held them",
    "pagedserve_kv_transfer_seconds_total": "wall time of the successful transfers, summed",
    "pagedserve_kv_transfers_failed_total": "transfers that failed (the request recomputed its prompt)",
    "pagedserve_kv_transfer_queue_depth": "transfers under way",
    # latency
    "pagedserve_time_to_first_token_seconds": "request arrival to its first generated token",
    "pagedserve_inter_token_latency_seconds": "time between two tokens of one request",
    "pagedserve_e2e_request_latency_seconds": "request arrival to its last token (stop and length)",
    # workers
    "pagedserve_worker_forward_duration_seconds": "the worker's forward time per step (from Step timings)",
    "pagedserve_worker_kv_cache_bytes_per_token": "KV bytes per token, all layers, K and V, scales included",
    "pagedserve_worker_kv_cache_bytes": "bytes of the worker's KV pool",
    "pagedserve_worker_healthy": "1 while the worker answers",
    "pagedserve_worker_weights_bytes": "bytes the worker's model weights hold in its memory, as served",
    "pagedserve_worker_info": "worker identity: device, model, dtype, weight_format, kv_dtype (value 1)",
}

VLLM_METRIC_NAMES = {
    # gauges per worker
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    # counters per worker
    "vllm:prefix_cache_queries_total": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits_total": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:num_preemptions_total": "Cumulative number of preemption from the engine.",
    "vllm:prompt_tokens_total": "Number of prefill tokens processed.",
    "vllm:generation_tokens_total": "Number of generation tokens processed.",
    "vllm:spec_decode_num_drafts_total": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens_total": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens_total": "Number of accepted tokens.",
    # request histograms
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
}

# Served only with --enable-lora (observability/lora_metrics.py); the vLLM one per worker,
# the adapters running and waiting in comma-separated labels.
LORA_METRIC_NAMES = {
    "pagedserve_lora_requests_running": "running requests per LoRA adapter",
    "pagedserve_lora_requests_waiting": "queued requests per LoRA adapter (waiting for a slot included)",
    "pagedserve_lora_adapter_resident": "1 for each adapter resident in one of the worker's slots",
    "pagedserve_lora_adapter_loads_total": "adapters loaded into the worker's slots",
    "pagedserve_lora_adapter_evictions_total": "adapters evicted from a slot for another",
    "pagedserve_lora_adapter_load_seconds_total": "time spent loading adapters onto the worker (the RPC included)",
    "vllm:lora_requests_info": "Running stats on lora requests.",
}
