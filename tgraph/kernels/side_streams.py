"""Work forked onto a side stream during a step and joined back at its end.

A kernel that must not hold up the stream's chain of dependent launches (an L2 prefetch, which
lasts as long as its bytes take to arrive) runs inside :func:`forked`: the side stream first
waits for everything launched so far on the current stream, so the forked work starts after the
kernel before it, and nothing on the current stream waits for it until :func:`join_forked`, which
the engine calls at the end of every run of its steps (also while capturing a CUDA graph, where
the fork and the join become edges of the graph).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["forked", "join_forked"]

_streams: dict[int, torch.cuda.Stream] = {}
_pending: set[int] = set()


@contextmanager
def forked(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """Make the side stream of CUDA ``device`` current, after it waited for the current one."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _streams.get(index)
    if side is None:
        side = _streams[index] = torch.cuda.Stream(index)
    side.wait_stream(torch.cuda.current_stream(index))
    with torch.cuda.stream(side):
        yield side
    _pending.add(index)


def join_forked() -> None:
    """Make the current stream of every device with forked work wait for it."""
    while _pending:
        index = _pending.pop()
        torch.cuda.current_stream(index).wait_stream(_streams[index])
