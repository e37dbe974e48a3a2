"""Every family against Hugging Face again, with the static graph on the Triton backend's kernels.

On CPU the static graph runs the torch references (``backend="auto"``); here its engines are built
with ``backend="triton"``, so the fused kernels the passes produce run through the Triton
backend's wrappers and, on CPU tensors, Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` without CUDA). Same prompts and tolerance as
:func:`tests.models.test_families.test_prefill_and_decode_match_hf` (fp32 both sides, so only the
summation order differs), with fewer decode steps: the interpreter runs every kernel launch in
Python, and four steps already take every sequence across a cache-block boundary.
"""
from __future__ import annotations

import pytest

from tests.helpers import build_with_triton_backend
from tests.models.conftest import PROMPTS, VARIANTS, load_tiny
from tests.models.test_families import assert_rows_close
from tgraph.testing import hf_greedy

DECODE_STEPS = 4


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_hf_on_the_triton_backend(tiny_model, greedy_parity, variant,
                                                           monkeypatch):
    build_with_triton_backend(monkeypatch)
    tm = tiny_model(variant)
    model = load_tiny(tm.path, "static")
    trace, rows = greedy_parity(model, tm.hf, PROMPTS, DECODE_STEPS)
    assert len(rows) == sum(len(p) for p in PROMPTS) + DECODE_STEPS * len(PROMPTS)
    assert_rows_close(rows, f"{variant} (static, triton backend)")
    kernels = {step.kernel_name for engine in model.engines.values()
               for step in engine.plan.steps}
    assert any(not name.startswith("torch.") for name in kernels), \
        f"no Triton backend kernel ran: {sorted(kernels)}"
    assert [g[:3] for g in trace.generated] == hf_greedy(tm.hf, PROMPTS, 3)
