"""``moe`` and ``moe_add_rms_norm`` on the CPU: the routed experts grouped by expert.

The op's reference (:func:`tgraph.ir.ops.moe.moe_reference`) finds each picked expert's tokens
with half a dozen small torch ops per expert, and dequantizes a quantized expert whole at every
call. Here the pairs (token, choice) are sorted by expert once; the gathered token rows then
take one ``gate|up`` and one ``down`` linear per picked expert, each written straight into its
slice of one buffer, with SwiGLU over all pairs at once and one weighted scatter-add.

- 16-bit and fp32 experts: the reference's arithmetic in the same order (the same rows per
  expert, the same roundings to the activations' dtype, each token's shares added in ascending
  expert order), so the result is the reference's bits; except that an fp32 expert's few rows
  (up to ``CpuTuning.native_max_rows``) take the compiled CPU kernel where it loads
  (``CpuTuning.native_kernels``), as the CPU backend's other linears do: the same products
  summed in another order.
- Quantized experts that torch's packed CPU kernels take (int4 groups, int8 per channel, int8
  groups with ``CpuTuning.int8_group_kernel``): each expert is packed at its first use and kept
  (:class:`~tgraph.kernels.cpu_backend.quant.PackedLinear`), and runs on fp32 activations
  rounded to bf16 as the CPU backend's quantized linears do
  (``CpuTuning.bf16_quant_activations``; about ``3 * 2**-9`` of an output's scale per linear).
  Other schemes (fp8; int8 in groups of 16 or 32, GGUF ``Q6_K`` and ``Q8_0``) and the exact
  mode multiply what the dequantized expert would: the compiled kernel on the codes of int4 /
  int8 experts wherever their dense twin's expert takes it (fp32 rows, few of them), the
  picked experts dequantized per call elsewhere. A model of such experts decodes with the bits
  of its dequantized twin (a cached dense copy of every expert would multiply the experts'
  memory).

This is what runs routed experts that a rule placed on the CPU (``device: cpu`` on
``mlp.experts``), and the experts of a model on the CPU.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from tgraph.ir.ops.fused import add_rms_norm_reference
from tgraph.ir.ops.moe import expert_weights, route
from tgraph.kernels.cpu_backend.common import BoundKernel, Thunk, returning
from tgraph.kernels.cpu_backend.native import library
from tgraph.kernels.cpu_backend.quant import packed_how, packed_linear
from tgraph.kernels.registry import KernelSpec
from tgraph.kernels.triton_backend.common import Outs, results_into
from tgraph.quant import is_quantized
from tgraph.tuning import CpuTuning, Tuning

__all__ = ["KERNELS", "GroupedExperts", "bind_moe", "bind_moe_add_rms_norm", "grouped_experts"]

_F32 = torch.float32
# Expert ``e`` of a weight into ``out``: ``out = a @ w[e].T``.
ExpertLinear = Callable[[int, torch.Tensor, torch.Tensor], None]


class GroupedExperts:
    """The experts ``w13``, ``w2`` of one layer, their kernels chosen once:
    ``experts(x, router_logits, top_k, renormalize)`` is ``moe(x, ...)`` in ``x``'s dtype (see
    the module docstring for which experts give the reference's bits and which run packed)."""

    def __init__(self, w13, w2, experts: int, cpu: CpuTuning) -> None:
        self.experts, self.inter = experts, _rows(w13, experts) // 2
        self.gate_up, packed13 = _expert_linear(w13, experts, cpu)
        self.down, packed2 = _expert_linear(w2, experts, cpu)
        self.packed = packed13 or packed2  # packed kernels take fp32 activations

    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> torch.Tensor:
        dtype = _F32 if self.packed else x.dtype
        weights, ids = route(router_logits, top_k, renormalize)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, pairs (so tokens) ascending
        counts = torch.bincount(flat, minlength=self.experts).tolist()
        tokens = order.div(top_k, rounding_mode="floor")
        xs = x.index_select(0, tokens).to(dtype)
        inter = self.inter
        gate_up = torch.empty(xs.shape[0], 2 * inter, dtype=dtype)
        y = torch.empty(xs.shape[0], x.shape[1], dtype=dtype)
        picked = [(e, c) for e, c in enumerate(counts) if c]
        start = 0
        for e, c in picked:
            self.gate_up(e, xs[start:start + c], gate_up[start:start + c])
            start += c
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        start = 0
        for e, c in picked:
            self.down(e, h[start:start + c], y[start:start + c])
            start += c
        out = torch.zeros(x.shape, dtype=_F32)
        out.index_add_(0, tokens, y.float() * weights.reshape(-1)[order, None])
        return out.to(x.dtype)


