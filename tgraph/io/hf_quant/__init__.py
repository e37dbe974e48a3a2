"""Quantized Hugging Face checkpoints: compressed-tensors, GPTQ, AWQ and FP8 directories,
repacked at load into :mod:`tgraph.quant`'s layouts and never dequantized.

:func:`register_hf_quantized` reads ``config.json``'s ``quantization_config`` and the
checkpoint's tensor names, shapes and dtypes (and a few small index tensors: ``weight_shape``,
``g_idx``), decides every quantized module's layout, and registers its logical
``<module>.weight`` with the loader; the packed parts are read only when the model reads the
weight. Anything unsupported (method, bit width, layout, group size, shapes) is refused while
planning, before any weight is read, naming the tensor, the scheme and what is supported.

What each format reads exactly is documented in its module: :mod:`.compressed_tensors`,
:mod:`.gptq_awq`, :mod:`.fp8`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tgraph.errors import WeightLoadError
from tgraph.io.hf_quant.common import Checkpoint, Plan
from tgraph.io.hf_quant.compressed_tensors import plan_compressed_tensors
from tgraph.io.hf_quant.fp8 import plan_fp8
from tgraph.io.hf_quant.gptq_awq import plan_awq, plan_gptq
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import WeightLoader

__all__ = ["METHODS", "register_hf_quantized"]

_PLANNERS: dict[str, Callable[[Checkpoint, Mapping[str, Any], torch.dtype], list[Plan]]] = {
    "compressed-tensors": plan_compressed_tensors,
    "gptq": plan_gptq,
    "awq": plan_awq,
    "fp8": plan_fp8,
}
METHODS: tuple[str, ...] = tuple(_PLANNERS)
# The tensor that marks a quantized module, per method (for the "nothing quantized" message).
_MARKERS = {"compressed-tensors": "weight_packed or weight_scale", "gptq": "qweight",
            "awq": "qweight", "fp8": "weight_scale_inv or weight_scale"}
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def register_hf_quantized(loader: WeightLoader, config: ModelConfig | None,
                          quant_config: Mapping[str, Any]) -> list[str]:
    """Register every quantized weight of a Hugging Face checkpoint with ``loader``.

    Args:
        loader: the checkpoint's loader (a :class:`~tgraph.io.weights.SafetensorFileLoader`
            gives dtypes from the file headers, so more is checked before any read).
        config: the model config (its ``torch_dtype`` is the weights' logical dtype until the
            loader sets its own); ``None`` for fp32.
        quant_config: ``config.json``'s ``quantization_config``.

    Returns:
        The logical weight names registered, sorted.

    Raises:
        WeightLoadError: an unsupported method or scheme, tensors that do not fit the format's
            layout, or no quantized tensor at all.
    """
    method = str(quant_config.get("quant_method") or "").lower()
    planner = _PLANNERS.get(method)
    if planner is None:
        raise WeightLoadError(
            f"quantization method {method or '(none)'!r} in config.json's quantization_config is "
            f"not supported; tgraph reads {', '.join(METHODS)} checkpoints (and GGUF files)")
    dtype = _DTYPES.get(str(getattr(config, "torch_dtype", None)), torch.float32)
    ckpt = Checkpoint(loader, method)
    try:
        plans = planner(ckpt, quant_config, dtype)
        if not plans:
            raise WeightLoadError(
                f"config.json declares {method} quantization, but no tensor of the checkpoint "
                f"is quantized that way (no module has a {_MARKERS[method]} tensor)")
    finally:
        ckpt.close()
    for plan in plans:
        loader.register_quantized(plan.name, plan.shape, plan.build, plan.parts)
    return sorted(p.name for p in plans)
