"""KV memory bookkeeping for one worker: the block pool and its free queue,
the prefix hash index, ref counts, copy-on-write, pinning, and contiguous-slot
accounting. Pure Python, no I/O; imports only scheduler_svc.request."""
