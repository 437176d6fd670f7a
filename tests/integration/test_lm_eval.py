"""lm-evaluation-harness scores a multiple-choice task through the gateway
(`local-completions`: echo + logprobs, the way it scores HellaSwag, ARC, MMLU)
exactly as its own `hf` backend scores the same float32 checkpoint in-process.

The task and its data ship in tests/data/lm_eval_tiny_mc (nothing is
downloaded; the hub is off)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import Cluster

TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval_tiny_mc"
TASK = "pagedserve_tiny_mc"
LOGPROB_ATOL = 1e-3


@pytest.fixture()
def offline(monkeypatch, tmp_path):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def evaluate(model: str, model_args: dict) -> tuple[dict, list[dict]]:
    """(metrics, per-document samples) of one lm-eval run on the shipped task."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        batch_size=1,
        log_samples=True,
        bootstrap_iters=0,
    )
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return out["results"][TASK], samples


def loglikelihoods(samples: list[dict]) -> list[list[float]]:
    """Per document, the loglikelihood lm-eval got for each choice."""
    return [[resp[0][0] for resp in s["resps"]] for s in samples]


def test_local_completions_scores_like_the_hf_backend(offline):
    model_dir = tiny_checkpoint("llama")
    hf_metrics, hf_samples = evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"})
    with Cluster(
        model_dir, ["--dtype", "float32", "--num-blocks", "128"], ["--max-model-len", "256"], gateway=True
    ) as c:
        api_metrics, api_samples = evaluate(
            "local-completions",
            {
                "model": model_dir.name,
                "base_url": f"{c.gateway_url}/v1/completions",
                "tokenizer_backend": "huggingface",
                "tokenizer": str(model_dir),
                "tokenized_requests": True,  # token ids go over the wire: lm-eval's context split is kept
                "max_length": 256,
                "num_concurrent": 1,
                "max_retries": 1,
            },
        )
    assert len(hf_samples) == len(api_samples) == 16
    assert [s["doc_id"] for s in api_samples] == [s["doc_id"] for s in hf_samples]
    want, got = loglikelihoods(hf_samples), loglikelihoods(api_samples)
    assert all(len(w) == len(g) == 4 for w, g in zip(want, got))
    worst = max(abs(a - b) for w, g in zip(want, got) for a, b in zip(w, g))
    assert worst < LOGPROB_ATOL, worst
    greedy = [[resp[0][1] for resp in s["resps"]] for s in hf_samples]
    assert [[resp[0][1] for resp in s["resps"]] for s in api_samples] == greedy
    for metric in ("acc,none", "acc_norm,none"):
        assert api_metrics[metric] == hf_metrics[metric], metric
