"""Sparse mixture-of-experts MLP blocks: a router, the routed experts held stacked, and the
optional shared expert of Qwen2-MoE.

Checkpoints store one tensor per expert, as transformers saves them
(``{prefix}.experts.{e}.gate_proj.weight`` ... or Mixtral's ``w1 / w3 / w2``; transformers 5's
in-memory state dicts hold them stacked as ``experts.gate_up_proj`` / ``experts.down_proj``,
also read); they are stacked at load into ``w13 [experts, 2 * inter, hidden]`` (each expert's
gate rows, then its up rows) and ``w2 [experts, hidden, inter]``, the operands of the ``moe``
op. Under tensor parallelism
each expert's intermediate dimension is split over the ranks as the dense MLP's is, and the
block's partial sums are all-reduced once. Quantized experts (GGUF, int4/int8 groups, FP8) stay
packed, stacked flat as ``[E * 2I, H]`` and ``[E * H, I]`` quantized weights the expert kernels
read as codes; experts that cannot (GPTQ act-order, mixed schemes) are dequantized at load.
"""
from __future__ import annotations

import torch

from tgraph.errors import ConfigError, WeightLoadError
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import WeightLoader
from tgraph.layers.linear import ReplicatedLinear, divide
from tgraph.layers.mlp import Mlp
from tgraph.nn import functional as F
from tgraph.nn.module import Module, Parameter
from tgraph.nn.tensor import Tensor
from tgraph.quant import QuantizedWeight, dense, is_quantized

__all__ = ["MoeConfig", "MoeExperts", "SparseMoeBlock", "sparse_or_dense_mlp"]

# Per-expert checkpoint names of the gate, up and down projections, by family.
HF_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


