"""Dumping a step's intermediates: every named value an engine computes, for debugging."""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tgraph.engine import Engine

__all__ = ["dump_intermediates"]


def dump_intermediates(engine: Engine, inputs: Mapping[str, Any],
                       runtime: Mapping[str, Any] | None,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       directory: str | Path) -> int:
    """Save the named intermediates of one step of ``engine`` to ``directory``.

    Writes ``<engine name>.safetensors`` (the values) and ``<engine name>.json`` (their shapes
    and dtypes). The KV caches are snapshotted and restored around the run, so the real step
    that follows sees the cache as it was.

    Args:
        engine: the engine of the step.
        inputs: the step's engine inputs.
        runtime: the step's runtime parameters, or ``None``.
        kv_caches: the caches the step writes, ``(k, v)`` per layer.
        directory: where to write (created if missing).

    Returns:
        The number of intermediates written.
    """
    from safetensors.torch import save_file

    saved = [(k.clone(), v.clone()) for k, v in kv_caches]
    values = engine.intermediates(inputs, runtime or None)
    for (k, v), (k0, v0) in zip(kv_caches, saved):
        k.copy_(k0)
        v.copy_(v0)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = engine.net.name.replace(":", "_").replace("+", "_")
    save_file({n: t.contiguous().cpu() for n, t in values.items()},
              str(directory / f"{stem}.safetensors"))
    index = {n: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
             for n, t in values.items()}
    (directory / f"{stem}.json").write_text(json.dumps(index, indent=1))
    return len(values)
