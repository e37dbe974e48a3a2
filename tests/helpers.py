"""Shared test utilities for tgraph's core tests.

The usual flow of a test is: record a network from a function of symbolic inputs
(:func:`record`), build it with or without passes, run it on real tensors with poisoned output
buffers (:func:`run_engine`, or :func:`run_graph` for all three steps) and compare with a plain
torch computation (:func:`assert_close`, with tolerances chosen by dtype in :data:`TOLERANCES`).
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tgraph.engine import Engine
from tgraph.ir.network import Network
from tgraph.nn.module import Parameter
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (rtol, atol) used when an output of this dtype is compared with an fp64 (or exact) expectation.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # fp64 results: only summation order differs.
    torch.float64: (1e-10, 1e-10),
    # fp32: unit roundoff 6e-8; sums of <= 64 terms and fp32 transcendentals stay well below 1e-5.
    torch.float32: (1e-5, 1e-5),
    # fp16: unit roundoff 4.9e-4; the output is rounded once and some ops round an intermediate
    # (e.g. RMSNorm rounds before scaling), so allow about 4 units.
    torch.float16: (2e-3, 2e-3),
    # bf16: unit roundoff 3.9e-3; same reasoning, about 4-5 units of the last place.
    torch.bfloat16: (2e-2, 2e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """The ``(rtol, atol)`` for comparing a result of ``dtype`` with a high-precision reference.

    Args:
        dtype: the dtype of the result under test.
    Returns:
        ``(rtol, atol)``; ``(0, 0)`` for integer and bool dtypes, which must match exactly.
    """
    if not dtype.is_floating_point:
        return 0.0, 0.0
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float | None = None,
                 atol: float | None = None, msg: str = "") -> None:
    """Compare a result with its reference.

    Floating results are compared in fp64 with the tolerance of ``actual``'s dtype (override with
    ``rtol``/``atol``); NaN never matches, so a poisoned element the kernel did not write fails.
    Integer and bool results must be equal.

    Args:
        actual: the tensor under test.
        expected: the reference, in any precision (usually fp64).
        rtol, atol: explicit tolerances.
        msg: prefix of the failure message.
    """
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != expected " \
                                           f"{tuple(expected.shape)}"
    if not actual.dtype.is_floating_point:
        assert not expected.dtype.is_floating_point, f"{msg}: got {actual.dtype}, expected " \
                                                     f"floating {expected.dtype}"
        mismatch = actual.to(torch.int64) != expected.to(torch.int64)
        assert not mismatch.any(), (f"{msg}: {int(mismatch.sum())} of {mismatch.numel()} "
                                    f"elements differ; first at {mismatch.nonzero()[0].tolist()}")
        return
    default_rtol, default_atol = tolerance(actual.dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    a, e = actual.to(torch.float64), expected.to(torch.float64)
    # NOTE: written out rather than torch.testing.assert_close, whose first call imports
    # torch.distributed (seconds on a small CPU); NaN or inf never compares close here.
    bad = ~((a - e).abs() <= atol + rtol * e.abs())
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0].tolist())
        finite = ~bad | torch.isfinite(a)
        worst = ((a - e).abs() / (atol + rtol * e.abs()))[finite & bad]
        raise AssertionError(
            f"{msg} ({actual.dtype}, rtol={rtol}, atol={atol}): {int(bad.sum())} of {bad.numel()} "
            f"elements differ; first at {list(where)}: got {a[where].item()!r}, expected "
            f"{e[where].item()!r}" + (f"; worst finite error is {worst.max().item():.3g}x the "
                                       "tolerance" if worst.numel() else ""))


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``t`` whose every element differs from ``t``'s.

    Floats are NaN; bools are negated; integers are shifted by one. An output buffer filled with
    this shows any element a kernel forgot to write.
    """
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    if t.dtype == torch.bool:
        return ~t
    return t + 1


def output_names(out: Any) -> dict[str, Any]:
    """Name a function's result the way :func:`record` marks it: ``out`` for one tensor,
    ``out0, out1, ...`` for a tuple or list, the keys for a dict."""
    if isinstance(out, Mapping):
        return dict(out)
    if isinstance(out, (tuple, list)):
        return {f"out{i}": v for i, v in enumerate(out)}
    return {"out": out}


