"""Decode graphs (worker_svc/runner/cuda_graphs.py) and the one-copy step upload
(worker_svc/runner/batch.py, upload.py).

Without a GPU the graphs are "captured" through EagerReplay: the same ladder,
persistent buffer, padding and un-padding, with each replay running the forward
again. Those tests compare a worker with graphs against one without, step for
step, on the same checkpoint (fp32): tokens and logits must be identical. The
CUDA-only tests at the end (real CUDA graphs, no device sync in the forward) are
skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.worker_steps import Sampling, Seq, sampled, step_input
from worker_svc.config import WorkerConfig
from worker_svc.runner.batch import pad_decode, plan_batch
from worker_svc.runner.cuda_graphs import DecodeGraphs, Replay, batch_ladder, ladder_rung
from worker_svc.runner.upload import InputUploader, upload_batch
from worker_svc.runner.warm_up import compare_logits
from worker_svc.worker import Worker

BLOCK = 16
MAX_SEQS = 24  # ladder 1, 2, 4, 8, 16, 24


class EagerReplay:
    """A GraphBackend without graphs: each replay runs the forward again, over the
    same persistent buffers."""

    def capture(self, forward: Replay) -> Replay:
        forward()
        return forward


class CountingReplay(EagerReplay):
    """EagerReplay that counts captures and replays per batch size."""

    def __init__(self):
        self.captured: list[int] = []
        self.replays: list[int] = []

    def capture(self, forward):
        out = forward()
        size = out.shape[0]
        self.captured.append(size)

        def replay():
            self.replays.append(size)
            return forward()

        return replay


class WrongReplay(EagerReplay):
    """A capture whose replay gives other numbers than the forward it recorded."""

    def capture(self, forward):
        forward()
        return lambda: forward() * 1.5


def _worker(family="llama", **overrides) -> Worker:
    config = dict(model=str(tiny_checkpoint(family)), dtype="float32", num_blocks=96, max_num_seqs=MAX_SEQS)
    backend = overrides.pop("graph_backend", None)
    return Worker(WorkerConfig(**{**config, **overrides}), graph_backend=backend)


def _seq(seq_id, tokens, start, sample=True, from_previous=False):
    table = [seq_id * 3 + b for b in range(3)]  # 48 positions per sequence, blocks never shared
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + len(tokens))]
    return Seq(
        seq_id, tokens, start, table, slots, sample=sample, return_logits=sample, token_from_previous_step=from_previous
    )


def _prompt(seq_id: int, vocab: int) -> list[int]:
    rng = np.random.default_rng(seq_id)
    return rng.integers(3, vocab, size=int(rng.integers(3, 20))).tolist()


# --------------------------------------------------------------------------- ladder, padding, upload


@pytest.mark.parametrize(
    "max_num_seqs,ladder",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (256, [1, 2, 4, 8, *range(16, 257, 8)]),
    ],
)
def test_batch_ladder(max_num_seqs, ladder):
    assert batch_ladder(max_num_seqs) == ladder


def test_ladder_rung():
    ladder = batch_ladder(24)
    assert [ladder_rung(ladder, n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 24, 25)] == [1, 2, 4, 8, 8, 16, 16, 24, 24, None]


def test_pad_decode_rows_write_nowhere():
    seqs = [_seq(0, [5], 7), _seq(1, [9], 30, sample=False)]
    host = plan_batch(step_input(1, [], seqs))
    padded = pad_decode(host, 4, 10)
    assert padded.input_ids.tolist() == [5, 9, 0, 0] and padded.positions.tolist() == [7, 30, 0, 0]
    assert padded.slot_mapping.tolist() == [host.slot_mapping[0], host.slot_mapping[1], -1, -1]
    assert padded.decode.context_lens.tolist() == [8, 31, 1, 1]
    assert padded.decode.cu_query_lens.tolist() == [0, 1, 2, 3, 4]
    tables = padded.decode.block_tables
    assert tables.shape == (4, 10) and tables[:2, :3].tolist() == [[0, 1, 2], [3, 4, 5]] and not tables[:, 3:].any()
    assert not tables[2:].any()
    # Real rows keep their rows: what is sampled and what the graph returns first.
    assert padded.sample_rows.tolist() == host.sample_rows.tolist() == [0]


def test_step_inputs_cross_in_one_copy():
    """Every tensor of a mixed step (decodes, a prefill chunk, a reference to the
    previous step's sample, block copies) is a view of one uploaded buffer."""
    seqs = [_seq(0, [5], 7), _seq(1, [1, 2, 3], 0), _seq(2, [0], 12, from_previous=True)]
    host = plan_batch(step_input(2, [(40, 41), (42, 43)], seqs, previous_step_id=1), ref_sources=np.array([0]))
    batch = upload_batch(host, InputUploader(torch.device("cpu")))
    attention = batch.attention
    tensors = [batch.input_ids, batch.positions, attention.slot_mapping, batch.sample_rows, batch.copy_src]
    tensors.append(batch.copy_dst)
    for group in (attention.decode, attention.prefill):
        tensors += [group.block_tables, group.context_lens, group.cu_query_lens]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert batch.input_ids.tolist() == [5, 0, 1, 2, 3] and batch.input_ids.dtype == torch.int64
    assert (
        attention.decode.block_tables.tolist() == [[0, 1, 2], [6, 7, 8]]
        and attention.decode.block_tables.dtype == torch.int32
    )
    assert batch.copy_src.tolist() == [40, 42] and batch.copy_dst.tolist() == [41, 43]
    assert batch.sample_rows.tolist() == [0, 1, 4]
    # 16-byte aligned fields: the same pointer alignment for every field, every step.
    assert all(t.data_ptr() % 16 == 0 for t in tensors)


# --------------------------------------------------------------------------- graphs vs eager


def test_padded_graph_decode_is_eager_decode():
    """Decode steps of 1, 3 (padded to 4), 8, 9 and 17 (across the 8/16 and 16/24
    rungs) sequences, with block copies and references to the previous step's
    samples, through the graphs and eagerly: the same tokens, and the same logits:
    bit for bit where the batch fills its rung (1, 8: only the tables are padded,
    to the longest sequence served); within fp32 round-off where rows are padded
    (the CPU's GEMM picks its kernel by row count, so a row's sums change order
    with the batch size; cuBLAS does the same on a GPU)."""
    counting = CountingReplay()
    graphs, eager = _worker(graph_backend=counting), _worker()
    assert graphs.graphs_enabled and not eager.graphs_enabled
    assert sorted(counting.captured) == [1, 2, 4, 8, 16, 24]
    assert counting.replays == [4]  # the start-up check: 3 sequences padded to 4
    counting.replays.clear()
    vocab = graphs.info.vocab_size
    step_id = 0

    def run(seqs, copies=(), previous=None):
        nonlocal step_id
        step_id += 1
        step = step_input(step_id, list(copies), seqs, previous_step_id=previous)
        outs = [w.step(step) for w in (graphs, eager)]
        assert [t.token_id for t in sampled(outs[0])] == [t.token_id for t in sampled(outs[1])]
        padded = len(seqs) not in counting.captured and all(len(s.token_ids) == 1 for s in seqs)
        for a, b in zip(sampled(outs[0]), sampled(outs[1]), strict=True):
            assert a.seq_id == b.seq_id
            if padded:
                torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(a.logits, b.logits), (len(seqs), a.seq_id)
        assert outs[0].num_tokens == outs[1].num_tokens == sum(len(s.token_ids) for s in seqs)
        return {t.seq_id: t.token_id for t in sampled(outs[0])}

    for n in (1, 3, 8, 9, 17):
        ids = range(n)
        tokens = run([_seq(i, _prompt(i, vocab), 0) for i in ids])  # prefill: eager in both
        lens = {i: len(_prompt(i, vocab)) for i in ids}
        tokens = run([_seq(i, [tokens[i]], lens[i]) for i in ids])
        # Planned ahead: the inputs are the previous step's samples, resolved on the device.
        run([_seq(i, [0], lens[i] + 1, from_previous=True) for i in ids], previous=step_id)
    assert counting.replays == [1, 1, 4, 4, 8, 8, 16, 16, 24, 24]

    # A decode after copy-on-write: the copy lands before the graph reads it.
    seq = _seq(30, [7], 2)
    seq.block_table = [3 * 30 + 2, 1, 2]
    seq.slot_mapping = [(3 * 30 + 2) * BLOCK + 2]
    run([seq], copies=[(0, 3 * 30 + 2)])
    assert counting.replays[-1] == 1


@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {"kv_layout": "contiguous", "max_batch": 8}), ("llama", {"kv_dtype": "int8"}), ("gemma3", {})],
    ids=["contiguous", "int8", "gemma3-window"],
)
def test_graphs_over_other_caches(family, overrides):
    """The contiguous layout (one slot per sequence: a 1-wide table), a quantized
    cache (padding rows must not write scales either) and sliding-window layers:
    3 sequences padded to 4 decode as eager decodes them."""
    counting = CountingReplay()
    graphs, eager = _worker(family, graph_backend=counting, **overrides), _worker(family, **overrides)
    assert graphs.graphs_enabled
    vocab = graphs.info.vocab_size
    contiguous = overrides.get("kv_layout") == "contiguous"

    def seq(i, tokens, start):
        if not contiguous:
            return _seq(i, tokens, start)
        slots = [i * graphs.info.block_size + p for p in range(start, start + len(tokens))]
        return Seq(i, tokens, start, [i], slots, sample=True, return_logits=True)

    prompts = [_prompt(i, vocab) for i in range(3)]
    steps = [[seq(i, prompts[i], 0) for i in range(3)]]
    steps += [[seq(i, [11 + k], len(prompts[i]) + k) for i in range(3)] for k in range(3)]
    counting.replays.clear()
    for step_id, seqs in enumerate(steps, 1):
        outs = [w.step(step_input(step_id, [], seqs)) for w in (graphs, eager)]
        for a, b in zip(sampled(outs[0]), sampled(outs[1]), strict=True):
            assert (a.seq_id, a.token_id) == (b.seq_id, b.token_id)
            torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    assert counting.replays == [4, 4, 4]
    for tensor, other in zip(graphs.cache.tensors, eager.cache.tensors, strict=True):
        assert torch.equal(tensor != 0, other != 0)  # the padding rows wrote nothing


