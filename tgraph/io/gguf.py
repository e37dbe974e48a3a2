"""GGUF files (llama.cpp's format): the model config from the metadata, and a weight loader that
keeps quantized weights quantized.

A GGUF file holds a header (metadata key/values, then a table of tensors: name, dims, ggml type,
offset) and the tensor data. Tensors are named llama.cpp's way (``blk.0.attn_q.weight``) and
dims are listed fastest-first, so a ``[K, N]`` GGUF tensor is torch's ``[N, K]`` weight.

- :func:`gguf_model_config` maps the metadata of a Llama, Mistral, Qwen2 or Qwen3 file, or of a
  mixture-of-experts Qwen2-MoE, Qwen3-MoE or Mixtral file (:mod:`tgraph.io.gguf_moe`), to the
  Hugging Face config dict the families' builders read.
- :class:`GGUFLoader` reads the tensors under their Hugging Face names. F32/F16/BF16 tensors
  read as they are; the quantized types of :data:`~tgraph.io.gguf_blocks.QUANTIZED_TYPES`
  (``Q4_0`` to ``Q8_0``, ``Q2_K`` to ``Q6_K``, ``IQ4_NL``, ``IQ4_XS``) are repacked
  (:func:`~tgraph.io.gguf_blocks.repack_blocks`) into :mod:`tgraph.quant` layouts whose
  ``dequantize()`` is bit-identical to ``gguf.quants.dequantize``; every other type is refused
  before any weight is read. A
  MoE file's stacked experts read one expert at a time, under the per-expert names.
- A model split by llama.cpp's ``gguf-split`` (``NAME-00001-of-00003.gguf`` ...) is read whole
  from any of its parts (:func:`read_gguf_model`): the first part's metadata, every part's
  tensors.
- llama.cpp's converter permutes the q and k rows of Llama-architecture models (for its
  interleaved rotary); the loader undoes it, on quantized rows too (rows move whole).

NOTE: the header is parsed here rather than with ``gguf.GGUFReader``, which builds numpy views
for every token string of the vocabulary (~170 MB for a 49k vocabulary: more than a small
model's quantized weights). Tensor bytes are read with plain file reads, one tensor at a time, so
a load holds the repacked weights plus one tensor's temporaries, never a memory map of the file.
"""
from __future__ import annotations

import math
import mmap
import re
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tgraph.errors import ConfigError, WeightLoadError
from tgraph.io.gguf_blocks import (
    DENSE_TYPES,
    QUANTIZED_TYPES,
    SUPPORTED_TYPES,
    repack_blocks,
)
from tgraph.io.gguf_moe import (
    MIXTRAL_ARCHITECTURE,
    MOE_ARCHITECTURES,
    moe_config_of,
    moe_source,
    moe_tensors,
)
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import Index, WeightLoader
from tgraph.quant import QuantizedWeight

Q = GGMLQuantizationType

__all__ = ["DENSE_TYPES", "GGUFHeader", "GGUFLoader", "GGUFTensorInfo", "QUANTIZED_TYPES",
           "SUPPORTED_ARCHITECTURES", "SUPPORTED_TYPES", "gguf_model_config", "gguf_to_hf_name",
           "gguf_parts", "hf_config_of", "read_gguf_header", "read_gguf_model",
           "repack_blocks"]

# general.architecture -> (HF model_type, HF architecture class).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    **MOE_ARCHITECTURES,
}
# Architectures whose q/k rows llama.cpp's converter permutes (LlamaModel.permute).
_PERMUTED_ARCHITECTURES = ("llama", "mistral")
_GGUF_VERSIONS = (2, 3)
# A part of a split model, as llama.cpp's gguf-split names it: NAME-00001-of-00003.gguf.
_PART_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})(\.gguf)", re.IGNORECASE)
_DEFAULT_ALIGNMENT = 32
# Tensors the config consumes (Llama 3 rope factors): not weights of the model.
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Architectures whose block tensors are named otherwise: OLMo 2 normalises each block's output,
# Gemma 3 its input and output (its ffn_norm is the MLP's input norm).
_POST_NORMS = {"post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_BLOCK_NAMES = {"olmo2": {**_BLOCK_NAMES, **_POST_NORMS},
                     # Phi-3 keeps q|k|v and gate|up fused (the model reads their parts)
                     "phi3": {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj",
                              "ffn_up": "mlp.gate_up_proj"},
                     "gemma3": {**_BLOCK_NAMES, **_POST_NORMS,
                                "ffn_norm": "pre_feedforward_layernorm"}}