def grouped_experts(x: torch.Tensor, router_logits: torch.Tensor, w13, w2, top_k: int,
                    renormalize: bool, cpu: CpuTuning | None = None) -> torch.Tensor:
    """``moe(x, router_logits, w13, w2)`` in ``x``'s dtype (:class:`GroupedExperts` once)."""
    experts = GroupedExperts(w13, w2, router_logits.shape[1], cpu or CpuTuning())
    return experts(x, router_logits, top_k, renormalize)


def _rows(w, experts: int) -> int:
    """Rows of one expert of ``w`` (3-D dense experts, or flat quantized ones)."""
    return w.shape[1] if w.dim() == 3 else w.shape[0] // experts


def _expert_linear(w, experts: int, cpu: CpuTuning) -> tuple[ExpertLinear, bool]:
    """How expert ``e`` of ``w`` multiplies activations ``a`` (in their dtype), and whether it
    runs packed (then the activations must be fp32)."""
    lib = library() if cpu.native_kernels else None
    threads = torch.get_num_threads()

    def native(a: torch.Tensor) -> bool:  # the compiled kernels' rows, as for other linears
        return lib is not None and a.dtype == _F32 and a.shape[0] <= cpu.native_max_rows

    if not is_quantized(w):
        def dense(e: int, a: torch.Tensor, out: torch.Tensor) -> None:
            call = lib.bind_linear(out, a, w[e], None, None, threads) \
                if native(a) and w.dtype == _F32 else None
            if call is None:
                torch.mm(a, w[e].to(a.dtype).T, out=out)
            else:
                call()
        return dense, False
    rows = w.shape[0] // experts
    first = w.narrow(0, 0, rows)
    groups = cpu.int8_group_kernel
    if cpu.bf16_quant_activations and packed_how(first, _F32, True, groups) != "dense":
        def packed(e: int, a: torch.Tensor, out: torch.Tensor) -> None:
            packed_linear(w, _F32, True, groups, rows=(e * rows, rows)).run(a, out)
        return packed, True
    codes_ok = lib is not None and lib.takes_quantized(first)

    def dequantized(e: int, a: torch.Tensor, out: torch.Tensor) -> None:
        # Where the dense twin's expert takes the compiled kernel, so does this one: its bits.
        call = None
        if native(a) and codes_ok:
            call = lib.bind_linear_q(out, a, w.narrow(0, e * rows, rows), None, None, threads)
        dense = None if call is not None else expert_weights(w, e, experts, a.dtype)
        if call is None and native(a):
            call = lib.bind_linear(out, a, dense, None, None, threads)
        if call is None:
            torch.mm(a, dense.T, out=out)
        else:
            call()
    return dequantized, False


def bind_moe(outs: Outs, x, router_logits, w13, w2, *, top_k, renormalize,
             tuning: Tuning | None = None) -> Thunk:
    out = outs[0]
    experts = GroupedExperts(w13, w2, router_logits.shape[1], (tuning or Tuning()).cpu)

    def run() -> None:
        out.copy_(experts(x, router_logits, top_k, renormalize))
    return returning(run, out)


def bind_moe_add_rms_norm(outs: Outs, x, router_logits, w13, w2, residual, weight, *, top_k,
                          renormalize, eps, tuning: Tuning | None = None) -> Thunk:
    experts = GroupedExperts(w13, w2, router_logits.shape[1], (tuning or Tuning()).cpu)

    def run() -> tuple:
        return results_into(outs, add_rms_norm_reference(
            experts(x, router_logits, top_k, renormalize), residual, weight, eps=eps))
    return run


KERNELS = (KernelSpec("moe", BoundKernel(bind_moe), tuned=True),
           KernelSpec("moe_add_rms_norm", BoundKernel(bind_moe_add_rms_norm), tuned=True))
