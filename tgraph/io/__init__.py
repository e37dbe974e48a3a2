"""Reading checkpoints: the safetensors weight loader and the ``config.json`` parser.

This package sits below ``tgraph.layers``: layers read their weights through
:class:`tgraph.io.weights.WeightLoader` and their shapes from
:class:`tgraph.io.model_config.ModelConfig`, so neither layers nor checkpoint formats depend on
``tgraph.models``.
"""
