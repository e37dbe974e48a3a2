"""The small-M linear on quantized weights against the dense reference: every layout, one row
(CUDA cores, tiles of several scale groups) and 2-64 rows (tensor cores on the codes), with the
fused RMSNorm, SwiGLU, bias, residual and split-K (under the interpreter on CPU; real Llama shapes
and a CUDA graph on a GPU, where int4 codes are read by the bit trick of quant_tiles).

Tolerances: the kernel multiplies exact products of codes and activations and applies the fp32
scales per tile, the reference rounds the dequantized weight to bf16 first; both round the
output to bf16. So each product may differ by 2**-8 of its size (the reference's weight
rounding, 2**-9, plus the activations' rounding to bf16 under a fused norm) and the output by
one ulp: ``2**-7 * (|x| @ |w|.T) + 2**-7 * |out|`` (as tests/kernels/test_quant_linear.py). One
row of int4 codes on bf16 activations sums each word's products in bf16x2 chains of four, which
round up to 4 * 2**-8 of ``|x| @ |s (q - 8)|.T`` more (:func:`centred_magnitude`). One row of
fp8 codes on 16-bit activations sums fp16 chains of four, within 4 * 2**-11 of ``|x| @ |w|.T``,
inside the budget; 2-64 rows of fp8 codes multiply fp16 activations (bf16 ones scaled into
fp16 exactly). fp32 differs by summation order only (1e-5 relative).
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu_tiers import sweep
from tests.helpers import capture_cuda_graph
from tgraph.kernels.triton.gemv import prefer_quant_gemv, small_m_linear
from tgraph.quant import QuantizedWeight, quantize
from tgraph.quant.weight import unpack_int4
from tgraph.tuning import GemvTuning, QuantGemvTuning

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUTS = [("int4", 32, False, None), ("int4", 64, True, None), ("int4", None, False, None),
           ("int4", 16, True, None),
           ("int8", 32, False, None), ("int8", 16, True, None), ("fp8", None, False, None),
           ("fp8", None, False, (32, 64))]


def _weight(kind, group, offsets, block, n, k, dtype, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    return quantize(w, kind, group, offsets, block).to(DEV, dtype)


def centred_magnitude(xf: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """``|x| @ |s (q - 8)|.T`` of int4 codes: what bounds the bf16x2 word sums' rounding."""
    k = w.shape[1]
    scale = w.scale.float().repeat_interleave(w.scheme.block[1], 1)[:, :k]
    return xf.abs() @ ((unpack_int4(w.qdata).float() - 8) * scale).abs().T  # scales may be < 0


