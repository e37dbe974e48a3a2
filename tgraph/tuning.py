"""Launch settings of the kernels: frozen dataclasses, one per kernel family, in one
:class:`Tuning`.

The defaults are the measured choices (``docs/performance.md`` has the measurements); each field
says in one line why it has its value. An :class:`~tgraph.engine.Engine` holds one ``Tuning``
and hands each kernel its section as an argument, so two engines in one process can run with
different settings (``tgraph.bench.ab`` compares two that way) and a captured CUDA graph always
replays the settings of the engine that captured it. Nothing here is mutable.

The settings tree exposes every field as ``llm.engine.tuning.<section>.<field>``::

    tgraph generate --model DIR --set llm.engine.tuning.gemv.tma_weights=false

and ``python -m tgraph.config --tuning`` prints them all with their docs.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AllReduceTuning", "CpuTuning", "DecodeAttentionTuning", "DecodeTiles", "GemvConfig",
           "GemvOverride", "GemvTuning", "LoraTuning", "MoeTuning", "PrefetchTuning",
           "QuantGemmTuning", "QuantGemvTuning", "Tuning", "VocabParallelTuning", "convert",
           "describe", "from_dict", "leaf_types", "to_dict"]


def knob(default: Any, doc: str, minimum: int = 1) -> Any:
    """A field with its default and the one-line reason for it (shown by ``--tuning``); an int
    field accepts values from ``minimum`` up."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("tuning defaults must be immutable")
    return field(default=default, metadata={"doc": doc, "minimum": minimum})


def section(cls: type, doc: str, **values: Any) -> Any:
    """A nested section whose default is ``cls(**values)``."""
    return field(default_factory=lambda: cls(**values), metadata={"doc": doc})


class _Section:
    """Base of the tuning dataclasses: built directly, they get the checks settings get."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if isinstance(f.default, int) and not isinstance(f.default, bool):
                convert(f"{type(self).__name__}.{f.name}", int, getattr(self, f.name),
                        f.metadata.get("minimum", 1))


@dataclass(frozen=True)
class GemvConfig(_Section):
    """One launch of the small-M linear (the ``config`` argument of ``small_m_linear``)."""

    block_n: int = knob(4, "output columns per program; 64 or more swaps the MMA operands")
    block_k: int = knob(1024, "K elements per loop step")
    split_k: int = knob(1, "programs sharing one output tile's K range")
    num_warps: int = knob(4, "warps per program")
    num_stages: int = knob(3, "software-pipeline depth of the weight loads")


@dataclass(frozen=True)
class GemvOverride(_Section):
    """A launch configuration that replaces the heuristic's for one shape."""

    block_m: int = knob(1, "the M bucket: 1, 16 or 32")
    n: int = knob(1, "output features")
    k: int = knob(1, "input features")
    gated: bool = knob(False, "a SwiGLU gate|up linear")
    norm: bool = knob(False, "with the RMSNorm fused")
    config: GemvConfig = section(GemvConfig, "the launch to use for this shape")

    def key(self) -> tuple[int, int, int, bool, bool]:
        return (self.block_m, self.n, self.k, self.gated, self.norm)


