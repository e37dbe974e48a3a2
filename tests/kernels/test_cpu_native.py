"""The CPU backend's compiled kernels (:mod:`tgraph.kernels.cpu_backend.native`) against fp64
references, their wiring into the CPU kernels, the loader's fallback and its cache.

Each kernel runs twice: as built for this machine (AVX-512 where it has it) and, on x86-64, built
with ``-mno-avx512f`` (the portable loops every other machine runs).

Tolerances (fp32, unit roundoff u = 2^-24) are bounds on summation-order error, computed from the
data: a dot product of K terms summed in any order is within (K + 2) u of the sum of |x| |w|
(+ |bias| + |residual|, each one more rounding), so ``|got - exact| <= (K + 2) u (|x| @ |w|.T +
|bias| + |res|)`` elementwise. The RMSNorm has the reference's bits (``torch.equal``); before a
linear it adds at most (K + 8) u relative error to each normed value (its sum of squares and
three roundings). SwiGLU (C's ``expf``): a few roundings and silu' <= 1.1 times the gate's error.
Attention: a score's error is delta <= (d + 2) u scale |q|.|k|; softmax turns it into at most
2 delta relative error of each weight, and the weighted sum of values adds (keys + 8) u, so
``|got - exact| <= max|v| (2 delta + (keys + 8) u)``. A wrong row, key or head is off by O(1),
far above these bounds.
"""
from __future__ import annotations

import dataclasses
import logging
import platform

import pytest
import torch

from tgraph.ir.ops import get_op
from tgraph.kernels.cpu_backend import attention, core
from tgraph.kernels.cpu_backend.native import NativeLibrary, build, library
from tgraph.tuning import Tuning

U = 2.0 ** -24


def _tuning(native: bool, **cpu) -> Tuning:
    t = Tuning()
    return dataclasses.replace(t, cpu=dataclasses.replace(t.cpu, native_kernels=native, **cpu))


@pytest.fixture(scope="module")
def built() -> NativeLibrary:
    if build.find_compiler() is None:
        pytest.skip("no C compiler: the CPU backend keeps torch's kernels")
    lib = library()
    assert lib is not None, "a compiler is there, yet the native kernels did not build"
    return lib


@pytest.fixture(scope="module")
def portable(built: NativeLibrary, tmp_path_factory: pytest.TempPathFactory) -> NativeLibrary:
    if platform.machine() not in ("x86_64", "AMD64"):
        return built  # already the portable loops
    path = build.build(tmp_path_factory.mktemp("portable"), extra_flags=("-mno-avx512f",))
    assert path is not None
    return NativeLibrary(path)


@pytest.fixture(params=["machine", "portable"])
def lib(request: pytest.FixtureRequest) -> NativeLibrary:
    return request.getfixturevalue("built" if request.param == "machine" else "portable")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - want).abs()
    worst = (err - bound).max()
    assert worst <= 0, f"{what}: error exceeds its bound by {worst:.3g} (max error {err.max():.3g})"


def _linear_bound(x: torch.Tensor, w: torch.Tensor, bias, res) -> torch.Tensor:
    scale = x.double().abs() @ w.double().abs().t()
    if bias is not None:
        scale = scale + bias.double().abs()
    if res is not None:
        scale = scale + res.double().abs()
    return (x.shape[1] + 2) * U * scale


@pytest.mark.parametrize("k", [1, 5, 16, 33, 100])
@pytest.mark.parametrize("n", [1, 3, 17, 131])
def test_linear_matches_fp64_at_every_small_m(lib: NativeLibrary, n: int, k: int) -> None:
    g = _gen(n * 1000 + k)
    for m in range(1, 9):
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        bias, res = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
        for b, r in ((None, None), (bias, None), (None, res), (bias, res)):
            out = torch.full((m, n), float("nan"))
            call = lib.bind_linear(out, x, w, b, r, torch.get_num_threads())
            assert call is not None
            call()
            want = x.double() @ w.double().t()
            want = want + (0 if b is None else b.double()) + (0 if r is None else r.double())
            _within(out, want, _linear_bound(x, w, b, r), f"linear m={m} n={n} k={k}")


