"""LoRA through real processes over gRPC (fp32): a scheduler with --enable-lora in front
of a worker with two adapter slots serves a mixed batch of the base and three adapters
(different ranks and target modules, non-trivial A and B: tools/tiny_adapters.py) with
every row token-exact against transformers + PEFT's merged model, with chunked prefill,
a small pool (preemption), n-gram speculation and the prefix cache on; three adapters
through two slots are evicted and reloaded and stay exact; the same prompt under
another adapter (or the base) finds nothing cached; admin.v1 registers and forgets an
adapter while requests stream; a bad adapter is refused by name; a JSON-schema request
under an adapter equals transformers + PEFT under the same mask; a tensor-parallel
worker (TP=2) serves the mixed batch exactly; every block comes back."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto import admin_pb2, admin_pb2_grpc
from scheduler_svc.client import SchedulerClient
from scheduler_svc.structured import Constraint
from tests.helpers.checkpoints import tiny_adapter, tiny_checkpoint
from tests.helpers.cluster import SPEC_FLAGS, assert_pool_clean, hf_greedy, load_model, wait_idle
from tests.helpers.grammar_reference import reference
from tests.helpers.procs import Cluster, free_port
from tools.tiny_adapters import merged_model

FAMILY = "qwen3"
ADAPTERS = {"qv": "r4_qv", "all": "r8_all_rslora", "mlp": "r2_mlp"}
LORA = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
SCHEDULER = ["--max-num-batched-tokens", "48", "--chunk-size", "32", *SPEC_FLAGS]
PROMPTS = [[(31 * i + 7 * j) % 500 + 4 for i in range(40 + 3 * j)] for j in range(2)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir():
    return tiny_checkpoint(FAMILY)


@pytest.fixture(scope="module")
def references(model_dir):
    """name -> transformers' fp32 model ("" the base, else PEFT's merge of that adapter)."""
    refs = {"": load_model(model_dir)}
    refs |= {name: merged_model(model_dir, tiny_adapter(FAMILY, a)) for name, a in ADAPTERS.items()}
    return refs


@pytest.fixture(scope="module")
def cluster(model_dir):
    modules = [f"{name}={tiny_adapter(FAMILY, a)}" for name, a in ADAPTERS.items()]
    port = free_port()
    cluster = Cluster(
        model_dir,
        ["--dtype", "float32", "--num-blocks", "12", *LORA],
        [*SCHEDULER, *LORA, "--lora-modules", *modules, "--metrics-port", str(port)],
    )
    cluster.metrics_url = f"http://127.0.0.1:{port}/metrics"
    with cluster:
        yield cluster


def totals(url: str, prefix: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_mixed_batch_of_base_and_three_adapters_is_token_exact(cluster, references):
    cases = [(name, prompt) for prompt in PROMPTS for name in ["", *ADAPTERS]]
    with SchedulerClient(cluster.address) as client, ThreadPoolExecutor(len(cases)) as pool:
        got = list(
            pool.map(
                lambda c: client.generate(
                    prompt_token_ids=c[1], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                    lora_adapter=c[0], timeout=300,
                ),
                cases,
            )
        )  # fmt: skip
        for (name, prompt), completion in zip(cases, got):
            want = hf_greedy(references[name], prompt, MAX_TOKENS, ignore_eos=True)
            assert completion.token_ids == want, f"adapter {name or 'base'}"
        outputs = {name: c.token_ids for (name, p), c in zip(cases, got) if p is PROMPTS[0]}
        assert len({tuple(t) for t in outputs.values()}) == 4  # every adapter changes the tokens
        wait_idle(client)
        assert_pool_clean(client, cluster)
    lora = totals(cluster.metrics_url, "pagedserve_lora_adapter_")
    assert lora["pagedserve_lora_adapter_loads_total"] >= 3  # three adapters, two slots
    assert lora["pagedserve_lora_adapter_evictions_total"] >= 1
    assert totals(cluster.metrics_url, "pagedserve_preemptions")["pagedserve_preemptions_total"] > 0
    assert totals(cluster.metrics_url, "pagedserve_spec_decode_")["pagedserve_spec_decode_draft_tokens_total"] > 0


def test_prefix_cache_is_shared_within_an_adapter_only(cluster, references):
    prompt = [(17 * i) % 400 + 9 for i in range(50)]
    with SchedulerClient(cluster.address) as client:

        def run(name):
            return client.generate(prompt_token_ids=prompt, max_tokens=4, temperature=0.0, lora_adapter=name)

        first, again = run("qv"), run("qv")
        assert first.cached_prompt_tokens == 0 and again.cached_prompt_tokens >= 32
        assert again.token_ids == first.token_ids == hf_greedy(references["qv"], prompt, 4)
        for other in ("mlp", ""):
            reply = run(other)
            assert reply.cached_prompt_tokens == 0, other
            assert reply.token_ids == hf_greedy(references[other], prompt, 4), other
        wait_idle(client)
        assert_pool_clean(client, cluster)


def test_adapters_load_and_unload_at_run_time_and_bad_ones_are_refused(cluster, references, tmp_path):
    admin = grpc.insecure_channel(cluster.scheduler.admin_address)
    stub = admin_pb2_grpc.AdminStub(admin)
    meta = cluster.admin_metadata
    with SchedulerClient(cluster.address) as client, ThreadPoolExecutor(4) as pool:
        streaming = [
            pool.submit(client.generate, prompt_token_ids=PROMPTS[1], max_tokens=30, temperature=0.0,
                        ignore_eos=True, lora_adapter=name, timeout=300)
            for name in ("qv", "all")
        ]  # fmt: skip
        path = str(tiny_adapter(FAMILY, "r16_ko_down"))
        stub.LoadLoraAdapter(admin_pb2.LoadLoraAdapterRequest(lora_name="kod", lora_path=path), metadata=meta)
        reply = client.generate(prompt_token_ids=PROMPTS[0], max_tokens=8, temperature=0.0, lora_adapter="kod")
        assert reply.token_ids == hf_greedy(merged_model(cluster.model_dir, path), PROMPTS[0], 8)
        stub.UnloadLoraAdapter(admin_pb2.UnloadLoraAdapterRequest(lora_name="kod"), metadata=meta)
        with pytest.raises(grpc.RpcError) as info:
            client.generate(prompt_token_ids=PROMPTS[0], max_tokens=2, lora_adapter="kod")
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "lora_adapter" in info.value.details()
        for name, future in zip(("qv", "all"), streaming):
            assert future.result().token_ids == hf_greedy(references[name], PROMPTS[1], 30, ignore_eos=True)
        # A directory that is no adapter, refused by name before any worker sees it.
        with pytest.raises(grpc.RpcError) as info:
            stub.LoadLoraAdapter(
                admin_pb2.LoadLoraAdapterRequest(lora_name="x", lora_path=str(tmp_path)), metadata=meta
            )
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "adapter_model.safetensors: missing" in info.value.details()
        wait_idle(client)
        assert_pool_clean(client, cluster)
    admin.close()


def test_a_json_schema_under_an_adapter_equals_peft_under_the_mask(cluster, references, compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}}}
    constraint = Constraint.json_schema(schema)
    with SchedulerClient(cluster.address) as client:
        for name in ("all", ""):
            got = client.generate(
                prompt_token_ids=PROMPTS[0], max_tokens=40, temperature=0.0, lora_adapter=name,
                json_schema=json.dumps(schema), timeout=300,
            )  # fmt: skip
            assert got.token_ids == reference(references[name], compiler, PROMPTS[0], constraint, 40), name or "base"
        wait_idle(client)
        assert_pool_clean(client, cluster)


@pytest.mark.slow  # TP=2 with adapters meets PEFT in make test at the worker (test_lora_worker_service.py)
def test_a_tensor_parallel_worker_serves_the_mixed_batch_exactly(model_dir, references):
    modules = [f"{name}={tiny_adapter(FAMILY, a)}" for name, a in ADAPTERS.items()]
    worker = ["--dtype", "float32", "--num-blocks", "32", "--tensor-parallel-size", "2", *LORA]
    with Cluster(model_dir, worker, [*SCHEDULER, *LORA, "--lora-modules", *modules]) as tp:
        with SchedulerClient(tp.address) as client, ThreadPoolExecutor(4) as pool:
            names = ["", *ADAPTERS]
            got = list(
                pool.map(
                    lambda name: client.generate(
                        prompt_token_ids=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                        lora_adapter=name, timeout=300,
                    ),
                    names,
                )
            )  # fmt: skip
            for name, completion in zip(names, got):
                want = hf_greedy(references[name], PROMPTS[1], MAX_TOKENS, ignore_eos=True)
                assert completion.token_ids == want, f"adapter {name or 'base'}"
            wait_idle(client)
            assert_pool_clean(client, tp)
