"""pagedserve scheduler service: CPU-only planning over a paged KV cache.

Layers, imports pointing one way (tests/unit/test_layers.py): request.py (the
shared data class) < kv/ < planning/ < config.py < engine/ < api/; text/ beside
them; observability/ reads the engine and only __main__ imports it.
See docs/design.md, "Layout"."""
