"""CPU kernels of the core ops, each writing into the buffers the engine planned in its arena.

Calling convention (see :mod:`tgraph.kernels.registry`): ``kernel(outs, *inputs, **attrs)``;
each kernel is also its ``bind``, which the engine's step programs call once per binding
(:mod:`tgraph.kernels.cpu_backend.common`). Every kernel computes as the op's torch reference
does, in the same order and dtype where that is free (fp32 norms, rope and SwiGLU give the
reference's bits); GEMMs and attention differ only by summation order. Inputs the kernels do not
take (other dtypes, transposed operands, layouts no view reads) go to the reference, copied into
the planned buffer. Rope, the cache write and attention are in
:mod:`tgraph.kernels.cpu_backend.attention`.

With the compiled kernels of :mod:`tgraph.kernels.cpu_backend.native` loaded and
``CpuTuning.native_kernels`` on, linears of a few fp32 rows (decode), alone, with their residual
or after their RMSNorm (and SwiGLU), are one native call each instead of the norm's, the GEMM's
and the epilogue's torch calls. The native norm has the reference's bits; the native SwiGLU
rounds as C's ``expf`` does, so every fp32 norm and SwiGLU then runs natively, fused into a
linear or not, at any row count: each gives the same bits whichever kernels the passes and a
partition made of it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from tgraph.ir.ops.fused import EPILOGUE_ACTIVATIONS
from tgraph.kernels.cpu_backend.attention import (
    paged_attention_into,
    reshape_and_cache_into,
    rope_cache_attention_into,
    rope_cache_into,
    rope_into,
)
from tgraph.kernels.cpu_backend.common import (
    F32,
    BoundKernel,
    Thunk,
    as_rows,
    fp32,
    held_or_per_call,
    reference_thunk,
    returning,
)
from tgraph.kernels.cpu_backend.native import NativeLibrary, library
from tgraph.kernels.cpu_backend.quant import PackedLinear, packed_how, packed_linear
from tgraph.kernels.registry import KernelSpec
from tgraph.kernels.triton.checks import memory_overlaps
from tgraph.kernels.triton_backend.common import Outs, reference_into
from tgraph.quant import is_quantized
from tgraph.tuning import Tuning

__all__ = ["KERNELS", "matmul_into"]

_DEFAULT_TUNING = Tuning()
# out= form of silu (torch.nn.functional.silu has none)
_SILU = torch._C._nn.silu

# A GEMM bound to its output, weight, bias and residual; called with the rows it multiplies.
Matmul = Callable[[torch.Tensor], None]


# ---- norms and SwiGLU -----------------------------------------------------------------------
def _native_lib(tuning: Tuning | None) -> NativeLibrary | None:
    """The native kernels when they are on and loaded."""
    return library() if (tuning or _DEFAULT_TUNING).cpu.native_kernels else None


def _prefill_sized(rows: int, n: int, tuning: Tuning | None) -> bool:
    """Whether ``[rows, n]`` fp32 rows outgrow the held scratch (a prefill's, not a decode's)."""
    return rows * n * 4 > (tuning or _DEFAULT_TUNING).cpu.held_scratch_kb * 1024


def _threads_for(rows: int, n: int, tuning: Tuning | None) -> int:
    """torch's threads for a pointwise kernel over a prefill's rows, one thread for fewer."""
    return torch.get_num_threads() if _prefill_sized(rows, n, tuning) else 1


def _bind_native_rms(out2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor | None,
                     eps: float, tuning: Tuning | None, res2: torch.Tensor | None = None,
                     summed2: torch.Tensor | None = None) -> Callable[[], None] | None:
    """The native norm (the one the native ``norm_linear`` computes), or ``None``."""
    lib = _native_lib(tuning)
    if lib is None:
        return None
    return lib.bind_rms_norm(out2, x2, weight, eps, _threads_for(*x2.shape, tuning), res2,
                             summed2)


# NOTE: the reference's operations in its order (the bits torch.rms_norm gives fp32 rows) into
# held memory: fewer calls than torch.rms_norm's casts and allocations, each paying cold caches.
def _bind_rms(out2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor | None, eps: float,
              tuning: Tuning | None) -> Callable[[], None]:
    """``out2 = rms_norm(x2)`` for fp32 ``[M, N]`` rows (``out2`` may be ``x2``): native when
    the native kernels are on (see the module docstring)."""
    native = _bind_native_rms(out2, x2, weight, eps, tuning)
    if native is not None:
        return native
    rows, n = x2.shape
    if _prefill_sized(rows, n, tuning):  # the one call, no held scratch
        shape = (n,)
        return lambda: out2.copy_(torch.rms_norm(x2, shape, weight, eps))
    inv = torch.empty(rows, 1, dtype=F32)
    # out2 holds the squares unless it overlaps x2
    squares = torch.empty(rows, n, dtype=F32) if memory_overlaps(out2, x2) else out2
    # 0-dim tensors: a Python scalar is wrapped into a new tensor at every call; sum then divide
    # is how torch.mean computes fp32 rows (the same bits)
    count, eps_t = torch.tensor(float(n), dtype=F32), torch.tensor(eps, dtype=F32)

    def run() -> None:
        torch.mul(x2, x2, out=squares)
        torch.sum(squares, -1, keepdim=True, out=inv)
        inv.div_(count).add_(eps_t).rsqrt_()
        torch.mul(x2, inv, out=out2)
        if weight is not None:
            out2.mul_(weight)
    return run


def bind_rms_norm(outs: Outs, x, weight=None, *, eps, tuning: Tuning | None = None) -> Thunk:
    x2 = as_rows(x)
    if x2 is None or not fp32(x, weight):
        return reference_thunk("rms_norm", outs, x, weight, eps=eps)
    out = outs[0]
    return returning(_bind_rms(out.view(-1, x.shape[-1]), x2, weight, eps, tuning), out)


def bind_add_rms_norm(outs: Outs, x, residual, weight, *, eps,
                      tuning: Tuning | None = None) -> Thunk:
    if not fp32(x, residual, weight) or residual.shape != x.shape:
        return reference_thunk("add_rms_norm", outs, x, residual, weight, eps=eps)
    normed, summed = outs[0], outs[1]
    n = x.shape[-1]
    x2, res2 = as_rows(x), as_rows(residual)
    if x2 is not None and res2 is not None:  # the add and the norm in one native call
        native = _bind_native_rms(normed.view(-1, n), x2, weight, eps, tuning, res2,
                                  summed.view(-1, n))
        if native is not None:
            return returning(native, (normed, summed))
    norm = _bind_rms(normed.view(-1, n), summed.view(-1, n), weight, eps, tuning)

    def run() -> None:
        torch.add(x, residual, out=summed)
        norm()
    return returning(run, (normed, summed))


def _bind_swiglu(out2: torch.Tensor, gate_up2: torch.Tensor, tuning: Tuning | None) -> Thunk:
    """``out2 = silu(gate) * up`` for fp32 ``gate_up2 = [gate | up]`` rows: native when the
    native kernels are on (see the module docstring)."""
    lib = _native_lib(tuning)
    native = None if lib is None else lib.bind_swiglu(
        out2, gate_up2, _threads_for(*gate_up2.shape, tuning))
    if native is not None:
        return native
    half = gate_up2.shape[-1] // 2
    gate, up = gate_up2[:, :half], gate_up2[:, half:]

    def run() -> None:
        _SILU(gate, out=out2)
        out2.mul_(up)
    return run


def bind_swiglu(outs: Outs, gate_up, *, tuning: Tuning | None = None) -> Thunk:
    gate_up2 = as_rows(gate_up)
    if gate_up2 is None or gate_up.dtype != F32:
        return reference_thunk("swiglu", outs, gate_up)
    return returning(_bind_swiglu(outs[0].view(-1, outs[0].shape[-1]), gate_up2, tuning),
                     outs[0])


def bind_embedding(outs: Outs, ids, weight) -> Thunk:
    out = outs[0]
    if is_quantized(weight):  # the looked-up rows only, dequantized
        return returning(lambda: out.copy_(weight.rows(ids)), out)
    flat = ids.view(-1) if ids.is_contiguous() else None
    if flat is None:
        return reference_thunk("embedding", outs, ids, weight)
    out2 = out.view(-1, weight.shape[1])
    return returning(functools.partial(torch.index_select, weight, 0, flat, out=out2), out)


# ---- linears --------------------------------------------------------------------------------
def _bind_mm(out2: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
             residual2: torch.Tensor | None) -> Matmul:
    if residual2 is not None:
        if bias is None:
            return lambda x2: torch.addmm(residual2, x2, b, out=out2)

        def with_bias(x2: torch.Tensor) -> None:
            torch.addmm(residual2, x2, b, out=out2)
            out2.add_(bias)
        return with_bias
    if bias is not None:
        return lambda x2: torch.addmm(bias, x2, b, out=out2)
    return lambda x2: torch.mm(x2, b, out=out2)


def _bind_packed(packed: PackedLinear, out2: torch.Tensor, bias: torch.Tensor | None,
                 residual2: torch.Tensor | None) -> Matmul:
    def run(x2: torch.Tensor) -> None:
        packed.run(x2, out2)
        if residual2 is not None:
            out2.add_(residual2)
        if bias is not None:
            out2.add_(bias)
    return run


def _bind_matmul(out2: torch.Tensor, w: Any, bias: torch.Tensor | None,
                 residual2: torch.Tensor | None, transpose_b: bool, tuning: Tuning | None,
                 dtype: torch.dtype = F32) -> Matmul:
    """``out2 = x2 @ w(.T) + bias + residual2`` for the ``[M, K]`` rows ``x2`` it is called
    with: ``addmm`` into the planned buffer (the residual as its input), or a quantized weight
    through its packed CPU kernel."""
    cpu = (tuning or _DEFAULT_TUNING).cpu
    if is_quantized(w):
        if not transpose_b:
            w = w.dequantize(dtype)  # a transposed quantized operand: no kernel takes it packed
        else:
            packed = packed_linear(w, dtype, cpu.bf16_quant_activations,
                                   cpu.int8_group_kernel)
            if packed.how != "dense":
                return _bind_packed(packed, out2, bias, residual2)
            w = packed.packed  # the cached dense copy, multiplied as any dense weight
    b = w.t() if transpose_b else w
    n = b.shape[1]
    if 1 < out2.shape[0] <= cpu.slice_max_rows and n > cpu.slice_cols:
        # MKL's small-M GEMM streams a wide weight faster in column slices.
        parts = [_bind_mm(out2[:, cols], b[:, cols], None if bias is None else bias[cols],
                          None if residual2 is None else residual2[:, cols])
                 for cols in (slice(s, s + cpu.slice_cols) for s in range(0, n, cpu.slice_cols))]

        def sliced(x2: torch.Tensor) -> None:
            for part in parts:
                part(x2)
        return sliced
    return _bind_mm(out2, b, bias, residual2)


def _native_for(tuning: Tuning | None, rows: int) -> NativeLibrary | None:
    """The native kernels when they are on and loaded and ``rows`` is few enough for their
    linears."""
    if rows > (tuning or _DEFAULT_TUNING).cpu.native_max_rows:
        return None
    return _native_lib(tuning)


def _reads_codes(lib: NativeLibrary, w: Any, tuning: Tuning | None) -> bool:
    """Whether the native quantized linear takes ``w`` where torch would multiply a dense copy
    (no packed torch kernel takes it): the copy's bits from the codes, the copy never made."""
    cpu = (tuning or _DEFAULT_TUNING).cpu
    return is_quantized(w) and lib.takes_quantized(w) and packed_how(
        w, F32, cpu.bf16_quant_activations, cpu.int8_group_kernel) == "dense"