def test_batches_past_the_ladder_run_eager():
    counting = CountingReplay()
    graphs = _worker(graph_backend=counting, max_num_seqs=2, num_blocks=16)
    counting.replays.clear()
    vocab = graphs.info.vocab_size
    graphs.step(step_input(1, [], [_seq(i, _prompt(i, vocab), 0, sample=False) for i in range(3)]))
    graphs.step(step_input(2, [], [_seq(i, [5], len(_prompt(i, vocab))) for i in range(3)]))  # 3 > 2: eager
    graphs.step(step_input(3, [], [_seq(i, [5], len(_prompt(i, vocab)) + 1) for i in range(2)]))
    assert counting.replays == [2]


def test_start_up_check_falls_back_to_eager_with_one_warning():
    with capture_logs() as logs:
        worker = _worker(graph_backend=WrongReplay())
    assert not worker.graphs_enabled
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and "differs from eager" in warnings[0]["event"], warnings
    assert "logit difference" in warnings[0]["problem"]
    # It serves, eagerly, and the check left the cache as it found it.
    assert not worker.cache.k.any() and not worker.cache.v.any()
    eager = _worker()
    vocab = worker.info.vocab_size
    steps = [
        step_input(1, [], [_seq(0, _prompt(0, vocab), 0)]),
        step_input(2, [], [_seq(0, [4], len(_prompt(0, vocab)))]),
    ]
    for step in steps:
        a, b = worker.step(step), eager.step(step)
        assert torch.equal(sampled(a)[0].logits, sampled(b)[0].logits)


