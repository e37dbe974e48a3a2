"""The stacked shrink: one launch writes ``[x | first set's columns | second set's columns]`` of a
LoRA linear with two adapter sets (multi-LoRA's stack and the always-on single adapter), with or
without the RMSNorm (+ residual add) before it folded in.

Against the op's torch reference (``tgraph.ir.ops.lora``: the composition of the one-set
references), through Triton's interpreter on CPU (fp32 / fp16: the interpreter rounds fp32 to
bf16 its own way); ``gpu`` tests take the Llama-3.2-1B decode shapes in bf16 / fp16. Errors are
``max|got - ref| / max|ref|`` over the LoRA columns: fp32 2e-5, fp16 4e-3, bf16 2e-2 (one
rounding of an fp32 sum, doubled where the norm's output is rounded before the shrink, as in
``test_lora_prologue``). The copied ``x`` columns are exact without a norm, and every column
outside a token's slot blocks is an exact zero.
"""
from __future__ import annotations

import pytest
import torch

from tgraph.ir.ops.lora import (
    add_rms_norm_lora_concat_reference,
    lora_shrink_concat_reference,
    rms_norm_lora_concat_reference,
)
from tgraph.kernels.triton import lora as lora_kernels
from tgraph.kernels.triton import lora_tile
from tgraph.kernels.triton.lora import (
    AdapterSet,
    lora_concat_splits,
    lora_prologue_concat,
    lora_segments,
    lora_shrink_concat,
    new_lora_counters,
)
from tgraph.kernels.triton_backend.lora import (
    add_rms_norm_lora_concat_into,
    lora_shrink_concat_into,
    rms_norm_lora_concat_into,
)
from tgraph.tuning import Tuning

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
EPS = 1e-5
# Multi's stack (L slots of rank R) then the single adapter (2 slots: every token in slot 1).
K, L, R, R2 = 96, 4, 8, 12
LEAD, LEAD2 = 3, 2
WIDTH = LEAD + (L - 1) * R + 5   # lead, 3 slot blocks, padding
WIDTH2 = LEAD2 + R2 + 3
LAYOUT = (LEAD, WIDTH, LEAD2, WIDTH2)


