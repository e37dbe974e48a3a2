"""Fixtures shared by the runtime tests."""
from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture
def no_gc() -> Iterator[None]:
    """The garbage collector off: only reference counting frees memory (as after ``del llm`` in
    a busy process), so what is released must be released without it."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
