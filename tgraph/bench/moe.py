"""Mixture-of-experts runs of ``tgraph bench models``.

- Presets too large for the GPU in bf16 (Mixtral-8x7B: 93 GB) run with their weights quantized
  (:data:`PRESET_SCHEMES`): attention and expert linears held as FP8 or int4 codes, generated
  and quantized one tensor at a time as the model loads them (the bf16 model never exists), the
  experts under their checkpoint names (one tensor per expert), kept packed by the loader.
- ``--cpu-experts``: the same model with the routed experts of the first half of the layers on
  the CPU (``configs/rules/moe_experts_on_cpu.yaml`` narrowed to those layers), KTransformers'
  placement for models larger than the GPU; no CUDA graphs (the step crosses devices).

The bound of a step counts the bytes it reads (:func:`moe_step_bytes`): everything but the
experts, the batch's embedding rows and the experts its tokens are expected to touch.
"""
from __future__ import annotations

import gc
import re

import torch

from tgraph.bench.random_loader import checkpoint_shapes
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import DictWeightLoader
from tgraph.models.loading import build_model
from tgraph.quant import QuantizedWeight, quantize

__all__ = ["PRESET_SCHEMES", "cpu_experts_rules", "moe_step_bytes", "quantized_moe_model"]

# Presets that do not fit one GPU in bf16, and the scheme their bench runs in.
PRESET_SCHEMES: dict[str, str] = {"mixtral-8x7b": "fp8"}
# quantize() arguments per scheme (int4: group 128, symmetric).
_SCHEME_ARGS = {"fp8": dict(kind="fp8"), "int4": dict(kind="int4", group_size=128),
                "int8": dict(kind="int8")}
_QUANTIZED = re.compile(r"\.layers\.\d+\.(self_attn\.\w+_proj|.*\.experts\.\d+\.\w+)\.weight$")


def moe_step_bytes(hf_config: dict, sizes: dict[str, tuple[int, int]], batch: int) -> float:
    """Bytes a decode step of ``batch`` tokens reads from a MoE model's weights: everything but
    the experts and the embedding table, the batch's embedding rows, and the experts the batch
    is expected to touch under uniform routing, ``E * (1 - (1 - k / E) ** batch)`` of ``E``.

    ``sizes``: weight name -> (resident bytes, bytes of one row).
    """
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    k = hf_config["num_experts_per_tok"]
    expert_bytes = other = 0
    for name, (nbytes, row_bytes) in sizes.items():
        if ".experts." in name:
            expert_bytes += nbytes
        elif name.endswith("embed_tokens.weight") and not hf_config.get("tie_word_embeddings"):
            other += batch * row_bytes
        else:
            other += nbytes
    return other + expert_bytes * (1 - (1 - k / experts) ** batch)


def dense_sizes(weights: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """:func:`moe_step_bytes`' sizes of dense weights."""
    return {n: (w.numel() * w.element_size(), w[0].numel() * w.element_size() if w.dim() else 0)
            for n, w in weights.items()}


def _checkpoint_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the HF checkpoint of ``hf_config``, one tensor per expert (as saved
    on disk; transformers 5 stacks them in memory)."""
    mixtral = hf_config["model_type"] == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shapes = {}
    for name, shape in checkpoint_shapes(hf_config).items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            e, rows, cols = shape
            for i in range(e):
                if leaf == "gate_up_proj":
                    shapes[f"{prefix}.{i}.{gate}.weight"] = (rows // 2, cols)
                    shapes[f"{prefix}.{i}.{up}.weight"] = (rows // 2, cols)
                else:
                    shapes[f"{prefix}.{i}.{down}.weight"] = (rows, cols)
        else:
            shapes[name] = shape
    return shapes


def quantized_moe_model(hf_config: dict, kind: str, device: str = "cuda", **llm_options
                        ) -> tuple[object, dict[str, tuple[int, int]]]:
    """A model of ``hf_config`` on ``device`` with random weights, the attention and expert
    linears quantized to ``kind`` as they load, and :func:`moe_step_bytes`' sizes."""
    shapes = _checkpoint_shapes(hf_config)
    gen = torch.Generator(device=device).manual_seed(0)

    def draw(shape: tuple[int, ...], name: str) -> torch.Tensor:
        w = torch.empty(shape, dtype=torch.bfloat16, device=device)
        return w.fill_(1.0) if name.endswith("norm.weight") else w.normal_(0, 0.02,
                                                                            generator=gen)

    dense = {n: draw(s, n) for n, s in shapes.items() if not _QUANTIZED.search(n)}
    loader = DictWeightLoader(dense, device=device, dtype=torch.bfloat16)
    sizes = dense_sizes(dense)
    probe: dict[tuple[int, ...], int] = {}
    for name, shape in shapes.items():
        if name in dense:
            continue
        def make(name: str = name, shape: tuple[int, ...] = shape) -> QuantizedWeight:
            return quantize(draw(shape, name), name=name, **_SCHEME_ARGS[kind])

        loader.register_quantized(name, shape, make)
        if shape not in probe:
            probe[shape] = quantize(torch.zeros(shape, dtype=torch.bfloat16, device=device),
                                    **_SCHEME_ARGS[kind]).nbytes
        sizes[name] = (probe[shape], 0)
    model = build_model(ModelConfig.from_dict(hf_config), loader, **llm_options)
    del dense
    gc.collect()
    return model, sizes


def cpu_experts_rules(hf_config: dict) -> list:
    """Rules placing the routed experts of the first half of the layers on the CPU."""
    from tgraph.rules import load_rules

    half = hf_config["num_hidden_layers"] // 2
    layers = "|".join(str(i) for i in range(half))
    # Module names: every family's sparse block is the layer's mlp.
    return load_rules([{"match": {"name": rf"^model\.layers\.({layers})\.mlp\.experts$"},
                        "replace": {"class": "default", "kwargs": {"device": "cpu"}}}])
