"""Schemathesis over the gateway's published OpenAPI document (as vLLM's CI runs
it), against REAL services (tiny Llama worker + scheduler + gateway): every
generated request, valid or not, is answered with a documented status and
never a 5xx. Bounded in time (FUZZ_SECONDS); `make test-slow` runs it."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from tests.helpers.procs import Cluster

FUZZ_SECONDS = 150
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(model_dir):
    with Cluster(
        model_dir, ["--dtype", "float32", "--num-blocks", "64"], ["--max-model-len", "128"], gateway=True
    ) as c:
        yield c


# The APIs agents and RAG pipelines call, fuzzed on their own as well: one run over the whole
# document may spend its time on the first operations (on a loaded machine it tested 3 of 15).
AGENT_ROUTES = r"^/v1/(responses|messages|embeddings|score|rerank)"
AGENT_OPERATIONS = 8  # POST /v1/responses, GET + DELETE /v1/responses/{id}, messages, count_tokens, 3 pooling


def _schemathesis(cluster, tmp_path, *extra: str) -> str:
    args = [
        "run",
        f"{cluster.gateway_url}/openapi.json",
        *extra,
        "--checks",
        "not_a_server_error,status_code_conformance,content_type_conformance",
        "--max-time",
        str(FUZZ_SECONDS),
        "--workers",
        "1",
        "--seed",
        "28",
        "--request-timeout",
        "30",
        "--suppress-health-check",
        "all",
        "--no-color",
    ]
    cli = (
        "import sys; from schemathesis.cli import schemathesis; sys.argv[0] = 'schemathesis'; sys.exit(schemathesis())"
    )
    run = subprocess.run(
        [sys.executable, "-c", cli, *args], cwd=tmp_path, capture_output=True, text=True, timeout=FUZZ_SECONDS + 120
    )
    report = run.stdout[-12000:] + run.stderr[-3000:]
    assert run.returncode == 0, report
    assert "No issues found" in report or "passed" in report, report
    return report


def test_the_agent_routes_are_each_fuzzed_without_a_server_error(cluster, tmp_path):
    report = _schemathesis(cluster, tmp_path, "--include-path-regex", AGENT_ROUTES, "--phases", "coverage,fuzzing")
    tested = re.search(r"Tested: (\d+)", report)
    assert tested is not None and int(tested[1]) == AGENT_OPERATIONS, report


def test_no_request_gets_a_server_error(cluster, tmp_path):
    report = _schemathesis(cluster, tmp_path)
    # Every operation of the document was fuzzed, the APIs agents call among them.
    paths = httpx.get(f"{cluster.gateway_url}/openapi.json", timeout=30).json()["paths"]
    operations = sum(len(methods) for methods in paths.values())
    assert {"/v1/responses", "/v1/responses/{response_id}", "/v1/messages", "/v1/messages/count_tokens"} <= set(paths)
    selected = re.search(r"Operations:\s+(\d+) selected / (\d+) total", report)
    assert selected is not None and int(selected[1]) == int(selected[2]) == operations, report
