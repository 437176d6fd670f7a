"""LoRA adapters in the scheduler: the registry of adapters requests may name (read and
checked without torch) and each worker's adapter slots (which adapter is resident where)."""