# Architectures whose norm scales llama.cpp's converter stores with Gemma's one added.
_UNIT_OFFSET_NORMS = ("gemma3",)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)")

# Metadata value types (GGUFValueType) of fixed width -> struct format.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of architecture ``arch`` (``blk.3.attn_q.weight``
    -> ``model.layers.3.self_attn.q_proj.weight``), or ``None`` for a name outside the map."""
    base, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{kind}"
    m = _BLOCK_RE.fullmatch(base)
    names = _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES)
    if m is None or m[2] not in names:
        return None
    return f"model.layers.{m[1]}.{names[m[2]]}.{kind}"


def _dense_source(name: str, arch: str) -> tuple[str, None] | None:
    """The GGUF tensor a Hugging Face name of a dense model is read from (the inverse of
    :func:`gguf_to_hf_name`)."""
    base, _, kind = name.rpartition(".")
    for gguf_base, hf_base in _TOP_NAMES.items():
        if base == hf_base:
            return f"{gguf_base}.{kind}", None
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
    if m is not None:
        for gguf_base, hf_base in _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES).items():
            if m[2] == hf_base:
                return f"blk.{m[1]}.{gguf_base}.{kind}", None
    return None


# ------------------------------------------------------------------------------------ header
@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of a GGUF file's tensor table.

    Attributes:
        name: the GGUF name (``blk.0.attn_q.weight``).
        shape: the torch shape (the GGUF dims reversed).
        ggml_type: the storage type (an int when the ``gguf`` package does not know it).
        offset: absolute byte offset of the data in the file.
        nbytes: size of the data (-1 for a type the ``gguf`` package does not know).
        file: the file holding the data (one part of a split model).
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: Q | int
    offset: int
    nbytes: int
    file: Path | None = None

    @property
    def type_name(self) -> str:
        return self.ggml_type.name if isinstance(self.ggml_type, Q) else f"type {self.ggml_type}"

    def describe(self) -> str:
        return f"'{self.name}' ({self.type_name} {list(self.shape)})"


class SkippedStrings:
    """A metadata array of strings the config does not need (a vocabulary, merges): only its
    length is kept."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"<{self.count} strings>"


