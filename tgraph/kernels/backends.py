"""The one place every kernel backend registers from, and the kernel choice of the engine.

:func:`select_kernel` is what the engine's lowering calls for each node on the Triton backend
(CUDA) and the CPU backend: the registered entry (:mod:`tgraph.kernels.registry`) bound to the
engine's tuning, else the op's torch reference writing into the planned buffers, so every
network runs.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tgraph.ir.node import Node
from tgraph.kernels.registry import kernel_for, register_kernel
from tgraph.tuning import Tuning

__all__ = ["load_backends", "select_kernel"]


@functools.cache
def load_backends() -> None:
    """Register every backend's kernels (once per process)."""
    from tgraph.kernels.cpu_backend import core as cpu_core
    from tgraph.kernels.cpu_backend import moe as cpu_moe
    from tgraph.kernels.cpu_backend import qk_norm as cpu_qk_norm
    from tgraph.kernels.triton_backend import collective, core, lora, moe, sdpa

    backends = {"triton": (core, lora, collective, sdpa, moe),
                "cpu": (cpu_core, cpu_qk_norm, cpu_moe)}
    for backend, modules in backends.items():
        for module in modules:
            for spec in module.KERNELS:
                register_kernel(spec.op, backend, spec.fn, supports=spec.supports,
                                tuned=spec.tuned, name=spec.name)


def select_kernel(node: Node, tuning: Tuning, backend: str = "triton"
                  ) -> tuple[Callable[..., Any], str]:
    """The kernel that runs ``node`` on ``backend`` with ``tuning``, and a printable name."""
    from tgraph.kernels.triton_backend.common import reference_into

    load_backends()
    entry = kernel_for(node, backend)
    if entry is None:
        return reference_into(node.op), f"torch.{node.op}"
    fn = entry.spec.fn
    if entry.spec.tuned:
        tuned = functools.partial(fn, tuning=tuning)
        if hasattr(fn, "bind"):  # the engine's step programs bind such kernels once
            tuned.bind = functools.partial(fn.bind, tuning=tuning)
        fn = tuned
    return fn, entry.name
