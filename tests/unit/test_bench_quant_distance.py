"""The token distance bench/quant_distance.py reports (issue 38), and the GGUF rows of
bench/peers.py: pure logic, on hand-made token lists and records."""

from __future__ import annotations

import grpc
import pytest

from bench.harness import isa
from bench.harness.llama_cpp import LLAMA_ISA_ARGS
from bench.peers import GGUF_RUN, GGUF_SERVERS, WORKLOADS, Workload, gguf_kind, gguf_targets, shortened
from bench.quant_distance import Distance, distance, first_divergence, refusal, until_stop

STOPS = frozenset({0, 2})


def test_outputs_end_before_their_first_end_of_sequence_token():
    assert until_stop([5, 6, 2, 7, 0], STOPS) == [5, 6]
    assert until_stop([0, 5], STOPS) == []
    assert until_stop([5, 6], STOPS) == [5, 6]


def test_the_first_divergence_is_where_tokens_differ_or_one_side_ends():
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # stopped early
    assert first_divergence([1, 2, 3, 4], [1, 2, 3]) == 3  # went on past the reference's end
    assert first_divergence([], [1]) == 0


def test_distance_counts_same_position_tokens_over_the_reference():
    references = [[1, 2, 3, 4], [5, 6, 7, 8]]
    outputs = [[1, 2, 3, 4], [5, 9, 7]]  # identical; differs at 1, same again at 2, ends at 3
    assert distance(outputs, references) == Distance(
        identical_fraction=6 / 8, mean_first_divergence=(4 + 1) / 2, identical_prompts=1, prompts=2
    )
    assert distance(references, references).identical_fraction == 1.0


def test_the_gguf_servers_pair_pagedserve_and_llamacpp_per_file():
    assert GGUF_SERVERS[:2] == ("pagedserve-q4_1", "llamacpp-q4_1")
    assert {gguf_kind(s) for s in GGUF_SERVERS} == {"Q4_1", "Q8_0", "Q4_K_M"}
    assert gguf_kind("llamacpp-f16") == "" and gguf_kind("pagedserve") == ""


def test_a_shortened_workload_says_what_ran():
    assert WORKLOADS["1"].name == "1 stream, 256 in, 128 out"
    assert WORKLOADS["prefix"].name == "16 streams sharing a 1,024-token prefix, 64 out"
    short = shortened(WORKLOADS["32"], max_tokens=32, requests_per_stream=0)
    assert (short.name, short.streams, short.requests_per_stream) == ("32 streams, 256 in, 32 out", 32, 1)
    assert shortened(WORKLOADS["1"], 0, 2) == Workload(1, 2, 256, 128, label="1 stream")


def test_the_targets_compare_each_file_with_llamacpp_on_it():
    one, many = WORKLOADS["1"], WORKLOADS["32"]

    def rec(key: str, itl: float, tok_s: float) -> dict:
        return {"key": key, "results": {one.name: {"itl_p50": itl}, many.name: {"tok_s": tok_s}}}

    records = [
        rec("pagedserve-q8_0", 0.030, 300.0),
        rec("llamacpp-q8_0", 0.020, 150.0),
        rec("pagedserve-q4_1", 0.02, 1),
    ]
    text = gguf_targets(records, [one, many])
    assert "- Q8_0: 1 stream, 256 in, 128 out ITL p50 30.0 vs llama.cpp 20.0 ms = 1.50x (target <= 1.0x)" in text
    assert "32 streams, 256 in, 128 out output tok/s 300.0 vs llama.cpp 150.0 tok/s = 2.00x (target >= 1.5x)" in text
    assert "Q4_1" not in text  # no llama.cpp row to compare with
    assert "bf16" not in text  # pagedserve-bf16 did not run


def test_the_targets_compare_a_file_at_batch_with_pagedserve_bf16_where_it_ran():
    one, many = WORKLOADS["1"], WORKLOADS["32"]
    records = [
        {"key": "pagedserve-bf16", "results": {one.name: {"itl_p50": 0.025}, many.name: {"tok_s": 240.0}}},
        {"key": "pagedserve-q4_1", "results": {one.name: {"itl_p50": 0.009}, many.name: {"tok_s": 180.0}}},
        {"key": "llamacpp-q4_1", "results": {one.name: {"itl_p50": 0.010}, many.name: {"tok_s": 90.0}}},
    ]
    text = gguf_targets(records, [one, many])
    assert text.splitlines()[-1] == (
        "- Q4_1: 1 stream, 256 in, 128 out ITL p50 9.0 vs llama.cpp 10.0 ms = 0.90x (target <= 1.0x); "
        "32 streams, 256 in, 128 out output tok/s 180.0 vs llama.cpp 90.0 tok/s = 2.00x (target >= 1.5x); "
        "32 streams, 256 in, 128 out output tok/s 180.0 vs pagedserve bf16 240.0 tok/s = 0.75x (target >= 1.0x)"
    )


def test_an_avx2_run_compares_a_file_at_batch_with_the_fp32_checkpoint():
    one, many = WORKLOADS["1"], WORKLOADS["32"]
    assert GGUF_RUN["avx2"][0] == "pagedserve-fp32" and GGUF_RUN["native"][0] == "pagedserve-bf16"
    records = [
        {"key": "pagedserve-fp32", "results": {one.name: {"itl_p50": 0.05}, many.name: {"tok_s": 80.0}}},
        {"key": "pagedserve-q8_0", "results": {one.name: {"itl_p50": 0.012}, many.name: {"tok_s": 120.0}}},
        {"key": "llamacpp-q8_0", "results": {one.name: {"itl_p50": 0.012}, many.name: {"tok_s": 100.0}}},
    ]
    text = gguf_targets(records, [one, many])
    assert text.endswith("output tok/s 120.0 vs pagedserve fp32 80.0 tok/s = 1.50x (target >= 1.0x)")
    assert "bf16" not in text


def test_an_avx2_run_holds_pagedserve_and_llamacpp_to_avx2():
    env = isa.pagedserve_env("avx2")
    assert env["PAGEDSERVE_CPU_MARCH"] == "haswell" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert isa.pagedserve_env("native") == {} and isa.describe("native") == ""
    assert "PAGEDSERVE_CPU_MARCH=haswell" in isa.describe("avx2")
    flags = LLAMA_ISA_ARGS["avx2"].split()
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags
    assert not [f for f in flags if "AVX512" in f or "VNNI" in f]  # off unless named: ggml's defaults


def test_a_refusing_worker_is_reported_by_its_last_line_or_its_status_details():
    started = RuntimeError("worker_svc did not start:\nloading\n\nValueError: --quant-activations: no Q6_K kernel\n")
    assert refusal(started) == "ValueError: --quant-activations: no Q6_K kernel"
    # A step that fails: a real gRPC error (nothing listens on port 1), reported by its details.
    with grpc.insecure_channel("127.0.0.1:1") as channel, pytest.raises(grpc.RpcError) as failed:
        channel.unary_unary("/worker.v1.Worker/Step")(b"", timeout=5)
    assert isinstance(failed.value, grpc.Call) and failed.value.details()
    assert refusal(failed.value) == failed.value.details().strip().splitlines()[-1][:300]