def _dense_weight(w: Any, tuning: Tuning | None) -> torch.Tensor | None:
    """``w`` as the fp32 ``[N, K]`` tensor a linear multiplies by (a quantized weight's cached
    dense copy when its CPU kernel is that copy), or ``None``."""
    if is_quantized(w):
        cpu = (tuning or _DEFAULT_TUNING).cpu
        packed = packed_linear(w, F32, cpu.bf16_quant_activations, cpu.int8_group_kernel)
        return packed.packed if packed.how == "dense" else None
    return w if w.dtype == F32 else None


def _bind_native_linear(out2: torch.Tensor, x2: torch.Tensor, w: Any, bias: torch.Tensor | None,
                        residual2: torch.Tensor | None, transpose_b: bool,
                        tuning: Tuning | None) -> Callable[[], None] | None:
    """``out2 = x2 @ w.T + bias + residual2`` as one native call (on the codes of a quantized
    weight torch would copy densely), or ``None`` (the torch path) when the native kernels are
    off or do not take these arguments."""
    lib = _native_lib(tuning)
    if lib is None or not transpose_b:
        return None
    prefetch = (tuning or _DEFAULT_TUNING).cpu.native_prefetch_bytes
    if _reads_codes(lib, w, tuning):  # at any row count: the dense copy is never made
        return lib.bind_linear_q(out2, x2, w, bias, residual2, torch.get_num_threads(),
                                 prefetch)
    if _native_for(tuning, x2.shape[0]) is None:
        return None
    dense = _dense_weight(w, tuning)
    if dense is None:
        return None
    return lib.bind_linear(out2, x2, dense, bias, residual2, torch.get_num_threads(), prefetch)