@dataclass(frozen=True)
class QuantGemvTuning(_Section):
    """The small-M linear on quantized weights (tensor cores on the codes, scales per tile)."""

    small_m_max: int = knob(64, "largest M run as a GEMV on a quantized weight; above it the "
                                "dequantizing GEMM")
    block_n: int = knob(64, "weight rows per program (64 or more: the weight is the MMA's M "
                            "side; 32-row non-swapped tiles made int8 / fp8 steps slower)")
    block_k: int = knob(128, "logical K per step, capped at the scale group: every tile lies "
                             "in one scale block")
    num_warps: int = knob(4, "warps per program")
    num_stages: int = knob(4, "software-pipeline depth of the code loads")
    programs_per_sm: int = knob(4, "split K until the grid has this many programs per SM (the "
                                   "whole-step sweep's best at 16 and 64 rows for every scheme)")
    words: bool = knob(True, "2-64 rows of int4 / fp8 codes: MMAs on code pairs made from "
                             "int32 words in registers (False: the code tile converted whole and "
                             "laid out through shared memory)")
    words_block_n: int = knob(128, "2-32 rows on int4 words: weight rows per program (the "
                                   "cold per-layer sweep's best; fp8 has its own)")
    words_fp8_block_n: int = knob(64, "2-32 rows on fp8 words: weight rows per program")
    words_block_n_m64: int = knob(64, "33-64 rows on words: weight rows per program (128 made "
                                      "int4 and fp8 layers slower than the byte tiles)")
    words_block_k: int = knob(128, "2-64 rows on words: K per step, capped at the scale group")
    words_num_warps: int = knob(4, "2-64 rows on words: warps per program")
    words_num_stages: int = knob(3, "2-64 rows on words: pipeline depth")
    m1_fp8_words: bool = knob(True, "one row of fp8 codes on 16-bit activations: fp16x2 "
                                    "products on int32 words of codes (False: the fp32 loop "
                                    "on one-byte codes)")
    m1_fp8_words_block_n: int = knob(8, "one row of fp8 words: weight rows per program (the "
                                        "cold per-layer sweep's best with 2048-wide K tiles)")
    m1_fma: bool = knob(True, "one row runs on CUDA cores (the tile dequantized in registers), "
                              "as the bf16 GEMV of one row does, not padded to 16 for MMA")
    m1_block_n: int = knob(8, "one row of int4 codes: weight rows per program")
    m1_int8_block_n: int = knob(4, "one row of int8 codes: weight rows per program (the "
                                   "whole-step sweep's best for int8)")
    m1_fp8_block_n: int = knob(4, "one row of fp8 codes in the fp32 loop (fp32 activations, "
                                  "or m1_fp8_words off): weight rows per program (with its "
                                  "2048-wide K tiles, the cold per-layer sweep's best)")
    m1_block_k: int = knob(1024, "one row of int8 codes, and of int4 codes under "
                                 "m1_int4_norm_registers: K per step, whole scale groups")
    m1_int4_block_k: int = knob(2048, "one row of int4 codes: K per step, whole scale groups "
                                      "(the packed bf16 word sums' cold per-layer best; 2048 "
                                      "spills under the norm's register cap)")
    m1_fp8_block_k: int = knob(2048, "one row of fp8 codes: K per step (int8 measured slower "
                                     "at 2048)")
    m1_num_warps: int = knob(4, "one row: warps per program")
    m1_num_stages: int = knob(3, "one row: pipeline depth")
    m1_int4_norm_registers: int = knob(80, "one row of int4 codes, norm fused, not gated: "
                                           "registers per thread (the compiler's 96 leave 5 "
                                           "programs per SM, two waves for q|k|v; 0: its "
                                           "choice)", minimum=0)


