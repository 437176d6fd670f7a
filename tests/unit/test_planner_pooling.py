"""Pooling requests in the planner against the fake worker: prefill-only rows
batched with generation in the same steps, chunked, prefix-cached (last-token
pooling; mean pooling reads nothing from the cache), never a slot past the
prompt, their blocks freed the step their prompt is done, and the embedding
made of the chunks' pooled vectors (mean: the sums added up) as the whole
prompt's would be; a yes/no reranker (--classifier-from-token) asks only the
chunk that ends its prompt to sample, for the logits there, and scores by its
two tokens'; audit() around every step."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.plan import RowPooling, StepSamples
from scheduler_svc.planning.planner import Planner, PlannerConfig
from scheduler_svc.planning.pooling import classifier_pooling, model_pooling
from scheduler_svc.request import PoolingKind, PoolingOptions, Request, SamplingOptions
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.planner_sim import BS, VOCAB, reference, req

_ids = iter(range(10_000, 10**9))


def hidden(context: list[int]) -> np.ndarray:
    """A fake last-layer state of the context's last position: order-sensitive."""
    n = len(context)
    return np.array([n, context[-1], sum((i + 1) * t for i, t in enumerate(context)) % 997, 1.0], dtype=np.float32)


def pooler(kind: PoolingKind, prompt: list[int], rid: str, **options) -> Request:
    return Request(rid, next(_ids), prompt, SamplingOptions(max_tokens=0), pooling=PoolingOptions(kind, **options))