def _case(T: int, dtype: torch.dtype, prologue: str = "none", mixed_second: bool = False,
          k: int = K, r: int = R, r2: int = R2, num_slots: int = L, device: str = DEV) -> dict:
    """Inputs of scale O(1): x (or the norm's inputs), both sets' A of scale 1/sqrt(K), slots
    cycling through "no adapter" and every adapter; the second set's slots all 1 (the single
    adapter), or mixed with 0 (``mixed_second``)."""
    g = torch.Generator().manual_seed(T * 7 + k)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    a = rnd(num_slots, r, k) / k ** 0.5
    a[1, r // 2:] = 0  # slot 1 of a smaller rank: zero-padded rows
    slots2 = torch.ones(T, dtype=torch.int64)
    if mixed_second:
        slots2[1::3] = 0
    c = {"x": rnd(T, k), "a": a, "scaling": torch.rand(num_slots, generator=g) + 0.5,
         "slots": torch.tensor([(i + 1) % num_slots for i in range(T)], dtype=torch.int32),
         "a2": rnd(2, r2, k) / k ** 0.5, "scaling2": torch.tensor([0.0, 1.0]),
         "slots2": slots2, "w": torch.rand(k, generator=g) + 0.5}
    if prologue == "add_rms_norm":
        c["r"] = rnd(T, k)
    for name in ("x", "a", "a2", "w", "r"):
        if name in c:
            c[name] = c[name].to(dtype)
    return {n: v.to(device) for n, v in c.items()}


def _lora_inputs(c: dict) -> tuple[tuple, tuple]:
    """The op's two sets of six inputs (segments computed, fresh zeroed counters)."""
    device = c["x"].device
    first = (c["a"], c["scaling"], c["slots"], *lora_segments(c["slots"], c["a"].shape[0]),
             new_lora_counters(device))
    second = (c["a2"], c["scaling2"], c["slots2"], *lora_segments(c["slots2"], 2),
              new_lora_counters(device))
    return first, second


def _reference(c: dict, prologue: str, layout: tuple[int, int, int, int]):
    first, second = _lora_inputs(c)
    lead, width, lead2, width2 = layout
    layout = dict(lead=lead, width=width, second_lead=lead2, second_width=width2)
    if prologue == "none":
        return lora_shrink_concat_reference(c["x"], *first, *second, **layout), None
    if prologue == "rms_norm":
        return rms_norm_lora_concat_reference(c["x"], c["w"], *first, *second, eps=EPS,
                                              **layout), None
    return add_rms_norm_lora_concat_reference(c["x"], c["r"], c["w"], *first, *second, eps=EPS,
                                              **layout)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not got.isnan().any(), "unwritten (NaN) elements"
    got, ref = got.double(), ref.double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _check(c: dict, out: torch.Tensor, summed: torch.Tensor | None, prologue: str,
           dtype: torch.dtype, layout: tuple[int, int, int, int] = LAYOUT) -> None:
    want, want_sum = _reference(c, prologue, layout)
    width = layout[1]
    k = c["a"].shape[2]
    assert out.shape == want.shape
    if prologue == "none":
        assert torch.equal(out[:, :k], want[:, :k]), "x columns"
    else:
        assert _rel(out[:, :k], want[:, :k]) <= TOL[dtype], "x columns"
    lora, want_lora = out[:, k:], want[:, k:]
    assert (lora[want_lora == 0] == 0).all(), "columns outside the tokens' blocks must be zero"
    for cols, what in ((slice(0, width), "first set"), (slice(width, None), "second set")):
        assert _rel(lora[:, cols], want_lora[:, cols]) <= TOL[dtype], what
    # Both sets wrote something: a kernel that dropped one would leave its block zero.
    assert want_lora[:, :width].abs().sum() > 0 and want_lora[:, width:].abs().sum() > 0
    if want_sum is not None:
        torch.testing.assert_close(summed, want_sum, rtol=0.0, atol=0.0)


def _out(T: int, dtype: torch.dtype, width: int = WIDTH, width2: int = WIDTH2,
         k: int = K) -> torch.Tensor:
    return torch.full((T, k + width + width2), float("nan"), dtype=dtype, device=DEV)


def _second(c: dict, counters: torch.Tensor | None = None, segments: bool = True) -> AdapterSet:
    seg = lora_segments(c["slots2"], 2) if segments else None
    return AdapterSet(c["a2"], c["scaling2"], c["slots2"],
                      new_lora_counters(DEV) if counters is None else counters, LEAD2, seg)


# ---- the kernel ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, rows, splits", [
    (1, True, None), (6, True, None), (16, True, None),   # decode: the per-token kernel
    (20, False, 1), (20, False, 3),                        # slot tiles, unsplit / split K
    (150, False, None),                                    # prefill-sized: 64-token tiles
], ids=["rows1", "rows6", "rows16", "tiles20", "split20", "prefill150"])
@pytest.mark.parametrize("mixed_second", [False, True], ids=["always-on", "mixed"])
def test_stacked_shrink_matches_the_reference(dtype, T, rows, splits, mixed_second):
    c = _case(T, dtype, mixed_second=mixed_second)
    out = _out(T, dtype)
    counters = new_lora_counters(DEV)
    counters2 = new_lora_counters(DEV)
    lora_shrink_concat(c["x"], c["a"], c["scaling"], c["slots"], out, counters, lead=LEAD,
                       width=WIDTH, rows=rows if splits is None else None, splits=splits,
                       second=_second(c, counters2, segments=T != 20))
    _check(c, out, None, "none", dtype)
    assert not counters.any() and not counters2.any(), "counters must be left zeroed"


def test_second_set_keeps_the_first_sets_split():
    # The second set's tiles run at the first set's split: the stacked launch sums the first
    # set's K as the one-set launch of the same tokens does (same BLOCK_R: the larger rank's).
    for T in (1, 16, 65, 100, 119, 128, 300, 1024, 4096):
        for k, r, r2, slots, slots2 in ((2048, 48, 48, 4, 2), (8192, 16, 16, 4, 2),
                                        (8192, 16, 64, 5, 2), (2048, 16, 8, 2, 9)):
            assert lora_concat_splits(T, k, r, slots, "cpu", second_rank=r2,
                                      second_slots=slots2) == \
                lora_concat_splits(T, k, max(r, r2), slots, "cpu"), (T, k, r, r2, slots, slots2)
    assert lora_concat_splits(16, 2048, 0, 5, "cpu", second_rank=16, second_slots=2) >= 1
    # More tiles than one set's counters: one split.
    assert lora_concat_splits(4096, 2048, 16, 5, "cpu", max_tiles=8, second_rank=16,
                              second_slots=2) == 1


