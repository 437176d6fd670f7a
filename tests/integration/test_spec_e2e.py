"""Speculative decoding through real processes over gRPC (fp32): a scheduler with
--speculative-method ngram in front of a worker gives every greedy request exactly the
tokens transformers' greedy decoding gives, and exactly those of the same request
opted out (no_speculation), in both scheduling modes, with stop strings and
max_tokens inside accepted runs; greedy requests with penalties, logit bias and
min_tokens draft and still get transformers' tokens under the same processing;
seeded sampled requests draft and get the same tokens run after run (and those
of their plain decoding); every block comes back (the engine's audit, the
pool's counters). On text that copies its prompt, drafts are accepted and the
request takes fewer steps."""

from __future__ import annotations

import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from scheduler_svc.client import SchedulerClient
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import SPEC_FLAGS, assert_pool_clean, hf_greedy, load_model, scheduler_of, wait_idle
from tests.helpers.logprob_reference import reference_greedy
from tests.helpers.procs import Cluster, ServiceProcess, free_port
from tests.helpers.sweeps import sweep

MODES = {"async": [], "sync": ["--no-async-scheduling"]}
# Small steps and pool: drafts compete with prefill chunks for the budget, and requests wait.
SCHEDULER = ["--max-num-batched-tokens", "48", "--chunk-size", "32", "--max-num-seqs", "8", *SPEC_FLAGS]


def spec_totals(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("pagedserve_spec_decode_") and s.name.endswith("_total"):
                totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


@pytest.fixture(scope="module")
def llama_worker():
    """The tiny llama's worker, 24 blocks, for the tests of this module that use it, each
    with a scheduler of its own (one at a time; none knows the blocks another left)."""
    args = ["--model", str(tiny_checkpoint("llama")), "--dtype", "float32", "--num-blocks", "24"]
    with ServiceProcess("worker_svc", args) as proc:
        yield proc


@pytest.mark.parametrize("mode", sweep(MODES, keep=["async"]))  # sync: make test-slow
def test_tiny_model_tokens_are_exact_with_speculation(mode, llama_worker):
    """A random model rarely agrees with a lookup, so most drafts are rejected: the
    rejection paths (trim, no indexing of rejected positions) under load."""
    model_dir = tiny_checkpoint("llama")
    ref = load_model(model_dir)
    rng = random.Random(3)
    cases = []
    for _ in range(10):
        motif = [rng.randrange(4, 700) for _ in range(rng.randrange(3, 9))]
        cases.append((motif * rng.randrange(2, 6) + motif[: rng.randrange(0, 3)], rng.randrange(4, 30)))
    port = free_port()
    flags = [*SCHEDULER, *MODES[mode], "--metrics-port", str(port)]
    with scheduler_of(model_dir, [llama_worker], *flags) as (scheduler, client):

        def run(case, opt_out):
            ids, n = case
            return client.generate(
                prompt_token_ids=ids, max_tokens=n, temperature=0.0, no_speculation=opt_out, timeout=120
            )

        with ThreadPoolExecutor(len(cases)) as pool:
            spec = list(pool.map(lambda c: run(c, False), cases))
        with ThreadPoolExecutor(len(cases)) as pool:
            plain = list(pool.map(lambda c: run(c, True), cases))
        for (ids, n), got, want in zip(cases, spec, plain):
            assert got.token_ids == want.token_ids == hf_greedy(ref, ids, n)
            assert got.completion_tokens == want.completion_tokens
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)  # accepted drafts' too
        totals = spec_totals(f"http://127.0.0.1:{port}/metrics")
        assert totals["pagedserve_spec_decode_drafts_total"] > 0
        assert_pool_clean(client, scheduler)