def test_enforce_eager_captures_nothing():
    counting = CountingReplay()
    worker = _worker(graph_backend=counting, enforce_eager=True)
    assert not worker.graphs_enabled and counting.captured == []


def test_compare_logits():
    eager = torch.tensor([[1.0, 5.0, 2.0], [3.0, 3.01, 0.0]])
    assert compare_logits(eager.clone(), eager, torch.float32) is None
    assert "logit difference" in compare_logits(eager + 0.1, eager, torch.float32)
    assert "not finite" in compare_logits(eager * float("nan"), eager, torch.float32)
    # bf16 tolerance 5e-2 x 5: row 1's near tie may flip, row 0's clear winner may not.
    flipped = eager.clone()
    flipped[1] = torch.tensor([3.01, 3.0, 0.0])
    assert compare_logits(flipped, eager, torch.bfloat16) is None
    flipped[0] = torch.tensor([1.0, 2.1, 2.2])
    assert compare_logits(flipped, eager, torch.bfloat16) is not None


def test_graph_covers_only_decode_only_batches_that_fit():
    graphs = DecodeGraphs(lambda batch: batch.input_ids, EagerReplay(), torch.device("cpu"), 4, table_width=3)
    decode = [_seq(i, [1], 5) for i in range(4)]
    assert graphs.covers(plan_batch(step_input(1, [], decode)))
    assert not graphs.covers(plan_batch(step_input(1, [], [*decode, _seq(9, [1], 5)])))  # 5 > 4
    assert not graphs.covers(plan_batch(step_input(1, [], [*decode[:3], _seq(9, [1, 2], 5)])))  # a prefill
    wide = _seq(9, [1], 5)
    wide.block_table = [1, 2, 3, 4]
    assert not graphs.covers(plan_batch(step_input(1, [], [wide])))
    assert not graphs.covers(plan_batch(step_input(1, [(1, 2)] * 5, decode)))  # more copies than room