def _bind_linear_call(out2: torch.Tensor, x2: torch.Tensor, w: Any, bias: torch.Tensor | None,
                      residual2: torch.Tensor | None, transpose_b: bool,
                      tuning: Tuning | None) -> Callable[[], None]:
    """``out2 = x2 @ w.T + bias + residual2`` bound to these tensors: native where it takes
    them, else torch's GEMM (or a quantized weight's packed kernel)."""
    native = _bind_native_linear(out2, x2, w, bias, residual2, transpose_b, tuning)
    if native is not None:
        return native
    return functools.partial(_bind_matmul(out2, w, bias, residual2, transpose_b, tuning), x2)


def matmul_into(out2: torch.Tensor, x2: torch.Tensor, w: Any, bias: torch.Tensor | None,
                residual2: torch.Tensor | None, transpose_b: bool = True,
                tuning: Tuning | None = None) -> None:
    """``out2 = x2 @ w(.T) + bias + residual2`` (see :func:`_bind_matmul`)."""
    _bind_matmul(out2, w, bias, residual2, transpose_b, tuning, x2.dtype)(x2)


def _linear_ok(x, w, bias=None, residual=None) -> bool:
    return x.dim() >= 1 and fp32(x, bias, residual) and (is_quantized(w) or w.dtype == F32)


