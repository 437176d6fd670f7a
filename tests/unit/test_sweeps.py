"""tests/helpers/sweeps.py: which cases of a sweep `make test` keeps."""

from __future__ import annotations

import pytest

from tests.helpers.sweeps import sweep


def _slow(param) -> bool:
    return any(mark.name == "slow" for mark in param.marks)


def test_cases_not_kept_are_slow_and_tuples_spread_into_arguments():
    params = sweep([("a", 1), ("b", 2), ("c", 3)], keep=[("b", 2)], ids=["a1", "b2", "c3"])
    assert [(p.values, p.id, _slow(p)) for p in params] == [
        (("a", 1), "a1", True),
        (("b", 2), "b2", False),
        (("c", 3), "c3", True),
    ]
    assert [p.values for p in sweep(["x", "y"], keep=["y"])] == [("x",), ("y",)]


def test_keeping_a_case_the_sweep_lacks_is_an_error():
    with pytest.raises(AssertionError, match="renamed"):
        sweep(["llama", "qwen3"], keep=["qwen2"])
