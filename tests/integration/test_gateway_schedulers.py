"""The gateway over two schedulers (--schedulers), each with its own worker, as real
processes on 127.0.0.1 (tiny llama, float32): requests sharing a prompt prefix
land on the scheduler that owns the prefix's key and find it cached there, the
prefixes spread over both, every answer equals transformers' greedy text, and
with one scheduler stopped every request is still served by the other."""

from __future__ import annotations

import random

import httpx
import pytest
from tokenizers import Tokenizer

from gateway_svc.prefix_routing import HashRing, PrefixKeys
from scheduler_svc.client import SchedulerClient
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import hf_greedy, load_model, wait_idle
from tests.helpers.procs import ServiceProcess, running

MODEL = tiny_checkpoint("llama")
WORKER_ARGS = ["--model", str(MODEL), "--dtype", "float32", "--num-blocks", "256"]
SYSTEM_TOKENS = 48  # three full blocks: the part requests of one group share


@pytest.fixture(scope="module")
def reference():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def cells():
    """Two cells (a worker and its scheduler) and a gateway over both schedulers."""
    schedulers: list[ServiceProcess] = []
    gateway = None
    with running([ServiceProcess("worker_svc", WORKER_ARGS) for _ in range(2)]) as workers:
        try:
            for w in workers:
                args = ["--model", str(MODEL), "--workers", w.address, "--admin-port", "-1"]
                schedulers.append(ServiceProcess("scheduler_svc", args).start())
            gateway = ServiceProcess(
                "gateway_svc",
                [
                    "--schedulers",
                    ",".join(s.address for s in schedulers),
                    "--model-dir",
                    str(MODEL),
                    "--scheduler-health-interval-s",
                    "0.2",
                ],
            ).start()
            yield schedulers, gateway
        finally:
            for p in (gateway, *schedulers):
                if p is not None:
                    p.stop()


def finished(scheduler: ServiceProcess) -> int:
    with SchedulerClient(scheduler.address) as client:
        return client.stats().requests_finished


def test_shared_prefixes_land_together_exactly_and_survive_a_stopped_scheduler(cells, reference):
    schedulers, gateway = cells
    # Which scheduler owns which prefix, computed as the gateway does: pick two per scheduler.
    ring = HashRing([s.address for s in schedulers])
    keys = PrefixKeys(Tokenizer.from_file(str(MODEL / "tokenizer.json")), 32)
    rng = random.Random(21)
    groups: dict[str, list[list[int]]] = {s.address: [] for s in schedulers}
    while min(len(g) for g in groups.values()) < 2:
        system = [rng.randrange(4, 700) for _ in range(SYSTEM_TOKENS)]
        owner = ring.order(keys.key("", system))[0]
        if len(groups[owner]) < 2:
            groups[owner].append(system)

    answers: list[tuple[list[int], dict]] = []  # (prompt, the gateway's choice)

    def complete(http: httpx.Client, ids: list[int]) -> dict:
        r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        answers.append((ids, choice))
        return r.json()["usage"]

    with httpx.Client(base_url=f"http://{gateway.address}", timeout=60) as http:
        for owner, systems in groups.items():
            for system in systems:
                before = {s.address: finished(s) for s in schedulers}
                usages = [complete(http, system + [rng.randrange(4, 700) for _ in range(5 + i)]) for i in range(3)]
                after = {s.address: finished(s) for s in schedulers}
                landed = {a: after[a] - before[a] for a in after}
                assert landed == {a: 3 if a == owner else 0 for a in after}  # all three where the key says
                cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
                assert cached == [0, SYSTEM_TOKENS, SYSTEM_TOKENS]  # the prefix is computed once

        # One scheduler stops: the gateway routes around it and every prefix is served.
        stopped, survivor = schedulers[1], schedulers[0]
        stopped.stop()
        before = finished(survivor)
        for systems in groups.values():
            for system in systems:
                complete(http, system + [rng.randrange(4, 700) for _ in range(4)])
        assert finished(survivor) - before == 4
        assert http.get("/health").json() == {"status": "ok"}

    # Exact: each answer's tokens (asked again over gRPC, where serving.v1 returns them)
    # are transformers' greedy tokens, and the gateway's text is the scheduler's.
    with SchedulerClient(survivor.address) as client:
        for ids, choice in answers:
            again = client.generate(prompt_token_ids=ids, max_tokens=8, temperature=0.0, timeout=60)
            assert again.token_ids == hf_greedy(reference, ids, 8)
            assert (choice["text"], choice["finish_reason"]) == (again.text, again.finish_reason)
        assert wait_idle(client).blocks_used == 0
