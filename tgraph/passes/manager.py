"""The pass manager: runs an ordered pipeline of passes, lets callers disable passes by name,
counts matches and keeps provenance (``AddRmsNorm: 32 matches, 0.4 ms``)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tgraph.errors import PassError
from tgraph.ir.network import Network
from tgraph.ir.node import Node

logger = logging.getLogger("tgraph.passes")


class Pass:
    """A network rewrite. Subclasses set ``name`` and implement :meth:`run`."""

    name: str = ""

    def run(self, net: Network) -> int:
        """Rewrite ``net`` in place; return the number of matches/changes made."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<Pass {self.name}>"


def rewrite_each(net: Network, op: str, rewrite: Callable[[Network, Node], int]) -> int:
    """``rewrite(net, node)`` for every ``op`` node still in ``net`` when its turn comes (an
    earlier rewrite may have removed it); the sum of what the rewrites return."""
    count = 0
    for node in list(net.nodes):
        if node.op == op and net.contains(node):
            count += rewrite(net, node)
    return count


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: its name, how many matches it rewrote, and how long it took."""

    name: str
    matches: int
    ms: float
    skipped: bool = False

    def __str__(self) -> str:
        if self.skipped:
            return f"{self.name}: disabled"
        return f"{self.name}: {self.matches} matches, {self.ms:.1f} ms"


class PassManager:
    """Runs ``passes`` in order, skipping the ``disabled`` ones.

    Raises:
        PassError: if ``disabled`` names a pass that is not in the pipeline.
    """

    def __init__(self, passes: Sequence[Pass], disabled: Iterable[str] = ()) -> None:
        self.passes = list(passes)
        names = [p.name for p in self.passes]
        self.disabled = set(disabled)
        unknown = sorted(self.disabled - set(names))
        if unknown:
            raise PassError(f"unknown pass name(s) {unknown} in disabled_passes; the pipeline has: "
                            + ", ".join(names))

    def run(self, net: Network) -> list[PassRecord]:
        records = []
        for p in self.passes:
            if p.name in self.disabled:
                records.append(PassRecord(p.name, 0, 0.0, skipped=True))
                continue
            start = time.perf_counter()
            try:
                matches = p.run(net)
                net.verify()
            except PassError:
                raise
            except Exception as err:
                raise PassError(f"pass {p.name} failed on network {net.name!r}: {err}") from err
            record = PassRecord(p.name, matches, (time.perf_counter() - start) * 1e3)
            logger.debug("%s", record)
            records.append(record)
        return records
