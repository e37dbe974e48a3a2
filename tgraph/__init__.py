"""tgraph: graph capture and fused kernels for fast LLM inference.

The serving API::

    from tgraph import LLM, SamplingParams

    outputs = LLM("path/to/model").generate(["Hello"], SamplingParams(max_tokens=16))

``import tgraph`` itself is cheap: the names of ``__all__`` are imported on first use (PEP 562),
so a script that records a network never loads the serving runtime, and neither loads torch
before it is needed.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> (module, attribute; None: the module itself), imported on first access.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "LLM": ("tgraph.runtime.llm", "LLM"),
    "SamplingParams": ("tgraph.runtime.sampling_params", "SamplingParams"),
    "RequestOutput": ("tgraph.runtime.llm", "RequestOutput"),
    "StreamEvent": ("tgraph.runtime.llm", "StreamEvent"),
    "TokenLogprobs": ("tgraph.runtime.sampler", "TokenLogprobs"),
    "Engine": ("tgraph.engine", "Engine"),
    "build_engine": ("tgraph.engine", "build_engine"),
    "TGraphError": ("tgraph.errors", "TGraphError"),
    "nn": ("tgraph.nn", None),
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:
    # ``X as X``: explicit re-exports (``__all__`` is built from _EXPORTS, which ruff cannot read).
    from tgraph import nn as nn
    from tgraph.engine import Engine as Engine
    from tgraph.engine import build_engine as build_engine
    from tgraph.errors import TGraphError as TGraphError
    from tgraph.runtime.llm import LLM as LLM
    from tgraph.runtime.llm import RequestOutput as RequestOutput
    from tgraph.runtime.llm import StreamEvent as StreamEvent
    from tgraph.runtime.sampler import TokenLogprobs as TokenLogprobs
    from tgraph.runtime.sampling_params import SamplingParams as SamplingParams


def __getattr__(name: str) -> Any:
    """Import a public name on first access and keep it as a module attribute."""
    try:
        module_name, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'tgraph' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
