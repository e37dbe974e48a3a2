"""What the Hugging Face quantized formats share: the facts about a checkpoint's tensors that are
known before any weight is read (names, shapes, and dtypes from the safetensors headers), the
plan each format makes per quantized module, and the bit handling from int32-packed codes to
:mod:`tgraph.quant`'s layouts.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tgraph.errors import WeightLoadError
from tgraph.io.weights import SAFETENSORS_DTYPES, SafetensorFileLoader, WeightLoader
from tgraph.quant import QuantizedWeight

__all__ = ["FLOATS", "INTS", "Checkpoint", "Plan", "group_perm", "int32_bytes", "pack_int4",
           "skipped"]

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INTS = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Plan:
    """One quantized weight, decided before any weight is read.

    Attributes:
        name: the logical weight name (``...q_proj.weight``).
        shape: its logical ``(N, K)``.
        parts: the checkpoint tensors it is made of.
        build: reads the parts and returns the :class:`QuantizedWeight`.
    """

    name: str
    shape: tuple[int, int]
    parts: tuple[str, ...]
    build: Callable[[], QuantizedWeight]


class Checkpoint:
    """The tensors of a checkpoint as a quantized format sees them.

    Names and shapes come from the loader; dtypes from the safetensors headers when the loader
    reads files (``None`` otherwise). :meth:`read` reads a part raw: in its own dtype unless
    asked, onto the loader's device (a shape-only tensor on ``meta``), even where the part has
    the logical weight's name (``weight`` of an fp8 module), which the loader itself resolves to
    the quantized weight.

    Args:
        loader: the checkpoint's weight loader.
        method: the format's name, for messages.
    """

    def __init__(self, loader: WeightLoader, method: str) -> None:
        self.loader = loader
        self.method = method
        self.names = frozenset(loader.names())
        self._files: dict[str, Path] = {}
        self._dtypes: dict[str, torch.dtype | None] = {}
        self._handles: dict[Path, Any] = {}
        if isinstance(loader, SafetensorFileLoader):
            for file in loader.files:
                handle = self._handle(file)
                for name in handle.keys():
                    self._files[name] = file
                    self._dtypes[name] = SAFETENSORS_DTYPES.get(handle.get_slice(name).get_dtype())

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    def close(self) -> None:
        """Close the files opened for headers and small reads (reads reopen them)."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    # ---- facts known before any weight is read --------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.names

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.loader.shape(name))

    def dtype(self, name: str) -> torch.dtype | None:
        """The stored dtype, or ``None`` when the loader does not say."""
        return self._dtypes.get(name)

    def modules(self, suffix: str) -> list[str]:
        """The module prefixes ``p`` of every tensor named ``p.<suffix>``, sorted."""
        tail = "." + suffix
        return sorted(n[: -len(tail)] for n in self.names if n.endswith(tail))

    def expect(self, name: str, shape: Sequence[int], dtypes: Iterable[torch.dtype],
               scheme: str, why: str) -> None:
        """Check that ``name`` exists with ``shape`` (and one of ``dtypes`` when known).

        Args:
            name: the checkpoint tensor.
            shape: its expected shape.
            dtypes: the dtypes the format allows.
            scheme: the module's scheme, for the message.
            why: where the expected shape comes from, for the message.

        Raises:
            WeightLoadError: the tensor is missing or has another shape or dtype.
        """
        if name not in self.names:
            raise WeightLoadError(f"tensor '{name}' ({scheme}) is missing: {self.method} needs "
                                  f"it next to the module's other tensors")
        got = self.shape(name)
        if got != tuple(shape):
            raise WeightLoadError(f"tensor '{name}' ({scheme}) has shape {list(got)}, expected "
                                  f"{list(shape)} ({why})")
        dtypes = tuple(dtypes)
        dtype = self.dtype(name)
        if dtype is not None and dtype not in dtypes:
            raise WeightLoadError(
                f"tensor '{name}' ({scheme}) is stored as {_dtype_name(dtype)}; {self.method} "
                f"stores it as {' or '.join(_dtype_name(d) for d in dtypes)}")

    def small(self, name: str) -> torch.Tensor | None:
        """A small tensor's values on the CPU (``weight_shape``, ``g_idx``), read while planning;
        ``None`` where the loader has no values (``meta``)."""
        if name in self._files:
            return self._handle(self._files[name]).get_tensor(name)
        t = self.loader.get_tensor(name)
        return None if t.is_meta else t.cpu()

    def check_raw_reads(self, parts: Iterable[str], logical: str) -> None:
        """Refuse, while planning, a part named like its logical weight that the loader can only
        read through that weight (a loader without safetensors files)."""
        if logical in parts and logical not in self._files:
            raise WeightLoadError(
                f"tensor '{logical}' is both the quantized data and the weight's name; "
                f"{self.method} checkpoints are read from safetensors files, not from "
                f"{type(self.loader).__name__}")

    # ---- reads, from a weight's build ----------------------------------------------------------
    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read a part whole onto the loader's device, in ``dtype`` (default: its own)."""
        device = self.loader.device
        if name not in self._files:  # a loader without files converts floats to its dtype
            return self.loader.get_tensor(name, dtype)
        if device.type == "meta":
            stored = self._dtypes[name] or torch.float32
            return torch.empty(self.shape(name), dtype=dtype or stored, device="meta")
        t = self._handle(self._files[name]).get_tensor(name).to(device)
        return t if dtype is None else t.to(dtype)


