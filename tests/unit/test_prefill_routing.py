"""Prefill routing (--prefill-attention): chunks that start at position 0 may go
to torch SDPA over their own K/V instead of the paged prefill op. On CPU the SDPA
route must give the reference op's result (kernels/reference.py, the oracle),
and the worker the same tokens either way."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kernels import quant, reference
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.worker_steps import Seq, sampled, step_input
from worker_svc.attention import cache_attention
from worker_svc.attention import prefill_route as route_module
from worker_svc.attention.backend import BACKENDS
from worker_svc.attention.prefill_route import PREFILL_ATTENTION, fresh_prefill_attention, prefill_route, sdpa_takes
from worker_svc.config import WorkerConfig
from worker_svc.runner.batch import plan_batch
from worker_svc.worker import Worker

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_prefill_route():
    assert prefill_route("auto", CUDA, "triton") == "sdpa"
    assert prefill_route("auto", CUDA, "torch") == "paged"
    assert prefill_route("auto", CPU, "torch") == "paged"
    assert prefill_route("auto", CPU, "triton") == "paged"
    assert prefill_route("sdpa", CPU, "torch") == "sdpa"
    assert prefill_route("paged", CUDA, "triton") == "paged"
    with pytest.raises(ValueError, match="prefill attention"):
        prefill_route("flash", CUDA, "triton")


def test_sdpa_takes_only_what_it_computes_exactly():
    f32, bf16 = torch.float32, torch.bfloat16
    assert sdpa_takes(bf16, bf16, 0, 4000)
    assert not sdpa_takes(quant.FP8_DTYPE, bf16, 0, 10)  # the paged op reads dequantized values
    assert not sdpa_takes(torch.int8, f32, 0, 10)
    assert not sdpa_takes(torch.float16, bf16, 0, 10)  # a narrower cache rounds K/V
    assert sdpa_takes(bf16, bf16, 512, 512)  # the window hides nothing inside the chunk
    assert not sdpa_takes(bf16, bf16, 512, 513)


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_fresh_prefill_attention_matches_the_reference(q_heads, kv_heads):
    """Chunks of 1, 17 and 40 tokens written into a paged cache: the reference op
    reading them back and SDPA over the chunks' own K/V agree."""
    query_lens, head_dim, block = (17, 1, 40), 16, 16
    g = torch.Generator().manual_seed(0)
    total = sum(query_lens)
    query = torch.randn(total, q_heads, head_dim, generator=g)
    key = torch.randn(total, kv_heads, head_dim, generator=g)
    value = torch.randn(total, kv_heads, head_dim, generator=g)
    k_cache = torch.zeros(16, kv_heads, block, head_dim)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[3, 9, 0], [5, 0, 0], [1, 7, 12]], dtype=torch.int32)
    slots = torch.cat(
        [
            torch.tensor([int(tables[s, p // block]) * block + p % block for p in range(n)])
            for s, n in enumerate(query_lens)
        ]
    )
    reference.write_kv(key, value, k_cache, v_cache, slots)
    cu = torch.tensor([0, 17, 18, 58], dtype=torch.int32)
    ctx = torch.tensor(query_lens, dtype=torch.int32)
    expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, 0.3)
    out = fresh_prefill_attention(query, key, value, cu, query_lens, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


class FakeVarlen:
    """torch.nn.attention.varlen.varlen_attn as a given torch release spells it,
    computed per chunk with SDPA from the cumulative lengths it is given."""

    def __init__(self, causal_keyword: str):
        self.calls: list[tuple[list[int], int]] = []
        self.causal_keyword = causal_keyword

    def attn_2_11(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                  window_size=(-1, -1)):  # fmt: skip
        assert window_size == (-1, 0), "not causal"
        return self._run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)

    def attn_2_10(
        self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None, scale=None
    ):
        assert is_causal
        return self._run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)

    def _run(self, query, key, value, cu_q, cu_k, max_q, max_k, scale):
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        bounds = cu_q.tolist()
        lens = [b - a for a, b in zip(bounds, bounds[1:])]
        assert bounds[0] == 0 and bounds[-1] == query.shape[0] and max_q == max_k == max(lens)
        self.calls.append((bounds, max_q))
        out = torch.empty_like(query)
        for a, b in zip(bounds, bounds[1:]):
            q, k, v = (t[a:b].transpose(0, 1)[None] for t in (query, key, value))
            gqa = q.shape[1] != k.shape[1]
            out[a:b] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)[
                0
            ].transpose(0, 1)
        return out

    @property
    def attn(self):
        return self.attn_2_11 if self.causal_keyword == "window_size" else self.attn_2_10


@pytest.fixture
def fake_varlen(monkeypatch, request):
    """varlen_attn faked (as torch 2.11 spells it, or 2.10 with param 'is_causal'),
    and taken on CPU fp32 as on a GPU in bf16."""
    from torch.nn.attention import varlen

    fake = FakeVarlen(getattr(request, "param", "window_size"))
    monkeypatch.setattr(varlen, "varlen_attn", fake.attn)
    monkeypatch.setattr(route_module, "varlen_takes", lambda query: True)
    route_module.varlen_attention.cache_clear()
    yield fake
    route_module.varlen_attention.cache_clear()


@pytest.mark.parametrize("fake_varlen", ["window_size", "is_causal"], indirect=True)
def test_fresh_chunks_take_one_varlen_call(fake_varlen):
    """Issue 27, fault 6: every fresh chunk of a step in one varlen call (not one
    SDPA call per chunk per layer), its cumulative lengths and longest chunk as
    the batch says, the result the per-chunk one."""
    query_lens = (17, 1, 40)
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(58, heads, 16, generator=g) for heads in (8, 2, 2))
    cu = torch.tensor([0, 17, 18, 58], dtype=torch.int32)
    out = fresh_prefill_attention(query, key, value, cu, query_lens, 0.3)
    assert fake_varlen.calls == [([0, 17, 18, 58], 40)]
    torch.testing.assert_close(out, _per_chunk(query, key, value, query_lens, 0.3))


