"""Parameter sweeps split between `make test` and `make test-slow`: the cases a
sweep keeps run in every `make test`; the rest are marked slow. A case kept is the
one that exercises the most distinct code (say why where a sweep is declared); the
others repeat that path for another family or setting."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import pytest


def sweep(cases: Iterable[Any], keep: Collection[Any], ids: Iterable[str] | None = None) -> list[Any]:
    """pytest.param per case (a tuple is one case of several arguments); those not in
    `keep` carry the slow mark. A name in `keep` that is not a case is an error, so a
    renamed family cannot silently drop every case into the slow set."""
    cases = list(cases)
    missing = [k for k in keep if k not in cases]
    assert not missing, f"sweep keeps cases it does not have (renamed?): {missing}"
    names = list(ids) if ids is not None else [None] * len(cases)
    params = []
    for case, name in zip(cases, names):
        values = case if isinstance(case, tuple) else (case,)
        params.append(pytest.param(*values, marks=() if case in keep else pytest.mark.slow, id=name))
    return params
