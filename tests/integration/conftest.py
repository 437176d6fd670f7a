"""Fixtures several integration modules share (plain helpers live in tests/helpers/).

A module that asks for grpc_client, oai or no_leak brings its own module-scoped
`cluster` (svc_common's Cluster; with gateway=True for oai) and its WAIT_S, the
bound on any one request there: these are clients on that cluster."""

from __future__ import annotations

import openai
import pytest

from scheduler_svc.client import SchedulerClient
from scheduler_svc.structured import GrammarCompiler, GrammarVocab
from scheduler_svc.text.tokenizer import load_tokenizer
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import load_model, wait_idle


@pytest.fixture(scope="module")
def model_dir():
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def model(model_dir):
    """transformers' float32 model of model_dir: the reference."""
    return load_model(model_dir)


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with SchedulerClient(cluster.address) as client:
        yield client


@pytest.fixture(scope="module")
def oai(cluster, request):
    """The official openai client on the cluster's gateway."""
    timeout = request.module.WAIT_S
    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0, timeout=timeout)
    yield client
    client.close()


@pytest.fixture
def no_leak(grpc_client):
    """After the test the scheduler is idle with no block in use: no leak, nothing left
    running for a client that went away. Modules opt in: pytestmark = usefixtures."""
    yield
    stats = wait_idle(grpc_client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0), stats


@pytest.fixture(scope="module")
def compiler(model_dir):
    """The grammar compiler over the tiny model's vocabulary (the structured-output oracles')."""
    compiler = GrammarCompiler(GrammarVocab.from_model_tokenizer(load_tokenizer(model_dir)))
    yield compiler
    compiler.close()