def _per_chunk(query, key, value, query_lens, scale):
    out, start = [], 0
    for n in query_lens:
        q, k, v = (t[start : start + n].transpose(0, 1)[None] for t in (query, key, value))
        out.append(
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
        )
        start += n
    return torch.cat(out)


def test_no_varlen_in_this_torch_means_per_chunk_sdpa(monkeypatch):
    from torch.nn.attention import varlen

    def without_scale(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
        raise AssertionError("never called: it cannot take the model's scale")

    monkeypatch.setattr(varlen, "varlen_attn", without_scale)
    route_module.varlen_attention.cache_clear()
    try:
        assert route_module.varlen_attention() is None
        assert not route_module.varlen_takes(torch.zeros(4, 2, 16, dtype=torch.bfloat16))
    finally:
        route_module.varlen_attention.cache_clear()


def test_the_worker_runs_one_varlen_call_per_layer(fake_varlen):
    """Two fresh prompts and a continued chunk in one step through the worker:
    one varlen call per layer (the tiny llama has 2), over both prompts, and the
    paged route's tokens and logits."""
    model = str(tiny_checkpoint("llama"))
    workers = {
        route: Worker(WorkerConfig(model=model, dtype="float32", num_blocks=64, prefill_attention=route))
        for route in ("paged", "sdpa")
    }
    vocab = workers["paged"].info.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (30, 21, 9)]

    def seq(i, tokens, start):
        table = [4 * i + b for b in range(4)]
        slots = [table[p // 16] * 16 + p % 16 for p in range(start, start + len(tokens))]
        return Seq(i, tokens, start, table, slots, sample=True, return_logits=True)

    first = step_input(1, [], [seq(2, prompts[2][:4], 0)])
    second = step_input(2, [], [seq(0, prompts[0], 0), seq(1, prompts[1], 0), seq(2, prompts[2][4:], 4)])
    for step in (first, second):
        fake_varlen.calls.clear()
        outs = {route: w.step(step) for route, w in workers.items()}
        for a, b in zip(sampled(outs["sdpa"]), sampled(outs["paged"]), strict=True):
            assert (a.seq_id, a.token_id) == (b.seq_id, b.token_id)
            torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    assert fake_varlen.calls == [([0, 30, 51], 30)] * 2


def test_plan_batch_orders_fresh_chunks_after_decodes():
    def seq(i, n, start):
        return Seq(i, list(range(1, n + 1)), start, [i], [i * 64 + start + k for k in range(n)], sample=True)

    step = step_input(1, [], [seq(0, 5, 10), seq(1, 1, 7), seq(2, 3, 0), seq(3, 4, 0)])
    host = plan_batch(step, split_fresh=True)
    assert step.seqs.seq_ids[host.order].tolist() == [1, 2, 3, 0]
    assert [len(g.context_lens) for g in (host.decode, host.fresh, host.prefill)] == [1, 2, 1]
    assert host.fresh.cu_query_lens.tolist() == [0, 3, 7]
    assert host.sample_rows.tolist() == [0, 3, 7, 12]
    merged = plan_batch(step)
    assert merged.fresh is None and len(merged.prefill.context_lens) == 3


@pytest.mark.parametrize(
    "family,kv_dtype,sdpa_layers",
    [("llama", "auto", 2), ("gemma3", "auto", 1), ("llama", "int8", 0)],
    ids=["llama", "gemma3-window", "llama-int8"],
)
def test_worker_routes_fresh_chunks(monkeypatch, family, kv_dtype, sdpa_layers):
    """A step with two fresh chunks (one the first of a chunked prompt), then one
    with a decode, two fresh prompts and a continued chunk, then a decode step:
    --prefill-attention sdpa gives paged's tokens and logits (fp32), and SDPA runs
    once per prefill step in each layer where it is exact: both llama layers; only
    Gemma3's full-attention layer (its three sliding layers' 8-token window is
    shorter than the prompts); never over an INT8 cache."""
    calls = []
    real = cache_attention.fresh_prefill_attention
    monkeypatch.setattr(cache_attention, "fresh_prefill_attention", lambda *a: calls.append(1) or real(*a))
    model = str(tiny_checkpoint(family))
    workers = {
        route: Worker(
            WorkerConfig(model=model, dtype="float32", kv_dtype=kv_dtype, num_blocks=64, prefill_attention=route)
        )
        for route in ("paged", "sdpa")
    }
    assert workers["sdpa"].runner.prefill_route == "sdpa" and workers["paged"].runner.prefill_route == "paged"
    vocab = workers["paged"].info.vocab_size

    def seq(i, tokens, start):
        table = [4 * i + b for b in range(4)]
        slots = [table[p // 16] * 16 + p % 16 for p in range(start, start + len(tokens))]
        return Seq(i, tokens, start, table, slots, sample=True, return_logits=True)

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (12, 30, 21, 9)]
    steps = [
        step_input(1, [], [seq(0, prompts[0], 0), seq(3, prompts[3][:4], 0)]),
        step_input(2, [], [seq(0, [5], 12), seq(1, prompts[1], 0), seq(2, prompts[2], 0), seq(3, prompts[3][4:], 4)]),
        step_input(3, [], [seq(0, [7], 13), *(seq(i, [7], len(prompts[i])) for i in (1, 2, 3))]),
    ]
    per_step = []
    for step in steps:
        calls.clear()
        outs = {route: w.step(step) for route, w in workers.items()}
        per_step.append(len(calls))
        for a, b in zip(sampled(outs["sdpa"]), sampled(outs["paged"]), strict=True):
            assert (a.seq_id, a.token_id) == (b.seq_id, b.token_id)
            torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    assert per_step == [sdpa_layers, sdpa_layers, 0]


def test_the_flags_offer_what_the_worker_has():
    fields = {f.name: f for f in dataclasses.fields(WorkerConfig)}
    assert fields["attention_backend"].metadata["choices"] == ("auto", *BACKENDS)
    assert fields["prefill_attention"].metadata["choices"] == PREFILL_ATTENTION


def test_worker_flag_validation():
    with pytest.raises(ValueError, match="--max-num-seqs"):
        WorkerConfig(model=str(tiny_checkpoint("llama")), max_num_seqs=0).validate()
