"""The small-M linear's decode fusions: RMSNorm of ``x`` in the prologue and SwiGLU on a packed
gate|up weight in the epilogue, against an fp64 reference of the unfused ops.

The reference normalises in fp64 from the same rounded inputs, so only accumulation order, the
kernel's fp32 norm and the final rounding differ. Tolerances as in test_gemv_lora_kernels.py:
fp32 1e-5, fp16 2e-3, bf16 2e-2 (unit roundoff 3.9e-3; the fused kernel does not round the
normed activations to bf16 as the unfused path does, which is what the 2e-2 covers).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as tF

from tgraph.kernels.triton.gemv import choose_config, small_m_linear, workspace_size

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
EPS = 1e-5


def _reference(x, w, *, g=None, norm=False, gated=False, bias=None, residual=None) -> torch.Tensor:
    h = x.double()
    if norm:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        if g is not None:
            h = h * g.double()
    y = h @ w.double().T
    if bias is not None:
        y = y + bias.double()
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = tF.silu(gate) * up
    if residual is not None:
        y = y + residual.double()
    return y


def _inputs(M, N_out, K, dtype, gated, device=DEV):
    rows = 2 * N_out if gated else N_out
    # Non-unit row scales: the norm must really divide by each row's own RMS.
    row_scale = torch.linspace(0.5, 3.0, M, device=device)[:, None]
    x = (torch.randn(M, K, device=device) * row_scale).to(dtype)
    w = (torch.randn(rows, K, device=device) / K**0.5).to(dtype)
    g = (1 + 0.5 * torch.randn(K, device=device)).to(dtype)
    b = torch.randn(rows, device=device).to(dtype)
    r = torch.randn(M, N_out, device=device).to(dtype)
    return x, w, g, b, r


def _run(M, N_out, K, dtype, *, gated, norm, with_g=True, bias=False, residual=False, split_k=None,
         device=DEV, config=None, tuning=None):
    x, w, g, b, r = _inputs(M, N_out, K, dtype, gated, device)
    out = torch.full((M, N_out), float("nan"), dtype=dtype, device=device)
    small_m_linear(x, w, out, bias=b if bias else None, residual=r if residual else None,
                   split_k=split_k, norm_eps=EPS if norm else None,
                   norm_weight=g if norm and with_g else None, gated=gated, config=config,
                   **({} if tuning is None else {"tuning": tuning}))
    expected = _reference(x, w, g=g if with_g else None, norm=norm, gated=gated,
                          bias=b if bias else None, residual=r if residual else None)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("split_k", [1, 3])
def test_norm_prologue(dtype, M, split_k):
    # K = 100 is ragged against every BLOCK_K; split 3 sums the squares per split and the
    # reduce applies 1 / rms.
    _run(M, 24, 100, dtype, gated=False, norm=True, bias=True, split_k=split_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 16])
@pytest.mark.parametrize("split_k", [1, 2])
def test_gated_epilogue(dtype, M, split_k):
    _run(M, 40, 96, dtype, gated=True, norm=False, split_k=split_k)


@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("split_k", [1, 3])
def test_norm_and_gate_together(M, split_k):
    _run(M, 20, 80, torch.float32, gated=True, norm=True, bias=True, split_k=split_k)


@pytest.mark.parametrize("M", [1, 2])
def test_norm_without_weight_and_residual(M):
    _run(M, 32, 64, torch.float32, gated=False, norm=True, with_g=False, residual=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [5, 16, 33])
@pytest.mark.parametrize("fusion", ["plain", "norm", "gated", "norm+gated"])
@pytest.mark.parametrize("split", [1, 3])
def test_swapped_operands(dtype, M, fusion, split):
    # BLOCK_N = 64 at 16-row blocks swaps the MMA operands (weight tile on the M side). N = 70 is
    # ragged against the 64-wide block; K = 200 against the 64-wide K tile (4 tiles, so 3 splits
    # really split); M = 33 spans two row blocks.
    config = (64, 64, split, 4, 2)
    _run(M, 70, 200, dtype, gated="gated" in fusion, norm="norm" in fusion, bias=True,
         residual=True, config=config)


def test_gated_split_uses_a_double_workspace():
    M, N, K = 2, 16, 4096  # four 1024-wide K tiles at M=2, so split_k=4 holds
    assert workspace_size(M, N, 4, gated=True) == 2 * workspace_size(M, N, 4)
    x, w, g, b, r = _inputs(M, N, K, torch.float32, gated=True)
    out = torch.empty(M, N, device=DEV)
    with pytest.raises(ValueError, match="workspace must be contiguous with >= 256"):
        small_m_linear(x, w, out, workspace=torch.empty(workspace_size(M, N, 4), device=DEV),
                       split_k=4, gated=True)


def test_norm_split_keeps_its_sums_of_squares_in_the_workspace():
    M, N, K = 2, 16, 4096
    assert workspace_size(M, N, 4, norm=True) == workspace_size(M, N, 4) + 4 * M
    assert workspace_size(M, N, 1, norm=True) == 0
    x, w, g, b, r = _inputs(M, N, K, torch.float32, gated=False)
    out = torch.empty(M, N, device=DEV)
    with pytest.raises(ValueError, match=f"workspace must be contiguous with >= {4 * M * (N + 1)}"):
        small_m_linear(x, w, out, workspace=torch.empty(workspace_size(M, N, 4), device=DEV),
                       split_k=4, norm_eps=EPS, norm_weight=g)
    # A workspace full of NaN: every element the kernels read must be written first.
    ws = torch.full((workspace_size(M, N, 4, norm=True),), float("nan"), device=DEV)
    small_m_linear(x, w, out, workspace=ws, split_k=4, norm_eps=EPS, norm_weight=g)
    torch.testing.assert_close(out.double(), _reference(x, w, g=g, norm=True), rtol=1e-5, atol=1e-5)


def test_fusion_arguments_are_checked():
    x, w, g, b, r = _inputs(2, 16, 64, torch.float32, gated=True)
    out = torch.empty(2, 16, device=DEV)
    with pytest.raises(ValueError, match="norm_weight needs norm_eps"):
        small_m_linear(x, w, out, norm_weight=g, gated=True)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        small_m_linear(x, w, out, norm_eps=EPS, norm_weight=g[:10], gated=True)
    with pytest.raises(TypeError, match="norm_weight dtype"):
        small_m_linear(x, w, out, norm_eps=EPS, norm_weight=g.half(), gated=True)
    with pytest.raises(ValueError, match="even row count"):
        small_m_linear(x, w[:31], out, gated=True)
    with pytest.raises(ValueError, match="out must have shape"):
        small_m_linear(x, w, torch.empty(2, 32, device=DEV), gated=True)
    with pytest.raises(ValueError, match="norm_eps must be"):
        small_m_linear(x, w, out, norm_eps=-1.0, gated=True)


def test_gated_config_halves_the_m1_block():
    # Same K tile, warps and stages as the norm-fused linear, half its output rows per program.
    norm = choose_config(1, 8192, 2048, "cpu", norm=True)
    gated = choose_config(1, 8192, 2048, "cpu", gated=True)
    assert gated[0] * 2 == norm[0] and gated[1:] == norm[1:]


def test_fused_configs_swap_the_operands_at_16_rows():
    # A fused norm or gate at 16-row blocks takes 64 weight rows per program (swapped operands)
    # and no split; the stages fit 227 KB of shared memory: 4 x (64 + 16) x 256 x 2 B with one
    # weight tile, 3 x (2 x 64 + 16) x 256 x 2 B with two, and fp32 halves the K tile.
    assert choose_config(16, 3072, 2048, "cpu", norm=True) == (64, 256, 1, 4, 4)
    assert choose_config(16, 8192, 2048, "cpu", gated=True, norm=True) == (64, 256, 1, 4, 3)
    assert choose_config(16, 8192, 2048, "cpu", gated=True) == (64, 128, 1, 4, 4)
    assert choose_config(16, 8192, 2048, "cpu", gated=True, norm=True, itemsize=4)[:2] == (64, 128)
    # Unfused 16-row linears keep narrow column blocks and split to fill the GPU.
    assert choose_config(16, 2048, 2048, "cpu")[0] == 16
    # 2-4 rows are padded to the same 16-row tiles.
    assert choose_config(4, 3072, 2048, "cpu", norm=True) == (64, 256, 1, 4, 4)
    assert choose_config(2, 8192, 2048, "cpu", gated=True, norm=True) == (64, 256, 1, 4, 3)


def test_config_overrides_replace_the_heuristic_for_their_shape():
    from tgraph.tuning import GemvConfig, GemvOverride, GemvTuning

    # (M bucket, N, K, gated, norm) -> launch
    override = GemvOverride(block_m=16, n=70, k=200, gated=False, norm=True,
                            config=GemvConfig(16, 64, 2, 4, 2))
    tuning = GemvTuning(overrides=(override,))
    assert choose_config(9, 70, 200, "cpu", norm=True, tuning=tuning) == (16, 64, 2, 4, 2)
    assert choose_config(9, 70, 200, "cpu", norm=True) != (16, 64, 2, 4, 2)  # default tuning
    assert choose_config(9, 70, 200, "cpu", tuning=tuning) != (16, 64, 2, 4, 2)  # another key
    # The overridden launch (16-column blocks, 2 splits with the norm pre-pass) is still exact.
    _run(9, 70, 200, torch.float32, gated=False, norm=True, bias=True, tuning=tuning)


# --------------------------------------------------------------------------- GPU, real shapes

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("shape", [(3072, 2048), (8192, 2048), (6144, 4096), (14336, 4096),
                                   (4864, 896)])
def test_gpu_fused_real_shapes(shape, M, dtype):
    N, K = shape
    _run(M, N, K, dtype, gated=False, norm=True, bias=True, device="cuda")
    _run(M, N, K, dtype, gated=True, norm=True, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [5, 16])
@pytest.mark.parametrize("shape", [(3072, 2048), (2048, 8192), (8192, 2048), (4864, 896)])
def test_gpu_swapped_operands_real_shapes(shape, M):
    N, K = shape
    for split in (1, 4):
        config = (64, 256 if K < 8192 else 128, split, 4, 4)
        _run(M, N, K, torch.bfloat16, gated=False, norm=False, residual=True, config=config,
             device="cuda")
        _run(M, N, K, torch.bfloat16, gated=False, norm=True, bias=True, config=config,
             device="cuda")
        # Two weight tiles and the activations' tile per stage: 128-wide K tiles fit 4 stages.
        _run(M, N, K, torch.bfloat16, gated=True, norm=False, config=(64, 128, split, 4, 4),
             device="cuda")
        _run(M, N, K, torch.bfloat16, gated=True, norm=True, config=config[:4] + (3,),
             device="cuda")
