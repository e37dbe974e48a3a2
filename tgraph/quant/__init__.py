"""Quantized weights: the layouts every quantized format is repacked into at load
(:class:`QuantScheme`) and the weight object that carries them through the graph
(:class:`QuantizedWeight`). Below the IR: op references dequantize through :func:`dense`."""
from tgraph.quant.quantize import quantize
from tgraph.quant.scheme import KINDS, QuantScheme
from tgraph.quant.weight import QuantizedWeight, dense, is_quantized, unpack_int4

__all__ = ["KINDS", "QuantScheme", "QuantizedWeight", "dense", "is_quantized", "quantize",
           "unpack_int4"]
