"""Which network ops are recorded into.

Ops go to the innermost network opened with :func:`recording` or, outside any, to the default
network of the current thread. Building an engine from the default network replaces it by a fresh
one, so a script can record, build, and record again.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tgraph.ir.network import Network
from tgraph.nn.tensor import Tensor


class _State(threading.local):
    def __init__(self) -> None:
        self.default: Network | None = None
        self.stack: list[Network] = []


_state = _State()


def new_network(name: str = "network") -> Network:
    """A fresh network whose values are :class:`Tensor`s."""
    return Network(name, value_cls=Tensor)


def get_default_net() -> Network:
    """The network ops are recorded into now (the innermost :func:`recording`, or the default)."""
    if _state.stack:
        return _state.stack[-1]
    if _state.default is None:
        _state.default = new_network("default")
    return _state.default


def reset_default_net() -> Network:
    """Replace the default network by a fresh one and return it."""
    _state.default = new_network("default")
    return _state.default


def release_if_default(net: Network) -> None:
    """Called after an engine is built from ``net``: a built default network is replaced."""
    if net is _state.default:
        reset_default_net()


@contextmanager
def recording(net: Network | str = "network") -> Iterator[Network]:
    """Record ops into ``net`` (a network, or the name of a new one) inside the ``with`` block.

    Example:
        >>> with recording("prefill") as net:
        ...     net.mark_output(F.exp(Tensor("x")), "y")
    """
    if isinstance(net, str):
        net = new_network(net)
    _state.stack.append(net)
    try:
        yield net
    finally:
        _state.stack.pop()
