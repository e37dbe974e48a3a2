"""The tgraph error hierarchy.

Every error tgraph raises on purpose is a :class:`TGraphError`. Each subclass also derives from the
builtin exception a Python user would expect (``ValueError``, ``TypeError``, ``RuntimeError``), so
``except ValueError`` keeps working for callers that do not know tgraph.
"""
from __future__ import annotations

import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Frames inside these parts of tgraph are machinery; layers and models count as user code.
_INTERNAL = tuple(os.path.join(_PACKAGE_DIR, part) for part in ("ir", "nn", "passes", "errors.py"))


class TGraphError(Exception):
    """Base class of every error tgraph raises on purpose."""


class RecordError(TGraphError, ValueError):
    """An op could not be recorded: its inputs contradict its shape or dtype rule."""


class GraphError(TGraphError, ValueError):
    """A network is malformed (duplicate names, cycles, unknown outputs...)."""


class PassError(TGraphError, RuntimeError):
    """A pass failed or was configured wrongly."""


class EngineInputError(TGraphError, ValueError):
    """``Engine.forward`` was given inputs or outputs that contradict the built network."""


class ConfigError(TGraphError, ValueError):
    """A configuration file, key or value is invalid."""


class WeightLoadError(TGraphError, ValueError):
    """A checkpoint is missing a tensor, has a wrong shape, or is in a refused format."""


class RequestTooLongError(TGraphError, ValueError):
    """A request can never fit in the model's context or the KV cache."""


class InvalidRequestError(TGraphError, ValueError):
    """A request, its prompt or its sampling parameters are malformed (refused at submission)."""


class InvalidRequestTypeError(InvalidRequestError, TypeError):
    """A request field has the wrong type (a prompt that is not text or token ids, ``stop=5``)."""


class CaptureError(TGraphError, RuntimeError):
    """A CUDA-graph capture failed; the cause is chained."""


def user_frame() -> str:
    """Return ``file:line`` of the innermost stack frame outside tgraph's recording machinery.

    Recording errors use it to point at the line of model code that recorded the bad op.
    """
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_INTERNAL):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"
