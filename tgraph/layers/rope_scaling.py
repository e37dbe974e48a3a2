"""RoPE frequencies for the scaling variants found in HF checkpoints, and their cos/sin tables.

The inverse frequencies depend only on the config (and, for dynamic NTK, on the sequence length),
so they are computed once on the host in fp32 and the model reads ``cos``/``sin`` rows by position
at run time. Supported ``rope_type`` values: default, linear, dynamic, llama3, yarn, longrope.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tgraph.errors import ConfigError
from tgraph.io.model_config import ModelConfig

__all__ = ["rope_inv_freq", "cos_sin_table", "SUPPORTED_ROPE_TYPES"]

Scaling = Mapping[str, Any]
RopeResult = tuple[torch.Tensor, float]


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    """The original RoPE frequencies ``base ** (-2i / dim)`` for i in [0, dim/2), in fp32."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exponents)


def _param(scaling: Mapping[str, Any], key: str, rope_type: str, default: Any = None) -> Any:
    value = scaling.get(key, default)
    if value is None:
        raise ConfigError(f"rope_scaling of type '{rope_type}' needs '{key}'; got {dict(scaling)}")
    if isinstance(value, bool) or not isinstance(value, (int, float, list)):
        raise ConfigError(
            f"rope_scaling '{key}' must be a number, got {type(value).__name__} {value!r}"
        )
    return value


def _default(config: ModelConfig, scaling: Scaling, seq_len: int | None, dim: int) -> RopeResult:
    return _base_inv_freq(config.rope_theta, dim), 1.0


def _linear(config: ModelConfig, scaling: Scaling, seq_len: int | None, dim: int) -> RopeResult:
    # Dividing positions by `factor` equals dividing every frequency by it.
    factor = float(_param(scaling, "factor", "linear"))
    return _base_inv_freq(config.rope_theta, dim) / factor, 1.0


def _dynamic(config: ModelConfig, scaling: Scaling, seq_len: int | None, dim: int) -> RopeResult:
    # NTK-aware: stretch the base as the sequence outgrows max_position_embeddings; at or below
    # that length the frequencies are the default ones.
    factor = float(_param(scaling, "factor", "dynamic"))
    max_pos = config.max_position_embeddings
    length = max_pos if seq_len is None else max(int(seq_len), max_pos)
    base = config.rope_theta * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim), 1.0


def _llama3(config: ModelConfig, scaling: Scaling, seq_len: int | None, dim: int) -> RopeResult:
    # Llama 3.1: long wavelengths are scaled by 1/factor, short ones kept, and the band between
    # is blended linearly in (old_context / wavelength).
    factor = float(_param(scaling, "factor", "llama3"))
    low = float(_param(scaling, "low_freq_factor", "llama3"))
    high = float(_param(scaling, "high_freq_factor", "llama3"))
    old_ctx = float(_param(
        scaling, "original_max_position_embeddings", "llama3", config.max_position_embeddings
    ))
    inv_freq = _base_inv_freq(config.rope_theta, dim)
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > old_ctx / low
    short_wave = wavelen < old_ctx / high
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(long_wave, inv_freq / factor, blended)
    return torch.where(short_wave, inv_freq, out), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(config: ModelConfig, scaling: Scaling, seq_len: int | None, dim: int) -> RopeResult:
    # YaRN: interpolate low frequencies, extrapolate high ones, with a linear ramp over the dims
    # whose number of rotations over the original context lies between beta_slow and beta_fast.
    base = config.rope_theta
    old_ctx = float(
        _param(scaling, "original_max_position_embeddings", "yarn", config.max_position_embeddings)
    )
    factor = scaling.get("factor")
    factor = config.max_position_embeddings / old_ctx if factor is None else float(factor)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_for_rotations(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = _base_inv_freq(base, dim)
    interpolated = extrapolated / factor
    keep = 1 - ramp  # 1 where the dim is extrapolated (high frequency), 0 where interpolated
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def _longrope(config: ModelConfig, scaling: Scaling, seq_len: int | None, dim: int) -> RopeResult:
    # LongRoPE (Phi-3): per-dim rescale factors, the long set once past the original context.
    old_ctx = int(_param(scaling, "original_max_position_embeddings", "longrope"))
    factor = scaling.get("factor")
    factor = config.max_position_embeddings / old_ctx if factor is None else float(factor)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    key = "long_factor" if seq_len is not None and seq_len > old_ctx else "short_factor"
    ext = torch.tensor(_param(scaling, key, "longrope"), dtype=torch.float32)
    if ext.shape != (dim // 2,):
        raise ConfigError(f"rope_scaling '{key}' must have {dim // 2} entries, got {ext.numel()}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (ext * config.rope_theta**exponents), float(attention)


_RopeFn = Callable[[ModelConfig, Scaling, "int | None", int], RopeResult]
_ROPE_FNS: dict[str, _RopeFn] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}
SUPPORTED_ROPE_TYPES = tuple(_ROPE_FNS)


def rope_inv_freq(config: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Compute the RoPE inverse frequencies of a model.

    Args:
        config: the model config; reads ``rope_theta``, ``rope_scaling``, ``head_dim``,
            ``partial_rotary_factor`` and ``max_position_embeddings``.
        seq_len: current sequence length. Only "dynamic" (and "longrope", which switches factor
            sets past the original context) depend on it; ``None`` means
            ``max_position_embeddings`` for dynamic and the short factors for longrope.

    Returns:
        ``(inv_freq, attention_scaling)``: fp32 CPU tensor of shape ``[rotary_dim // 2]`` and the
        factor cos/sin are multiplied by (1.0 except for yarn and longrope).

    Raises:
        ConfigError: unknown ``rope_type`` or a missing/mistyped scaling parameter.
    """
    scaling: Mapping[str, Any] = config.rope_scaling or {"rope_type": "default"}
    rope_type = scaling.get("rope_type", "default")
    fn = _ROPE_FNS.get(rope_type)
    if fn is None:
        raise ConfigError(
            f"unsupported rope_type '{rope_type}'; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    bad_len = isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1
    if seq_len is not None and bad_len:
        raise ValueError(f"seq_len must be a positive int or None, got {seq_len!r}")
    dim = int(config.head_dim * config.partial_rotary_factor)
    inv_freq, attention_scaling = fn(config, scaling, seq_len, dim)
    return inv_freq.to(torch.float32), float(attention_scaling)


def cos_sin_table(
    inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tabulate ``cos``/``sin`` of ``position * inv_freq`` for positions ``[0, max_positions)``.

    The tables hold each frequency once (half the rotary dim); the rotation pairs dim ``i`` with
    ``i + R/2`` (HF's ``rotate_half`` layout), so the second half reuses the same columns.

    Args:
        inv_freq: fp32 tensor ``[R/2]`` from :func:`rope_inv_freq`.
        max_positions: number of table rows.
        attention_scaling: factor both tables are multiplied by.

    Returns:
        ``(cos, sin)``, each fp32 ``[max_positions, R/2]`` on ``inv_freq``'s device.
    """
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1:
        got = getattr(inv_freq, "shape", inv_freq)
        raise ValueError(f"inv_freq must be a 1-D tensor, got {got!r}")
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"max_positions must be a positive int, got {max_positions!r}")
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    # fp32 products, as HF computes them: position * inv_freq rounds the same way here and there.
    freqs = torch.outer(positions, inv_freq.to(torch.float32))
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
