"""Speculative decoding's scheduler side, pure Python and numpy (no torch): the
drafts (ngram.py: prompt lookup). The worker verifies
(worker_svc/sampling/verify.py); docs/design.md, speculative decoding."""
