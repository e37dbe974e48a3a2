"""Model hyper-parameters parsed from a Hugging Face ``config.json``.

:class:`ModelConfig` is the one typed view of a checkpoint's shape that the layers and models use.
Each model family registers a builder (:func:`register_config_builder`) that reads the family's
keys and fills in its defaults, so a family-specific quirk (Qwen2's attention bias, Mistral's
sliding window) lives in one small function here instead of ``if`` branches in model code.

Both ``config.json`` layouts are read: transformers 4.x (``rope_theta`` + ``rope_scaling``) and
transformers 5.x (``rope_parameters`` holding ``rope_theta`` and ``rope_type``).
"""
from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tgraph.errors import ConfigError

__all__ = [
    "ModelConfig",
    "register_config_builder",
    "registered_config_builders",
    "parse_common_fields",
]

_REQUIRED = object()
DEFAULT_ROPE_THETA = 10000.0
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer checkpoint.

    Attributes:
        model_type: the HF ``model_type`` ("llama", "qwen2"...).
        architectures: the HF ``architectures`` list (class names), possibly empty.
        vocab_size: rows of the embedding and of the LM head.
        hidden_size: model width.
        intermediate_size: MLP width.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA); equals ``num_attention_heads`` for MHA.
        head_dim: per-head width (explicit in the config, else ``hidden_size // num_heads``).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: ``None`` for plain RoPE, else the scaling parameters with a ``"rope_type"``
            key ("linear", "dynamic", "llama3", "yarn", ...) and without ``rope_theta``.
        max_position_embeddings: context length the model was configured for.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        attention_bias: attention projections carry a bias (which ones is the family's choice:
            Qwen2 puts it on q/k/v only, Llama on q/k/v/o).
        mlp_bias: MLP projections carry a bias.
        qk_norm: an RMSNorm is applied per head to q and k before RoPE (Qwen3).
        sliding_window: attention window in tokens, or ``None`` for full attention.
        hidden_act: MLP activation name ("silu").
        torch_dtype: the checkpoint's dtype name ("bfloat16"), or ``None`` if unstated.
        bos_token_id: beginning-of-sequence token, or ``None``.
        eos_token_ids: every end-of-sequence token (HF allows an int or a list).
        pad_token_id: padding token, or ``None``.
        partial_rotary_factor: fraction of ``head_dim`` that RoPE rotates (1.0 for these families).
        layer_types: ``"full_attention"`` or ``"sliding_attention"`` per layer (OLMo 3): only the
            sliding layers use ``sliding_window``; empty: every layer alike.
        sliding_rope: ``(rope_theta, rope_scaling)`` of the sliding layers where they differ from
            the full ones (OLMo 3 scales only the full layers' RoPE), else ``None``.
        hf_config: the raw ``config.json`` dict, for family-specific keys not mirrored above.
    """

    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    hidden_act: str
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None = None
    partial_rotary_factor: float = 1.0
    layer_types: tuple[str, ...] = ()
    sliding_rope: tuple[float, dict[str, Any] | None] | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def layer_config(self, layer_idx: int) -> ModelConfig:
        """The config as layer ``layer_idx`` sees it: with :attr:`layer_types`, a full-attention
        layer has no window and a sliding one the sliding RoPE; without, ``self``."""
        if not self.layer_types:
            return self
        if self.layer_types[layer_idx] == FULL_ATTENTION:
            return replace(self, sliding_window=None)
        if self.sliding_rope is None:
            return self
        theta, scaling = self.sliding_rope
        return replace(self, rope_theta=theta, rope_scaling=scaling)

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence token, or ``None``."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def rotary_dim(self) -> int:
        """Number of head dims RoPE rotates (``head_dim`` unless partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_type(self) -> str:
        """The RoPE variant: "default" or ``rope_scaling["rope_type"]``."""
        return "default" if self.rope_scaling is None else str(self.rope_scaling["rope_type"])

    def validate(self) -> None:
        """Check the cross-field invariants every layer relies on.

        Raises:
            ConfigError: naming the inconsistent keys and their values.
        """
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ConfigError(
                f"the rotary dim (head_dim {self.head_dim} x partial_rotary_factor "
                f"{self.partial_rotary_factor} = {self.rotary_dim}) must be a positive even number"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(
                f"sliding_window must be a positive int or null, got {self.sliding_window}"
            )
        if self.layer_types:
            kinds = (FULL_ATTENTION, SLIDING_ATTENTION)
            if len(self.layer_types) != self.num_hidden_layers or \
                    not set(self.layer_types) <= set(kinds):
                raise ConfigError(
                    f"layer_types must name one of {list(kinds)} for each of the "
                    f"{self.num_hidden_layers} layers, got {list(self.layer_types)}"
                )
            if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
                raise ConfigError("layer_types has sliding_attention layers but sliding_window "
                                  "is null")

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read ``config.json`` from a checkpoint directory (or the path of the file itself).

        Args:
            path: model directory or ``config.json`` path.

        Returns:
            The parsed, validated config.

        Raises:
            ConfigError: missing file, invalid JSON (with line and column), missing or mistyped
                keys, or an unsupported ``model_type``.
        """
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        if not file.is_file():
            raise ConfigError(f"model config not found: '{file}' does not exist")
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{file}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{file}: not a text file ({exc.reason} at byte {exc.start}); "
                              "expected a JSON model config") from exc
        return cls.from_dict(data, source=str(file))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "model config") -> ModelConfig:
        """Build a config from an HF config dict with the first matching family builder.

        Args:
            d: the ``config.json`` content.
            source: where ``d`` came from, used in error messages.

        Returns:
            The parsed, validated config; ``hf_config`` holds a deep copy of ``d``.

        Raises:
            ConfigError: as for :meth:`from_dir`.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        d = copy.deepcopy(dict(d))
        model_type = d.get("model_type")
        if not isinstance(model_type, str):
            raise ConfigError(
                f"{source}: 'model_type' must be a string naming the model family "
                f"(supported: {', '.join(_builder_names())}), got {model_type!r}"
            )
        for name, condition, build in _BUILDERS:
            if condition(d):
                try:
                    config = build(d)
                    if not isinstance(config, ModelConfig):
                        raise TypeError(f"config builder '{name}' returned {type(config).__name__}")
                    config.validate()
                except ConfigError as exc:
                    # Builders and readers word errors without the file; say which file here.
                    raise ConfigError(f"{source} ({name} config): {exc}") from None
                config.hf_config = d
                return config
        raise ConfigError(
            f"{source}: unsupported model_type '{model_type}'; supported: "
            f"{', '.join(_builder_names())}"
        )


# ------------------------------------------------------------------------------ builder registry
ConfigCondition = Callable[[dict[str, Any]], bool]
ConfigBuild = Callable[[dict[str, Any]], ModelConfig]
_BUILDERS: list[tuple[str, ConfigCondition, ConfigBuild]] = []


def register_config_builder(
    name: str, condition: ConfigCondition, build: ConfigBuild, *, first: bool = False
) -> None:
    """Register how to build a :class:`ModelConfig` for one model family.

    Builders are tried in registration order and the first whose ``condition`` accepts the raw
    dict builds the config. Registering an existing ``name`` again replaces it in place.

    Args:
        name: family name shown in "supported:" error lists (usually the ``model_type``).
        condition: ``raw_dict -> bool``, e.g. ``lambda d: d["model_type"] == "llama"``.
        build: ``raw_dict -> ModelConfig``; :func:`parse_common_fields` does the common part.
        first: try this builder before all others (to specialize a built-in family).
    """
    entry = (name, condition, build)
    for i, (existing, _, _) in enumerate(_BUILDERS):
        if existing == name:
            _BUILDERS[i] = entry
            return
    if first:
        _BUILDERS.insert(0, entry)
    else:
        _BUILDERS.append(entry)


def registered_config_builders() -> list[str]:
    """Return the registered builder names, in the order they are tried."""
    return _builder_names()


def _builder_names() -> list[str]:
    return [name for name, _, _ in _BUILDERS]


# ------------------------------------------------------------------------------- typed readers
def _type_error(key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"'{key}' must be {expected}, got {type(value).__name__} {value!r}")


def _get(d: Mapping[str, Any], key: str, default: Any) -> Any:
    value = d.get(key, default)
    if value is _REQUIRED:
        raise ConfigError(f"missing required key '{key}'")
    return value


def _int(d: Mapping[str, Any], key: str, default: Any, minimum: int = 1) -> int:
    value = _get(d, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(key, "an int", value)
    if value < minimum:
        raise ConfigError(f"'{key}' must be >= {minimum}, got {value}")
    return value


def _opt_int(d: Mapping[str, Any], key: str) -> int | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(key, "an int or null", value)
    return value


def _float(d: Mapping[str, Any], key: str, default: Any) -> float:
    value = _get(d, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(key, "a number", value)
    return float(value)


def _bool(d: Mapping[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(key, "true or false", value)
    return value


def _str(d: Mapping[str, Any], key: str, default: Any) -> Any:
    value = d.get(key, default)
    if value is not None and not isinstance(value, str):
        raise _type_error(key, "a string", value)
    return value


def _token_ids(d: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = d.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise _type_error(key, "an int, a list of ints or null", value)
    return tuple(values)


def _parse_rope(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """Return (rope_theta, rope_scaling, partial_rotary_factor) from either config layout."""
    params = d.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise _type_error("rope_parameters", "an object", params)
        if params and "rope_type" not in params and "type" not in params and all(
            isinstance(v, dict) for v in params.values()
        ):
            raise ConfigError(
                f"per-layer-type 'rope_parameters' ({', '.join(params)}) are not supported"
            )
    legacy = d.get("rope_scaling")
    if legacy is not None and not isinstance(legacy, dict):
        raise _type_error("rope_scaling", "an object or null", legacy)

    theta_src: Mapping[str, Any] = params if params and "rope_theta" in params else d
    theta_key = "rope_parameters.rope_theta" if theta_src is params else "rope_theta"
    theta = theta_src.get("rope_theta", DEFAULT_ROPE_THETA)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise _type_error(theta_key, "a positive number", theta)

    # transformers 5.x writes rope_parameters; 4.x writes rope_scaling. Prefer the newer one when
    # it names a scaling type, else fall back to the legacy key.
    scaling_src = params if params and ("rope_type" in params or "type" in params) else legacy
    scaling = dict(scaling_src) if scaling_src else None
    partial = d.get("partial_rotary_factor", 1.0)
    if scaling is not None:
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        scaling.pop("rope_theta", None)
        partial = scaling.pop("partial_rotary_factor", partial)
        if not isinstance(rope_type, str):
            raise _type_error("rope_type", "a string", rope_type)
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **scaling}
        if scaling is not None and d.get("original_max_position_embeddings") is not None:
            # Phi-3 style configs keep the pre-training length at top level; like transformers,
            # it takes priority over the copy inside the scaling dict.
            scaling["original_max_position_embeddings"] = d["original_max_position_embeddings"]
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise _type_error("partial_rotary_factor", "a number in (0, 1]", partial)
    return float(theta), scaling, float(partial)


def parse_common_fields(
    d: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Read the keys every decoder-only family shares into :class:`ModelConfig` keyword arguments.

    Family builders call this, adjust the few fields where their family differs, and construct
    ``ModelConfig(**fields)``.

    Args:
        d: the raw config dict.
        defaults: family defaults for optional keys (``max_position_embeddings``,
            ``rms_norm_eps``, ``head_dim``, ``tie_word_embeddings``...), used when ``d`` lacks them.

    Returns:
        A dict with every :class:`ModelConfig` field except ``hf_config``.

    Raises:
        ConfigError: a required key is missing or a key has the wrong type.
    """
    defaults = dict(defaults or {})
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [k for k in required if d.get(k) is None and k not in defaults]
    if missing:
        raise ConfigError(f"missing required keys: {', '.join(missing)}")

    def dflt(key: str, fallback: Any = _REQUIRED) -> Any:
        return defaults.get(key, fallback)

    hidden = _int(d, "hidden_size", dflt("hidden_size"))
    heads = _int(d, "num_attention_heads", dflt("num_attention_heads"))
    kv_heads = d.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else _int(d, "num_key_value_heads", heads)
    head_dim = d.get("head_dim")
    if head_dim is None:
        head_dim = dflt("head_dim", None)
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(
                    f"no 'head_dim' and hidden_size ({hidden}) is not divisible by "
                    f"num_attention_heads ({heads})"
                )
            head_dim = hidden // heads
    else:
        head_dim = _int(d, "head_dim", None)
    architectures = d.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise _type_error("architectures", "a list of strings", architectures)
    theta, scaling, partial = _parse_rope(d)
    # transformers 5.x renamed torch_dtype to dtype in config.json.
    dtype_key = "dtype" if d.get("dtype") is not None else "torch_dtype"
    bos = _opt_int(d, "bos_token_id")
    return dict(
        model_type=_str(d, "model_type", None),
        architectures=tuple(architectures),
        vocab_size=_int(d, "vocab_size", dflt("vocab_size")),
        hidden_size=hidden,
        intermediate_size=_int(d, "intermediate_size", dflt("intermediate_size")),
        num_hidden_layers=_int(d, "num_hidden_layers", dflt("num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(d, "rms_norm_eps", dflt("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int(
            d, "max_position_embeddings", dflt("max_position_embeddings", 2048)
        ),
        tie_word_embeddings=_bool(d, "tie_word_embeddings", dflt("tie_word_embeddings", False)),
        attention_bias=_bool(d, "attention_bias", dflt("attention_bias", False)),
        mlp_bias=_bool(d, "mlp_bias", dflt("mlp_bias", False)),
        qk_norm=dflt("qk_norm", False),
        sliding_window=None,
        hidden_act=_str(d, "hidden_act", dflt("hidden_act", "silu")),
        torch_dtype=_str(d, dtype_key, None),
        bos_token_id=bos,
        eos_token_ids=_token_ids(d, "eos_token_id"),
        pad_token_id=_opt_int(d, "pad_token_id"),
        partial_rotary_factor=partial,
    )


def _qwen_window(d: Mapping[str, Any]) -> int | None:
    # Qwen configs always carry a sliding_window value; it only applies with use_sliding_window.
    if not _bool(d, "use_sliding_window", False):
        return None
    window = _opt_int(d, "sliding_window")
    if window is None:
        raise ConfigError("use_sliding_window is true but sliding_window is null")
    return window


# ----------------------------------------------------------------------------- family builders
def _model_type_is(*names: str) -> ConfigCondition:
    return lambda d: d.get("model_type") in names


def _build_llama(d: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**parse_common_fields(d, {"max_position_embeddings": 2048}))


def _qwen_layer_types(d: Mapping[str, Any], window: int | None,
                      layers: int) -> tuple[str, ...]:
    # With a window, Qwen2 / Qwen3 slide only from layer max_window_layers on (transformers'
    # layer_types, which a 5.x config.json states).
    if window is None:
        return ()
    types = d.get("layer_types")
    if types is None:
        first = _int(d, "max_window_layers", 28, minimum=0)
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]
    if not isinstance(types, list):
        raise _type_error("layer_types", "a list of strings", types)
    return tuple(types)


def _build_qwen2(d: dict[str, Any]) -> ModelConfig:
    fields = parse_common_fields(d, {"max_position_embeddings": 32768})
    # Qwen2 always has q/k/v biases; its config.json has no attention_bias key.
    window = _qwen_window(d)
    fields.update(attention_bias=True, sliding_window=window,
                  layer_types=_qwen_layer_types(d, window, fields["num_hidden_layers"]))
    return ModelConfig(**fields)


def _build_qwen3(d: dict[str, Any]) -> ModelConfig:
    # head_dim is decoupled from hidden_size in Qwen3 (128 when unstated, as in transformers).
    fields = parse_common_fields(
        d, {"max_position_embeddings": 32768, "head_dim": 128, "qk_norm": True}
    )
    window = _qwen_window(d)
    fields.update(sliding_window=window,
                  layer_types=_qwen_layer_types(d, window, fields["num_hidden_layers"]))
    return ModelConfig(**fields)


def _build_mistral(d: dict[str, Any]) -> ModelConfig:
    fields = parse_common_fields(d, {"max_position_embeddings": 131072})
    fields.update(attention_bias=False, sliding_window=_opt_int(d, "sliding_window"))
    return ModelConfig(**fields)


def _build_qwen3_moe(d: dict[str, Any]) -> ModelConfig:
    # Unlike Qwen3, a Qwen3-MoE config without head_dim means hidden_size / heads.
    fields = parse_common_fields(d, {"max_position_embeddings": 32768, "qk_norm": True})
    fields.update(sliding_window=_qwen_window(d))
    return ModelConfig(**fields)


def _build_qwen2_moe(d: dict[str, Any]) -> ModelConfig:
    fields = parse_common_fields(d, {"max_position_embeddings": 32768})
    # q/k/v biases by the config's qkv_bias (transformers' default: on).
    fields.update(attention_bias=_bool(d, "qkv_bias", True), sliding_window=_qwen_window(d))
    return ModelConfig(**fields)


def _build_phi3(d: dict[str, Any]) -> ModelConfig:
    # Phi-3's mini-4k window (sliding_window) applies to every layer; no biases.
    fields = parse_common_fields(d, {"max_position_embeddings": 4096})
    fields.update(attention_bias=False, sliding_window=_opt_int(d, "sliding_window"))
    return ModelConfig(**fields)


def _build_olmo2(d: dict[str, Any]) -> ModelConfig:
    # head_dim is hidden_size / heads; no sliding window.
    return ModelConfig(**parse_common_fields(d, {"max_position_embeddings": 2048}))


def _build_olmoe(d: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**parse_common_fields(d, {"max_position_embeddings": 4096}))


def _typed_layers(d: dict[str, Any], defaults: dict[str, Any], *, pattern: int,
                  local_theta_key: str | None = None, window: int = 4096) -> dict[str, Any]:
    """Common fields of a family whose layers are typed sliding / full (OLMo 3, Gemma 3).

    RoPE is given per layer type (transformers 5's ``rope_parameters``), or as the hub's
    ``rope_theta`` + ``rope_scaling`` that only the full layers use, the sliding ones plain RoPE
    of ``local_theta_key``'s base (else the same theta), as transformers converts them. Without
    ``layer_types`` every ``pattern``-th layer is full.
    """
    params = d.get("rope_parameters")
    per_type = isinstance(params, dict) and bool(params) and all(
        isinstance(v, dict) for v in params.values())
    if per_type:
        unknown = set(params) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ConfigError(f"rope_parameters: unknown layer types {sorted(unknown)}; expected "
                              f"{FULL_ATTENTION!r} and {SLIDING_ATTENTION!r}")
        base = {k: v for k, v in d.items() if k not in ("rope_parameters", "rope_scaling")}
        fields = parse_common_fields({**base, "rope_parameters": params.get(FULL_ATTENTION, {})},
                                     defaults)
        sliding_theta, sliding_scaling, _ = _parse_rope(
            {**base, "rope_parameters": params.get(SLIDING_ATTENTION, {})})
    else:
        fields = parse_common_fields(d, defaults)
        sliding_theta, sliding_scaling = fields["rope_theta"], None
        if local_theta_key is not None and d.get(local_theta_key) is not None:
            sliding_theta = _float(d, local_theta_key, None)
    layers = fields["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                 for i in range(layers)]
    if not isinstance(types, list):
        raise _type_error("layer_types", "a list of strings", types)
    sliding_rope = None if (sliding_theta, sliding_scaling) == \
        (fields["rope_theta"], fields["rope_scaling"]) else (sliding_theta, sliding_scaling)
    fields.update(layer_types=tuple(types), sliding_rope=sliding_rope,
                  sliding_window=_opt_int(d, "sliding_window") if "sliding_window" in d
                  else window)
    return fields


def _build_olmo3(d: dict[str, Any]) -> ModelConfig:
    # OLMo 2 with three sliding-window layers to one full layer.
    return ModelConfig(**_typed_layers(d, {"max_position_embeddings": 2048}, pattern=4))


# transformers' Gemma3TextConfig defaults: a vision-language checkpoint's text_config states only
# what differs from them.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=256,
    sliding_window=4096, sliding_window_pattern=6, max_position_embeddings=131072,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2,
    eos_token_id=1, pad_token_id=0)


def gemma3_text_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's keys of a Gemma 3 config (``gemma3_text``, or a vision-language
    ``gemma3``'s ``text_config`` with the outer token ids), over transformers' defaults."""
    if d.get("model_type") != "gemma3":
        return {**GEMMA3_TEXT_DEFAULTS, **d}
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise _type_error("text_config", "an object (the language model's config)", text)
    outer = {k: d[k] for k in ("architectures", "eos_token_id", "bos_token_id", "pad_token_id",
                               "torch_dtype", "dtype", "tie_word_embeddings") if k in d}
    return {**GEMMA3_TEXT_DEFAULTS, **text, **outer, "model_type": "gemma3"}


def _build_gemma3(d: dict[str, Any]) -> ModelConfig:
    # Five sliding layers (local RoPE base rope_local_base_freq) to one full; the activation is
    # hidden_activation. A vision-language checkpoint (model_type gemma3) gives its text model.
    t = gemma3_text_config(d)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if t.get(key) is not None:
            raise ConfigError(f"{key} = {t[key]!r} is not supported (Gemma 3 has none; Gemma 2's "
                              "soft-capping is not implemented)")
    if t.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention is not supported (an encoder, not a "
                          "causal LM)")
    fields = _typed_layers(t, {}, pattern=_int(t, "sliding_window_pattern", 6),
                           local_theta_key="rope_local_base_freq")
    fields.update(hidden_act=_str(t, "hidden_activation", "gelu_pytorch_tanh"))
    return ModelConfig(**fields)


register_config_builder("llama", _model_type_is("llama"), _build_llama)
register_config_builder("qwen2", _model_type_is("qwen2"), _build_qwen2)
register_config_builder("qwen3", _model_type_is("qwen3"), _build_qwen3)
register_config_builder("mistral", _model_type_is("mistral"), _build_mistral)
register_config_builder("qwen3_moe", _model_type_is("qwen3_moe"), _build_qwen3_moe)
register_config_builder("qwen2_moe", _model_type_is("qwen2_moe"), _build_qwen2_moe)
register_config_builder("mixtral", _model_type_is("mixtral"), _build_mistral)
register_config_builder("olmo2", _model_type_is("olmo2"), _build_olmo2)
register_config_builder("olmoe", _model_type_is("olmoe"), _build_olmoe)
register_config_builder("olmo3", _model_type_is("olmo3"), _build_olmo3)
register_config_builder("gemma3", _model_type_is("gemma3_text", "gemma3"), _build_gemma3)
register_config_builder("phi3", _model_type_is("phi3"), _build_phi3)