def bind_linear(outs: Outs, x, w, bias=None, *, tuning: Tuning, transpose_a=False,
                transpose_b=True, impl=None) -> Thunk:
    x2 = None if transpose_a else as_rows(x)
    if x2 is None or not _linear_ok(x, w, bias):
        return reference_thunk("linear", outs, x, w, bias, transpose_a=transpose_a,
                               transpose_b=transpose_b)
    out = outs[0]
    out2 = out.view(-1, out.shape[-1])
    return returning(_bind_linear_call(out2, x2, w, bias, None, transpose_b, tuning), out)


def bind_linear_epilogue(outs: Outs, x, w, bias=None, residual=None, *, tuning: Tuning,
                         transpose_b=True, act=None) -> Thunk:
    out = outs[0]
    x2 = as_rows(x)
    res2 = None if residual is None else as_rows(residual)
    if x2 is None or (residual is not None and res2 is None) \
            or not _linear_ok(x, w, bias, residual) \
            or (residual is not None and tuple(residual.shape) != tuple(out.shape)):
        return reference_thunk("linear_epilogue", outs, x, w, bias, residual,
                               transpose_b=transpose_b, act=act)
    out2 = out.view(-1, out.shape[-1])
    if act is None:
        return returning(_bind_linear_call(out2, x2, w, bias, res2, transpose_b, tuning), out)
    mm = _bind_matmul(out2, w, bias, None, transpose_b, tuning)
    activation = EPILOGUE_ACTIVATIONS[act]

    def run() -> None:
        mm(x2)
        out2.copy_(activation(out2))
        if res2 is not None:
            out2.add_(res2)
    return returning(run, out)