@dataclass(frozen=True)
class GemvTuning(_Section):
    """The small-M linear (``tgraph.kernels.triton.gemv``): decode GEMV with fused norm/gate."""

    small_m_max: int = knob(16, "largest M run by the small-M kernel; above it cuBLAS tiles win")
    m1_block_n: int = knob(4, "M=1 output rows per program: best or within 3% on every swept "
                              "Llama/Qwen shape with cold weights")
    m1_gated_block_n: int = knob(2, "M=1 gated rows per program: a gated row reads two weight "
                                    "rows, so half of m1_block_n keeps the bytes in flight")
    m1_stages: int = knob(3, "M=1 pipeline depth: the cold-weight sweep's best")
    m1_wide_k: int = knob(2048, "an unfused M=1 linear from this K takes 2048-wide K tiles: "
                                "half as long a chain of dependent loads per program")
    m1_wide_k_8_warps: int = knob(4096, "from this K the wide tiles run on 8 warps (32 weight "
                                        "elements per thread and tile, as at 4 warps)")
    m1_min_programs_per_sm: int = knob(2, "an unfused M=1 grid below this many programs per SM "
                                          "halves its rows per program")
    m16_block_k: int = knob(256, "16-row plain linears: K tile of the cold-weight sweep's best")
    m16_stages: int = knob(4, "16-row plain linears: pipeline depth")
    m16_long_k: int = knob(8192, "from this K a 16-row plain linear swaps operands and splits K "
                                 "(down projections), and stays on this kernel, not cuBLAS")
    m16_fused_block_n: int = knob(64, "16-row linears with a fused norm or gate: weight rows per "
                                      "program (swapped operands: the weight is the MMA's M side)")
    m16_fused_block_k: int = knob(256, "16-row fused linears: K tile (halved for two weight "
                                       "tiles or fp32), what 227 KB of shared memory holds")
    swap_min_block_n: int = knob(64, "narrowest output block that swaps the MMA operands")
    max_split_k: int = knob(16, "most K splits: beyond it the partials' round trip outweighs")
    split_k_fixup: bool = knob(True, "the last split of a tile reduces it in the same launch "
                                     "(not with swapped operands without a norm: slower there)")
    tma_weights: bool = knob(True, "swapped-operand programs read weight tiles by TMA on Hopper "
                                   "(same tiles and bits as pointer loads, slightly faster)")
    overrides: tuple[GemvOverride, ...] = knob((), "per-shape launches that replace the "
                                                   "heuristic's (for A/Bs of whole steps)")
    quant: QuantGemvTuning = section(QuantGemvTuning, "the same kernel on quantized weights")

    def override_for(self, key: tuple[int, int, int, bool, bool]) -> GemvConfig | None:
        """The override of shape ``key`` = (block_m, n, k, gated, norm), if any."""
        for entry in self.overrides:
            if entry.key() == key:
                return entry.config
        return None


@dataclass(frozen=True)
class DecodeTiles(_Section):
    """Tiles of the split-KV decode attention kernel."""

    block_n: int = knob(64, "keys per inner-loop step")
    num_warps: int = knob(4, "warps per program")
    num_stages: int = knob(3, "K/V pipeline depth")


@dataclass(frozen=True)
class DecodeAttentionTuning(_Section):
    """Split-KV decode attention (``tgraph.kernels.triton.attention_decode``)."""

    min_keys_per_split: int = knob(256, "a split streams at least this many keys, else its "
                                        "partial state's round trip stops being small")
    max_splits: int = knob(64, "beyond this the reduce pass and the workspace grow for nothing")
    programs_per_sm: int = knob(2, "split until the grid has this many programs per SM: 4 gave "
                                   "one-tile splits in two waves, slower at batch 16")
    early_kv_max_programs_per_sm: int = knob(1, "with the new key folded in, splits load their "
                                                "first K/V tile before the PDL wait at grids of "
                                                "at most this many programs per SM (0: never)",
                                           minimum=0)
    small_grid_tiles: DecodeTiles = section(
        DecodeTiles, "a grid of at most one program per SM (head_dim <= 128): 32-key tiles in 2 "
                     "stages, so every split of a 512-key context holds a tile",
        block_n=32, num_stages=2)
    tiles: DecodeTiles = section(DecodeTiles, "larger grids with head_dim <= 128")
    override: DecodeTiles | None = knob(None, "tiles for every CUDA launch instead of the "
                                              "heuristic's (for A/Bs), or null")


@dataclass(frozen=True)
class LoraTuning(_Section):
    """The multi-LoRA shrink kernels (``tgraph.kernels.triton.lora``)."""

    programs_per_sm: int = knob(2, "split-K aims at this many programs per SM to cover HBM "
                                   "latency with loads in flight")
    max_splits: int = knob(32, "most K splits of the shrink")
    min_blocks_per_split: int = knob(2, "K blocks per split, at least: two 128-wide blocks ran "
                                        "10-35% faster than one at decode")
    rows_max_tokens: int = knob(64, "up to this many tokens the per-token kernel runs (decode "
                                    "batches); above it the tiled split-K kernel")