def packs_words(m: int, w: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether the small-M linear sums ``w``'s words in bf16x2 chains for ``m`` rows."""
    return m == 1 and w.scheme.kind == "int4" and dtype == torch.bfloat16


def _reference(x, w, norm_weight=None, gated=False, residual=None, eps=1e-5):
    xf = x.float()
    if norm_weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    wd = w.dequantize(x.dtype).float()
    y = xf @ wd.T
    mag = xf.abs() @ wd.abs().T
    if packs_words(x.shape[0], w, x.dtype):  # 4 * 2**-8 of it on a 2**-7 budget: twice
        mag = mag + 2 * centred_magnitude(xf, w)
    if gated:
        n = y.shape[1] // 2
        gate, up = y[:, :n], y[:, n:]
        mag = 1.1 * mag[:, :n] * up.abs() + gate.abs() * mag[:, n:]  # |silu'| <= 1.1
        y = torch.nn.functional.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y, mag


def _check(out, want, mag, dtype):
    if dtype == torch.float32:
        tol = 1e-5 * max(1.0, float(want.abs().max()))
        torch.testing.assert_close(out.float(), want, rtol=0, atol=tol)
        return
    bound = 2 ** -7 * mag + 2 ** -7 * want.abs() + 1e-6
    excess = (out.float() - want).abs() - bound
    assert float(excess.max()) <= 0, f"bf16 error above its bound by {float(excess.max()):.3g}"


@pytest.mark.parametrize("kind, group, offsets, block", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("fused", ["plain", "norm+gate", "norm+split", "gate+split"])
def test_matches_the_dense_reference(kind, group, offsets, block, dtype, m, fused):
    n, k = 70, 192  # ragged against every tile; 192 is not a power of two
    gated, norm = "gate" in fused, "norm" in fused
    split = 3 if "split" in fused else None
    w = _weight(kind, group, offsets, block, 2 * n if gated else n, k, dtype)
    x = torch.randn(m, k, device=DEV).to(dtype)
    g = torch.randn(k, device=DEV).to(dtype) if norm else None
    r = torch.randn(m, n, device=DEV).to(dtype)
    out = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
    assert prefer_quant_gemv(m, w)
    small_m_linear(x, w, out, residual=r, norm_eps=1e-5 if norm else None, norm_weight=g,
                   gated=gated, split_k=split)
    want, mag = _reference(x, w, g, gated, r)
    _check(out, want, mag, dtype)


@pytest.mark.parametrize("offsets, group", [(False, 128), (True, 32), (False, None)])
def test_one_row_int4_on_16_bit_activations_keeps_its_stated_precision(offsets, group):
    """One row of int4 codes on fp16 activations sums ``(0.5 + q / 256) * x`` per word, one FMA
    per code, and recovers ``sum(q * x)`` as ``256 * (t - sum(x) / 2)``: the cancellation costs
    ~2**-13 of ``sum(|x|)`` per word, far below fp16's rounding of the output (2**-11 of it),
    so the result stays within that rounding plus 2**-13 of ``|x| @ |w|.T``, large activations
    included."""
    k = 4096
    w = _weight("int4", group, offsets, None, 64, k, torch.float16, seed=3)
    x = (torch.randn(1, k, device=DEV) * 50).to(torch.float16)
    out = torch.empty(1, 64, device=DEV, dtype=torch.float16)
    small_m_linear(x, w, out)
    wd = w.dequantize(torch.float32).double()
    want = x.double() @ wd.T
    mag = x.double().abs() @ wd.abs().T
    excess = (out.double() - want).abs() - (2 ** -11 * want.abs() + 2 ** -13 * mag)
    assert float(excess.max()) <= 0, f"error above its bound by {float(excess.max()):.3g}"


def _bf16_word_chains(x, w) -> torch.Tensor:
    """The one-row int4 kernel's arithmetic on bf16 activations, modelled in float64: per int32
    word, columns 0-3 and 4-7 are two chains of ``acc = bf16(acc + (q - 8) * x)`` (one
    ``fma.rn.bf16x2`` a step), their sum scaled per group in fp32 (offsets: plus ``(b + 8 s) *
    sum(x)``)."""
    n, k = w.shape
    cols = w.scheme.block[1]
    q = unpack_int4(w.qdata).double().view(n, k // 8, 2, 4)
    xs = x.double().view(1, k // 8, 2, 4)
    acc = torch.zeros(n, k // 8, 2, dtype=torch.float64, device=x.device)
    for i in range(4):
        acc = (acc + (q[..., i] - 8.0) * xs[..., i]).to(torch.bfloat16).double()
    group = torch.arange(k // 8, device=x.device) * 8 // cols
    scale = w.scale.double()[:, group]
    y = (acc.sum(-1) * scale).sum(-1)
    if w.offset is not None:
        y = y + ((w.offset.double()[:, group] + 8 * scale) * xs.sum((-1, -2))).sum(-1)
    return y[None]


@pytest.mark.parametrize("offsets, group", [(False, 128), (True, 32), (False, None)])
def test_one_row_int4_on_bf16_activations_sums_words_in_bf16_pairs(offsets, group):
    """On bf16 activations each word's eight products are summed as two chains of four bf16x2
    FMAs (2.25 instructions a code against ~4.7 in fp32): the output equals the model of that
    arithmetic to the output's own rounding (one bf16 ulp), and stays within its worst case of
    ``4 * 2**-8`` of ``|x| @ |s (q - 8)|.T`` (four roundings of a chain of ``(q - 8) * x``,
    whose size that bounds; x is bf16 already) plus that ulp from the exact product; an fp32
    kernel would miss the model by the chains' error."""
    k = 2048
    w = _weight("int4", group, offsets, None, 96, k, torch.bfloat16, seed=5)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6)).to(DEV, torch.bfloat16)
    out = torch.empty(1, 96, device=DEV, dtype=torch.bfloat16)
    small_m_linear(x, w, out)
    model = _bf16_word_chains(x, w)
    ulp = 2.0 ** (torch.floor(torch.log2(model.abs().clamp_min(1e-30))) - 7)
    assert float(((out.double() - model).abs() / ulp).max()) <= 1.0
    exact = x.double() @ w.dequantize(torch.float32).double().T
    mag = centred_magnitude(x.float(), w).double()
    assert float(((out.double() - exact).abs() - (4 * 2 ** -8 * mag + ulp)).max()) <= 0
    # The model is ulps away from the exact sum: the first check tells the chains from fp32.
    assert float(((model - exact).abs() / ulp).max()) > 2.5


WORD_LAYOUTS = [("int4", 128, False, None), ("int4", 64, True, None), ("int4", None, False, None),
                ("fp8", None, False, None), ("fp8", None, False, (32, 64))]


@pytest.mark.parametrize("kind, group, offsets, block", WORD_LAYOUTS)
@pytest.mark.parametrize("m", [2, 16, 33])
def test_many_rows_take_int32_words_and_match_the_byte_tiles(monkeypatch, kind, group, offsets,
                                                             block, m):
    """2-64 rows of int4 (groups of 64 or more) and fp8 codes run the MMAs on code pairs made
    from int32 words (``QuantGemvTuning.words``); they keep the byte tiles' bound, and the
    launcher does take them (a fallback to the byte tiles would pass the bound silently)."""
    from tgraph.kernels.triton import gemv_quant_launch as launch

    taken = []
    real = launch._words_mma
    monkeypatch.setattr(launch, "_words_mma", lambda *a, **k: taken.append(real(*a, **k)) or
                        taken[-1])
    n, k = 80, 256
    w = _weight(kind, group, offsets, block, 2 * n, k, torch.bfloat16, seed=7)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    g = torch.randn(k, device=DEV).to(torch.bfloat16)
    want, mag = _reference(x, w, g, gated=True)
    for words in (True, False):
        taken.clear()
        out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
        small_m_linear(x, w, out, norm_eps=1e-5, norm_weight=g, gated=True, split_k=2,
                       tuning=GemvTuning(quant=QuantGemvTuning(words=words)))
        assert taken[-1] is words
        _check(out, want, mag, torch.bfloat16)


def test_fp8_words_scale_bf16_activations_into_fp16_exactly():
    """fp8 codes multiply in fp16; bf16 activations far outside fp16's range (1e8, 1e-9) enter
    it scaled per row by a power of two, so nothing overflows or flushes: the output keeps the
    bf16 bound row by row."""
    w = _weight("fp8", None, False, None, 96, 512, torch.bfloat16, seed=8)
    x = torch.randn(4, 512, device=DEV)
    x[0] *= 1e8
    x[1] *= 1e-9
    x[2, :256] *= 1e6  # one row spanning ~2**20 between its halves
    x = x.to(torch.bfloat16)
    out = torch.empty(4, 96, device=DEV, dtype=torch.bfloat16)
    small_m_linear(x, w, out)
    want, mag = _reference(x, w)
    assert out.float().isfinite().all()
    _check(out, want, mag, torch.bfloat16)


def _fp16_unit_chains(x, w) -> torch.Tensor:
    """The one-row fp8 kernel's arithmetic on 16-bit activations, modelled in float64: per unit
    of eight columns, x scaled by the power of two that puts its largest into [16, 32) and
    rounded to fp16, then columns 0, 2, 4, 6 and 1, 3, 5, 7 as two chains of ``acc =
    fp16(acc + q * x)`` (one ``fma.rn.f16x2`` a step), their sum scaled back and by the weight's
    scales."""
    n, k = w.shape
    xs = x.double().view(1, k // 8, 8)
    top = xs.abs().amax(-1, keepdim=True)
    power = torch.where(top > 0, 2.0 ** (4 - torch.floor(torch.log2(top.clamp_min(1e-300)))), 1.0)
    xs = (xs * power).to(torch.float16).double()
    q = w.qdata.view(torch.float8_e4m3fn).double().view(n, k // 8, 8)
    acc = torch.zeros(n, k // 8, 2, dtype=torch.float64, device=x.device)
    for i in range(4):
        acc = (acc + q[..., 2 * i:2 * i + 2] * xs[..., 2 * i:2 * i + 2]).to(torch.float16).double()
    rows, cols = w.scheme.block
    scale = w.scale.double().repeat_interleave(min(rows, n), 0)[:n]
    scale = scale.repeat_interleave(min(cols, k), 1)[:, :k:8]
    return (acc.sum(-1) / power[..., 0] * scale).sum(-1)[None]


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_fp8_on_16_bit_activations_sums_units_in_fp16_chains(block, dtype):
    """One row of fp8 codes on bf16 / fp16 activations sums each unit of eight products as two
    chains of four fp16x2 FMAs (1.4 instructions a code against ~5.5 in fp32), the unit's
    activations scaled into fp16's range by a power of two (some here are 300x the rest): the
    output equals the model of that arithmetic to its own rounding (one ulp; the fp32 loop
    misses it by 8-15 here), and stays within the chains' worst case of ``4 * 2**-11`` of
    ``|x| @ |w|.T`` plus that ulp of the exact product."""
    k = 2048
    w = _weight("fp8", None, False, block, 96, k, dtype, seed=9)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(10))
    x[0, :64] *= 300
    x = x.to(DEV, dtype)
    out = torch.empty(1, 96, device=DEV, dtype=dtype)
    small_m_linear(x, w, out)
    model = _fp16_unit_chains(x, w)
    bits = 7 if dtype == torch.bfloat16 else 10
    ulp = 2.0 ** (torch.floor(torch.log2(model.abs().clamp_min(1e-30))) - bits)
    assert float(((out.double() - model).abs() / ulp).max()) <= 1.0
    wd = w.dequantize(torch.float32).double()
    exact, mag = x.double() @ wd.T, x.double().abs() @ wd.abs().T
    assert float(((out.double() - exact).abs() - (4 * 2 ** -11 * mag + ulp)).max()) <= 0
    # The model is ulps away from the exact sum: the first check tells the chains from fp32.
    assert float(((model - exact).abs() / ulp).max()) > 2.5


def test_one_row_on_tensor_cores_matches_too():
    """``m1_fma=False`` pads one row to 16 for the MMA path: same results within the bound."""
    w = _weight("int4", 32, True, None, 70, 192, torch.bfloat16)
    x = torch.randn(1, 192, device=DEV).to(torch.bfloat16)
    out = torch.empty(1, 70, device=DEV, dtype=torch.bfloat16)
    small_m_linear(x, w, out, tuning=GemvTuning(quant=QuantGemvTuning(m1_fma=False)))
    _check(out, *_reference(x, w), torch.bfloat16)


def test_what_it_does_not_take():
    w = _weight("int4", 32, True, None, 64, 128, torch.float32)
    assert not prefer_quant_gemv(65, w)  # above small_m_max: the GEMM's
    perm = torch.randperm(128, device=DEV)
    permuted = QuantizedWeight(w.scheme, w.qdata, w.scale, w.offset, w.dtype, "p", perm)
    assert not prefer_quant_gemv(1, permuted)
    narrow = _weight("int4", 8, False, None, 64, 128, torch.float32)
    assert not prefer_quant_gemv(1, narrow)
    x, out = torch.randn(1, 128, device=DEV), torch.empty(1, 64, device=DEV)
    with pytest.raises(ValueError, match="act-order"):
        small_m_linear(x, permuted, out)
    with pytest.raises(ValueError, match="too narrow"):
        small_m_linear(x, narrow, out)
    with pytest.raises(ValueError, match=r"straddles the scale blocks .* use 32"):
        small_m_linear(torch.randn(2, 128, device=DEV), w, torch.empty(2, 64, device=DEV),
                       config=(64, 64, 1, 4, 2))
    with pytest.raises(ValueError, match="powers of two"):  # a tile Triton cannot lay out
        small_m_linear(torch.randn(2, 128, device=DEV), w, torch.empty(2, 64, device=DEV),
                       tuning=GemvTuning(quant=QuantGemvTuning(block_n=96)))
    with pytest.raises(TypeError, match="must match x dtype"):
        small_m_linear(x.to(torch.bfloat16), w, out.to(torch.bfloat16))


REAL = [("int4", 128, False, None), ("int8", None, False, None), ("fp8", None, False, None),
        ("fp8", None, False, (128, 128)), ("int4", 32, True, None)]


@pytest.mark.parametrize("layout, m, fused", sweep(
    [REAL, [1, 4, 16, 64], ["plain", "norm+gate"]],
    fast=[(REAL[0], 1, "norm+gate"), (REAL[0], 16, "plain"), (REAL[1], 1, "plain"),
          (REAL[2], 4, "norm+gate"), (REAL[3], 64, "plain"), (REAL[4], 1, "plain")],
    ids=(lambda r: f"{r[0]}-{r[1]}-{r[3]}", None, None)))
def test_gpu_llama_shapes_in_a_cuda_graph(layout, m, fused):
    gated = fused == "norm+gate"
    n, k = (14336, 4096) if gated else (4096, 14336)
    w = _weight(*layout, 2 * n if gated else n, k, torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(k, device="cuda", dtype=torch.bfloat16) if gated else None
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    graph = capture_cuda_graph(lambda: small_m_linear(
        x, w, out, norm_eps=1e-5 if gated else None, norm_weight=g, gated=gated))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, *_reference(x, w, g, gated), torch.bfloat16)


_COMPILE_SCRIPT = r"""
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tgraph.kernels.triton.gemv_kernels import small_m_linear_kernel as fn

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
DIV16 = {"N", "K", "k_per_split", "gate_rows", "stride_xm", "stride_wn", "stride_rm",
         "stride_om", "stride_qs"}


def stack_of(consts, w_type, x_type, stages, cap):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if name == "w_ptr":
            sig[name] = w_type
        elif name in ("qs_ptr", "qb_ptr", "ws_ptr"):
            sig[name] = "*fp32"
        elif name == "count_ptr":
            sig[name] = "*i32"
        elif name == "x_ptr":
            sig[name] = x_type
        elif name.endswith("_ptr") or name == "w_desc":
            sig[name] = "*bf16"
        else:
            sig[name] = "fp32" if name == "eps" else "i32"
        if sig[name].startswith("*") or name in DIV16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": stages, "maxnreg": cap})
    # Spilled registers show as stack in the resource usage (e.g. a K tile the cap can't hold).
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


# One row as the launcher specialises Llama-3-8B's linears: int4 g128 words (bf16's packed
# PTX word sums, fp16's one-FMA form, fp32's exact form), fp8 channel codes (4 x 2048 tiles,
# folded in runs of 16 columns); plain with the residual, the fused norm (its register cap),
# gated with the norm.
for kind, x_type in ((0, "*bf16"), (0, "*fp16"), (0, "*fp32"), (2, "*bf16")):
    for norm, gated, res, cap in ((False, False, True, None), (True, False, False, 80),
                                  (True, True, False, None)):
        block_k = 1024 if kind == 0 and cap else 2048  # int4 under the norm's cap: 1024
        consts = dict(HAS_BIAS=False, HAS_RES=res, WRITE_PARTIAL=False, NORM=norm, HAS_G=norm,
                      GATED=gated, BLOCK_M=1, BLOCK_N=8 if kind == 0 else 4,
                      BLOCK_K=block_k, F32_DOT=False,
                      SWAP_AB=False, PDL=True, FIXUP=False, W_DESC=False, QKIND=kind,
                      QROWS=1 << 30, QCOLS=128 if kind == 0 else 1 << 30, QOFFSETS=False,
                      QZERO=8388616.0 if kind == 0 else 0.0, QBASE_BITS=0, ON_GPU=True,
                      QDTYPE=tl.float32, QNG=block_k // 128 if kind == 0 else 1, QWORDS=False)
        stack = stack_of(consts, "*i32" if kind == 0 else "*fp8e4nv", x_type, 3,
                         cap if kind == 0 else None)
        print(f"one row, kind {kind} {x_type} norm={norm} gated={gated}: stack {stack}")
        if kind == 2 and x_type == "*bf16":  # fp8 on int32 words: fp16 chains (8 x 2048)
            for words_x in ("*bf16", "*fp16"):
                consts.update(QWORDS=True, BLOCK_N=8)
                stack = stack_of(consts, "*i32", words_x, 3, None)
                print(f"one row, fp8 words {words_x} norm={norm} gated={gated}: stack {stack}")

# 16 and 64 rows on int32 words (QuantGemvTuning's words tiles): int4 g128 pairs under the
# bf16 / fp16 magic, fp8 pairs converted to fp16 (bf16 activations scaled into it); plain,
# and gated with the norm and the split-K fixup.
for kind, x_type, block_n, block_m in ((0, "*bf16", 128, 16), (0, "*fp16", 128, 16),
                                       (2, "*bf16", 64, 16), (2, "*fp16", 64, 16),
                                       (0, "*bf16", 64, 64), (2, "*bf16", 64, 64)):
    for gated in (False, True):
        magic = (0x4300 if x_type == "*bf16" else 0x6400) if kind == 0 else 0
        consts = dict(HAS_BIAS=False, HAS_RES=not gated, WRITE_PARTIAL=True, NORM=gated,
                      HAS_G=gated, GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128,
                      F32_DOT=False, SWAP_AB=True, PDL=True, FIXUP=True, W_DESC=False,
                      QKIND=kind, QROWS=1 << 30, QCOLS=128 if kind == 0 else 1 << 30,
                      QOFFSETS=False, QZERO={0x4300: 136.0, 0x6400: 1032.0}.get(magic, 0.0),
                      QBASE_BITS=magic, ON_GPU=True, QNG=1, QWORDS=True,
                      QDTYPE=tl.bfloat16 if magic == 0x4300 else tl.float16)
        stack = stack_of(consts, "*i32", x_type, 3, None)
        print(f"words, kind {kind} {x_type} {block_m} rows gated={gated}: stack {stack}")
print("compiled")
"""


@pytest.mark.slow
def test_quantized_kernels_compile_for_sm90_without_a_gpu():
    # The interpreter runs the integer-op unpack, not the PTX one; compiling for an H100 target
    # with the bundled ptxas checks the GPU's form (one row, and the words of 2-64 rows) on a
    # CPU-only machine, and that no register spills.
    from tests.helpers import run_without_interpreter

    done = run_without_interpreter(_COMPILE_SCRIPT)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-4000:]
    stacks = {line.rsplit(": stack ", 1)[0]: int(line.rsplit(" ", 1)[1])
              for line in done.stdout.splitlines() if ": stack " in line}
    # The gated 64-row words tile spills a little and still measured fastest (docs/performance.md,
    # "2-64 rows on int32 words").
    allowed = {name: 160 if "64 rows gated=True" in name else 0 for name in stacks}
    over = {name: size for name, size in stacks.items() if size > allowed[name]}
    assert len(stacks) == 30 and not over, over
