"""The LoRA shrink with its producer folded in (``lora_prologue_concat``): RMSNorm or residual
add + RMSNorm, then ``[x | scaled shrink]``, in one launch; and the graph ops' Triton wrappers,
which take the two-launch path where the one-launch kernel does not apply.

Against the composed torch references (``tgraph.ir.ops.lora``), through Triton's interpreter on
CPU. Tolerances (``max|got - ref| / max|ref|``) by dtype, as in ``test_lora_split``: fp32 1e-5,
fp16 2e-3, bf16 1e-2, doubled for the ``x`` columns and the shrink: the producer's value is
rounded to the dtype (as the unfused kernel stores it) where the reference may round a
differently accumulated rsqrt one ulp apart. The sum of the residual add is exact (to within
the interpreter's bf16 rounding).
"""
from __future__ import annotations

import pytest
import torch

from tgraph.ir.ops.lora import add_rms_norm_lora_concat_reference, rms_norm_lora_concat_reference
from tgraph.kernels.triton import lora as lora_kernels
from tgraph.kernels.triton import lora_rows
from tgraph.kernels.triton.lora import lora_prologue_concat, lora_segments, new_lora_counters
from tgraph.kernels.triton_backend.lora import (
    add_rms_norm_lora_concat_into,
    rms_norm_lora_concat_into,
)
from tgraph.tuning import Tuning

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
EPS = 1e-5


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not got.isnan().any(), "unwritten (NaN) elements"
    got, ref = got.double(), ref.double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _case(prologue: str, T: int, K: int, R: int, L: int, dtype: torch.dtype):
    """Producer inputs, stacked A of scale 1/sqrt(K) (slot s has rank R - 2s) and the slots."""
    g = torch.Generator(device="cpu").manual_seed(T * 1000 + K)
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEV)  # noqa: E731
    x = rnd(T, K).to(dtype)
    a = rnd(L, R, K) / K ** 0.5
    for s in range(L):
        a[s, max(1, R - 2 * s):] = 0
    args = {"x": x, "a": a.to(dtype), "scaling": torch.rand(L, generator=g).to(DEV) + 0.5,
            "slots": torch.tensor([[0, 1, 2, L - 1][i % 4] for i in range(T)], dtype=torch.int32,
                                  device=DEV),
            "w": (torch.rand(K, generator=g).to(DEV) + 0.5).to(dtype)}
    if prologue == "add_rms_norm":
        args["r"] = rnd(T, K).to(dtype)
    return args


def _reference(prologue: str, c: dict, lead: int, width: int):
    order, seg = lora_segments(c["slots"], c["a"].shape[0])
    lora = (c["a"], c["scaling"], c["slots"], order, seg, None)
    if prologue == "rms_norm":
        return rms_norm_lora_concat_reference(c["x"], c["w"], *lora, eps=EPS, lead=lead,
                                              width=width), None
    return add_rms_norm_lora_concat_reference(c["x"], c["r"], c["w"], *lora, eps=EPS, lead=lead,
                                              width=width)


def _check(prologue, c, out, summed, lead, width, dtype) -> None:
    want, want_sum = _reference(prologue, c, lead, width)
    K = c["a"].shape[2]
    assert _rel(out[:, :K], want[:, :K]) <= TOL[dtype], "x columns"
    lora, want_lora = out[:, K:], want[:, K:]
    assert (lora[want_lora == 0] == 0).all(), "columns outside the slot's block must be zero"
    assert _rel(lora, want_lora) <= TOL[dtype], "shrink columns"
    if want_sum is not None:
        # Rounded once from the fp32 sum, as torch rounds it; Triton's interpreter rounds fp32 to
        # bf16 its own way (at most 1 ulp apart, seen in the rope tests too).
        ulp = 2 ** -7 if dtype == torch.bfloat16 and not summed.is_cuda else 0.0
        torch.testing.assert_close(summed, want_sum, rtol=ulp, atol=0.0)


