"""Engines: lowering a network to a launch plan and running it."""
from tgraph.engine.engine import CaptureHandle, Engine, EngineStats, build_engine

__all__ = ["CaptureHandle", "Engine", "EngineStats", "build_engine"]