@dataclass(frozen=True)
class PrefetchTuning(_Section):
    """The L2 weight prefetch of batch-1 decode (``tgraph.kernels.triton.prefetch``)."""

    max_rows: int = knob(1, "prefetch only for steps of at most this many tokens: at batch 16 "
                            "the linears already stream near copy bandwidth and it only competes")
    l2_fraction: float = knob(0.5, "share of L2 one layer's prefetched weights may take")


@dataclass(frozen=True)
class QuantGemmTuning(_Section):
    """Prefill GEMMs on quantized weights (``tgraph.kernels.triton.fp8_linear`` /
    ``quant_linear``)."""

    fp8_activations: bool = knob(False, "prefill on fp8 weights quantizes the activations per "
                                        "token for e4m3 tensor cores: 1.25x faster prefill, but "
                                        "~2% noise per linear (top-1 95% against the exact "
                                        "model on random weights), so opt-in")
    block_m: int = knob(128, "fp8 GEMM: rows per program")
    block_n: int = knob(128, "fp8 GEMM: output columns per program")
    block_k: int = knob(128, "fp8 GEMM: K per step (capped at a block-scaled weight's block)")
    num_warps: int = knob(8, "fp8 GEMM: warps per program")
    num_stages: int = knob(3, "fp8 GEMM: pipeline depth")
    dense_min_m: int = knob(256, "from this many rows the weight is dequantized into a scratch "
                                 "buffer and cuBLAS multiplies (a pass of a few percent of the "
                                 "GEMM)")
    fp8_cublas: bool = knob(True, "fp8 channel / tensor scales: torch._scaled_mm (cuBLAS) on "
                                  "the e4m3 codes instead of the Triton GEMM")
    int_block_m: int = knob(128, "int GEMM (codes dequantized per tile): rows per program")
    int_block_n: int = knob(128, "int GEMM: output columns per program")
    int_block_k: int = knob(64, "int GEMM: K per step (capped at the scale group)")
    int_num_warps: int = knob(8, "int GEMM: warps per program")
    int_num_stages: int = knob(3, "int GEMM: pipeline depth")


@dataclass(frozen=True)
class MoeTuning(_Section):
    """Routed experts (``tgraph.kernels.triton.moe``)."""

    decode_max_tokens: int = knob(8, "up to this many tokens each reads only its experts' "
                                      "weights (decode kernels); more run the grouped GEMM")
    split_max_tokens: int = knob(8, "up to this many tokens the decode down projection runs "
                                    "a program per (token, expert), then a combine")
    block_n: int = knob(16, "decode kernels on quantized experts: weight rows per program")
    block_k: int = knob(512, "decode kernels on quantized experts: K per step")
    dense_block_n: int = knob(4, "decode kernels on 16-bit experts: weight rows per program "
                                 "(their products summed in runs of 8 columns leave registers "
                                 "for many small programs)")
    dense_block_k: int = knob(1024, "decode kernels on 16-bit experts: K per step")
    grouped_block_m: int = knob(64, "grouped GEMM: the largest block of (token, expert) pairs")
    grouped_block_n: int = knob(64, "grouped GEMM: output columns per program")
    grouped_block_k: int = knob(64, "grouped GEMM: K per step")
    grouped_num_warps: int = knob(4, "grouped GEMM: warps per program")
    grouped_num_stages: int = knob(3, "grouped GEMM: software pipeline stages")
    grouped_tma_weights: bool = knob(False, "grouped GEMM: 16-bit experts' weight tiles read by "
                                            "TMA on Hopper (pointer loads otherwise)")
    group_one_program_max_pairs: int = knob(
        0, "grouped GEMM: up to this many (token, expert) pairs (at most 4096) one program "
           "sorts them by expert (one launch; 0: never, not yet measured on a GPU); more are "
           "counted with atomics (four launches)", minimum=0)