@dataclass
class GGUFHeader:
    """The metadata and tensor table of a GGUF file (no tensor data).

    Attributes:
        path: the file (of a split model, its first part).
        version: the GGUF version (2 or 3).
        metadata: key -> value; numeric arrays are numpy arrays, string arrays
            :class:`SkippedStrings`.
        tensors: GGUF name -> :class:`GGUFTensorInfo`, in file order.
        file_size: the file's size in bytes (of a split model, all parts').
        parts: the files read (one, or every part of a split model in order).
    """

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    file_size: int
    parts: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        self.parts = self.parts or (self.path,)

    @property
    def split_count(self) -> int:
        """How many files the model is split into (llama.cpp's ``split.count``; 1 if whole)."""
        return int(self.metadata.get("split.count", 1))

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def quantized_bytes(self) -> int:
        """Bytes of the tensor data (what the file spends on weights)."""
        return sum(max(t.nbytes, 0) for t in self.tensors.values())


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF file's header and check that every tensor's data lies inside the file.

    Args:
        path: the ``.gguf`` file.

    Returns:
        The header.

    Raises:
        WeightLoadError: not a GGUF file, an unsupported version or byte order, a corrupt or
            truncated header, or a tensor whose data is cut off or inconsistent (named).
    """
    path = Path(path)
    if not path.is_file():
        raise WeightLoadError(f"GGUF file '{path}' does not exist")
    size = path.stat().st_size
    with path.open("rb") as f:
        if size < 24 or f.read(4) != b"GGUF":
            raise WeightLoadError(f"'{path}' is not a GGUF file (it does not start with 'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            try:
                return _parse_header(path, blob, size)
            except (struct.error, UnicodeDecodeError, OverflowError) as err:
                raise WeightLoadError(f"'{path}': the GGUF header is truncated or corrupt "
                                      f"({err})") from err


def gguf_parts(path: str | Path) -> list[Path]:
    """The files of the GGUF model ``path`` belongs to: ``[path]`` for a whole model; every part
    of a split one (llama.cpp's ``gguf-split`` names them ``NAME-00001-of-00003.gguf``), in
    order, whichever part ``path`` names.

    Raises:
        WeightLoadError: a split model whose parts are not named that way, or a part missing.
    """
    return _parts_of(read_gguf_header(path))


def _parts_of(header: GGUFHeader) -> list[Path]:
    path, count = header.path, header.split_count
    if count <= 1:
        return [path]
    m = _PART_NAME.fullmatch(path.name)
    if m is None or int(m[3]) != count:
        raise WeightLoadError(f"'{path}' is one part of a GGUF model split in {count} files, but "
                              f"its name does not follow llama.cpp's NAME-00001-of-{count:05d}.gguf"
                              ", so the other parts cannot be found")
    parts = [path.with_name(f"{m[1]}-{i:05d}-of-{m[3]}{m[4]}") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise WeightLoadError(f"'{path}' is one part of a GGUF model split in {count} files; "
                              f"missing beside it: {', '.join(missing)}")
    return parts


def read_gguf_model(path: str | Path) -> GGUFHeader:
    """The header of the GGUF model ``path`` belongs to: :func:`read_gguf_header` for a whole
    file; for a split model (any part named), the first part's metadata and every part's tensor
    table (each entry names its file), checked to add up to the model.

    Raises:
        WeightLoadError: as :func:`read_gguf_header` for any part, a part missing, or parts that
            disagree (their number, their order, a tensor in two parts, a tensor count that does
            not match ``split.tensors.count``).
    """
    named = read_gguf_header(path)
    parts = _parts_of(named)
    headers = [named if p == named.path else read_gguf_header(p) for p in parts]
    if len(headers) == 1:
        return headers[0]
    tensors: dict[str, GGUFTensorInfo] = {}
    for i, header in enumerate(headers):
        no, count = int(header.metadata.get("split.no", -1)), header.split_count
        if (no, count) != (i, len(parts)):
            raise WeightLoadError(f"'{header.path}' says it is part {no + 1} of {count}; expected "
                                  f"part {i + 1} of {len(parts)}")
        for name, info in header.tensors.items():
            if name in tensors:
                raise WeightLoadError(f"tensor '{name}' is in both '{tensors[name].file}' and "
                                      f"'{header.path}'")
            tensors[name] = info
    first = headers[0]
    want = int(first.metadata.get("split.tensors.count", len(tensors)))
    if want != len(tensors):
        raise WeightLoadError(f"'{first.path}': the {len(parts)} parts hold {len(tensors)} "
                              f"tensors; split.tensors.count says {want}")
    return GGUFHeader(first.path, first.version, first.metadata, tensors,
                      sum(h.file_size for h in headers), tuple(parts))


def _parse_header(path: Path, blob: mmap.mmap, size: int) -> GGUFHeader:
    (version,) = struct.unpack_from("<I", blob, 4)
    if version & 0xFFFF == 0 and version:
        raise WeightLoadError(f"'{path}' is a big-endian GGUF file; tgraph reads little-endian "
                              "GGUF files only")
    if version not in _GGUF_VERSIONS:
        raise WeightLoadError(f"'{path}' is GGUF version {version}; supported versions: "
                              f"{', '.join(map(str, _GGUF_VERSIONS))}")
    tensor_count, kv_count = struct.unpack_from("<QQ", blob, 8)
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, pos = _read_string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _read_value(blob, pos + 4, value_type, key)
    table = []
    for _ in range(tensor_count):
        name, pos = _read_string(blob, pos)
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        pos += 4 + 8 * n_dims
        raw_type, offset = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        table.append((name, dims, raw_type, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise WeightLoadError(f"'{path}': general.alignment {alignment} is not a power of two")
    data_start = -(-pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, raw_type, offset in table:
        info = _tensor_info(path, name, dims, raw_type, data_start + offset, size)
        if name in tensors:
            raise WeightLoadError(f"'{path}': tensor '{name}' is listed twice")
        tensors[name] = info
    return GGUFHeader(path, version, metadata, tensors, size)


def _tensor_info(path: Path, name: str, dims: Sequence[int], raw_type: int, offset: int,
                 size: int) -> GGUFTensorInfo:
    try:
        ggml_type: Q | int = Q(raw_type)
    except ValueError:
        ggml_type = raw_type
    shape = tuple(int(d) for d in reversed(dims))
    nbytes = -1
    if isinstance(ggml_type, Q) and ggml_type in GGML_QUANT_SIZES:
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        row = int(dims[0]) if dims else 1
        if row % block:
            raise WeightLoadError(
                f"'{path}': tensor '{name}' ({ggml_type.name} {list(shape)}) is inconsistent: "
                f"its rows of {row} values are not whole {ggml_type.name} blocks of {block}")
        nbytes = math.prod(shape) // block * type_size
        if offset + nbytes > size:
            raise WeightLoadError(
                f"'{path}': tensor '{name}' ({ggml_type.name} {list(shape)}) needs bytes "
                f"{offset}..{offset + nbytes} but the file ends at {size}: the file is truncated")
    return GGUFTensorInfo(name, shape, ggml_type, offset, nbytes, path)


def _read_string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    end = pos + 8 + length
    if end > len(blob):
        raise struct.error(f"a string of {length} bytes at offset {pos} runs past the end")
    return blob[pos + 8:end].decode("utf-8"), end


def _read_value(blob: mmap.mmap, pos: int, value_type: int, key: str) -> tuple[Any, int]:
    if value_type in _SCALARS:
        fmt = "<" + _SCALARS[value_type]
        (value,) = struct.unpack_from(fmt, blob, pos)
        return value, pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(blob, pos)
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if item_type in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[item_type])
            end = pos + count * dtype.itemsize
            if end > len(blob):
                raise struct.error(f"metadata array '{key}' runs past the end of the file")
            return np.frombuffer(blob, dtype, count, pos).copy(), end
        if item_type == _STRING:
            for _ in range(count):  # variable length: walk the length prefixes only
                (length,) = struct.unpack_from("<Q", blob, pos)
                pos += 8 + length
            return SkippedStrings(count), pos
        items = []
        for _ in range(count):
            value, pos = _read_value(blob, pos, item_type, key)
            items.append(value)
        return items, pos
    raise struct.error(f"metadata key '{key}' has unknown value type {value_type}")


def _read_bytes(handle: BinaryIO, info: GGUFTensorInfo, path: Path) -> np.ndarray:
    """The tensor's bytes, in a fresh (writable) buffer."""
    buf = np.empty(info.nbytes, dtype=np.uint8)
    handle.seek(info.offset)
    got = handle.readinto(buf)
    if got != info.nbytes:
        raise WeightLoadError(f"'{path}': tensor {info.describe()} is cut off: read {got} of "
                              f"{info.nbytes} bytes (the file changed or is truncated)")
    return buf


# ------------------------------------------------------------------------------------ config
def gguf_model_config(path: str | Path) -> ModelConfig:
    """The model config of a GGUF file, from its metadata and tensor table.

    Args:
        path: the ``.gguf`` file.

    Returns:
        The parsed, validated config (``hf_config`` holds the Hugging Face dict built here).

    Raises:
        ConfigError: an unsupported architecture (the supported ones are listed) or missing keys.
        WeightLoadError: the file is not a readable GGUF file.
    """
    header = read_gguf_model(path)
    return ModelConfig.from_dict(hf_config_of(header), source=str(path))


def hf_config_of(header: GGUFHeader) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict a GGUF header describes.

    Raises:
        ConfigError: an unsupported architecture, a missing key, rope factors that match no
            supported rope scaling, or stacked experts whose shape disagrees with the metadata.
    """
    meta, tensors, arch = header.metadata, header.tensors, header.architecture
    if len(header.parts) != header.split_count:
        raise ConfigError(f"'{header.path}' is one part of a GGUF model split in "
                          f"{header.split_count} files: read the whole model's header with "
                          "read_gguf_model")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"'{header.path}': GGUF architecture {arch!r} is not supported; "
                          f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def key(name: str, default: Any = ConfigError) -> Any:
        full = f"{arch}.{name}"
        if full not in meta:
            if default is ConfigError:
                raise ConfigError(f"'{header.path}': the GGUF metadata has no '{full}'")
            return default
        return meta[full]

    model_type, arch_class = SUPPORTED_ARCHITECTURES[arch]
    # llama.cpp converts Mixtral and Mistral models as "llama": the expert count, then the name,
    # tell them apart.
    if arch == "llama" and int(key("expert_count", 0)):
        model_type, arch_class = MIXTRAL_ARCHITECTURE
    elif arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        model_type, arch_class = SUPPORTED_ARCHITECTURES["mistral"]

    heads = _one_int(key("attention.head_count"), f"{arch}.attention.head_count")
    kv_heads = _one_int(key("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv")
    hidden = int(key("embedding_length"))
    q = tensors.get("blk.0.attn_q.weight")
    head_dim = key("attention.key_length", None)
    if head_dim is None:
        head_dim = q.shape[0] // heads if q is not None else hidden // heads
    head_dim = int(head_dim)
    embed = tensors.get("token_embd.weight")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = embed.shape[0] if embed is not None else key(
        "vocab_size", len(tokens) if tokens is not None else ConfigError)
    d: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [arch_class],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": _checkpoint_dtype(tensors.values()),
    }
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        d["partial_rotary_factor"] = rope_dim / head_dim
    if model_type == "llama" and "blk.0.attn_q.bias" in tensors:
        d["attention_bias"] = True
    window = key("attention.sliding_window", None)
    if window is not None and model_type in ("mistral", "mixtral", "gemma3_text", "phi3"):
        d["sliding_window"] = int(window)
    if arch == "gemma3":
        d.update(_gemma3_config(d))
    clamp = key("attention.clamp_kqv", None)
    if clamp is not None:  # OLMo's clip_qkv
        d["clip_qkv"] = float(clamp)
    scaling = _rope_scaling(header, key, head_dim, float(d["rope_theta"]))
    if scaling is not None:
        d["rope_scaling"] = scaling
    if arch in MOE_ARCHITECTURES or model_type == "mixtral":
        d.update(moe_config_of(arch, model_type, key, tensors, str(header.path)))
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("pad_token_id",
                                                                "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            d[hf_key] = int(value)
    # llama.cpp stops at EOS and at the end-of-turn / end-of-message tokens (Llama 3 chat).
    eos = [int(meta[f"tokenizer.ggml.{k}"]) for k in ("eos_token_id", "eot_token_id",
                                                       "eom_token_id")
           if meta.get(f"tokenizer.ggml.{k}") is not None]
    if eos:
        d["eos_token_id"] = eos[0] if len(eos) == 1 else list(dict.fromkeys(eos))
    return d


def _gemma3_config(d: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp fixes for Gemma 3 rather than storing: five sliding layers to one full,
    the sliding layers' RoPE base 10000, and the attention scale (27B, 62 layers: hidden / heads;
    the others: head_dim)."""
    layers, heads = d["num_hidden_layers"], d["num_attention_heads"]
    scalar = d["hidden_size"] // heads if layers == 62 else d["head_dim"]
    return {"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": scalar}


def _one_int(value: Any, key: str) -> int:
    """A head count: an int, or a per-layer array whose layers agree."""
    if isinstance(value, np.ndarray):
        distinct = sorted({int(v) for v in value.tolist()})
        if len(distinct) != 1:
            raise ConfigError(f"'{key}' differs between layers ({distinct}); tgraph needs the "
                              "same head count in every layer")
        return distinct[0]
    return int(value)


def _checkpoint_dtype(tensors: Collection[GGUFTensorInfo]) -> str:
    """The dtype a GPU run computes in: the file's half type, else bf16 (quantized files)."""
    kinds = {t.ggml_type for t in tensors if len(t.shape) >= 2}
    if kinds and kinds <= {Q.F32}:
        return "float32"
    if Q.F16 in kinds and Q.BF16 not in kinds:
        return "float16"
    return "bfloat16"


def _rope_scaling(header: GGUFHeader, key: Any, head_dim: int,
                  theta: float) -> dict[str, Any] | None:
    kind = key("rope.scaling.type", None)
    if kind in ("linear", "yarn"):
        scaling: dict[str, Any] = {"rope_type": kind,
                                   "factor": float(key("rope.scaling.factor"))}
        original = key("rope.scaling.original_context_length", None)
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if kind not in (None, "none"):
        raise ConfigError(f"'{header.path}': rope scaling type {kind!r} is not supported; "
                          "supported: linear, yarn, and Llama 3's rope_freqs.weight")
    if "rope_factors_long.weight" in header.tensors:  # Phi-3's LongRoPE, its factors as tensors
        scaling = {"rope_type": "longrope",
                   "long_factor": _config_tensor(header, "rope_factors_long.weight").tolist(),
                   "short_factor": _config_tensor(header, "rope_factors_short.weight").tolist(),
                   "original_max_position_embeddings":
                       int(key("rope.scaling.original_context_length"))}
        attention = key("rope.scaling.attn_factor", None)
        if attention is not None:
            scaling["attention_factor"] = float(attention)
        return scaling
    if "rope_freqs.weight" not in header.tensors:
        return None
    factors = _config_tensor(header, "rope_freqs.weight").astype(np.float64)
    return _fit_llama3(header.path, factors, head_dim, theta,
                       int(key("context_length", 8192)))


def _config_tensor(header: GGUFHeader, name: str) -> np.ndarray:
    """An F32 tensor the config is made from (rope factors), read from the part holding it."""
    info = header.tensors.get(name)
    if info is None or info.ggml_type != Q.F32:
        raise ConfigError(f"'{header.path}': expected an F32 tensor '{name}', got "
                          f"{'none' if info is None else info.describe()}")
    path = info.file or header.path
    with path.open("rb") as f:
        return _read_bytes(f, info, path).view(np.float32)


def _llama3_factors(dim: int, theta: float, factor: float, low: float, high: float,
                    original: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as ``rope_freqs.weight``."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0,
                    np.where(wavelen > original / low, factor, blended))


def _fit_llama3(path: Path, factors: np.ndarray, dim: int, theta: float,
                context: int) -> dict[str, Any] | None:
    """Llama 3's rope scaling parameters that reproduce ``rope_freqs.weight``.

    The file stores only the resulting per-frequency factors; every Llama 3.x release uses
    low_freq_factor 1 and high_freq_factor 4, so only the original context is searched.
    """
    if factors.shape != (dim // 2,):
        raise ConfigError(f"'{path}': rope_freqs.weight has {factors.size} values, expected "
                          f"{dim // 2} (head_dim / 2)")
    if np.all(factors == 1.0):
        return None
    factor = float(factors.max())
    for original in (8192, context, 4096, 2048, 16384, 32768, 65536, 131072):
        expect = _llama3_factors(dim, theta, factor, 1.0, 4.0, original)
        if np.allclose(factors, expect, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": original}
    raise ConfigError(f"'{path}': rope_freqs.weight holds rope factors that match no Llama 3 "
                      "rope scaling (low_freq_factor 1, high_freq_factor 4); other per-frequency "
                      "factors are not supported")


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's ``permute(w, n_head, n_head_kv)``: within each
    head, rows ``(i, j)`` of a ``(head_dim / 2, 2)`` grid go back to ``(j, i)``."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(-1)


# ------------------------------------------------------------------------------------ loader
class GGUFLoader(WeightLoader):
    """Reads a GGUF file's tensors under their Hugging Face names (see the module doc).

    Quantized tensors are registered with :meth:`register_quantized`: reading one repacks its
    blocks (never dequantizing); F32/F16/BF16 tensors read as they are, to the loader's dtype.
    Every tensor type is checked when the loader is made, before any weight is read.

    Args:
        path: the ``.gguf`` file.
        config: its model config (:func:`gguf_model_config`): the head counts for the q/k rows.
        device: where every returned tensor is placed.
        dtype: dtype floating-point tensors (and quantized weights' logical dtype) take.
        rank: tensor-parallel rank, default of :meth:`get_sharded`.
        world_size: tensor-parallel world size, default of :meth:`get_sharded`.
        progress: force the progress bar on/off; ``None`` shows it above 1 GB.

    Raises:
        WeightLoadError: the file is unreadable or truncated, or a tensor's type is not supported
            (the tensor, its type and the supported types are named).
    """

    def __init__(self, path: str | Path, config: ModelConfig, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, rank: int = 0, world_size: int = 1,
                 progress: bool | None = None) -> None:
        super().__init__(device, dtype, rank, world_size, progress)
        self.header = read_gguf_model(path)
        self.path = self.header.path
        arch = self.header.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise WeightLoadError(f"'{self.path}': GGUF architecture {arch!r} is not supported; "
                                  f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        permuted = arch in _PERMUTED_ARCHITECTURES
        self._arch, self._model_type = arch, config.model_type
        self._unit_offset_norms = arch in _UNIT_OFFSET_NORMS
        self._handles: dict[Path, BinaryIO] = {}
        self._infos: dict[str, GGUFTensorInfo] = {}
        self._heads: dict[str, int] = {}  # names whose rows llama.cpp permuted -> head count
        refused = []
        for gguf_name, info in self.header.tensors.items():
            if gguf_name in _CONFIG_TENSORS:
                continue
            if info.ggml_type not in DENSE_TYPES and info.ggml_type not in QUANTIZED_TYPES:
                refused.append(info)
            # A MoE file's stacked experts: one 2-D entry per expert.
            entries = moe_tensors(info, config.model_type) or [
                (gguf_to_hf_name(gguf_name, arch) or gguf_name, info)]
            self._infos.update(entries)
            if permuted and re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", gguf_name):
                self._heads[entries[0][0]] = (config.num_attention_heads
                                              if ".attn_q." in gguf_name
                                              else config.num_key_value_heads)
        if refused:
            shown = ", ".join(i.describe() for i in refused[:4])
            more = f" and {len(refused) - 4} more" if len(refused) > 4 else ""
            raise WeightLoadError(
                f"'{self.path}': tensor {shown}{more} use a GGUF type tgraph does not support; "
                f"supported types: {', '.join(SUPPORTED_TYPES)}")
        for name, info in self._infos.items():
            if info.ggml_type in QUANTIZED_TYPES:
                if len(info.shape) != 2:
                    raise WeightLoadError(f"'{self.path}': tensor {info.describe()} is "
                                          "quantized but not a 2-D weight")
                self.register_quantized(name, info.shape, partial(self._build, name, info))

    # ------------------------------------------------------------------------------ reads
    def _file(self, info: GGUFTensorInfo) -> BinaryIO:
        path = info.file or self.path
        if path not in self._handles:
            self._handles[path] = path.open("rb")
        return self._handles[path]

    def _row_order(self, name: str, rows: int) -> np.ndarray | None:
        heads = self._heads.get(name)
        if heads is None:
            return None
        if rows % (2 * heads):
            raise WeightLoadError(f"tensor '{name}' has {rows} rows, not a whole number of "
                                  f"{heads} heads of even size")
        return _unpermute_rows(rows, heads)

    def _build(self, name: str, info: GGUFTensorInfo) -> QuantizedWeight:
        dtype = self.dtype or torch.float32
        scheme = QUANTIZED_TYPES[info.ggml_type]
        n, k = info.shape
        if self.device.type == "meta":  # shapes only (check-model): no bytes are read
            groups = k // scheme.block[1]
            meta = partial(torch.empty, device="meta")
            return QuantizedWeight(scheme, meta(n, scheme.packed_cols(k),
                                                dtype=scheme.storage_dtype),
                                   meta(n, groups, dtype=torch.float32),
                                   meta(n, groups, dtype=torch.float32) if scheme.offsets
                                   else None, dtype, name)
        data = _read_bytes(self._file(info), info, info.file or self.path)
        return repack_blocks(data, info.ggml_type, info.shape, self._row_order(name, n), dtype,
                             name)

    def _read(self, name: str, index: Index | None) -> torch.Tensor:
        info = self._infos[name]
        if info.ggml_type not in DENSE_TYPES:
            raise WeightLoadError(f"'{self.path}': tensor {info.describe()} cannot be read; "
                                  f"supported types: {', '.join(SUPPORTED_TYPES)}")
        dtype = DENSE_TYPES[info.ggml_type]
        if self.device.type == "meta":
            t = torch.empty(info.shape, dtype=dtype, device="meta")
        else:
            raw = _read_bytes(self._file(info), info, info.file or self.path)
            t = torch.from_numpy(raw).view(dtype).reshape(info.shape)
            order = self._row_order(name, info.shape[0])
            if order is not None:
                t = t[torch.from_numpy(order)]
            if self._unit_offset_norms and name.endswith("norm.weight"):
                t = t.float() - 1.0  # the checkpoint's scale: the model adds the one back
        return t if index is None else t[index]

    def _dtype(self, name: str) -> torch.dtype | None:
        return DENSE_TYPES.get(self._infos[name].ggml_type)

    def _row_chunk(self, name: str, start: int, stop: int) -> torch.Tensor:
        info = self._infos[name]
        dtype = DENSE_TYPES.get(info.ggml_type)
        if dtype is None:
            return self._read(name, (slice(start, stop),))  # refuses with the type's name
        rows = info.shape[0]
        row_bytes = info.nbytes // rows
        handle = self._file(info)
        handle.seek(info.offset + start * row_bytes)
        buf = np.empty((stop - start) * row_bytes, dtype=np.uint8)
        if handle.readinto(buf) != buf.size:
            raise WeightLoadError(f"'{info.file or self.path}': tensor {info.describe()} is cut "
                                  "off")
        return torch.from_numpy(buf).view(dtype).reshape(stop - start, *info.shape[1:])

    # ------------------------------------------------------------------------- hook impls
    def _names(self) -> Sequence[str]:
        return list(self._infos)

    def _name_set(self) -> Collection[str]:
        return self._infos

    def _shape(self, name: str) -> tuple[int, ...]:
        return self._infos[name].shape

    def _describe_sources(self) -> str:
        parts = len(self.header.parts)
        split = f" in {parts} files" if parts > 1 else ""
        return f"{self.path} (GGUF, {len(self.header.tensors)} tensors{split})"

    def _missing_message(self, name: str) -> str:
        msg = super()._missing_message(name)
        source = moe_source(name, self._model_type) or _dense_source(name, self._arch)
        if source is None:
            return msg
        gguf_name, expert = source
        info = self.header.tensors.get(gguf_name)
        what = f"GGUF tensor '{gguf_name}'" if expert is None else \
            f"expert {expert} of the stacked GGUF tensor '{gguf_name}'"
        held = "which the file does not have" if info is None else \
            f"which is {info.type_name} {list(info.shape)}"
        return f"{msg}; it is read from {what}, {held}"

    def _total_bytes(self) -> int:
        return self.header.file_size

    def close(self) -> None:
        """Close the file and the progress bar."""
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        super().close()
