"""The two GPU test tiers: ``gpu`` (``pytest -m gpu``, the suite to run before a change lands)
and ``slow_gpu`` (``pytest -m slow_gpu``, the full real-width sweeps).

A sweep lists every case and names the few that cover its code paths; those run in the ``gpu``
tier and the rest in ``slow_gpu``.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

__all__ = ["sweep"]


def sweep(axes: Sequence[Iterable[Any]], fast: Iterable[tuple], ids=None) -> list[Any]:
    """``pytest.param`` of every combination of ``axes``: those in ``fast`` marked ``gpu``, the
    others ``slow_gpu``.

    Raises:
        ValueError: a ``fast`` case is not a combination of the axes.
    """
    cases = list(itertools.product(*axes))
    fast = list(fast)
    missing = [c for c in fast if c not in cases]
    if missing:
        raise ValueError(f"fast cases {missing} are not in the sweep")
    params = []
    for case in cases:
        mark = pytest.mark.gpu if case in fast else pytest.mark.slow_gpu
        case_id = None if ids is None else "-".join(
            str(f(v)) if f else str(v) for f, v in zip(ids, case))
        params.append(pytest.param(*case, marks=mark, id=case_id))
    return params