def record(fn: Callable[..., Any], inputs: Mapping[str, torch.Tensor], *,
           shapes: Mapping[str, Sequence[int | str | None] | None] | None = None,
           host: Sequence[str] = (), kwargs: Mapping[str, Any] | None = None,
           weights: Mapping[str, torch.Tensor] | None = None, name: str = "test") -> Network:
    """Record ``fn(**symbolic_inputs, **kwargs)`` into a new network and mark its outputs.

    Args:
        fn: model code on symbolic tensors; returns a tensor, a tuple/list or a dict of them.
        inputs: example tensors; each becomes ``Tensor(name, t.dtype, t.shape)``.
        shapes: per-input shape overrides (symbols, ``None`` dims, or ``None`` for unknown rank).
        host: names of inputs declared ``host`` (passed in ``runtime_params``).
        kwargs: extra non-tensor arguments of ``fn`` (Python scalars, attributes).
        weights: tensors passed to ``fn`` as named :class:`Parameter` weights (not inputs).
        name: the network's name.
    Returns:
        the network, with outputs named as :func:`output_names` says.
    """
    shapes = dict(shapes or {})
    with recording(name) as net:
        symbolic = {
            k: Tensor(k, t.dtype, tuple(t.shape) if k not in shapes else shapes[k],
                      host=k in host)
            for k, t in inputs.items()
        }
        symbolic.update({k: Parameter(t, name=k) for k, t in (weights or {}).items()})
        out = fn(**symbolic, **dict(kwargs or {}))
        for out_name, value in output_names(out).items():
            net.mark_output(value, out_name)
    return net


def run_engine(engine: Engine, inputs: Mapping[str, torch.Tensor],
               like: Mapping[str, torch.Tensor] | None = None,
               runtime_params: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Run ``engine``; with ``like``, into poisoned preallocated outputs shaped like it.

    Args:
        engine: the built engine.
        inputs: the device inputs.
        like: per output, a tensor with the shape and dtype the output must have (its values
            seed the poison); the engine refuses buffers whose shape or dtype it disagrees with.
        runtime_params: host values.
    Returns:
        the outputs by name.
    """
    if like is None:
        return engine.forward(dict(inputs), None, runtime_params)
    outputs = {k: poison_like(v) for k, v in like.items()}
    result = engine.forward(dict(inputs), outputs, runtime_params)
    for k, t in outputs.items():
        assert result[k] is t, f"output {k!r} was not written into the given tensor"
    return result


def run_graph(fn: Callable[..., Any], inputs: Mapping[str, torch.Tensor], *,
              passes: bool = True, like: Mapping[str, torch.Tensor] | None = None,
              shapes: Mapping[str, Sequence[int | str | None] | None] | None = None,
              host: Sequence[str] = (), kwargs: Mapping[str, Any] | None = None,
              weights: Mapping[str, torch.Tensor] | None = None,
              runtime_params: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Record ``fn``, build it (with or without passes) and run it on ``inputs``.

    Inputs named in ``host`` are taken from ``inputs`` but passed as ``runtime_params``.

    Returns:
        the outputs by name (see :func:`output_names`).
    """
    net = record(fn, inputs, shapes=shapes, host=host, kwargs=kwargs, weights=weights)
    engine = net.build_engine(passes=passes)
    device_inputs = {k: v for k, v in inputs.items() if k not in host}
    params = dict(runtime_params or {})
    params.update({k: v for k, v in inputs.items() if k in host})
    return run_engine(engine, device_inputs, like, params or None)


def upcast(t: Any) -> Any:
    """fp64 copy of a floating tensor (other values unchanged): the precision references use."""
    if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
        return t.to(torch.float64)
    return t


def run_without_interpreter(script: str, extra_env: Mapping[str, str] | None = None,
                            timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python -c script`` with the repository importable and ``TRITON_INTERPRET`` unset.

    For tests that compile kernels for sm_90 on a CPU-only machine: Triton's interpreter accepts
    code its compiler rejects, and a process that ever set ``TRITON_INTERPRET`` cannot compile.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout)


def capture_cuda_graph(step: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """Run ``step`` once on a side stream (compiling kernels outside the capture), then capture
    it into a CUDA graph and return the graph (not yet replayed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def build_with_triton_backend(monkeypatch: Any) -> None:
    """Make every ``Network.build_engine`` of the test pick the Triton backend (on CPU tensors
    through the interpreter); skips the test where the interpreter is not set."""
    import pytest

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on CPU tensors needs the interpreter (set without CUDA)")
    build = Network.build_engine
    monkeypatch.setattr(Network, "build_engine",
                        lambda self, *a, **k: build(self, *a, **{**k, "backend": "triton"}))


def linear_operands(M: int, N: int, K: int, dtype: torch.dtype, gated: bool, device: str,
                    seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Seeded operands of a small-M linear: ``x [M, K]``, ``weight [N or 2N (gated), K]``
    (scaled by ``1/sqrt(K)``), ``bias`` and ``residual [M, N]``, in ``dtype`` on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * N if gated else N
    x = torch.randn(M, K, generator=gen).to(dtype).to(device)
    w = (torch.randn(rows, K, generator=gen) / K**0.5).to(dtype).to(device)
    b = torch.randn(rows, generator=gen).to(dtype).to(device)
    r = torch.randn(M, N, generator=gen).to(dtype).to(device)
    return x, w, b, r


# Quantized linears on the CPU computed exactly (dequantized once, cached), not through torch's
# packed bf16 kernels: for tests that hold a quantized model to transformers' greedy tokens
# token for token (the packed kernels' own tolerance: tests/kernels/test_cpu_quant_linear.py).
EXACT_CPU_QUANT = {"llm.engine.tuning.cpu.bf16_quant_activations": False}