def test_linear_strided_rows_residual_in_place_and_many_rows(lib: NativeLibrary) -> None:
    g = _gen(1)
    wide = torch.randn(70, 90, generator=g)
    x = wide[:, 3:67]  # rows 90 apart; 70 rows: two passes over the weights (64 at a time)
    w = torch.randn(37, 64, generator=g)
    out = torch.randn(70, 37, generator=g)
    res = out.clone()
    call = lib.bind_linear(out, x, w, None, out, 2)  # the residual is the output's memory
    assert call is not None
    call()
    _within(out, x.double() @ w.double().t() + res.double(), _linear_bound(x, w, None, res),
            "linear in place")
    assert lib.bind_linear(x[:, :37], x, w[:, :64], None, None, 2) is None  # out overlaps x
    assert lib.bind_linear(out, x, w.t().contiguous().t(), None, None, 2) is None  # w strided
    assert lib.bind_linear(out, x.double(), w, None, None, 2) is None


@pytest.mark.parametrize("swiglu", [False, True])
def test_row_strided_weights_give_the_contiguous_weights_bits(lib: NativeLibrary,
                                                             swiglu: bool) -> None:
    """A weight whose rows sit apart (a LoRA bank's view ``storage[:, :K]`` of ``[W | B]``) is
    read in place, with the same arithmetic as its contiguous copy: the same bits."""
    g = _gen(7)
    storage = torch.randn(48, 64 + 24, generator=g)
    w = storage[:, :64]
    x, nw = torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    got, want = torch.empty(3, 48), torch.empty(3, 48)
    for weight, out in ((w, got), (w.contiguous(), want)):
        lib.bind_linear(out, x, weight, None, None, 2)()
    assert torch.equal(got, want)
    width = 24 if swiglu else 48
    got, want = torch.empty(3, width), torch.empty(3, width)
    for weight, out in ((w, got), (w.contiguous(), want)):
        lib.bind_norm_linear(out, x, nw, 1e-5, weight, None, swiglu, 2)()
    assert torch.equal(got, want)


