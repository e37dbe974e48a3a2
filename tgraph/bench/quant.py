"""Quantized models next to the bf16 one (``tgraph bench models --quant int4|int8|fp8|all``).

The random bf16 weights of a preset are quantized with round-to-nearest into the layouts the
checkpoint loaders repack to: every linear of the decoder layers held quantized, the embedding,
the norms and ``lm_head`` in bf16 (what int4 / fp8 checkpoints ship). Each scheme is measured in
the same run as the bf16 model (``fp8-a8``: fp8 weights with the activations quantized to e4m3
in prefill, ``QuantGemmTuning.fp8_activations``): decode steps at the requested batches (static
graphs, context 512), CUDA-graph replays, and prefill 1 x 2048 and 8 x 512.

A step's weight-read bound counts the bytes one decode step must read: the quantized codes with
their scales (and offsets), the bf16 weights that stay dense except the embedding table, of
which a step reads only its batch's rows (a tied table is read whole, as ``lm_head``), divided by
the copy bandwidth the same run measured. The bf16 model gets the same per-step bound here, next
to the whole-checkpoint bound of the main table.
"""
from __future__ import annotations

import gc
import re
from dataclasses import dataclass, field

import torch

from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import DictWeightLoader
from tgraph.models.loading import build_model
from tgraph.quant import QuantizedWeight, quantize
from tgraph.tuning import QuantGemmTuning, Tuning

__all__ = ["QUANT_SCHEMES", "SCHEME_TUNING", "QuantResult", "linear_names", "quantize_linears",
           "step_read_bytes"]

# kind -> quantize() arguments: int4 group 128 symmetric (GPTQ / AWQ / compressed-tensors
# W4A16), int8 per channel (W8A16), fp8 e4m3 per channel (FP8-dynamic checkpoints).
QUANT_SCHEMES: dict[str, dict] = {
    "int4": dict(kind="int4", group_size=128),
    "int8": dict(kind="int8"),
    "fp8": dict(kind="fp8"),
    "fp8-a8": dict(kind="fp8"),  # fp8 with e4m3 activations in prefill (SCHEME_TUNING)
}
# Schemes that run with other than the default settings.
SCHEME_TUNING: dict[str, Tuning] = {
    "fp8-a8": Tuning(quant_gemm=QuantGemmTuning(fp8_activations=True)),
}
_LINEAR = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


@dataclass
class QuantResult:
    scheme: str
    weight_bytes: int                                    # resident weight bytes
    step_bytes: int                                      # bytes one batch-1 decode step reads
    bound_ms: float                                      # step_bytes / copy bandwidth
    decode_ms: dict = field(default_factory=dict)        # batch -> ms
    replay_ms: dict = field(default_factory=dict)        # batch -> ms of the graphs alone
    prefill_ms: dict = field(default_factory=dict)       # "8x512" -> ms
    skipped: str | None = None


def linear_names(weights: dict[str, torch.Tensor]) -> list[str]:
    """The names of the decoder layers' linear weights (what the bench quantizes)."""
    return [name for name in weights if _LINEAR.search(name)]


def quantize_linears(weights: dict[str, torch.Tensor], kind: str) -> dict[str, QuantizedWeight]:
    """The decoder layers' linear weights of ``weights`` quantized to scheme ``kind``."""
    args = QUANT_SCHEMES[kind]
    return {name: quantize(weights[name], name=name, **args) for name in linear_names(weights)}


def step_read_bytes(hf_config: dict, weights: dict[str, torch.Tensor],
                    quantized: dict[str, QuantizedWeight], batch: int = 1) -> int:
    """Bytes a decode step of ``batch`` tokens reads from the weights (see the module doc)."""
    total = 0
    for name, w in weights.items():
        if name in quantized:
            total += quantized[name].nbytes
        elif name.endswith("embed_tokens.weight") and not hf_config.get("tie_word_embeddings"):
            total += batch * w.shape[1] * w.element_size()
        else:
            total += w.numel() * w.element_size()
    return total


