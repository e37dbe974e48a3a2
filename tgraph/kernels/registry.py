"""The kernel registry: which function runs an op on a backend.

An entry says: for op ``op`` on backend ``backend`` (``"triton"``, the CUDA engine's backend),
``fn(outs, *inputs, **attrs)`` writes the op's results into the preallocated buffers ``outs``
(``None`` for outputs that alias an input) and returns them; ``supports(node)``, when given,
says which nodes it takes (the first registered entry that takes a node wins, an entry without
``supports`` last). An entry registered with ``tuned=True`` also receives the engine's
:class:`~tgraph.tuning.Tuning` as ``tuning=``.

Backends register from one place, :mod:`tgraph.kernels.backends`, which the engine imports;
the reference backend needs no entries (every op's torch reference is in its op definition).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tgraph.ir.node import Node

__all__ = ["KernelEntry", "KernelSpec", "kernel_for", "register_kernel", "registered_kernels"]

KernelFn = Callable[..., Any]


@dataclass(frozen=True)
class KernelSpec:
    """What a backend module declares for one op (registered by :mod:`tgraph.kernels.backends`).

    Attributes:
        op: the op name (see :mod:`tgraph.ir.ops`).
        fn: ``fn(outs, *inputs, **attrs)``; see the module docstring.
        supports: which nodes ``fn`` takes (``None``: all of them).
        tuned: ``fn`` takes ``tuning=`` (the engine's :class:`~tgraph.tuning.Tuning`).
        name: the kernel's name in ``str(engine)`` (default ``"<backend>.<op>"``).
    """

    op: str
    fn: KernelFn
    supports: Callable[[Node], bool] | None = None
    tuned: bool = False
    name: str | None = None


@dataclass(frozen=True)
class KernelEntry:
    """A registered kernel: a :class:`KernelSpec` on a backend."""

    backend: str
    spec: KernelSpec

    @property
    def name(self) -> str:
        return self.spec.name or f"{self.backend}.{self.spec.op}"


_ENTRIES: dict[tuple[str, str], list[KernelEntry]] = {}


def register_kernel(op: str, backend: str, fn: KernelFn, *,
                    supports: Callable[[Node], bool] | None = None, tuned: bool = False,
                    name: str | None = None) -> KernelEntry:
    """Register ``fn`` as the kernel of ``op`` on ``backend``.

    Args:
        op: the op it runs.
        backend: e.g. ``"triton"``.
        fn: ``fn(outs, *inputs, **attrs)`` (and ``tuning=`` when ``tuned``).
        supports: a predicate on the node; ``None`` takes every node of the op.
        tuned: pass the engine's tuning to ``fn``.
        name: printable name (default ``"<backend>.<op>"``).

    Returns:
        the entry.

    Raises:
        ValueError: an entry without ``supports`` for the same op and backend exists already
            (with a different function).
    """
    entry = KernelEntry(backend, KernelSpec(op, fn, supports, tuned, name))
    entries = _ENTRIES.setdefault((op, backend), [])
    for old in entries:
        if old.spec.fn is fn and old.spec.supports is supports:
            return old  # registering the same kernel again changes nothing
        if supports is None and old.spec.supports is None:
            raise ValueError(f"op {op!r} already has a {backend} kernel for every node "
                             f"({old.name}: {old.spec.fn.__module__}.{old.spec.fn.__qualname__})")
    # Conditional entries are tried before the unconditional one.
    entries.insert(len(entries) if supports is None else
                   sum(1 for e in entries if e.spec.supports is not None), entry)
    return entry


def kernel_for(node: Node, backend: str) -> KernelEntry | None:
    """The entry that runs ``node`` on ``backend``, or ``None`` when none takes it."""
    for entry in _ENTRIES.get((node.op, backend), ()):
        if entry.spec.supports is None or entry.spec.supports(node):
            return entry
    return None


def registered_kernels(backend: str | None = None) -> list[KernelEntry]:
    """Every entry (of ``backend``), by op name."""
    return [e for key in sorted(_ENTRIES) for e in _ENTRIES[key]
            if backend is None or e.backend == backend]
