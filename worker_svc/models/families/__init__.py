"""One module per family; importing this package registers them all (registry.py)."""

from worker_svc.models.families import gemma, granite, llama, mistral, moe, olmo2, phi3, qwen

__all__ = ["gemma", "granite", "llama", "mistral", "moe", "olmo2", "phi3", "qwen"]