def _bind_norm_linear(outs: Outs, x2: torch.Tensor, norm_weight, w, bias, tuning: Tuning,
                      eps: float, act: str | None) -> Thunk:
    out = outs[0]
    out2 = out.view(-1, out.shape[-1])
    # the normed rows are M x K (one token's worth at decode): a small scratch
    normed = torch.empty(x2.shape, dtype=F32)
    norm = _bind_rms(normed, x2, norm_weight, eps, tuning)
    if act is None:
        mm = _bind_linear_call(out2, normed, w, bias, None, True, tuning)

        def run() -> None:
            norm()
            mm()
        return returning(run, out)
    gate_up = torch.empty(x2.shape[0], w.shape[0], dtype=F32)
    mm = _bind_linear_call(gate_up, normed, w, bias, None, True, tuning)
    swiglu = _bind_swiglu(out2, gate_up, tuning)

    def run_gated() -> None:
        norm()
        mm()
        swiglu()
    return returning(run_gated, out)


def bind_norm_linear(outs: Outs, x, norm_weight, w, bias=None, *, tuning: Tuning, eps,
                     act=None) -> Thunk:
    x2 = as_rows(x)
    if x2 is None or not (_linear_ok(x, w, bias) and fp32(norm_weight)):
        return reference_thunk("norm_linear", outs, x, norm_weight, w, bias, eps=eps, act=act)
    lib = _native_for(tuning, x2.shape[0]) if act in (None, "swiglu") else None
    # a quantized weight whose codes the native linear reads: its norm, then that linear
    dense = None if lib is None or _reads_codes(lib, w, tuning) else _dense_weight(w, tuning)
    if dense is not None:
        out = outs[0]
        native = lib.bind_norm_linear(out.view(-1, out.shape[-1]), x2, norm_weight, eps, dense,
                                      bias, act == "swiglu", torch.get_num_threads(),
                                      (tuning or _DEFAULT_TUNING).cpu.native_prefetch_bytes)
        if native is not None:
            return returning(native, out)
    scratch = x2.numel() * 4  # the normed rows
    if act is not None:
        scratch += x2.shape[0] * w.shape[0] * 4  # the gate|up rows
    return held_or_per_call(functools.partial(_bind_norm_linear, outs, x2, norm_weight, w, bias,
                                              tuning, eps, act), scratch, tuning)


def bind_matmul_op(outs: Outs, a, b) -> Thunk:
    return returning(functools.partial(torch.matmul, a, b, out=outs[0]), outs[0])


def bind_prefetch(outs: Outs, x, *weights, halves) -> Thunk:
    return lambda: x  # no L2 to stage into on the CPU


rms_norm_into = BoundKernel(bind_rms_norm)
add_rms_norm_into = BoundKernel(bind_add_rms_norm)
swiglu_into = BoundKernel(bind_swiglu)
embedding_into = BoundKernel(bind_embedding)
linear_into = BoundKernel(bind_linear)
linear_epilogue_into = BoundKernel(bind_linear_epilogue)
norm_linear_into = BoundKernel(bind_norm_linear)
matmul_op_into = BoundKernel(bind_matmul_op)
prefetch_into = BoundKernel(bind_prefetch)

KERNELS = (
    # A linear a rule asked to run as the torch reference (a quantized weight dequantized per
    # call); tried before the kernel entry below.
    KernelSpec("linear", reference_into("linear"), supports=lambda n: n.attrs.get("impl")
               == "reference", name="torch.linear"),
    KernelSpec("rms_norm", rms_norm_into, tuned=True),
    KernelSpec("add_rms_norm", add_rms_norm_into, tuned=True),
    KernelSpec("swiglu", swiglu_into, tuned=True),
    KernelSpec("embedding", embedding_into),
    KernelSpec("rope", rope_into, tuned=True),
    KernelSpec("reshape_and_cache", reshape_and_cache_into),
    KernelSpec("rope_cache", rope_cache_into, tuned=True),
    KernelSpec("rope_cache_attention", rope_cache_attention_into, tuned=True),
    KernelSpec("paged_attention", paged_attention_into, tuned=True),
    KernelSpec("linear", linear_into, tuned=True),
    KernelSpec("linear_epilogue", linear_epilogue_into, tuned=True),
    KernelSpec("norm_linear", norm_linear_into, tuned=True),
    KernelSpec("matmul", matmul_op_into, name="cpu.matmul"),
    KernelSpec("l2_prefetch", prefetch_into),
)