@dataclass(frozen=True)
class CpuTuning(_Section):
    """The CPU backend (``tgraph.kernels.cpu_backend``)."""

    bf16_quant_activations: bool = knob(
        True, "int4 / per-channel int8 linears run torch's packed kernels on bf16 activations "
              "and scales (fp32 activations take a ~30x slower path): ~0.2-0.4% error per "
              "linear; false dequantizes each quantized weight once into a cached exact dense "
              "copy (4-8x its packed bytes)")
    int8_group_kernel: bool = knob(
        False, "with bf16_quant_activations, int8 weights with group scales (GGUF Q8_0, e.g. "
               "SmolLM2's tied embedding / lm_head) run torch's int8 kernel once per group: "
               "~0.4% error, the codes' bytes resident instead of a 4x larger exact dense copy")
    slice_max_rows: int = knob(16, "dense GEMMs of 2 to this many rows run in column slices")
    slice_cols: int = knob(768, "the width of those column slices")
    step_programs: bool = knob(
        True, "a signature called again runs as its steps bound once (tgraph.engine.program): "
              "no per-step views, checks or argument lists on the host")
    held_scratch_kb: int = knob(
        256, "a step program's bound kernel keeps the scratch it made (rope's rotated q|k, the "
             "gate|up rows) up to this size, one per layer; a larger one (prefill) is made at "
             "each call")
    serial_attention_scores: int = knob(
        65536, "decode attention with at most this many scores (query heads x keys, summed "
               "over the batch) runs on the calling thread alone: a parallel region for so "
               "little work costs more than it saves, most of all while other processes hold "
               "the cores", minimum=0)
    native_kernels: bool = knob(
        True, "decode-sized fp32 linears (alone, + residual, after their RMSNorm, + SwiGLU) and "
              "rope + cache write + attention run compiled C kernels "
              "(tgraph.kernels.cpu_backend.native, built once per machine): one call per op "
              "instead of ~20 torch calls per layer half; off, or with no C compiler: torch's")
    native_max_rows: int = knob(
        8, "linears of up to this many rows take the native kernel (each weight row read once "
           "for every row; torch's GEMM at 4 rows runs ~2x slower than at 1); more: torch's")
    native_prefetch_bytes: int = knob(
        1024, "the native linears prefetch each weight row this far ahead of their loads: ~20% "
              "faster at 4 rows, a little at 1 (more misses in flight than the hardware "
              "prefetcher keeps); 0 prefetches the line being read", minimum=0)


@dataclass(frozen=True)
class AllReduceTuning(_Section):
    """Tensor-parallel all-reduce over peer GPU memory
    (``tgraph.kernels.triton.peer_allreduce``)."""

    peer: bool = knob(True, "all-reduce decode-sized messages through the peers' memory (CUDA "
                            "P2P, one kernel) instead of NCCL; NCCL stays the fallback")
    polled_max_bytes: int = knob(256 * 1024, "up to this message size the one-shot skips its "
                                             "flags: receivers poll the data itself", minimum=0)
    one_shot_max_bytes: int = knob(2 * 1024 * 1024, "up to this message size every rank pushes "
                                                     "its whole message to every peer (one "
                                                     "barrier): faster than NCCL up to 2 MB on 2 "
                                                     "H100s")
    two_shot_max_bytes: int = knob(0, "from one_shot_max_bytes up to this size each rank reduces "
                                      "1/N of the columns (two barriers); off: slower than "
                                      "one-shot at every size on 2 GPUs", minimum=0)
    programs: int = knob(32, "programs of the peer all-reduce kernel (rows are dealt round-robin)")


@dataclass(frozen=True)
class VocabParallelTuning(_Section):
    """Sampling from each tensor-parallel rank's vocabulary slice
    (``tgraph.runtime.vocab_parallel``)."""

    enabled: bool = knob(True, "decode steps that need only tokens skip the LM head's "
                               "all-gather; the ranks reduce their slices instead")
    max_batch: int = knob(256, "larger decode batches gather the logits: bounds the exchange "
                               "of top-k candidates (rows x ranks x max_top_k x 3 values)")
    max_top_k: int = knob(64, "largest top_k finished on the gathered candidates (each rank "
                              "sends the batch's largest top_k per row); a larger one, or "
                              "top-p / min-p without top-k, gathers the logits")