def want(kind: PoolingKind, prompt: list[int], normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
    states = np.stack([hidden(prompt[: i + 1]) for i in range(len(prompt))]).astype(np.float64)
    v = states[-1] if kind is PoolingKind.LAST else states.mean(0)
    v = v[:dimensions] if dimensions else v
    return v / np.linalg.norm(v) if normalize else v


def fake_logits(context: list[int]) -> np.ndarray:
    """A fake logits row after the context: a function of all of it."""
    phase = (len(context) + sum((i + 1) * t for i, t in enumerate(context))) % 101
    return (6 * np.sin(np.arange(VOCAB) * 0.37 + phase)).astype(np.float32)


class PoolingWorker(FakeWorker):
    """The fake worker, answering pooling rows too (the chunk's last state, or its sum),
    and the logits of the rows that ask."""

    def __init__(self, prompts: dict[int, list[int]]):
        super().__init__(256, BS, VOCAB)
        self.prompts = prompts  # seq_id -> prompt

    def execute(self, plan, allowed=None) -> StepSamples:
        samples = super().execute(plan, allowed)
        for seq in plan.seqs:
            if seq.return_logits:
                prompt = self.prompts[seq.seq_id]
                assert seq.sample and seq.start_pos + seq.num_tokens == len(prompt), "logits not at the prompt's end"
                samples.logits[seq.seq_id] = fake_logits(prompt)
            if seq.pooling is RowPooling.NONE:
                continue
            assert not seq.sample, "a pooling row sampled"
            prompt, end = self.prompts[seq.seq_id], seq.start_pos + len(seq.token_ids)
            assert seq.token_ids == prompt[seq.start_pos : end]
            first = end - 1 if seq.pooling is RowPooling.LAST else seq.start_pos
            samples.pooled[seq.seq_id] = np.sum([hidden(prompt[: p + 1]) for p in range(first, end)], axis=0)
        return samples


def make(**config) -> Planner:
    config = {"max_model_len": 4096, "chunk_size": 16, "max_num_batched_tokens": 24} | config
    return Planner(PlannerConfig(**config), KVCacheManager(BlockPool(64, BS), BS, extra_keys=("m",)))


def drive(planner: Planner, worker: PoolingWorker) -> tuple[list, dict[str, list]]:
    plans, results = [], {}
    while planner.has_work():
        plan = planner.schedule()
        planner.audit()
        for seq in plan.seqs:  # never a slot past the prompt of a pooling request
            request = planner.requests[seq.request_id]
            if request.pooling is not None:
                assert len(planner.kv.block_table(seq.request_id)) == math.ceil((seq.start_pos + seq.num_tokens) / BS)
        updates = planner.update(plan, worker.execute(plan))
        planner.audit()
        plans.append(plan)
        for u in updates:
            results.setdefault(u.request_id, []).append(u)
    assert planner.kv.pool.num_used_blocks == 0
    return plans, results


@pytest.mark.parametrize("kind", [PoolingKind.LAST, PoolingKind.MEAN])
def test_pooling_rows_run_beside_generation_chunked_and_end_with_the_prompts_embedding(kind):
    rng = np.random.default_rng(0)
    prompt, gen_prompt = rng.integers(3, VOCAB, 45).tolist(), rng.integers(3, VOCAB, 7).tolist()
    planner = make()
    pooled, generating = pooler(kind, prompt, "p"), req("g", gen_prompt, max_tokens=6)
    worker = PoolingWorker({pooled.seq_id: prompt})
    planner.add(generating)
    planner.add(pooled)
    plans, results = drive(planner, worker)
    rows = [(plan.step_id, s) for plan in plans for s in plan.seqs if s.request_id == "p"]
    assert [s.num_tokens for _, s in rows] == [16, 16, 13] or sum(s.num_tokens for _, s in rows) == 45
    assert len(rows) >= 3  # chunked
    mixed = [p for p in plans if {s.request_id for s in p.seqs} == {"p", "g"}]
    assert any(s.sample for p in mixed for s in p.seqs if s.request_id == "g"), "no step decoded beside a pooling chunk"
    asks = [s.pooling for _, s in rows]
    if kind is PoolingKind.MEAN:
        assert asks == [RowPooling.SUM] * len(rows)
    else:
        assert asks == [RowPooling.NONE] * (len(rows) - 1) + [RowPooling.LAST]
    end = results["p"][-1]
    assert end.finished and end.token_id is None and end.embedding is not None
    assert [u.finished for u in results["p"]] == [False] * (len(results["p"]) - 1) + [True]
    np.testing.assert_allclose(end.embedding, want(kind, prompt), rtol=1e-6)
    g_tokens = [u.token_id for u in results["g"] if u.token_id is not None]
    assert g_tokens == reference(gen_prompt, 6)  # generation beside it is untouched


def test_last_token_pooling_reads_the_prefix_cache_and_mean_pooling_does_not():
    prompt = np.random.default_rng(1).integers(3, VOCAB, 40).tolist()
    planner = make()
    first, again, mean = (
        pooler(PoolingKind.LAST, prompt, "a"),
        pooler(PoolingKind.LAST, prompt, "b", dimensions=3),
        pooler(PoolingKind.MEAN, prompt, "c", normalize=False),
    )
    worker = PoolingWorker({r.seq_id: prompt for r in (first, again, mean)})
    planner.add(first)
    _, results = drive(planner, worker)
    planner.add(again)
    planner.add(mean)
    _, later = drive(planner, worker)
    assert (first.num_cached_prompt_tokens, again.num_cached_prompt_tokens, mean.num_cached_prompt_tokens) == (0, 32, 0)
    np.testing.assert_allclose(results["a"][-1].embedding, want(PoolingKind.LAST, prompt), rtol=1e-6)
    np.testing.assert_allclose(later["b"][-1].embedding, want(PoolingKind.LAST, prompt, dimensions=3), rtol=1e-6)
    np.testing.assert_allclose(later["c"][-1].embedding, want(PoolingKind.MEAN, prompt, normalize=False), rtol=1e-5)


def test_a_checkpoints_pooling_config(tmp_path):
    assert model_pooling(str(tmp_path)) == PoolingOptions(PoolingKind.LAST, normalize=True)  # no modules.json
    (tmp_path / "modules.json").write_text(
        '[{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},'
        ' {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]'
    )
    (tmp_path / "1_Pooling").mkdir()
    config = tmp_path / "1_Pooling" / "config.json"
    config.write_text('{"pooling_mode_lasttoken": true, "pooling_mode_mean_tokens": false}')
    assert model_pooling(str(tmp_path)) == PoolingOptions(PoolingKind.LAST, normalize=True)  # Qwen3-Embedding's
    config.write_text('{"pooling_mode_mean_tokens": true}')
    assert model_pooling(str(tmp_path)) == PoolingOptions(PoolingKind.MEAN, normalize=True)
    config.write_text('{"pooling_mode_cls_token": true}')
    with pytest.raises(ValueError, match=r"pooling modes \['cls_token'\] are not served"):
        model_pooling(str(tmp_path))


@pytest.mark.parametrize("argv,pooling", [([], False), (["--runner", "pooling"], True), (["--task", "embed"], True)])
def test_runner_flag_and_vllms_task_alias(argv, pooling):
    from scheduler_svc.config import SchedulerConfig
    from svc_common.cli import parse_config

    assert parse_config(SchedulerConfig, "PAGEDSERVE_SCHEDULER", "", argv).pooling_runner is pooling


NO, YES = 5, 9


def test_a_classifier_samples_only_its_prompts_last_chunk_and_scores_by_its_two_tokens():
    rng = np.random.default_rng(2)
    prompt, gen_prompt = rng.integers(3, VOCAB, 45).tolist(), rng.integers(3, VOCAB, 7).tolist()
    planner = make()
    options = {"normalize": False, "classifier_token_ids": (NO, YES)}
    first, again = (pooler(PoolingKind.CLASSIFY, prompt, rid, **options) for rid in ("s", "t"))
    generating = req("g", gen_prompt, max_tokens=6)
    worker = PoolingWorker({first.seq_id: prompt, again.seq_id: prompt})
    planner.add(generating)
    planner.add(first)
    plans, results = drive(planner, worker)
    rows = [s for plan in plans for s in plan.seqs if s.request_id == "s"]
    assert len(rows) >= 3 and sum(s.num_tokens for s in rows) == len(prompt)  # chunked, never a decode
    assert [(s.sample, s.return_logits, s.pooling) for s in rows] == [(False, False, RowPooling.NONE)] * (
        len(rows) - 1
    ) + [(True, True, RowPooling.NONE)]
    logits = fake_logits(prompt).astype(np.float64)
    score = math.exp(logits[YES]) / (math.exp(logits[YES]) + math.exp(logits[NO]))
    [end] = [u for u in results["s"] if u.finished]
    assert end.token_id is None and end.embedding == pytest.approx([score], rel=1e-12)
    assert [u.token_id for u in results["g"] if u.token_id is not None] == reference(gen_prompt, 6)
    planner.add(again)  # the same prompt again: read from the prefix cache, scored the same
    _, later = drive(planner, worker)
    assert again.num_cached_prompt_tokens == 32 and later["t"][-1].embedding == end.embedding


def test_classifier_tokens_are_one_token_each_or_refused_naming_the_flag():
    vocab = {"no": [NO], "yes": [YES], "maybe": [1, 2]}
    options = classifier_pooling("no,yes", vocab.__getitem__)
    assert options == PoolingOptions(PoolingKind.CLASSIFY, normalize=False, classifier_token_ids=(NO, YES))
    for flag, why in (("no,maybe", "'maybe' is 2 tokens"), ("yes", "two tokens"), ("no,yes,no", "two tokens")):
        with pytest.raises(ValueError, match=f"--classifier-from-token: .*{why}"):
            classifier_pooling(flag, vocab.__getitem__)


def test_the_classifier_flag_needs_the_pooling_runner(capsys):
    from scheduler_svc.config import SchedulerConfig
    from svc_common.cli import parse_config

    with pytest.raises(SystemExit):
        parse_config(SchedulerConfig, "PAGEDSERVE_SCHEDULER", "", ["--classifier-from-token", "no,yes"])
    assert "--classifier-from-token: must be with --runner pooling" in capsys.readouterr().err
    argv = ["--runner", "pooling", "--classifier-from-token", "no,yes"]
    assert parse_config(SchedulerConfig, "PAGEDSERVE_SCHEDULER", "", argv).classifier_from_token == "no,yes"
