"""bench/harness/interleave.py: a workload's figure on a server over rounds."""

from __future__ import annotations

from bench.harness.interleave import median_result


def _round(tok_s: float, itl: float) -> dict:
    return {"tok_s": tok_s, "ttft_p50": 0.5, "itl_p50": itl, "wall_s": 10.0, "requests": 32, "tokens": 4096}


def test_each_figure_is_the_median_over_rounds_and_the_counts_add_up():
    merged = median_result([_round(300.0, 0.010), _round(250.0, 0.012), _round(330.0, 0.009)])
    assert merged["tok_s"] == 300.0 and merged["itl_p50"] == 0.010
    assert merged["requests"] == 96 and merged["tokens"] == 3 * 4096
    assert merged["rounds_tok_s"] == [300.0, 250.0, 330.0]
    assert merged["rounds_itl_p50"] == [0.010, 0.012, 0.009]


def test_an_even_number_of_rounds_takes_the_middle_twos_mean():
    assert median_result([_round(100.0, 0.01), _round(200.0, 0.03)])["tok_s"] == 150.0
