"""Attention over the KV cache: the backends' one typed interface and their
registry (backend.py), the cache layouts that own the K/V tensors and bind a
backend's ops to their layout (kv_cache.py), the per-step metadata attention
reads (metadata.py), and the callable the decoder runs per layer
(cache_attention.py), with the SDPA route for fresh prefill chunks
(prefill_route.py). Imports nothing of worker_svc."""
