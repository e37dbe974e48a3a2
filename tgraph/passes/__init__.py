"""Passes over networks: clean-up, pattern rewrites and fusions, partitioning, memory planning.

One pass family per file; the pipeline order is written once, in :mod:`tgraph.passes.pipeline`.
"""
from tgraph.passes.manager import Pass, PassManager, PassRecord
from tgraph.passes.pattern import Match, Pattern, PatternPass
from tgraph.passes.pipeline import default_pipeline, pass_names

__all__ = ["Match", "Pass", "PassManager", "PassRecord", "Pattern", "PatternPass",
           "default_pipeline", "pass_names"]
