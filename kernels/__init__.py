"""Attention and KV-cache math: pure-torch reference ops (the test oracle) and,
beside them with the same signatures, the Triton kernels."""
