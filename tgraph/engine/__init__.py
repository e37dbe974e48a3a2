"""Engines: lowering a network to a launch plan and running it."""
from tgraph.engine.engine import Engine, EngineStats, build_engine

__all__ = ["Engine", "EngineStats", "build_engine"]