def quantized_model(hf_config: dict, weights: dict[str, torch.Tensor],
                    quantized: dict[str, QuantizedWeight], scheme: str | None = None,
                    **llm_options):
    """A tgraph model of ``hf_config`` holding ``quantized`` in place of those dense weights,
    with the settings bench ``scheme`` runs with (:data:`SCHEME_TUNING`)."""
    if scheme in SCHEME_TUNING:
        llm_options.setdefault("tuning", SCHEME_TUNING[scheme])
    loader = DictWeightLoader({n: w for n, w in weights.items() if n not in quantized},
                              device="cuda", dtype=torch.bfloat16)
    for name, q in quantized.items():
        loader.register_quantized(name, q.shape, lambda q=q: q)
    return build_model(ModelConfig.from_dict(hf_config), loader, **llm_options)


def bench_quantized(hf_config: dict, weights: dict[str, torch.Tensor], kinds: list[str],
                    batches: list[int], copy_gbps: float, bench_tgraph) -> dict[str, QuantResult]:
    """Each scheme of ``kinds`` measured by ``bench_tgraph`` (the bf16 model's routine)."""
    from tgraph.bench.models import PresetResult

    out = {}
    for kind in kinds:
        quantized = quantize_linears(weights, kind)
        step = step_read_bytes(hf_config, weights, quantized)
        resident = step_read_bytes(hf_config, weights, quantized, batch=0) + sum(
            w.numel() * w.element_size() for n, w in weights.items()
            if n.endswith("embed_tokens.weight") and not hf_config.get("tie_word_embeddings"))
        res = QuantResult(QUANT_SCHEMES[kind]["kind"] + _describe(kind), resident, step,
                          step / (copy_gbps * 1e9) * 1e3)
        label = f"tgraph {kind}"
        try:
            model = quantized_model(hf_config, weights, quantized, kind, max_model_len=4096)
            scratch = PresetResult(label, resident, res.bound_ms)
            bench_tgraph(model, batches, scratch, "tgraph static")
            res.decode_ms = scratch.decode_ms["tgraph static"]
            res.replay_ms, res.prefill_ms = scratch.replay_ms, scratch.prefill_ms
            del model
        except Exception as err:  # reported, never faked
            res.skipped = f"{type(err).__name__}: {str(err)[:300]}"
        out[kind] = res
        del quantized
        gc.collect()
        torch.cuda.empty_cache()
    return out


def _describe(kind: str) -> str:
    args = QUANT_SCHEMES[kind]
    if args.get("group_size"):
        return f" g{args['group_size']}"
    return " channel" + (" a8" if kind == "fp8-a8" else "")


def print_quant_table(preset: str, bf16_step_ms: dict, bf16_prefill: dict, bf16_step_bound: float,
                      quant: dict[str, QuantResult], copy_gbps: float) -> None:
    """Decode per batch (ms, x its bound, speed-up over bf16) and prefill per shape."""
    batches = sorted(bf16_step_ms)
    print(f"\n{preset}: quantized decode (context 512) and prefill, against tgraph bf16")
    head = f"{'system':<22} {'step MB':>8} {'bound ms':>8}"
    for b in batches:
        head += f" {f'b{b} ms':>9} {'x bnd':>6} {'vs bf16':>7}"
    head += "".join(f" {k + ' ms':>12} {'vs bf16':>7}" for k in sorted(bf16_prefill))
    print(head)
    rows = [("bf16", None)] + [(k, r) for k, r in quant.items()]
    for kind, r in rows:
        if r is not None and r.skipped:
            print(f"{'tgraph ' + kind:<22} skipped: {r.skipped}")
            continue
        bound = r.bound_ms if r else bf16_step_bound
        step_mb = bound * copy_gbps if r is None else r.step_bytes / 1e6
        label = "tgraph bf16" if r is None else f"tgraph {r.scheme}"
        line = f"{label:<22} {step_mb:8.0f} {bound:8.3f}"
        for b in batches:
            ms = (r.decode_ms if r else bf16_step_ms).get(b)
            base = bf16_step_ms.get(b)
            if ms is None:
                line += f" {'-':>9} {'-':>6} {'-':>7}"
                continue
            line += f" {ms:9.3f} {ms / bound:6.2f} " \
                    f"{base / ms if base else float('nan'):6.2f}x"
        for shape in sorted(bf16_prefill):
            ms = (r.prefill_ms if r else bf16_prefill).get(shape)
            base = bf16_prefill.get(shape)
            line += f" {ms if ms else float('nan'):12.2f} " \
                    f"{base / ms if ms and base else float('nan'):6.2f}x"
        print(line)
