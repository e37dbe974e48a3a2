"""Engines: lowering a network to a launch plan and running it."""
from tgraph.engine.capture import CaptureHandle
from tgraph.engine.engine import Engine, EngineStats, build_engine

__all__ = ["CaptureHandle", "Engine", "EngineStats", "build_engine"]
