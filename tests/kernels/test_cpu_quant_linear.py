"""Quantized linears on the CPU backend (:mod:`tgraph.kernels.cpu_backend.quant`) against the
dequantized reference.

Tolerances, relative to the output's largest magnitude:

- torch's packed kernels (int4 groups, int8 per channel) take bf16 activations and scales and
  return bf16: each rounding is at most 2^-9 relative, so an output is off by at most ~3 * 2^-9
  (activation, scale and output roundings) of the output's scale: 1e-2 allowed, and the error
  must also stay above fp32 noise, showing the bf16 path really ran.
- int8 with group scales (GGUF ``Q8_0``) under ``CpuTuning.int8_group_kernel``: the int8
  kernel once per group, its bf16 partial products summed in fp32: the same roundings per
  partial, so the same 1e-2.
- The exact path (``CpuTuning.bf16_quant_activations=False``: dequantized once, cached) and
  int8 with group scales by default compute in fp32: 1e-5 (summation order only).
"""
from __future__ import annotations

import pytest
import torch

from tgraph.kernels.cpu_backend.quant import PackedLinear, packed_linear
from tgraph.quant import quantize

PACKED_TOL = 1e-2
EXACT_TOL = 1e-5


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _weight(kind: str, group: int | None, offsets: bool, n: int = 96, k: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    return quantize(w, kind, group_size=group, offsets=offsets)


@pytest.mark.parametrize("kind, group, offsets, how", [
    ("int4", 32, True, "int4pack"),    # GGUF Q4_1 / Q4_K, AWQ
    ("int4", 32, False, "int4pack"),   # GGUF Q4_0
    ("int4", 128, False, "int4pack"),  # GPTQ / compressed-tensors W4A16
    ("int8", None, False, "int8pack"),  # W8A16 per channel
    ("int8", None, True, "int8pack"),
])
@pytest.mark.parametrize("m", [1, 4, 33])
def test_packed_kernels_within_bf16_tolerance(kind: str, group: int | None, offsets: bool,
                                              how: str, m: int) -> None:
    w = _weight(kind, group, offsets)
    x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(1))
    want = x @ w.dequantize().t()
    packed = packed_linear(w, torch.float32)
    assert packed.how == how
    out = torch.empty(m, w.shape[0])
    packed.run(x, out)
    err = _rel(out, want)
    assert 1e-6 < err <= PACKED_TOL, f"{kind} g{group} offsets={offsets} M={m}: error {err:.3g}"


@pytest.mark.parametrize("m", [1, 4, 33])
def test_int8_groups_within_bf16_tolerance(m: int) -> None:
    w = _weight("int8", 32, False, k=576)  # GGUF Q8_0's layout, SmolLM2's K
    x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(4))
    want = x @ w.dequantize().t()
    packed = packed_linear(w, torch.float32, int8_groups=True)
    assert packed.how == "int8groups"
    assert packed.packed.nbytes == w.qdata.nbytes  # the codes, no dense copy
    out = torch.empty(m, w.shape[0])
    packed.run(x, out)
    err = _rel(out, want)
    assert 1e-6 < err <= PACKED_TOL, f"Q8_0 M={m}: error {err:.3g}"
    assert packed_linear(w, torch.float32).how == "dense"  # not asked for: the exact copy


@pytest.mark.parametrize("kind, group, offsets", [
    ("int4", 32, True), ("int8", 32, False), ("fp8", None, False), ("int4", 16, False)])
def test_exact_path_and_layouts_the_kernels_cannot_take(kind: str, group: int | None,
                                                        offsets: bool) -> None:
    w = _weight(kind, group, offsets)
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(2))
    want = x @ w.dequantize().t()
    bf16 = kind == "int4" and group == 32  # int4 g32 is packable: ask for the exact path
    packed = PackedLinear(w, torch.float32, bf16=not bf16)
    assert packed.how == "dense"
    out = torch.empty(3, w.shape[0])
    packed.run(x, out)
    assert _rel(out, want) <= EXACT_TOL


def test_packed_once_and_cached_per_weight() -> None:
    w = _weight("int4", 32, True, seed=3)
    first = packed_linear(w, torch.float32)
    assert packed_linear(w, torch.float32) is first  # no repacking per step
    assert packed_linear(w, torch.float32, bf16=False) is not first
    other = _weight("int4", 32, True, seed=4)
    assert packed_linear(other, torch.float32) is not first


def test_permuted_columns() -> None:
    w = _weight("int4", 32, False, seed=5)
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(6))
    w.perm = perm
    x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(7))
    want = x @ w.dequantize().t()
    out = torch.empty(2, w.shape[0])
    packed_linear(w, torch.float32).run(x, out)
    assert _rel(out, want) <= PACKED_TOL
    packed_linear(w, torch.float32, bf16=False).run(x, out)
    assert _rel(out, want) <= EXACT_TOL