def group_perm(ckpt: Checkpoint, g_idx: str, k: int, group: int, scheme: str,
               act_order: bool) -> torch.Tensor | None:
    """Read, while planning, a ``g_idx`` tensor (input feature ``k`` is in group ``g_idx[k]``)
    and turn it into the layouts' terms: ``None`` where feature ``k`` is in group ``k // group``
    (no activation order, or static groups), else the permutation ``perm`` (int64 ``[K]``, on
    the CPU) whose stored column ``j`` holds feature ``perm[j]``, which makes every group
    contiguous (GPTQ's ``desc_act``).

    Args:
        ckpt: the checkpoint.
        g_idx: the ``[K]`` tensor of group indices.
        k: the number of input features.
        group: the group size.
        scheme: the module's scheme, for the message.
        act_order: whether the config asks for activation ordering (``desc_act``,
            ``actorder: group``).

    Raises:
        WeightLoadError: a group does not hold exactly ``group`` features, or the groups
            cannot be read (no values on ``meta``) while the config asks for activation order.
    """
    values = ckpt.small(g_idx)
    if values is None:
        if act_order:
            raise WeightLoadError(
                f"tensor '{g_idx}' ({scheme}, activation order): the group of each input "
                "feature cannot be known without its values; read the checkpoint on cpu or "
                "cuda")
        return None
    values = values.to(torch.int64)
    if torch.equal(values, torch.arange(k, dtype=torch.int64) // group):
        return None
    counts = torch.bincount(values.clamp(min=0), minlength=k // group)
    if bool((values < 0).any()) or counts.numel() != k // group or bool((counts != group).any()):
        raise WeightLoadError(
            f"tensor '{g_idx}' ({scheme}): every one of the {k // group} groups must hold "
            f"exactly {group} input features, but the group sizes are "
            f"{sorted(set(counts.tolist()))}")
    return torch.argsort(values, stable=True)


def int32_bytes(words: torch.Tensor) -> torch.Tensor:
    """``int32 [..., W]`` -> ``uint8 [..., 4 W]``, byte ``j`` of each word holding its bits
    ``8j .. 8j + 7`` (the order the formats pack codes in, lowest bits first)."""
    out = words.contiguous().view(torch.uint8)
    if sys.byteorder == "big":  # NOTE: the formats are defined on the words' values, not bytes
        out = out.reshape(*words.shape, 4).flip(-1).reshape(out.shape)
    return out


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``uint8 [N, K]`` codes in ``[0, 15]`` -> tgraph's int4 layout ``uint8 [N, K / 2]`` (even
    k in the low nibble)."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def skipped(module: str, patterns: Sequence[str]) -> bool:
    """Whether a ``modules_to_not_convert`` list names ``module``, by transformers' rule: a
    pattern matches from the start up to a module boundary (also as a regex), or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for pattern in patterns:
        try:
            hit = re.match(rf"(?:{pattern}){boundary}", module) is not None
        except re.error:
            hit = module == pattern or module.startswith(pattern + ".")
        if hit or module.endswith(pattern):
            return True
    return False


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
