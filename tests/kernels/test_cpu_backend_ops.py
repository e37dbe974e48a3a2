"""The CPU backend (:mod:`tgraph.kernels.cpu_backend`) against the torch references.

Every op of :mod:`tests.ir.test_ops` is built with ``backend="cpu"`` and checked against the
same fp64 expectations and tolerances. Then the kernels one by one: norms, rope and SwiGLU in
fp32 compute exactly what the reference computes (the same operations in the same order, so
``torch.equal``); GEMMs and attention differ only by summation order, so fp32 results agree to
1e-5 relative to the output's scale (K <= 256 products of O(1) values, each rounding at 2^-24).
Norms, rope, linears and the fused decode attention run with ``CpuTuning.native_kernels`` off
(torch's kernels) and on (the compiled kernels, ``tests/kernels/test_cpu_native.py``): their norms
and rope give the reference's bits too; their SwiGLU rounds as C does (pinned here with it off).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.ir.test_ops import OP_INFOS, SHORT, OpInfo, check_samples
from tgraph.ir.network import Network
from tgraph.ir.ops import get_op
from tgraph.kernels.cpu_backend import attention, common, core
from tgraph.nn import functional as F
from tgraph.nn.network_manager import get_default_net
from tgraph.nn.tensor import Tensor
from tgraph.tuning import Tuning

TOL = 1e-5


def _ids() -> list[object]:
    return [pytest.param(info, dtype, id=f"{info.name}-{SHORT[dtype]}")
            for info in OP_INFOS for dtype in info.dtypes]


@pytest.mark.parametrize("info, dtype", _ids())
def test_op_matches_torch_on_the_cpu_backend(info: OpInfo, dtype: torch.dtype,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    build = Network.build_engine
    monkeypatch.setattr(Network, "build_engine",
                        lambda self, *a, **k: build(self, *a, **{**k, "backend": "cpu"}))
    with info.context():
        check_samples(info, info.samples(dtype), f"{info.name}[{SHORT[dtype]}] (cpu)")


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = want.abs().max().clamp_min(1e-6)
    err = (got - want).abs().max() / scale
    assert err <= TOL, f"{what}: max error {err:.3g} of the output's scale (allowed {TOL})"


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _native(native: bool, tuning: Tuning | None = None) -> Tuning:
    tuning = tuning or Tuning()
    return dataclasses.replace(tuning, cpu=dataclasses.replace(tuning.cpu, native_kernels=native))


TORCH = _native(False)  # torch's kernels only


def test_auto_picks_the_cpu_backend_with_an_arena() -> None:
    x = Tensor("x", dtype=torch.float32, shape=("m", 32))
    out = F.linear(x, Tensor("w", dtype=torch.float32, shape=(16, 32)), None, False, True)
    get_default_net().mark_output(out, "out")
    engine = get_default_net().build_engine()
    xs, w = torch.randn(3, 32), torch.randn(16, 32)
    got = engine.forward({"x": xs, "w": w})["out"]
    assert engine.kernel_kind(xs.device) == "cpu"
    assert engine.plan.uses_arena
    assert any(st.kernel_name == "cpu.linear" for st in engine.plan.steps), str(engine)
    _close(got, xs @ w.t(), "linear")


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 300])  # held scratch, and a prefill's torch.rms_norm
def test_rms_norm_is_the_references_bits_in_place_and_without_weight(rows: int,
                                                                      native: bool) -> None:
    g = _gen(3)
    x, w = torch.randn(rows, 576, generator=g) * 10, torch.randn(576, generator=g)
    for weight in (w, None):
        want = get_op("rms_norm").reference(x, weight, eps=1e-5)
        out = torch.empty_like(x)
        core.rms_norm_into([out], x, weight, eps=1e-5, tuning=_native(native))
        assert torch.equal(out, want)
        same = x.clone()
        core.rms_norm_into([same], same, weight, eps=1e-5, tuning=_native(native))  # in place
        assert torch.equal(same, want)


def test_serial_runs_on_one_thread_and_restores_the_count() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert common.serial(torch.get_num_threads) == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_norms_rope_swiglu_are_the_references_bits(interleaved: bool, native: bool) -> None:
    g = _gen(1)
    x, r, w = (torch.randn(5, 64, generator=g) for _ in range(3))
    w = w[0]
    out = torch.empty(5, 64)
    tuning = _native(native)
    core.rms_norm_into([out], x, w, eps=1e-6, tuning=tuning)
    assert torch.equal(out, get_op("rms_norm").reference(x, w, eps=1e-6))
    normed, summed = torch.empty(5, 64), torch.empty(5, 64)
    core.add_rms_norm_into([normed, summed], x, r, w, eps=1e-6, tuning=tuning)
    ref_n, ref_s = get_op("add_rms_norm").reference(x, r, w, eps=1e-6)
    assert torch.equal(normed, ref_n) and torch.equal(summed, ref_s)
    gate_up = torch.randn(5, 128, generator=g)
    out = torch.empty(5, 64)
    core.swiglu_into([out], gate_up, tuning=TORCH)  # native: C's silu (test_cpu_native.py)
    assert torch.equal(out, get_op("swiglu").reference(gate_up))
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    cos, sin = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)  # partial rotary
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    core.rope_into([q_out, k_out], q, k, cos, sin, interleaved=interleaved, tuning=tuning)
    ref_q, ref_k = get_op("rope").reference(q, k, cos, sin, interleaved=interleaved)
    assert torch.equal(q_out, ref_q) and torch.equal(k_out, ref_k)


def _cache(num_blocks: int, block: int, heads: int, dim: int, seed: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    return (torch.randn(num_blocks, block, heads, dim, generator=g),
            torch.randn(num_blocks, block, heads, dim, generator=g))


@pytest.mark.parametrize("serial_scores", [0, 65536])  # on torch's threads, on this one alone
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("tables", [
    [[3, 4, 5, 0]],                       # one run of consecutive blocks: read as one view
    [[7, 2, 3, 0]],                       # one sequence in two runs: its keys gathered
    [[7, 2, 3, 0], [1, 6, 0, 0]],          # several sequences: gathered, padded and masked
])
def test_decode_attention_reads_the_cache_in_place(tables: list[list[int]],
                                                   window: int | None,
                                                   serial_scores: int) -> None:
    k_cache, v_cache = _cache(8, 4, 2, 16, seed=2)
    batch = len(tables)
    q = torch.randn(batch, 6, 16, generator=_gen(3))
    block_table = torch.tensor(tables, dtype=torch.int32)
    seq_len = torch.tensor([11, 7][:batch], dtype=torch.int32)
    out = torch.empty_like(q)
    tuning = Tuning()
    tuning = dataclasses.replace(tuning, cpu=dataclasses.replace(
        tuning.cpu, serial_attention_scores=serial_scores))
    core.paged_attention_into([out], q, k_cache, v_cache, block_table, seq_len, scale=0.3,
                              sliding_window=window, tuning=tuning)
    want = get_op("paged_attention").reference(q, k_cache, v_cache, block_table, seq_len,
                                               scale=0.3, sliding_window=window)
    _close(out, want, "decode attention")


def test_prefill_attention_with_a_cached_prefix() -> None:
    k_cache, v_cache = _cache(8, 4, 2, 16, seed=4)
    # sequence 0: 6 new tokens after a 5-token prefix; sequence 1: 3 tokens, no prefix
    q = torch.randn(9, 4, 16, generator=_gen(5))
    block_table = torch.tensor([[2, 3, 6], [5, 0, 0]], dtype=torch.int32)
    seq_len = torch.tensor([11, 3], dtype=torch.int32)
    starts = torch.tensor([0, 6, 9], dtype=torch.int32)
    out = torch.empty_like(q)
    core.paged_attention_into([out], q, k_cache, v_cache, block_table, seq_len, starts)
    want = get_op("paged_attention").reference(q, k_cache, v_cache, block_table, seq_len, starts)
    _close(out, want, "prefill attention")


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("packed", [False, True])
def test_rope_cache_attention_writes_the_cache_and_attends(packed: bool, tokens: int,
                                                           native: bool) -> None:
    k_cache, v_cache = _cache(6, 4, 2, 16, seed=6)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    g = _gen(7)
    if packed:  # views of one q|k|v row, as the model's split makes them: rotated in one pass
        qkv = torch.randn(tokens, 8 * 16, generator=g)
        q, k, v = (part.view(tokens, -1, 16) for part in qkv.split([64, 32, 32], dim=1))
        assert attention._joined(q, k) is not None  # any stride of a single token's dim 0
    else:
        q, k, v = (torch.randn(tokens, h, 16, generator=g) for h in (4, 2, 2))
    cos, sin = torch.randn(tokens, 8, generator=g), torch.randn(tokens, 8, generator=g)
    # the second row, when there is one, is padding
    slots = torch.tensor([9, -1][:tokens], dtype=torch.int32)
    table = torch.tensor([[1, 2, 0], [4, 0, 0]][:tokens], dtype=torch.int32)
    seq_len = torch.tensor([10, 3][:tokens], dtype=torch.int32)
    out = torch.empty_like(q)
    core.rope_cache_attention_into([out, None, None], q, k, v, cos, sin, k_cache, v_cache, slots,
                                   table, seq_len, tuning=_native(native))
    want, _, _ = get_op("rope_cache_attention").reference(q, k, v, cos, sin, ref_k, ref_v, slots,
                                                          table, seq_len)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    _close(out, want, "rope_cache_attention")


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("held_kb", [256, 1])  # 1: the gate|up scratch made at every call
@pytest.mark.parametrize("m, n", [(3, 96), (4, 1600)])  # 1600: GEMMs in column slices
@pytest.mark.parametrize("act", [None, "swiglu"])
def test_linears_write_in_place_with_their_epilogues(act: str | None, m: int, n: int,
                                                     held_kb: int, native: bool) -> None:
    g = _gen(8)
    x, nw = torch.randn(m, 64, generator=g), torch.randn(64, generator=g)
    w, b = torch.randn(n, 64, generator=g) / 8, torch.randn(n, generator=g)
    res = torch.randn(m, n, generator=g)
    tuning = Tuning()
    tuning = _native(native, dataclasses.replace(tuning, cpu=dataclasses.replace(
        tuning.cpu, held_scratch_kb=held_kb)))
    out = torch.empty(m, n)
    core.linear_epilogue_into([out], x, w, b, res, tuning=tuning)
    _close(out, get_op("linear_epilogue").reference(x, w, b, res), "linear + bias + residual")
    core.linear_epilogue_into([out], x, w, b, res, tuning=tuning, act="silu")
    _close(out, get_op("linear_epilogue").reference(x, w, b, res, act="silu"), "act epilogue")
    out = torch.empty(m, n // 2 if act else n)
    bound = core.norm_linear_into.bind([out], x, nw, w, b, tuning=tuning, eps=1e-5, act=act)
    for _ in range(2):  # a bound kernel, as a step program runs it, at each call
        out.zero_()
        bound()
        _close(out, get_op("norm_linear").reference(x, nw, w, b, eps=1e-5, act=act),
               "norm_linear")