@pytest.mark.parametrize("prologue", ["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 6, 16])
def test_one_launch_matches_the_composed_reference(prologue, dtype, T):
    # K 96 in one 128-wide tile, ranks in chunks of 8 (R 12: two chunks), lead 5 and 3 pad columns.
    K, R, L, lead = 96, 12, 5, 5
    width = lead + (L - 1) * R + 3
    c = _case(prologue, T, K, R, L, dtype)
    out = torch.full((T, K + width), float("nan"), dtype=dtype, device=DEV)
    summed = torch.full((T, K), float("nan"), dtype=dtype, device=DEV)
    lora_prologue_concat(prologue, c["x"], c["a"], c["scaling"], c["slots"], out, lead=lead,
                         residual=c.get("r"), norm_weight=c.get("w"),
                         summed=summed if prologue == "add_rms_norm" else None, eps=EPS)
    _check(prologue, c, out, summed, lead, width, dtype)


def test_rows_longer_than_a_chunk_are_refused(monkeypatch):
    # The norm needs the whole row in one program: longer rows take the two-launch path.
    monkeypatch.setattr(lora_rows, "_ROWS_CHUNK_ELEMS", 64)
    K, R, L = 200, 4, 3
    out = torch.full((5, K + (L - 1) * R), float("nan"), device=DEV)
    assert not lora_kernels.prologue_fits("rms_norm", 5, K)
    n = _case("rms_norm", 5, K, R, L, torch.float32)
    with pytest.raises(ValueError, match="not a decode batch this kernel takes"):
        lora_prologue_concat("rms_norm", n["x"], n["a"], n["scaling"], n["slots"], out,
                             norm_weight=n["w"], eps=EPS)


def test_rejects_bad_input():
    K, R, L = 32, 4, 3
    c = _case("add_rms_norm", 4, K, R, L, torch.float32)
    out = torch.empty(4, K + (L - 1) * R, device=DEV)
    summed = torch.empty(4, K, device=DEV)
    common = dict(residual=c["r"], norm_weight=c["w"], summed=summed, eps=EPS)
    args = (c["x"], c["a"], c["scaling"], c["slots"], out)
    with pytest.raises(ValueError, match="unknown prologue 'gelu'"):
        lora_prologue_concat("gelu", *args, **common)
    with pytest.raises(ValueError, match=r"x must be \[T, 32\] to match lora_a"):
        lora_prologue_concat("rms_norm", c["x"][:, :16], *args[1:], norm_weight=c["w"], eps=EPS)
    with pytest.raises(ValueError, match=r"norm_weight must be torch.float32 \[32\]"):
        lora_prologue_concat("add_rms_norm", *args, **dict(common, norm_weight=c["w"][:8]))
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        lora_prologue_concat("add_rms_norm", *args, **dict(common, eps=None))
    with pytest.raises(ValueError, match=r"residual must be torch.float32 \[4, 32\]"):
        lora_prologue_concat("add_rms_norm", *args, **dict(common, residual=c["r"][:2]))
    with pytest.raises(ValueError, match="summed must not overlap x or residual"):
        lora_prologue_concat("add_rms_norm", *args, **dict(common, summed=c["r"]))
    with pytest.raises(ValueError, match=r"out must be torch.float32 \[4, >= 40\]"):
        lora_prologue_concat("add_rms_norm", c["x"], c["a"], c["scaling"], c["slots"],
                             out[:, :39], **common)
    many = _case("rms_norm", 65, K, R, L, torch.float32)
    with pytest.raises(ValueError, match="65 tokens of 32 features is not a decode batch"):
        lora_prologue_concat("rms_norm", many["x"], many["a"], many["scaling"], many["slots"],
                             torch.empty(65, K + 8, device=DEV), norm_weight=many["w"], eps=EPS)


# ---- the graph ops' Triton wrappers --------------------------------------------------------------

def _wrapper_call(prologue: str, c: dict, width: int, summed_aliases_residual: bool = False):
    T, K = c["x"].shape[0], c["a"].shape[2]
    order, seg = lora_segments(c["slots"], c["a"].shape[0])
    lora = (c["a"], c["scaling"], c["slots"], order, seg, new_lora_counters(DEV))
    out = torch.full((T, K + width), float("nan"), dtype=c["x"].dtype, device=DEV)
    if prologue == "rms_norm":
        rms_norm_lora_concat_into([out], c["x"], c["w"], *lora, tuning=Tuning(), eps=EPS, lead=0,
                                  width=width)
        return out, None
    residual = c["r"].clone() if summed_aliases_residual else c["r"]
    summed = residual if summed_aliases_residual else torch.empty_like(c["r"])
    add_rms_norm_lora_concat_into([out, summed], c["x"], residual, c["w"], *lora,
                                  tuning=Tuning(), eps=EPS, lead=0, width=width)
    return out, summed


@pytest.mark.parametrize("prologue", ["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("T, fused", [(5, True), (70, False)], ids=["decode", "prefill"])
def test_graph_op_wrappers(prologue, T, fused, monkeypatch):
    # Decode batches take the one-launch kernel; more than 64 tokens the producer's own kernel
    # writes x into the operand and the slot-tile shrink follows.
    launched = []
    one_launch = lora_kernels.lora_prologue_concat
    monkeypatch.setattr(lora_kernels, "lora_prologue_concat",
                        lambda *a, **k: launched.append(a[0]) or one_launch(*a, **k))
    K, R, L = 48, 8, 3
    c = _case(prologue, T, K, R, L, torch.float32)
    out, summed = _wrapper_call(prologue, c, (L - 1) * R)
    _check(prologue, c, out, summed, 0, (L - 1) * R, torch.float32)
    assert launched == ([prologue] if fused else [])


def test_add_rms_norm_wrapper_with_the_sum_in_place_of_the_residual():
    # An engine may plan the sum in the residual's buffer: the one-launch kernel would read
    # residual rows other programs are overwriting, so the wrapper takes the two-launch path.
    K, R, L = 48, 8, 3
    c = _case("add_rms_norm", 6, K, R, L, torch.float32)
    out, summed = _wrapper_call("add_rms_norm", c, (L - 1) * R, summed_aliases_residual=True)
    _check("add_rms_norm", c, out, summed, 0, (L - 1) * R, torch.float32)


# ---- GPU: the decode shapes of the LoRA benchmark ------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prologue, K, R", [("rms_norm", 2048, 48), ("add_rms_norm", 2048, 32)],
                         ids=["qkv", "gate_up"])
def test_gpu_decode_shapes_and_graph_replay(prologue, K, R, dtype):
    # Llama-3.2-1B at batch 16 with 4 adapters (5 slots): one launch, captured in a CUDA graph
    # and replayed on new inputs; a replay of the same inputs is bit-identical.
    from tests.helpers import capture_cuda_graph

    T, L = 16, 5
    width = (L - 1) * R
    c = _case(prologue, T, K, R, L, dtype)
    out = torch.full((T, K + width), float("nan"), dtype=dtype, device="cuda")
    summed = torch.empty(T, K, dtype=dtype, device="cuda")

    def step():
        lora_prologue_concat(prologue, c["x"], c["a"], c["scaling"], c["slots"], out,
                             residual=c.get("r"), norm_weight=c.get("w"),
                             summed=summed if prologue == "add_rms_norm" else None, eps=EPS)

    graph = capture_cuda_graph(step)
    for _ in range(2):
        c["x"].copy_(torch.randn_like(c["x"]))
        c["slots"].copy_(torch.randint(0, L, (T,), dtype=torch.int32, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(prologue, c, out, summed, 0, width, dtype)
        first = out.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