@dataclass(frozen=True)
class Tuning(_Section):
    """Every kernel family's launch settings; the engine holds one (``Engine.tuning``)."""

    gemv: GemvTuning = section(GemvTuning, "the small-M linear (decode GEMV)")
    decode_attention: DecodeAttentionTuning = section(DecodeAttentionTuning,
                                                      "split-KV decode attention")
    lora: LoraTuning = section(LoraTuning, "the multi-LoRA shrink kernels")
    prefetch: PrefetchTuning = section(PrefetchTuning, "the batch-1 L2 weight prefetch")
    quant_gemm: QuantGemmTuning = section(QuantGemmTuning, "prefill GEMMs on quantized weights")
    moe: MoeTuning = section(MoeTuning, "routed experts")
    cpu: CpuTuning = section(CpuTuning, "the CPU backend's quantized linears")
    all_reduce: AllReduceTuning = section(AllReduceTuning,
                                          "tensor-parallel all-reduce over peer memory")
    vocab_parallel: VocabParallelTuning = section(
        VocabParallelTuning, "tensor-parallel sampling without the logits' all-gather")


# ------------------------------------------------------------------------- dicts and settings
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def convert(path: str, tp: Any, value: Any, minimum: int = 1) -> Any:
    """``value`` (JSON-like) as type ``tp`` (an int at least ``minimum``), or a ``ValueError``
    naming ``path``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return convert(path, args[0], value, minimum)
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"'{path}' must be an object with keys "
                             f"{', '.join(f.name for f in dataclasses.fields(tp))}, got {value!r}")
        return from_dict(tp, value, path)
    if origin is tuple:
        (item,) = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"'{path}' must be a list, got {value!r}")
        return tuple(convert(f"{path}[{i}]", item, v) for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"'{path}' must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"'{path}' must be an integer >= {minimum}, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"'{path}' must be a number in (0, 1], got {value!r}")
        return float(value)
    raise TypeError(f"'{path}': unsupported tuning type {tp!r}")


def from_dict(cls: type, data: Mapping[str, Any] | None = None, path: str = "") -> Any:
    """Build ``cls`` (a tuning dataclass) from a partial mapping: missing keys keep defaults.

    Raises:
        ValueError: an unknown key (with the known ones) or a value of the wrong type.
    """
    data = dict(data or {})
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"'{path}'" if path else cls.__name__
        raise ValueError(f"unknown tuning key(s) {unknown} in {where}; known: {', '.join(names)}")
    minimum = {f.name: f.metadata.get("minimum", 1) for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        sub = f"{path}.{name}" if path else name
        if _is_dataclass_type(hints[name]) and isinstance(value, Mapping):
            # A partial section updates that section's defaults.
            base = to_dict(getattr(cls(), name))
            base.update(value)
            value = base
        kwargs[name] = convert(sub, hints[name], value, minimum[name])
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """A tuning object as plain JSON-like data (tuples as lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


def leaf_types(cls: type = None) -> dict[str, Any]:
    """The settings tree of a tuning class: nested dicts of sections, ``(type, doc)`` at leaves."""
    cls = Tuning if cls is None else cls
    hints = _hints(cls)
    tree: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_dataclass_type(tp):
            tree[f.name] = leaf_types(tp)
        else:
            tree[f.name] = (tp, f.metadata.get("doc", ""), f.metadata.get("minimum", 1))
    return tree


def describe(obj: Any = None, prefix: str = "llm.engine.tuning") -> list[tuple[str, Any, str]]:
    """Every leaf setting of a tuning object (default: ``Tuning()``) as ``(dotted key, value,
    doc)``, in declaration order."""
    obj = Tuning() if obj is None else obj
    rows: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}.{f.name}", getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            rows += describe(value, key)
        else:
            rows.append((key, to_dict(value), f.metadata.get("doc", "")))
    return rows