def test_padding_the_batch_leaves_the_real_rows_bit_identical(monkeypatch):
    # A captured prefill pads its tokens (first set: slot 0; second set: the single adapter's
    # slot 1, as the features pad); the second set's grid grows with the pad tokens. With 14 SMs
    # the one-set launch splits K 4 ways at 20 and at 32 tokens, while counting both sets' tiles
    # would split 4 and 3 ways: fp32 partials summed in another grouping, other bits.
    monkeypatch.setattr(lora_tile, "sm_count", lambda device: 14)
    k, real, padded = 1024, 20, 32
    c = _case(padded, torch.float32, k=k)
    c["slots"][real:] = 0
    for T in (real, padded):
        assert lora_concat_splits(T, k, R, L, DEV) == 4
        assert lora_concat_splits(T, k, R, L, DEV, second_rank=R2, second_slots=2) == 4
    outs = []
    for T in (real, padded):
        out = _out(T, torch.float32, k=k)
        second = AdapterSet(c["a2"], c["scaling2"], c["slots2"][:T], new_lora_counters(DEV),
                            LEAD2, (torch.arange(T, dtype=torch.int32, device=DEV),
                                    torch.tensor([0, 0, T], dtype=torch.int32, device=DEV)))
        lora_shrink_concat(c["x"][:T], c["a"], c["scaling"], c["slots"][:T], out,
                           new_lora_counters(DEV), lead=LEAD, width=WIDTH, rows=False,
                           second=second)
        outs.append(out)
    assert torch.equal(outs[0], outs[1][:real])
    # ... and the first set's columns are the one-set launch's, bit for bit.
    one = _out(real, torch.float32, width2=0, k=k)
    lora_shrink_concat(c["x"][:real], c["a"], c["scaling"], c["slots"][:real], one,
                       new_lora_counters(DEV), lead=LEAD, rows=False)
    assert torch.equal(outs[0][:, :k + WIDTH], one)