# --------------------------------------------------------------------------- what a graph step uploads


def _grown_seq(seq_id, tokens, start, **extra):
    """_seq with the table cut to the blocks the context needs, as the scheduler sends it."""
    seq = _seq(seq_id, tokens, start, **extra)
    seq.block_table = seq.block_table[: -(-(start + len(tokens)) // BLOCK)]
    return seq


def test_graph_steps_send_only_the_table_entries_that_changed(monkeypatch):
    """Issue 27, fault 7: a graph's tables are as wide as max_model_len needs (here
    32 blocks), but a decode step sends only the entries that differ from what the
    persistent device table holds: none while no sequence grows a block, one when
    one does; the upload stays a few words per row, and the steps decode as eager."""
    counting = CountingReplay()
    graphs, eager = _worker(graph_backend=counting), _worker()
    table = graphs.runner.graphs.tables
    assert table.width == graphs.info.max_model_len // BLOCK == 32
    uploaded: list[int] = []
    changed: list[int] = []
    real_upload, real_changes = graphs.runner.graphs.uploader.upload, table.changes
    monkeypatch.setattr(
        graphs.runner.graphs.uploader,
        "upload",
        lambda arrays, into=None: (
            uploaded.append(sum(a.size * a.itemsize // 4 for a in arrays)) or real_upload(arrays, into)
        ),
    )
    monkeypatch.setattr(table, "changes", lambda t: (lambda r: changed.append(r[0].size) or r)(real_changes(t)))
    vocab = graphs.info.vocab_size
    lens = {0: 10, 1: 15, 2: 3}  # seq 1 fills its first block after one decode
    prompts = {i: _prompt(i, vocab)[:1] * lens[i] for i in lens}
    step_id = 1
    for w in (graphs, eager):
        w.step(step_input(step_id, [], [_grown_seq(i, prompts[i], 0) for i in lens]))
    counting.replays.clear()
    for k in range(3):
        step_id += 1
        seqs = [_grown_seq(i, [5 + k], lens[i] + k) for i in lens]
        outs = [w.step(step_input(step_id, [], seqs)) for w in (graphs, eager)]
        for a, b in zip(sampled(outs[0]), sampled(outs[1]), strict=True):
            assert (a.seq_id, a.token_id) == (b.seq_id, b.token_id)
            torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)  # 3 rows padded to 4: round-off
        rows = [list(s.block_table) for s in seqs]
        width = max(map(len, rows))
        for r, blocks in enumerate(rows):
            assert table.tensor[r, : len(blocks)].tolist() == blocks == table.mirror[r, : len(blocks)].tolist()
        assert table.tensor[: len(rows), :width].tolist() == table.mirror[: len(rows), :width].tolist()
    assert counting.replays == [4, 4, 4]
    # Step 1 brings the rows' tables (the start-up check left others there); step 2 only
    # seq 1's second block (position 16); step 3 nothing.
    assert changed[1:] == [1, 0] and changed[0] > 0
    assert max(uploaded[-2:]) < 4 * table.width  # less than the 4 rows' padded tables alone


def test_logprob_indices_ride_in_the_steps_one_upload(monkeypatch):
    """Issue 27, fault 8: the rows that want alternatives, the prompt-logprob
    targets and rows reach the device in the step's one upload, eager (a prefill
    asking prompt logprobs) and through a graph (decodes asking alternatives, a
    1-token chunk asking its prompt logprob): the sampler never copies an index
    array itself, and the results are those of a runner that lets it."""
    from worker_svc.runner.upload import InputUploader
    from worker_svc.sampling.params import LogprobIndices

    graphs, eager = _worker(graph_backend=CountingReplay()), _worker()
    vocab = graphs.info.vocab_size
    prompt = _prompt(3, vocab)
    asking = Sampling(top_logprobs=3)

    def steps():
        first = _seq(0, prompt, 0)
        first.sampling, first.prompt_logprob_targets, first.prompt_top_logprobs = asking, prompt[1:], 2
        yield step_input(1, [], [first, _seq(1, prompt[:5], 0)])
        decodes = [_seq(0, [9], len(prompt)), _seq(1, [9], 5), _seq(2, [4], 0)]
        decodes[0].sampling = asking
        decodes[2].prompt_logprob_targets, decodes[2].prompt_top_logprobs = [6], 1
        yield step_input(2, [], decodes)

    results = {}
    for name, worker in (("eager", eager), ("graphs", graphs)):
        results[name] = [worker.step(step) for step in steps()]
    monkeypatch.setattr(LogprobIndices, "of", classmethod(lambda cls, *a: pytest.fail("a separate index copy")))
    calls = []
    real = InputUploader.upload
    monkeypatch.setattr(InputUploader, "upload", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    for name, worker in (("eager once more", _worker()), ("graphs once more", _worker(graph_backend=CountingReplay()))):
        calls.clear()
        outs = [worker.step(step) for step in steps()]
        assert len(calls) == 2, name  # one upload per step
        for out, want in zip(outs, results["eager"]):
            assert [t.token_id for t in sampled(out)] == [t.token_id for t in sampled(want)]
            for got, expected in zip(sampled(out), sampled(want)):
                assert got.top_token_ids == expected.top_token_ids
                np.testing.assert_allclose(got.top_logprobs, expected.top_logprobs, atol=1e-5)
            for got, expected in zip(out.prompt_logprobs, want.prompt_logprobs, strict=True):
                np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-5)
                assert got.top_token_ids.tolist() == expected.top_token_ids.tolist()
    assert [len(o.prompt_logprobs) for o in results["graphs"]] == [1, 1]
    assert len(sampled(results["graphs"][1])[0].top_token_ids) == 3


# --------------------------------------------------------------------------- CUDA only

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_match_eager_on_cuda(dtype):
    """Real CUDA graphs: captured at start, checked, and the same greedy tokens as
    an --enforce-eager worker over a few decode steps."""
    common = dict(model=str(tiny_checkpoint("llama")), dtype=dtype, num_blocks=96, max_num_seqs=8, device="cuda")
    graphs, eager = Worker(WorkerConfig(**common)), Worker(WorkerConfig(**common, enforce_eager=True))
    assert graphs.graphs_enabled and not eager.graphs_enabled
    vocab = graphs.info.vocab_size
    tokens = {w: {} for w in (graphs, eager)}
    for w in (graphs, eager):
        out = w.step(step_input(1, [], [_seq(i, _prompt(i, vocab), 0) for i in range(3)]))
        tokens[w] = {t.seq_id: [t.token_id] for t in sampled(out)}
        for k in range(5):
            seqs = [_seq(i, [tokens[w][i][-1]], len(_prompt(i, vocab)) + k) for i in range(3)]
            for t in sampled(w.step(step_input(2 + k, [], seqs))):
                tokens[w][t.seq_id].append(t.token_id)
    assert tokens[graphs] == tokens[eager]


@cuda
def test_decode_forward_does_not_sync_on_cuda():
    """The eager decode forward (what the graphs capture) makes no device sync."""
    worker = Worker(WorkerConfig(model=str(tiny_checkpoint("gemma3")), dtype="bfloat16", num_blocks=96, device="cuda"))
    vocab = worker.info.vocab_size
    worker.step(step_input(1, [], [_seq(i, _prompt(i, vocab), 0) for i in range(3)]))
    step = step_input(2, [], [_seq(i, [5], len(_prompt(i, vocab))) for i in range(3)])
    runner = worker.runner
    _, batch, _ = runner._prepare(step, None, None, use_graphs=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            runner.forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