def test_a_copying_prompt_accepts_drafts_in_fewer_steps(default_model):
    """SmolLM2 asked to repeat a sentence: the lookup finds it in the prompt."""
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    text = "The quick brown fox jumps over the lazy dog near the river bank, while the old farmer watches."
    chat = [{"role": "user", "content": f"Repeat this sentence exactly: {text}"}]
    prompt = tokenizer(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))["input_ids"]
    port = free_port()
    cluster = Cluster(
        default_model, ["--dtype", "float32", "--num-blocks", "64"], [*SPEC_FLAGS, "--metrics-port", str(port)]
    )
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    with cluster, SchedulerClient(cluster.address) as client:
        steps, outputs = [], []
        for opt_out in (True, False):
            before = client.stats().steps_run
            outputs.append(
                client.generate(
                    prompt_token_ids=prompt, max_tokens=40, temperature=0.0, no_speculation=opt_out, timeout=300
                )
            )
            wait_idle(client)
            steps.append(client.stats().steps_run - before)
        totals = spec_totals(metrics_url)
        plain, spec = outputs
        assert spec.token_ids == plain.token_ids == hf_greedy(load_model(default_model), prompt, 40)
        assert text[:40] in spec.text
        assert totals["pagedserve_spec_decode_accepted_tokens_total"] > 0
        assert steps[1] < steps[0] * 0.7, steps  # the plain run takes one step per token
        # A stop string inside an accepted run: cut there, as plain decoding cuts it.
        stopped = [
            client.generate(
                prompt_token_ids=prompt, max_tokens=40, temperature=0.0, stop=["lazy"], no_speculation=opt_out
            )
            for opt_out in (True, False)
        ]
        assert stopped[0].token_ids == stopped[1].token_ids and stopped[1].text == plain.text.split("lazy")[0]
        assert stopped[0].completion_tokens == stopped[1].completion_tokens
        assert_pool_clean(client, cluster)


EOS = 2  # the tiny checkpoint's
REPEAT = {100: 10.0}  # token 100 wins every step: text the lookup predicts, and something to penalize
# case -> (the request's controls, reference_greedy's names for them)
CONTROLS = {
    "presence and frequency": dict(logit_bias=REPEAT, presence_penalty=1.5, frequency_penalty=0.3),
    "repetition": dict(logit_bias=REPEAT, repetition_penalty=1.2),
    "min_tokens then EOS": dict(logit_bias={EOS: 30.0, 100: 29.0}, min_tokens=9),
    "all together": dict(logit_bias=REPEAT, presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1),
}
REFERENCE_NAMES = {"presence_penalty": "presence", "frequency_penalty": "frequency", "repetition_penalty": "repetition"}
# Token 100 about 7 times in 10: drafts of it get accepted about that often.
SEEDED = dict(temperature=0.9, top_k=50, top_p=0.95, min_p=0.001, presence_penalty=0.3, logit_bias={100: 7.0})


def test_processed_and_seeded_sampled_requests_draft_exactly(llama_worker):
    """Greedy requests with penalties, logit bias and min_tokens: transformers' tokens
    under the same processing, with speculation and opted out. Seeded sampled
    requests (filters, penalties, bias): the same tokens on every run with
    speculation, and those of the opted-out run (the race at each verified position
    is the one its plain decode runs). Drafts were accepted; every block came back."""
    model_dir = tiny_checkpoint("llama")
    ref = load_model(model_dir)
    prompt = [(37 * i + 11) % 700 + 4 for i in range(30)]
    port = free_port()
    with scheduler_of(model_dir, [llama_worker], *SPEC_FLAGS, "--metrics-port", str(port)) as (scheduler, client):

        def run(params: dict, opt_out: bool):
            return client.generate(
                prompt_token_ids=prompt, max_tokens=24, no_speculation=opt_out, timeout=120, **params
            )

        for controls in CONTROLS.values():
            named = {REFERENCE_NAMES.get(k, k): v for k, v in controls.items()}
            want, reason = reference_greedy(ref, prompt, 24, eos_ids=[EOS], **named)
            for opt_out in (False, True):
                got = run(dict(temperature=0.0, **controls), opt_out)
                assert got.token_ids == want and got.finish_reason == reason, (controls, opt_out)
        greedy_accepted = spec_totals(f"http://127.0.0.1:{port}/metrics")[
            "pagedserve_spec_decode_accepted_tokens_total"
        ]
        assert greedy_accepted > 0
        outputs = []
        for seed in (1, 2, 3):
            params = dict(SEEDED, seed=seed)
            first, again, plain = run(params, False), run(params, False), run(params, True)
            assert first.token_ids == again.token_ids == plain.token_ids, seed
            outputs.append(first.token_ids)
        assert len({tuple(o) for o in outputs}) == 3  # sampled: each seed its own tokens
        totals = spec_totals(f"http://127.0.0.1:{port}/metrics")
        assert totals["pagedserve_spec_decode_accepted_tokens_total"] > greedy_accepted  # sampled drafts accepted too
        assert_pool_clean(client, scheduler)