@pytest.mark.parametrize("prologue", ["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 6, 16])
def test_stacked_prologue_matches_the_reference(prologue, dtype, T):
    c = _case(T, dtype, prologue, mixed_second=T == 6)
    out = _out(T, dtype)
    summed = torch.full((T, K), float("nan"), dtype=dtype, device=DEV)
    lora_prologue_concat(prologue, c["x"], c["a"], c["scaling"], c["slots"], out, lead=LEAD,
                         residual=c.get("r"), norm_weight=c["w"],
                         summed=summed if prologue == "add_rms_norm" else None, eps=EPS,
                         width=WIDTH, second=_second(c))
    _check(c, out, summed if prologue == "add_rms_norm" else None, prologue, dtype)


def test_rejects_a_bad_second_set():
    c = _case(4, torch.float32)
    out = _out(4, torch.float32)
    args = (c["x"], c["a"], c["scaling"], c["slots"], out, new_lora_counters(DEV))
    with pytest.raises(ValueError, match="width .* must be an int >= 27"):
        lora_shrink_concat(*args, lead=LEAD, second=_second(c))
    with pytest.raises(ValueError, match=r"width 20 must be out's 49 columns after x"):
        lora_shrink_concat(*args, lead=LEAD, width=20)
    with pytest.raises(ValueError, match=r"second.lora_a must be torch.float32 \[L2, R2, 96\]"):
        lora_shrink_concat(*args, lead=LEAD, width=WIDTH,
                           second=_second(c)._replace(lora_a=c["a2"][:, :, :32]))
    with pytest.raises(ValueError, match=r"out must have >= 160 columns"):
        lora_shrink_concat(*args, lead=LEAD, width=WIDTH, second=_second(c)._replace(lead=20))
    with pytest.raises(ValueError, match=r"token_slots must have shape \[4\]"):
        lora_shrink_concat(*args, lead=LEAD, width=WIDTH,
                           second=_second(c)._replace(token_slots=c["slots2"][:2]))
    with pytest.raises(TypeError, match="second must be an AdapterSet"):
        lora_shrink_concat(*args, lead=LEAD, width=WIDTH, second=tuple(_second(c)))


# ---- the graph ops' Triton wrappers -------------------------------------------------------------
def _count_launches(monkeypatch) -> list[str]:
    """The shrink launches (one-set or stacked) the wrappers make, by entry point."""
    launched: list[str] = []
    for name in ("lora_shrink_concat", "lora_prologue_concat"):
        fn = getattr(lora_kernels, name)
        monkeypatch.setattr(lora_kernels, name,
                            lambda *a, _fn=fn, _name=name, **k: launched.append(_name)
                            or _fn(*a, **k))
    return launched


@pytest.mark.parametrize("prologue", ["none", "rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("T, one_launch", [(5, True), (70, False)], ids=["decode", "prefill"])
def test_graph_op_wrappers_launch_one_stacked_shrink(prologue, T, one_launch, monkeypatch):
    # Decode: one launch writes the norm's output, both sets' columns (and the sum). Prefill:
    # the norm's own kernel, then one stacked shrink.
    launched = _count_launches(monkeypatch)
    c = _case(T, torch.float32, prologue)
    first, second = _lora_inputs(c)
    out = _out(T, torch.float32)
    layout = dict(tuning=Tuning(), lead=LEAD, width=WIDTH, second_lead=LEAD2,
                  second_width=WIDTH2)
    summed = None
    if prologue == "none":
        lora_shrink_concat_into([out], c["x"], *first, *second, **layout)
    elif prologue == "rms_norm":
        rms_norm_lora_concat_into([out], c["x"], c["w"], *first, *second, eps=EPS, **layout)
    else:
        summed = torch.empty_like(c["r"])
        add_rms_norm_lora_concat_into([out, summed], c["x"], c["r"], c["w"], *first, *second,
                                      eps=EPS, **layout)
    _check(c, out, summed, prologue, torch.float32)
    fused = prologue != "none" and one_launch
    assert launched == ["lora_prologue_concat" if fused else "lora_shrink_concat"]


def test_wrapper_refuses_a_buffer_without_the_second_sets_columns():
    c = _case(4, torch.float32)
    first, second = _lora_inputs(c)
    out = _out(4, torch.float32, width2=0)
    with pytest.raises(ValueError, match=f"must have K \\+ width = {K + WIDTH + WIDTH2} columns"):
        lora_shrink_concat_into([out], c["x"], *first, *second, tuning=Tuning(), lead=LEAD,
                                width=WIDTH, second_lead=LEAD2, second_width=WIDTH2)


# ---- GPU: the decode shapes of the LoRA benchmark -----------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prologue, k, r", [("rms_norm", 2048, 48), ("add_rms_norm", 2048, 32),
                                            ("none", 8192, 16), ("none", 2048, 16)],
                         ids=["qkv", "gate_up", "down", "o"])
def test_gpu_stacked_decode_shapes_and_graph_replay(prologue, k, r, dtype):
    # Llama-3.2-1B at batch 16, 4 multi adapters (5 slots) + the single adapter: one launch per
    # adapted linear, captured in a CUDA graph and replayed on new inputs; a replay of the same
    # inputs is bit-identical.
    from tests.helpers import capture_cuda_graph

    T, slots = 16, 5
    width = (slots - 1) * r
    width2 = r
    c = _case(T, dtype, prologue, k=k, r=r, r2=r, num_slots=slots, device="cuda")
    first, second = _lora_inputs(c)
    out = torch.full((T, k + width + width2), float("nan"), dtype=dtype, device="cuda")
    summed = torch.empty(T, k, dtype=dtype, device="cuda") if prologue == "add_rms_norm" else None
    layout = dict(tuning=Tuning(), lead=0, width=width, second_lead=0, second_width=width2)

    def step():
        if prologue == "none":
            lora_shrink_concat_into([out], c["x"], *first, *second, **layout)
        elif prologue == "rms_norm":
            rms_norm_lora_concat_into([out], c["x"], c["w"], *first, *second, eps=EPS, **layout)
        else:
            add_rms_norm_lora_concat_into([out, summed], c["x"], c["r"], c["w"], *first, *second,
                                          eps=EPS, **layout)

    graph = capture_cuda_graph(step)
    for _ in range(2):
        c["x"].copy_(torch.randn_like(c["x"]))
        c["slots"].copy_(torch.randint(0, slots, (T,), dtype=torch.int32, device="cuda"))
        first, second = _lora_inputs(c)  # the reference's segments (the kernel needs none)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(c, out, summed, prologue, dtype, (0, width, 0, width2))
        once = out.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, once)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [300, 2048])
def test_gpu_stacked_prefill_tiles(T):
    # Prefill sizes: the slot-tile kernel, split K while the counters last (both sets' tiles).
    k, r, slots = 2048, 48, 5
    c = _case(T, torch.bfloat16, k=k, r=r, r2=r, num_slots=slots, device="cuda")
    counters, counters2 = new_lora_counters("cuda"), new_lora_counters("cuda")
    out = torch.full((T, k + (slots - 1) * r + r + LEAD + LEAD2), float("nan"),
                     dtype=torch.bfloat16, device="cuda")
    width = LEAD + (slots - 1) * r
    lora_shrink_concat(c["x"], c["a"], c["scaling"], c["slots"], out, counters, lead=LEAD,
                       width=width, second=_second(c, counters2))
    torch.cuda.synchronize()
    _check(c, out, None, "none", torch.bfloat16,
           (LEAD, width, LEAD2, out.shape[1] - k - width))
    assert not counters.any() and not counters2.any()
