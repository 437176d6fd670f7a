"""Token sampling on the logits' device: what to sample (params.py), the sampler
(sampler.py: greedy, temperature, top-k/top-p, seeded noise; logits_processing.py:
blocked ids, bias, penalties), prompt-logprob rows (prompt_logprobs.py) and the
one packed tensor every result comes back in (packed.py, with `TokenSampler`,
the protocol the model runner samples through)."""
