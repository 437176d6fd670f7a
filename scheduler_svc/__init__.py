"""pagedserve scheduler service: CPU-only planning over a paged KV cache."""
