"""Every op of :mod:`tests.ir.test_ops` again, on the Triton backend's kernels.

On CPU the engine picks the torch references (``backend="auto"``), so the Triton backend's
per-op wrappers (:mod:`tgraph.kernels.triton_backend`) would run only in GPU tests. Here every
``build_engine`` is forced onto ``backend="triton"``: with CPU tensors under ``TRITON_INTERPRET=1``
(set by ``tests/conftest.py`` without CUDA) the wrappers and their Triton kernels run through the
interpreter, at the op test's small shapes, against the same fp64 torch expectations and
tolerances. Ops without a Triton kernel fall back to the reference, as the engine does.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import build_with_triton_backend
from tests.ir.test_ops import OP_INFOS, SHORT, OpInfo, check_samples


def _ids() -> list[object]:
    return [pytest.param(info, dtype, id=f"{info.name}-{SHORT[dtype]}")
            for info in OP_INFOS for dtype in info.dtypes]


@pytest.mark.parametrize("info, dtype", _ids())
def test_op_matches_torch_on_the_triton_backend(info: OpInfo, dtype: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    build_with_triton_backend(monkeypatch)
    samples = info.samples(dtype)
    with info.context():
        ops = check_samples(info, samples, f"{info.name}[{SHORT[dtype]}] (triton)")
    if info.fused_into is not None:
        assert info.fused_into in ops, \
            f"{info.name}: the passes did not produce {info.fused_into} (ops: {sorted(ops)})"