class MoeConfig:
    """The MoE keys of a Hugging Face config (``config.hf_config``), checked.

    Attributes:
        num_experts: routed experts per sparse layer.
        top_k: experts per token.
        intermediate_size: each expert's intermediate width.
        renormalize: the chosen experts' probabilities are scaled to sum to one.
        shared_intermediate_size: the shared expert's width (0: none).
        sparse_step: every ``sparse_step``-th layer is sparse (Qwen2/3-MoE).
        dense_layers: layers kept dense (``mlp_only_layers``).
    """

    def __init__(self, config: ModelConfig, *, inter_key: str = "moe_intermediate_size",
                 renormalize: bool | None = None, shared: bool = False) -> None:
        d = config.hf_config
        # Qwen's checkpoints say num_experts; Mixtral's (and transformers 5's saves) say
        # num_local_experts.
        experts_key = "num_experts" if d.get("num_experts") is not None else "num_local_experts"

        def int_key(key: str, default: int | None = None) -> int:
            value = d.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{config.model_type}: {key!r} must be a non-negative int, "
                                  f"got {value!r}")
            return value

        self.num_experts = int_key(experts_key)
        self.top_k = int_key("num_experts_per_tok")
        self.intermediate_size = int_key(inter_key, config.intermediate_size)
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"{config.model_type}: num_experts_per_tok ({self.top_k}) must be "
                              f"between 1 and the {self.num_experts} experts")
        self.renormalize = bool(d.get("norm_topk_prob", False)) if renormalize is None \
            else renormalize
        self.shared_intermediate_size = int_key("shared_expert_intermediate_size", 0) \
            if shared else 0
        self.sparse_step = max(int_key("decoder_sparse_step", 1), 1)
        dense = d.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise ConfigError(f"{config.model_type}: 'mlp_only_layers' must be a list of layer "
                              f"indices, got {dense!r}")
        self.dense_layers = frozenset(dense)

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has the sparse block (else a dense MLP)."""
        return layer_idx not in self.dense_layers and (layer_idx + 1) % self.sparse_step == 0


class MoeExperts(Module):
    """The routed experts, stacked: ``w13 [E, 2 * I / tp, H]`` and ``w2 [E, H, I / tp]``.

    Calling it runs the ``moe`` op on ``(x, router_logits)``: a rule that places this module
    (``mlp.experts``) on another device moves the experts' weights and their work there, while
    the router and the rest of the layer stay (only the hidden states and logits cross).
    """

    def __init__(self, loader: WeightLoader, prefix: str, num_experts: int, hidden: int,
                 inter: int, top_k: int, renormalize: bool,
                 names: tuple[str, str, str] = HF_EXPERT_NAMES) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        rank, ws = loader.rank, loader.world_size
        part = divide(inter, ws, f"{prefix} intermediate size")
        if loader.has(f"{prefix}.gate_up_proj"):  # transformers 5's in-memory layout, stacked
            loader.expect_shape(f"{prefix}.gate_up_proj", (num_experts, 2 * inter, hidden))
            loader.expect_shape(f"{prefix}.down_proj", (num_experts, hidden, inter))
            gate_up = loader.get_tensor(f"{prefix}.gate_up_proj")
            down = loader.get_tensor(f"{prefix}.down_proj")
            if ws > 1:  # this rank's rows of every expert's gate and up, columns of its down
                cut = slice(rank * part, (rank + 1) * part)
                gate_up = gate_up.view(num_experts, 2, inter, hidden)[:, :, cut].reshape(
                    num_experts, 2 * part, hidden)
                down = down[:, :, cut]
            self.w13 = Parameter(gate_up.contiguous())  # no copy when already whole
            self.w2 = Parameter(down.contiguous())
            self.num_experts, self.world_size = num_experts, ws
            return
        gate_name, up_name, down_name = names
        gate_up, down = [], []
        for e in range(num_experts):
            base = f"{prefix}.{e}"
            for name, shape in ((gate_name, (inter, hidden)), (up_name, (inter, hidden)),
                                (down_name, (hidden, inter))):
                loader.expect_shape(f"{base}.{name}.weight", shape)
            gate_up += [loader.get_sharded(f"{base}.{gate_name}.weight", 0, rank, ws),
                        loader.get_sharded(f"{base}.{up_name}.weight", 0, rank, ws)]
            down.append(loader.get_sharded(f"{base}.{down_name}.weight", 1, rank, ws))
        w13, w2 = _packed(gate_up, f"{prefix}.w13"), _packed(down, f"{prefix}.w2")
        if w13 is not None and w2 is not None:  # flat [E * 2I, H] and [E * H, I], still packed
            self.w13, self.w2 = Parameter(w13), Parameter(w2)
        else:
            self.w13 = Parameter(torch.stack([torch.cat([dense(g), dense(u)]) for g, u
                                              in zip(gate_up[0::2], gate_up[1::2])]))
            self.w2 = Parameter(torch.stack([dense(d) for d in down]))
        self.num_experts, self.world_size = num_experts, ws

    def forward(self, x: Tensor, router_logits: Tensor) -> Tensor:
        return F.moe(x, router_logits, self.w13, self.w2, self.top_k, self.renormalize)

    def extra_repr(self) -> str:
        e, h = self.num_experts, self.w13.shape[-1]
        inter = self.w2.shape[-1]
        w13 = self.w13.data
        packed = f", {w13.scheme.describe(w13.shape)}" if is_quantized(w13) else ""
        return f"{e} experts, top {self.top_k}, hidden {h}, inter {inter} per rank{packed}"


class SparseMoeBlock(Module):
    """``sum_k p_k * expert_k(x)`` over each token's top-k experts (+ the gated shared expert).

    Args:
        config: the model config.
        loader: weight loader.
        prefix: the block's checkpoint prefix (``...mlp`` or Mixtral's ``...block_sparse_moe``).
        moe: the MoE keys.
        expert_names: per-expert gate / up / down checkpoint names.
    """

    def __init__(self, config: ModelConfig, loader: WeightLoader, prefix: str, moe: MoeConfig,
                 expert_names: tuple[str, str, str] = HF_EXPERT_NAMES) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = ReplicatedLinear(loader, f"{prefix}.gate", hidden, moe.num_experts)
        self.experts = MoeExperts(loader, f"{prefix}.experts", moe.num_experts, hidden,
                                  moe.intermediate_size, moe.top_k, moe.renormalize,
                                  expert_names)
        self.has_shared_expert = bool(moe.shared_intermediate_size)
        if self.has_shared_expert:
            self.shared_expert = Mlp(config, loader, f"{prefix}.shared_expert",
                                     intermediate_size=moe.shared_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(loader, f"{prefix}.shared_expert_gate",
                                                       hidden, 1)
            # Its partial sum joins the routed experts' before the block's one all-reduce
            # (the gate is the same on every rank, so it scales the partials alike).
            self.shared_expert.down_proj.reduce_output = False

    def forward(self, x: Tensor) -> Tensor:
        out = self.experts(x, self.gate(x))
        if self.has_shared_expert:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.experts.world_size > 1:  # one all-reduce for the routed and shared experts
            from tgraph.nn import distributed

            out = distributed.all_reduce(out)
        return out


def _packed(parts: list, name: str) -> QuantizedWeight | None:
    """Quantized expert weights stacked row-wise without dequantizing, or None where they
    cannot stay packed: a part is dense, has permuted columns (GPTQ act-order), or the parts'
    schemes differ or have scale blocks straddling two parts."""
    if not all(is_quantized(p) and p.perm is None for p in parts):
        return None
    try:
        return QuantizedWeight.cat(parts, name=name)
    except WeightLoadError:
        return None


def sparse_or_dense_mlp(config: ModelConfig, loader: WeightLoader, prefix: str, layer_idx: int,
                        shared: bool = False) -> Module:
    """Layer ``layer_idx``'s MLP in a Qwen-MoE family: the sparse block where
    ``decoder_sparse_step`` / ``mlp_only_layers`` make it sparse, else the dense MLP
    (``shared``: the sparse block has Qwen2-MoE's gated shared expert)."""
    moe = MoeConfig(config, shared=shared)
    if moe.is_sparse(layer_idx):
        return SparseMoeBlock(config, loader, prefix, moe)
    return Mlp(config, loader, prefix, bias=config.mlp_bias)