def _norm_reference(x: torch.Tensor, nw: torch.Tensor | None, eps: float) -> torch.Tensor:
    xd = x.double()
    normed = xd / (xd.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return normed if nw is None else normed * nw.double()


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("k, n", [(64, 96), (33, 18), (100, 6), (576, 2)])
def test_norm_linear_matches_fp64(lib: NativeLibrary, k: int, n: int, swiglu: bool) -> None:
    g = _gen(k + n)
    for m in (1, 2, 3, 5, 8):
        x = torch.randn(m, k, generator=g) * 3
        nw, w = torch.randn(k, generator=g), torch.randn(n, k, generator=g) / 4
        for norm_weight, bias in ((nw, None), (None, torch.randn(n, generator=g))):
            out = torch.full((m, n // 2 if swiglu else n), float("nan"))
            call = lib.bind_norm_linear(out, x, norm_weight, 1e-5, w, bias, swiglu, 2)
            assert call is not None
            call()
            normed = _norm_reference(x, norm_weight, 1e-5)
            y = normed @ w.double().t() + (0 if bias is None else bias.double())
            scale = normed.abs() @ w.double().abs().t()
            bound = (2 * k + 16) * U * (scale + (0 if bias is None else bias.double().abs()))
            if not swiglu:
                _within(out, y, bound, f"norm_linear m={m}")
                continue
            half = n // 2
            gate, up, eg, eu = y[:, :half], y[:, half:], bound[:, :half], bound[:, half:]
            silu = gate * torch.sigmoid(gate)
            want = silu * up
            _within(out, want, 1.1 * up.abs() * eg + silu.abs() * eu + 8 * U * want.abs(),
                    f"norm_linear + swiglu m={m}")


def test_norm_is_the_references_bits(lib: NativeLibrary) -> None:
    """Every row length up to a few vectors (each count of leftover vectors and scalars) and
    model widths: the squares are added in torch's order, so the bits are the reference's."""
    assert lib.norm_lanes is not None
    rms = get_op("rms_norm").reference
    g = _gen(2)
    for k in [*range(1, 80), 576, 1000, 1536, 4096, 8193]:
        for m in (1, 3):
            x, r, w = torch.randn(m, k, generator=g) * 3, torch.randn(m, k, generator=g), \
                torch.randn(k, generator=g)
            out, summed = torch.full((m, k), float("nan")), torch.full((m, k), float("nan"))
            call = lib.bind_rms_norm(out, x, w, 1e-5, 2, r, summed)
            assert call is not None
            call()
            assert torch.equal(summed, x + r), f"k={k}"  # one fp32 add, as torch's
            assert torch.equal(out, rms(x + r, w, eps=1e-5)), f"add + rms_norm k={k} m={m}"
            same = x.clone()
            lib.bind_rms_norm(same, same, None, 1e-6, 1)()  # in place, no weight
            assert torch.equal(same, rms(x, None, eps=1e-6)), f"rms_norm k={k} m={m}"


@pytest.mark.parametrize("k", [1, 7, 64, 100])
def test_swiglu_alone_matches_fp64(lib: NativeLibrary, k: int) -> None:
    g = _gen(k)
    for m in (1, 3, 9):
        gate_up = torch.randn(m, 2 * k, generator=g) * 4
        out = torch.full((m, k), float("nan"))
        lib.bind_swiglu(out, gate_up, 2)()
        gd, ud = gate_up[:, :k].double(), gate_up[:, k:].double()
        want = gd * torch.sigmoid(gd) * ud
        _within(out, want, 8 * U * want.abs(), f"swiglu m={m}")


@pytest.mark.parametrize("swiglu", [False, True])
def test_a_norm_has_the_same_bits_fused_or_not(swiglu: bool) -> None:
    """A norm (and SwiGLU) fused into a linear gives the bits of the norm, the linear and the
    SwiGLU as separate kernels, at any row count: a partition that splits them off changes no
    result."""
    g = _gen(11)
    tuning = _tuning(True)
    for m in (1, 4, 8, 12):  # 12: past native_max_rows, the norm native and torch's GEMM
        x, nw = torch.randn(m, 576, generator=g), torch.randn(576, generator=g)
        w = torch.randn(2 * 96 if swiglu else 96, 576, generator=g) / 8
        act = "swiglu" if swiglu else None
        fused = torch.empty(m, 96)
        core.norm_linear_into([fused], x, nw, w, tuning=tuning, eps=1e-5, act=act)
        normed, lin, alone = torch.empty(m, 576), torch.empty(m, w.shape[0]), torch.empty(m, 96)
        core.rms_norm_into([normed], x, nw, eps=1e-5, tuning=tuning)
        core.linear_into([lin], normed, w, tuning=tuning)
        if swiglu:
            core.swiglu_into([alone], lin, tuning=tuning)
        else:
            alone = lin
        assert torch.equal(fused, alone), f"m={m}"


def _attention_fp64(q_rot, k_cache, v_cache, table, seq_len, scale, window) -> tuple:
    """Per token: the fp64 attention over its keys, and the bound of the native kernel's
    error (see the module docstring)."""
    tokens, hq, d = q_rot.shape
    _, block, hk, _ = k_cache.shape
    group = hq // hk
    out, bound = torch.zeros(tokens, hq, d, dtype=torch.float64), torch.zeros(tokens, hq, 1,
                                                                              dtype=torch.float64)
    for b in range(tokens):
        n = int(seq_len[b])
        if n == 0:
            continue
        rows = [int(table[b, j // block]) * block + j % block for j in range(n)]
        first = n - window if window is not None and window < n else 0
        rows = rows[first:]
        kk = k_cache.reshape(-1, hk, d)[rows].double().repeat_interleave(group, 1)
        vv = v_cache.reshape(-1, hk, d)[rows].double().repeat_interleave(group, 1)
        qd = q_rot[b].double()
        probs = torch.softmax(torch.einsum("hd,khd->hk", qd, kk) * scale, -1)
        out[b] = torch.einsum("hk,khd->hd", probs, vv)
        delta = (d + 2) * U * scale * torch.einsum("hd,khd->hk", qd.abs(), kk.abs()).amax(-1)
        vmax = vv.abs().amax(dim=(0, 2))
        bound[b, :, 0] = vmax * (2 * delta + (len(rows) + 8) * U)
    return out, bound


@pytest.mark.parametrize("serial_scores", [0, 1 << 20])  # parallel over (sequence, kv head); one
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("hq, hk, d, half", [(4, 2, 16, 8), (6, 2, 24, 6), (3, 3, 20, 10)])
def test_rope_cache_attention_matches_the_reference(lib: NativeLibrary, hq: int, hk: int, d: int,
                                                    half: int, interleaved: bool,
                                                    window: int | None,
                                                    serial_scores: int) -> None:
    g = _gen(hq * d + half)
    tokens, block = 4, 4
    k_cache, v_cache = (torch.randn(12, block, hk, d, generator=g) for _ in range(2))
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g)  # views of one q|k|v row
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=1))
    cos, sin = torch.randn(tokens, half, generator=g), torch.randn(tokens, half, generator=g)
    # sequence 0 in two runs of blocks, 1 one run, 2 padding (nothing written, no keys), 3 a
    # block of its own (its first key, new)
    table = torch.tensor([[7, 2, 3], [4, 5, 0], [0, 0, 0], [9, 0, 0]], dtype=torch.int32)
    seq_len = torch.tensor([11, 6, 0, 1], dtype=torch.int32)
    slots = torch.tensor([3 * block + 2, 5 * block + 1, -1, 9 * block], dtype=torch.int32)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out = torch.full((tokens, hq, d), float("nan"))
    call = lib.bind_rope_cache_attention(out, q, k, v, cos, sin, k_cache, v_cache, slots, table,
                                         seq_len, interleaved, 0.3, window, serial_scores, 2)
    assert call is not None
    call()
    get_op("rope_cache").reference(q, k, v, cos, sin, ref_k, ref_v, slots,
                                   interleaved=interleaved)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # rope: the same bits
    q_rot, _ = get_op("rope").reference(q, k, cos, sin, interleaved=interleaved)
    want, bound = _attention_fp64(q_rot, ref_k, ref_v, table, seq_len, 0.3, window)
    _within(out, want, bound.expand_as(want), "rope_cache_attention")


def test_rope_cache_attention_refuses_what_it_does_not_take(built: NativeLibrary) -> None:
    q, k, v = torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    cos = sin = torch.randn(1, 8)
    k_cache, v_cache = torch.randn(4, 4, 2, 16), torch.randn(4, 4, 2, 16)
    i32 = torch.zeros(1, dtype=torch.int32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    args = (cos, sin, k_cache, v_cache, i32, table, i32 + 1, False, None, None, 0, 1)
    assert built.bind_rope_cache_attention(torch.empty(1, 4, 16), q, k, v, *args) is not None
    assert built.bind_rope_cache_attention(torch.empty(1, 4, 16), q, k, v, *args[:4],
                                           i32.long(), *args[5:]) is None  # int64 slots
    assert built.bind_rope_cache_attention(torch.empty(1, 4, 16), q, k, v, cos, sin,
                                           k_cache.half(), v_cache.half(), *args[4:]) is None


class _Spy:
    """Records which native binds gave a call."""

    def __init__(self, lib: NativeLibrary) -> None:
        self.lib, self.bound = lib, []

    def __getattr__(self, name: str):
        bind = getattr(self.lib, name)

        def spied(*args, **kwargs):
            call = bind(*args, **kwargs)
            if call is not None:
                self.bound.append(name)
            return call
        return spied


def test_the_cpu_kernels_call_the_native_ones(built: NativeLibrary,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(built)
    monkeypatch.setattr(core, "library", lambda: spy)
    monkeypatch.setattr(attention, "library", lambda: spy)
    g = _gen(5)
    x, nw = torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    w, res = torch.randn(96, 64, generator=g), torch.randn(3, 96, generator=g)
    for native in (True, False):
        tuning = _tuning(native)
        spy.bound.clear()
        out = torch.empty(3, 96)
        core.linear_epilogue_into([out], x, w, None, res, tuning=tuning)
        _within(out, x.double() @ w.double().t() + res.double(),
                _linear_bound(x, w, None, res), "linear_epilogue")
        core.linear_into([out], x, w, tuning=tuning)
        half = torch.empty(3, 48)
        core.norm_linear_into([half], x, nw, w, tuning=tuning, eps=1e-5, act="swiglu")
        want = get_op("norm_linear").reference(x, nw, w, eps=1e-5, act="swiglu")
        assert (half - want).abs().max() <= 1e-5 * want.abs().max()
        core.linear_epilogue_into([out], x, w, None, res, tuning=tuning, act="silu")  # torch's
        wide = torch.empty(12, 96)  # more rows than native_max_rows: torch's GEMM
        core.linear_into([wide], torch.randn(12, 64, generator=g), w, tuning=tuning)
        assert spy.bound == (["bind_linear", "bind_linear", "bind_norm_linear"] if native
                             else [])


def test_no_compiler_warns_once_and_keeps_the_torch_path(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture,
                                                         tmp_path) -> None:
    monkeypatch.setattr(build, "find_compiler", lambda: str(tmp_path / "no-such-cc"))
    library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tgraph.kernels"):
            assert library() is None
            assert library() is None  # cached: no second attempt, no second warning
            g = _gen(6)
            x, w, res = (torch.randn(*s, generator=g) for s in ((2, 40), (24, 40), (2, 24)))
            got, want = torch.empty(2, 24), torch.empty(2, 24)
            core.linear_epilogue_into([got], x, w, None, res, tuning=_tuning(True))
            core.linear_epilogue_into([want], x, w, None, res, tuning=_tuning(False))
            assert torch.equal(got, want)  # the torch path, bit for bit
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "no-such-cc" in warnings[0].getMessage()
        caplog.clear()
        monkeypatch.setattr(build, "find_compiler", lambda: None)
        with caplog.at_level(logging.WARNING, logger="tgraph.kernels"):
            assert build.build(tmp_path) is None
        assert "no C compiler" in caplog.records[0].getMessage()
    finally:
        library.cache_clear()  # the next caller builds (or finds) the real library


def test_a_second_build_reuses_the_cached_library(built: NativeLibrary, tmp_path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    first = build.build(tmp_path)
    assert first is not None and first.is_file() and first.parent.parent == tmp_path / "native"
    assert [p.name for p in first.parent.iterdir()] == [build.LIBRARY_NAME]  # no temp left

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again")
    monkeypatch.setattr(build, "_compile", no_compile)
    assert build.build(tmp_path) == first
    with pytest.raises(AssertionError, match="compiled again"):  # another key: a new build
        build.build(tmp_path, extra_flags=("-DTG_OTHER_KEY=1",))


# ---- quantized weights kept packed ---------------------------------------------------------------
QUANT_FORMS = {  # name -> quantize() arguments (GGUF Q4_1, Q4_0, Q8_0; int8 per channel)
    "int4 g32 offsets": dict(kind="int4", group_size=32, offsets=True),
    "int4 g64": dict(kind="int4", group_size=64),
    "int8 g32": dict(kind="int8", group_size=32),
    "int8 channel": dict(kind="int8"),
}


@pytest.mark.parametrize("form", sorted(QUANT_FORMS))
def test_quantized_linear_has_the_dense_kernels_bits(lib: NativeLibrary, form: str) -> None:
    """The codes dequantized as they are read, as ``QuantizedWeight.dequantize`` computes them,
    and multiplied in the dense kernel's order: bit for bit the native linear on the dequantized
    weight, at every row count (more than 64 rows: two passes), with bias and residual."""
    from tgraph.quant import quantize

    g = _gen(11)
    q = quantize(torch.randn(40, 192, generator=g) * 0.05, **QUANT_FORMS[form])
    dense = q.dequantize(torch.float32)
    assert lib.takes_quantized(q)
    for m in (1, 3, 8, 70):
        x, b = torch.randn(m, 192, generator=g), torch.randn(40, generator=g)
        res = torch.randn(m, 40, generator=g)
        got, want = torch.empty(m, 40), torch.empty(m, 40)
        lib.bind_linear_q(got, x, q, b, res, 2)()
        lib.bind_linear(want, x, dense, b, res, 2)()
        assert torch.equal(got, want), (form, m)


def test_quantized_linear_refuses_what_it_does_not_take(built: NativeLibrary) -> None:
    from tgraph.quant import quantize

    g = _gen(12)
    w = torch.randn(16, 96, generator=g)
    x, out = torch.randn(2, 96, generator=g), torch.empty(2, 16)
    for args in (dict(kind="int4", group_size=8), dict(kind="fp8")):  # group < 16; fp8
        q = quantize(w, **args)
        assert not built.takes_quantized(q) and built.bind_linear_q(out, x, q, None, None, 2) \
            is None
    odd = quantize(torch.randn(16, 40, generator=g), kind="int8")  # K not a multiple of 16
    assert built.bind_linear_q(out, torch.randn(2, 40), odd, None, None, 2) is None


@pytest.mark.parametrize("exact", [False, True])
def test_weights_torch_would_copy_densely_are_read_as_codes(built: NativeLibrary, exact: bool,
                                                            monkeypatch: pytest.MonkeyPatch):
    """A Q8_0-like weight (int8 in groups of 32, which no packed torch kernel takes), and in the
    exact mode every int4 weight, run on their codes: no dense copy is cached, and the result is
    the reference's up to summation order (fp32)."""
    from tgraph.kernels.cpu_backend import quant as cpu_quant
    from tgraph.quant import quantize

    spy = _Spy(built)
    monkeypatch.setattr(core, "library", lambda: spy)
    g = _gen(13)
    tuning = _tuning(True, bf16_quant_activations=not exact)
    weights = [quantize(torch.randn(48, 64, generator=g) * 0.05, kind="int8", group_size=32),
               quantize(torch.randn(48, 64, generator=g) * 0.05, kind="int4", group_size=32,
                        offsets=True)]
    x, nw = torch.randn(2, 64, generator=g), torch.randn(64, generator=g)
    for w in weights:
        spy.bound.clear()
        codes = w.scheme.kind == "int8" or exact
        # on codes: fp32, summation order only; else torch's packed kernel on bf16 activations
        # (its tolerance in test_cpu_quant_linear.py)
        tol = 1e-5 if codes else 1e-2
        out, half = torch.empty(2, 48), torch.empty(2, 24)
        core.linear_into([out], x, w, tuning=tuning)
        dense = w.dequantize(torch.float32)
        want = x.double() @ dense.double().t()
        if codes:
            _within(out, want, _linear_bound(x, dense, None, None), "quantized linear")
        assert (out - want).abs().max() <= tol * want.abs().max()
        core.norm_linear_into([half], x, nw, w, tuning=tuning, eps=1e-5, act="swiglu")
        want = get_op("norm_linear").reference(x, nw, dense, eps=1e-5, act="swiglu")
        assert (half - want).abs().max() <= tol * want.abs().max()
        assert spy.bound.count("bind_linear_q") == (2 if codes else 0), spy.bound
        dense_forms = [f for f in cpu_quant.cached_forms() if f.how == "dense"
                       and (f.n, f.k) == (48, 64)]
        assert not dense_forms if codes else True
