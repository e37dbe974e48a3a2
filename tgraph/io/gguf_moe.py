"""Mixture-of-experts GGUF files (Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral): the MoE keys of the config,
and the expert tensors under the names the MoE families read.

llama.cpp stacks a sparse layer's routed experts into one tensor per projection:
``blk.N.ffn_gate_exps.weight`` and ``ffn_up_exps`` of torch shape ``[experts, inter, hidden]``,
``ffn_down_exps`` ``[experts, hidden, inter]``. Expert ``e`` is the ``e``-th 2-D slice, stored
whole after expert ``e - 1`` in the tensor's ggml type (a quantized slice is whole rows of
blocks), so :func:`moe_tensors` gives each expert a tensor-table entry of its own at its offset,
and the loader serves it under the per-expert Hugging Face name
(``model.layers.N.mlp.experts.e.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.e.w1``) as it serves any 2-D tensor: dense, or repacked and kept
quantized. The router is ``ffn_gate_inp``; Qwen2-MoE's shared expert is ``ffn_*_shexp`` and its
gate ``ffn_gate_inp_shexp``, a 1-D ``[hidden]`` tensor read as the ``[1, hidden]`` linear.
Mixtral is written as architecture ``llama`` with an expert count; older files hold its experts
one tensor each (``blk.N.ffn_gate.e.weight``), which read too.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tgraph.errors import ConfigError

if TYPE_CHECKING:
    from tgraph.io.gguf import GGUFTensorInfo

__all__ = ["MIXTRAL_ARCHITECTURE", "MOE_ARCHITECTURES", "moe_config_of", "moe_source",
           "moe_tensors"]

# general.architecture -> (HF model_type, HF architecture class) of the MoE-only architectures.
MOE_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
}
# A "llama" file with an expert count.
MIXTRAL_ARCHITECTURE = ("mixtral", "MixtralForCausalLM")

# Whether llama.cpp renormalises the top-k probabilities: build_moe_ffn's norm_w is fixed per
# architecture (Mixtral's "llama": always), whatever the HF config said.
_RENORMALIZE = {"qwen2moe": False, "qwen3moe": True, "olmoe": False}

# model_type -> (the sparse block's name under model.layers.N, GGUF block tensor -> HF module);
# "{e}" marks a stacked expert tensor, one HF tensor per expert.
_QWEN_BLOCK = ("mlp", {
    "ffn_gate_inp": "gate", "ffn_gate_exps": "experts.{e}.gate_proj",
    "ffn_up_exps": "experts.{e}.up_proj", "ffn_down_exps": "experts.{e}.down_proj",
    "ffn_gate_shexp": "shared_expert.gate_proj", "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj", "ffn_gate_inp_shexp": "shared_expert_gate",
})
_MIXTRAL_BLOCK = ("block_sparse_moe", {
    "ffn_gate_inp": "gate", "ffn_gate_exps": "experts.{e}.w1", "ffn_up_exps": "experts.{e}.w3",
    "ffn_down_exps": "experts.{e}.w2",
})
_BLOCKS: dict[str, tuple[str, dict[str, str]]] = {
    "qwen2_moe": _QWEN_BLOCK, "qwen3_moe": _QWEN_BLOCK, "olmoe": _QWEN_BLOCK,
    "mixtral": _MIXTRAL_BLOCK}

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# Older Mixtral files: one tensor per expert.
_PER_EXPERT_RE = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")
_EXPERTS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def moe_tensors(info: GGUFTensorInfo, model_type: str
                ) -> list[tuple[str, GGUFTensorInfo]] | None:
    """The Hugging Face tensors a tensor of a MoE file holds, as ``(name, table entry)``.

    A stacked expert tensor gives one 2-D entry per expert (``blk.0.ffn_gate_exps.weight[3]``
    at its own offset); a router or shared-expert tensor one entry.

    Args:
        info: the GGUF tensor.
        model_type: the config's model type.

    Returns:
        The entries, or ``None`` for a tensor outside the sparse blocks (or a dense model type).
    """
    if model_type not in _BLOCKS:
        return None
    block, names = _BLOCKS[model_type]
    if m := _PER_EXPERT_RE.fullmatch(info.name):
        module = names.get(f"{m[2]}_exps")
        if module is None:
            return None
        return [(f"model.layers.{m[1]}.{block}.{module.format(e=m[3])}.weight", info)]
    m = _BLOCK_RE.fullmatch(info.name)
    if m is None or m[2] not in names:
        return None
    layer, module = m[1], names[m[2]]
    prefix = f"model.layers.{layer}.{block}"
    if "{e}" not in module:
        if len(info.shape) == 1:  # the shared expert's gate: a [1, hidden] linear
            info = replace(info, shape=(1, *info.shape))
        return [(f"{prefix}.{module}.weight", info)]
    if len(info.shape) != 3:
        return None  # refused by the config (gguf_model_config) with its shape
    experts = info.shape[0]
    step = info.nbytes // experts if info.nbytes > 0 else -1
    return [(f"{prefix}.{module.format(e=e)}.weight",
             replace(info, name=f"{info.name}[{e}]", shape=info.shape[1:],
                     offset=info.offset + e * max(step, 0), nbytes=step))
            for e in range(experts)]


def moe_source(name: str, model_type: str) -> tuple[str, int | None] | None:
    """The GGUF tensor a MoE Hugging Face name is read from, and its expert index (``None``: not
    a stacked expert), e.g. ``model.layers.1.mlp.experts.3.up_proj.weight`` ->
    ``("blk.1.ffn_up_exps.weight", 3)``; ``None`` for another name."""
    if model_type not in _BLOCKS:
        return None
    block, names = _BLOCKS[model_type]
    prefix = re.escape(f".{block}.")
    for gguf_module, module in names.items():
        pattern = re.escape(module).replace(re.escape("{e}"), r"(?P<e>\d+)")
        m = re.fullmatch(rf"model\.layers\.(?P<layer>\d+){prefix}{pattern}\.weight", name)
        if m is not None:
            expert = int(m["e"]) if "{e}" in module else None
            return f"blk.{m['layer']}.{gguf_module}.weight", expert
    return None


def moe_config_of(arch: str, model_type: str, key: Callable[..., Any],
                  tensors: Mapping[str, GGUFTensorInfo], where: str) -> dict[str, Any]:
    """The MoE keys of the Hugging Face config dict of a MoE file.

    Sizes come from the metadata (``expert_count``, ``expert_used_count``,
    ``expert_feed_forward_length``, ``expert_shared_feed_forward_length``), else from the
    tensors; a layer with neither router nor experts is a dense one (``mlp_only_layers``).

    Args:
        arch: ``general.architecture``.
        model_type: the HF model type chosen for it.
        key: reads ``{arch}.<name>`` from the metadata (``key(name, default)``; no default:
            required).
        tensors: the tensor table, by GGUF name.
        where: the file, for errors.

    Raises:
        ConfigError: a missing key, or a stacked expert tensor whose shape disagrees with the
            metadata (the tensor and the expected shape are named).
    """
    experts, top_k = int(key("expert_count")), int(key("expert_used_count"))
    hidden, dense_inter = int(key("embedding_length")), int(key("feed_forward_length"))
    layers = int(key("block_count"))

    def size_of(gguf_key: str, tensor: str, default: int) -> int:
        value = key(gguf_key, None)
        if value is not None:
            return int(value)
        found = next((t for n, t in tensors.items() if n.endswith(tensor)), None)
        return found.shape[-2] if found is not None else default

    d: dict[str, Any] = {"num_experts_per_tok": top_k}
    if model_type == "mixtral":  # every layer sparse; experts as wide as feed_forward_length
        d["num_local_experts"] = experts
        inter = dense_inter
    else:
        inter = size_of("expert_feed_forward_length", ".ffn_gate_exps.weight", dense_inter)
        d.update(num_experts=experts, moe_intermediate_size=inter, decoder_sparse_step=1,
                 norm_topk_prob=_RENORMALIZE[arch],
                 mlp_only_layers=[i for i in range(layers) if not any(
                     f"blk.{i}.{t}.weight" in tensors for t in ("ffn_gate_inp", "ffn_gate_exps"))])
    if model_type == "qwen2_moe":
        # llama.cpp's fallback for a missing key is feed_forward_length.
        d["shared_expert_intermediate_size"] = size_of(
            "expert_shared_feed_forward_length", ".ffn_up_shexp.weight", dense_inter)
        d["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    for name, t in tensors.items():
        m = _EXPERTS_RE.fullmatch(name)
        if m is None:
            continue
        want = (experts, hidden, inter) if m[2] == "down" else (experts, inter, hidden)
        if t.shape != want:
            raise ConfigError(f"'{where}': stacked expert tensor {t.describe()} does not match "
                              f"the metadata ({arch}.expert_count {experts}, hidden {hidden}, "
                              f"expert width {inter}): expected {list(want)}")
    return d
