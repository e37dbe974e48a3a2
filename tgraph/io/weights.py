"""Checkpoint readers: safetensors files on disk, or tensors already in memory.

Both readers share one interface (:class:`WeightLoader`): look a tensor up by its checkpoint name,
read it whole, read one tensor-parallel shard of it, or read several tensors packed into one weight
(q/k/v, gate/up). Every read lands on the loader's device and dtype, and every name read is
remembered so that a model can report the checkpoint tensors it never used.

Only safetensors is read. Pickle checkpoints (``pytorch_model.bin``, ``*.pt``...) are refused and
never opened, because unpickling a file runs whatever code it names.

Quantized checkpoints register their weights with :meth:`WeightLoader.register_quantized`: the
logical name (``...q_proj.weight``) then reads as a :class:`~tgraph.quant.QuantizedWeight` of
the logical shape, whole, sharded or packed, built from the checkpoint's parts (which count as
used when it is read) and never dequantized.
"""
from __future__ import annotations

import difflib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tgraph.errors import WeightLoadError
from tgraph.quant import QuantizedWeight

__all__ = [
    "WeightLoader",
    "SafetensorFileLoader",
    "DictWeightLoader",
    "load_weights",
    "PICKLE_PATTERNS",
]

# safetensors header dtype names -> torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files that are (or usually are) pickles. They are only ever listed, never opened.
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
# Above this checkpoint size a progress bar is shown unless progress=False.
PROGRESS_BYTES = 1 << 30

Index = tuple[slice, ...]


def _check_parallel(rank: Any, world_size: Any) -> None:
    for label, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{label} must be an int, got {type(value).__name__} {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def _check_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"dtype must be a torch.dtype or None, got {type(dtype).__name__} {dtype!r}"
        )
    return dtype


@dataclass(frozen=True)
class _QuantEntry:
    shape: tuple[int, ...]
    build: Callable[[], QuantizedWeight]
    parts: tuple[str, ...]


class WeightLoader(ABC):
    """Common interface and bookkeeping of the checkpoint readers.

    Subclasses provide the raw reads (:meth:`_names`, :meth:`_shape`, :meth:`_read`); this class
    adds name resolution through aliases, tensor-parallel slicing, packing, device/dtype
    placement, the used-name ledger and the progress bar.

    Args:
        device: where every returned tensor is placed.
        dtype: dtype every floating-point tensor is converted to; ``None`` keeps the checkpoint's.
            Integer and bool tensors always keep their dtype unless a call asks for one.
        rank: this process's tensor-parallel rank, the default of :meth:`get_sharded`.
        world_size: the tensor-parallel world size, the default of :meth:`get_sharded`.
        progress: ``True`` / ``False`` force the progress bar on / off; ``None`` shows it when the
            checkpoint is larger than 1 GB.
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        rank: int = 0,
        world_size: int = 1,
        progress: bool | None = None,
    ) -> None:
        _check_parallel(rank, world_size)
        self.device = torch.device(device)
        self.dtype = _check_dtype(dtype)
        self.rank = rank
        self.world_size = world_size
        self._progress_flag = progress
        self._aliases: dict[str, str] = {}
        self._views: dict[str, tuple[str, int, int]] = {}  # name -> (fused tensor, row, rows)
        self._fused: tuple[str, torch.dtype | None, QuantizedWeight] | None = None
        self._quantized: dict[str, _QuantEntry] = {}
        self._used: set[str] = set()
        self._read_names: set[str] = set()
        self._bar: Any = None

    # ----------------------------------------------------------------------------- subclass hooks
    @abstractmethod
    def _names(self) -> Sequence[str]:
        """All tensor names in the checkpoint."""

    @abstractmethod
    def _shape(self, name: str) -> tuple[int, ...]:
        """Shape of an existing checkpoint tensor."""

    @abstractmethod
    def _read(self, name: str, index: Index | None) -> torch.Tensor:
        """Read an existing tensor (or the part of it selected by ``index``), in its own dtype."""

    def _dtype(self, name: str) -> torch.dtype | None:
        """Stored dtype of an existing tensor without reading it; ``None``: unknown."""
        return None

    def _row_chunk(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start .. stop - 1`` of an existing tensor, in its own dtype, on the CPU."""
        return self._read(name, (slice(start, stop),))

    @abstractmethod
    def _describe_sources(self) -> str:
        """Where tensors were looked for, for error messages."""

    @abstractmethod
    def _total_bytes(self) -> int:
        """Size of the checkpoint, used to decide whether a progress bar is worth showing."""

    @property
    def checkpoint_bytes(self) -> int:
        """The bytes of the checkpoint's files (of in-memory weights: the tensors' bytes)."""
        return self._total_bytes()

    # ---------------------------------------------------------------------------- quantized
    def register_quantized(self, name: str, shape: Sequence[int],
                           build: Callable[[], QuantizedWeight],
                           parts: Sequence[str] = ()) -> None:
        """Make ``name`` read as a quantized weight.

        Args:
            name: the logical weight name (what the model asks for).
            shape: its logical ``[N, K]`` shape.
            build: reads the parts and returns the whole :class:`QuantizedWeight` (on any
                device; reads move it to the loader's).
            parts: the checkpoint tensors it is made of; they are hidden from :meth:`names`
                and count as used once ``name`` is read.
        """
        self._quantized[name] = _QuantEntry(tuple(int(d) for d in shape), build, tuple(parts))

    def is_quantized(self, name: str) -> bool:
        """Whether ``name`` (or its alias target) reads as a quantized weight."""
        real = self._lookup(name)
        return real is not None and real in self._quantized

    def quantized_names(self) -> list[str]:
        """The logical names registered with :meth:`register_quantized`, sorted."""
        return sorted(self._quantized)

    def _read_quantized(self, real: str, dtype: torch.dtype | None) -> QuantizedWeight:
        entry = self._quantized[real]
        weight = entry.build()
        if tuple(weight.shape) != entry.shape:
            raise WeightLoadError(f"tensor '{real}': its parts make a {list(weight.shape)} "
                                  f"weight, expected {list(entry.shape)} "
                                  f"({self._describe_sources()})")
        self._used.update(entry.parts)
        self._used.add(real)
        self._tick(real)
        return weight.to(self._device_for(real), dtype or self.dtype or weight.dtype)

    def _device_for(self, real: str) -> torch.device:
        """Where the tensor ``real`` is placed (subclasses may place tensors per name)."""
        return self.device

    # ---------------------------------------------------------------------------------- lookups
    def names(self) -> list[str]:
        """Return the sorted names of every tensor in the checkpoint (aliases excluded; a
        quantized weight by its logical name, not its parts)."""
        hidden = {p for e in self._quantized.values() for p in e.parts}
        return sorted((set(self._names()) - hidden) | set(self._quantized))

    def has(self, name: str) -> bool:
        """Return whether ``name`` can be read, directly or through an :meth:`alias` or a
        :meth:`row_view`."""
        if name in self._views and self._lookup(name) is None:
            return self._lookup(self._views[name][0]) is not None
        return self._lookup(name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        """Return the full (unsharded) checkpoint shape of ``name``.

        Raises:
            WeightLoadError: the tensor is missing.
        """
        view = self._view_of(name)
        if view is not None:
            target, _, rows = view
            return (rows, *self.shape(target)[1:])
        real = self._resolve(name)
        if real in self._quantized:
            return self._quantized[real].shape
        return self._shape(real)

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """The dtype ``name`` is stored in, known without reading its data; ``None`` for a
        quantized weight's logical name or when the reader cannot tell."""
        view = self._view_of(name)
        if view is not None:
            return self.stored_dtype(view[0])
        real = self._resolve(name)
        return None if real in self._quantized else self._dtype(real)

    def non_floating(self) -> list[tuple[str, torch.dtype]]:
        """``(name, dtype)`` of every tensor of :meth:`names` stored in an integer or bool dtype.

        Quantized weights are left out: their integer parts are read through their scheme. A
        dense weight stored as integers would be converted to the model's dtype and compute
        garbage, so the model loaders refuse what this returns.
        """
        out = []
        for name in self.names():
            dtype = self.stored_dtype(name)
            if dtype is not None and not dtype.is_floating_point:
                out.append((name, dtype))
        return out

    def iter_chunks(self, name: str, max_bytes: int = 64 << 20) -> Iterable[torch.Tensor]:
        """Yield a dense tensor's values in its stored dtype, a few rows at a time, so that a
        whole checkpoint can be scanned in bounded memory (nothing is marked used).

        Args:
            name: a checkpoint tensor (not a quantized weight's logical name).
            max_bytes: the most bytes of one chunk (at least one row is read).
        """
        real = self._resolve(name)
        shape = self._shape(real)
        if len(shape) == 0:
            yield self._read(real, None)
            return
        dtype = self._dtype(real)
        item = torch.empty((), dtype=dtype).element_size() if dtype is not None else 4
        row_bytes = max(1, item * int(torch.Size(shape[1:]).numel()))
        step = max(1, max_bytes // row_bytes)
        for start in range(0, shape[0], step):
            yield self._row_chunk(real, start, min(shape[0], start + step))

    def alias(self, name: str, target: str) -> None:
        """Read ``target`` whenever ``name`` is asked for but absent from the checkpoint.

        Used for tied weights, e.g. ``alias("lm_head.weight", "model.embed_tokens.weight")``: a
        checkpoint that stores ``lm_head.weight`` still gets its own tensor.
        """
        if not isinstance(name, str) or not isinstance(target, str):
            raise TypeError(f"alias names must be str, got {name!r} -> {target!r}")
        self._aliases[name] = target

    def row_view(self, name: str, target: str, start: int, rows: int) -> None:
        """Serve ``name``, where the checkpoint lacks it, as rows ``start .. start + rows - 1``
        of ``target``: a fused tensor read as its parts (Phi-3's ``qkv_proj`` as ``q_proj``,
        ``k_proj``, ``v_proj``). Reads of ``name`` (whole or sharded) read only those rows of a
        dense tensor; they mark ``target`` used.

        Raises:
            WeightLoadError: ``target`` is missing or has fewer than ``start + rows`` rows.
        """
        total = self.shape(target)[0]
        if start < 0 or rows <= 0 or start + rows > total:
            raise WeightLoadError(f"tensor '{name}': rows {start}..{start + rows - 1} of "
                                  f"'{target}', which has {total} rows")
        self._views[name] = (target, start, rows)

    def expect_shape(self, name: str, shape: Sequence[int | None]) -> None:
        """Check the checkpoint shape of ``name`` before reading it.

        Args:
            name: checkpoint tensor name (aliases allowed).
            shape: expected full shape; ``None`` or ``-1`` in a position accepts any size.

        Raises:
            WeightLoadError: the tensor is missing or its shape differs.
        """
        actual = self.shape(name)
        expected = tuple(shape)
        ok = len(actual) == len(expected) and all(
            e is None or e == -1 or e == a for a, e in zip(actual, expected)
        )
        if not ok:
            raise WeightLoadError(
                f"tensor '{name}' has shape {list(actual)} in the checkpoint, expected "
                f"{['*' if e in (None, -1) else e for e in expected]} ({self._describe_sources()})"
            )

    # ------------------------------------------------------------------------------------ reads
    def get_tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read a whole tensor onto the loader's device.

        Args:
            name: checkpoint tensor name (aliases allowed).
            dtype: overrides the loader's dtype for this read (applied to any tensor; a
                quantized weight's logical dtype).

        Returns:
            The tensor, contiguous, on ``self.device`` (a :class:`QuantizedWeight` for a name
            registered with :meth:`register_quantized`).
        """
        if self._view_of(name) is not None:
            return self._read_view(name, None, dtype)
        real = self._resolve(name)
        if real in self._quantized:
            return self._read_quantized(real, dtype)
        return self._finish(real, self._read(real, None), dtype)

    def get_sharded(
        self,
        name: str,
        dim: int,
        rank: int | None = None,
        world_size: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Read one tensor-parallel shard: chunk ``rank`` of ``world_size`` equal chunks of ``dim``.

        Only the shard's bytes are read from disk.

        Args:
            name: checkpoint tensor name (aliases allowed).
            dim: dimension to split (negative counts from the end).
            rank: shard index; defaults to the loader's rank.
            world_size: number of shards; defaults to the loader's world size.
            dtype: overrides the loader's dtype for this read.

        Returns:
            The shard, contiguous, on ``self.device``.

        Raises:
            WeightLoadError: the tensor is missing or ``dim`` is not divisible by ``world_size``.
        """
        if self._view_of(name) is not None:
            return self._read_view(name, self._shard_index(name, self.shape(name), dim, rank,
                                                           world_size), dtype)
        real = self._resolve(name)
        shape = self._quantized[real].shape if real in self._quantized else self._shape(real)
        index = self._shard_index(name, shape, dim, rank, world_size)
        if real in self._quantized:
            d = next(i for i, s in enumerate(index) if s != slice(None)) if any(
                s != slice(None) for s in index) else 0
            cut = index[d]
            whole = self._read_quantized(real, dtype)
            return whole.narrow(d, cut.start or 0, (cut.stop or whole.shape[d]) - (cut.start or 0))
        return self._finish(real, self._read(real, index), dtype)

    def get_merged(
        self,
        names: Sequence[str],
        dim: int = 0,
        shard_dim: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Read several checkpoint tensors and concatenate them into one packed weight.

        With ``shard_dim`` each part is sharded first, so rank r's packed weight is the
        concatenation of every part's r-th shard (what a column-parallel packed q/k/v or gate/up
        linear needs on that rank).

        Args:
            names: checkpoint tensor names, in packing order.
            dim: dimension to concatenate along.
            shard_dim: dimension to shard each part along, or ``None`` to read parts whole.
            dtype: overrides the loader's dtype for this read.

        Returns:
            The packed tensor on ``self.device``.
        """
        if isinstance(names, str) or not names:
            raise TypeError(f"get_merged expects a non-empty sequence of names, got {names!r}")
        if shard_dim is None:
            parts = [self.get_tensor(n, dtype) for n in names]
        else:
            parts = [self.get_sharded(n, shard_dim, dtype=dtype) for n in names]
        if any(isinstance(p, QuantizedWeight) for p in parts):
            if dim != 0 or not all(isinstance(p, QuantizedWeight) for p in parts):
                raise WeightLoadError(f"cannot pack {list(names)}: quantized weights stack "
                                      "along their rows, with quantized weights only")
            return QuantizedWeight.cat(parts)
        try:
            return torch.cat(parts, dim=dim)
        except (RuntimeError, IndexError) as exc:
            shapes = ", ".join(f"{n}: {list(p.shape)}" for n, p in zip(names, parts))
            raise WeightLoadError(
                f"cannot concatenate tensors along dim {dim} into one packed weight ({shapes})"
            ) from exc

    # ------------------------------------------------------------------------------ used ledger
    def mark_used(self, name: str) -> None:
        """Record that ``name`` (or its alias or view target) is consumed, without reading it."""
        view = self._view_of(name)
        self._used.add(self._resolve(name if view is None else view[0]))

    def unused_names(self) -> list[str]:
        """Return the sorted checkpoint names never read nor marked used (a quantized weight by
        its logical name)."""
        return sorted(set(self.names()) - self._used)

    # ------------------------------------------------------------------------------- life cycle
    def close(self) -> None:
        """Release open files and the progress bar. Reads after close reopen files lazily."""
        self._fused = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> WeightLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------- internals
    def _lookup(self, name: str) -> str | None:
        names = self._name_set()
        if name in names or name in self._quantized:
            return name
        target = self._aliases.get(name)
        if target is not None and (target in names or target in self._quantized):
            return target
        return None

    def _name_set(self) -> Collection[str]:
        """The checkpoint names as a container with fast membership (subclasses override)."""
        return set(self._names())

    def _resolve(self, name: str) -> str:
        if not isinstance(name, str):
            raise TypeError(f"tensor name must be a str, got {type(name).__name__} {name!r}")
        real = self._lookup(name)
        if real is None:
            raise WeightLoadError(self._missing_message(name))
        return real

    def _missing_message(self, name: str) -> str:
        msg = f"tensor '{name}' not found in {self._describe_sources()}"
        if name in self._aliases:
            msg += f" (its alias target '{self._aliases[name]}' is missing too)"
        close = difflib.get_close_matches(name, list(self._names()), n=5, cutoff=0.6)
        if close:
            msg += "; close matches: " + ", ".join(repr(c) for c in close)
        return msg

    def _view_of(self, name: str) -> tuple[str, int, int] | None:
        """The :meth:`row_view` serving ``name`` (``None`` where the checkpoint has it)."""
        if name not in self._views or self._lookup(name) is not None:
            return None
        return self._views[name]

    def _read_view(self, name: str, index: Index | None, dtype: torch.dtype | None):
        """A :meth:`row_view`'s rows (``index`` within the view), from its fused tensor."""
        target, start, rows = self._views[name]
        real = self._resolve(target)
        index = tuple(index or (slice(None),))
        first = index[0]
        lo, hi = first.start or 0, rows if first.stop is None else first.stop
        if real in self._quantized:
            # The fused weight is built once for all its views (a GGUF tensor is repacked whole).
            if self._fused is None or self._fused[:2] != (real, dtype):
                self._fused = (real, dtype, self._read_quantized(real, dtype))
            part = self._fused[2].narrow(0, start + lo, hi - lo)
            for d, cut in enumerate(index[1:], start=1):
                if cut != slice(None):
                    part = part.narrow(d, cut.start or 0, (cut.stop or part.shape[d]) -
                                       (cut.start or 0))
            return part
        return self._finish(real, self._read(real, (slice(start + lo, start + hi),
                                                    *index[1:])), dtype)

    def _shard_index(
        self, name: str, shape: Sequence[int], dim: int, rank: int | None,
        world_size: int | None
    ) -> Index:
        rank = self.rank if rank is None else rank
        world_size = self.world_size if world_size is None else world_size
        _check_parallel(rank, world_size)
        if not isinstance(dim, int) or isinstance(dim, bool) or not -len(shape) <= dim < len(shape):
            raise WeightLoadError(
                f"cannot shard tensor '{name}' of shape {list(shape)} along dim {dim}: no such dim"
            )
        dim %= len(shape)
        size = shape[dim]
        if size % world_size:
            raise WeightLoadError(
                f"cannot shard tensor '{name}' of shape {list(shape)} along dim {dim}: "
                f"size {size} is not divisible by world_size {world_size}"
            )
        chunk = size // world_size
        index = [slice(None)] * len(shape)
        index[dim] = slice(rank * chunk, (rank + 1) * chunk)
        return tuple(index)

    def _finish(self, real: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        dtype = _check_dtype(dtype)
        if dtype is None and tensor.is_floating_point():
            dtype = self.dtype
        # Move first, convert second: torch converts CPU->GPU copies on the CPU, which is slower
        # than converting on the GPU and, when widening (bf16 -> fp32), doubles the bytes moved.
        out = tensor.to(self._device_for(real)).to(dtype or tensor.dtype).contiguous()
        self._used.add(real)
        self._tick(real)
        return out

    def _tick(self, real: str) -> None:
        if real in self._read_names:
            return
        self._read_names.add(real)
        if self._progress_flag is None:
            # Decided once, on the first read: small checkpoints load too fast for a bar to help.
            self._progress_flag = self._total_bytes() > PROGRESS_BYTES
        if not self._progress_flag:
            return
        total = len(self._name_set())
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="Loading weights", unit="tensor")
        self._bar.update(1)
        if len(self._read_names) >= total:
            self._bar.close()
            self._bar = None


class SafetensorFileLoader(WeightLoader):
    """Memory-mapped reader of a safetensors checkpoint directory.

    Accepted layouts, in this order: ``model.safetensors.index.json`` (sharded checkpoint; its
    ``weight_map`` says which file holds each tensor), a single ``model.safetensors``, or else every
    ``*.safetensors`` file of the directory. A path to one ``.safetensors`` file also works. Each
    file is opened once, on first use, and only the bytes of the tensors (or shards) read are
    touched.

    Args:
        model_dir: checkpoint directory (or one ``.safetensors`` file).
        device: where every returned tensor is placed.
        dtype: dtype floating-point tensors are converted to; ``None`` keeps the checkpoint's.
        rank: tensor-parallel rank, default of :meth:`get_sharded`.
        world_size: tensor-parallel world size, default of :meth:`get_sharded`.
        progress: force the progress bar on/off; ``None`` shows it above 1 GB.

    Raises:
        WeightLoadError: no safetensors checkpoint is found, the directory holds only pickle
            checkpoints, the index is malformed or names files that do not exist.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        rank: int = 0,
        world_size: int = 1,
        progress: bool | None = None,
    ) -> None:
        super().__init__(device, dtype, rank, world_size, progress)
        self.model_dir = Path(model_dir)
        self._handles: dict[Path, Any] = {}
        self._name_to_file: dict[str, Path] | None = None
        self.files, index_map = self._discover(self.model_dir)
        if index_map is not None:
            self._name_to_file = index_map

    # ------------------------------------------------------------------------------- discovery
    @staticmethod
    def _discover(path: Path) -> tuple[list[Path], dict[str, Path] | None]:
        if path.is_file():
            if path.suffix != ".safetensors":
                raise WeightLoadError(
                    f"'{path}' is not a .safetensors file; tgraph loads safetensors only"
                )
            return [path], None
        if not path.is_dir():
            raise WeightLoadError(f"checkpoint directory '{path}' does not exist")
        index = path / INDEX_FILE
        if not index.is_file():
            others = sorted(path.glob("*.safetensors.index.json"))
            index = others[0] if len(others) == 1 else index
        if index.is_file():
            return SafetensorFileLoader._read_index(index)
        if (path / SINGLE_FILE).is_file():
            return [path / SINGLE_FILE], None
        files = sorted(path.glob("*.safetensors"))
        if files:
            return files, None
        pickles = sorted({p.name for pat in PICKLE_PATTERNS for p in path.glob(pat)})
        if pickles:
            raise WeightLoadError(_pickle_refusal(path, pickles))
        raise WeightLoadError(
            f"no safetensors checkpoint in '{path}': expected {INDEX_FILE}, {SINGLE_FILE} "
            f"or *.safetensors files"
        )

    @staticmethod
    def _read_index(index: Path) -> tuple[list[Path], dict[str, Path]]:
        try:
            data = json.loads(index.read_text())
        except json.JSONDecodeError as exc:
            raise WeightLoadError(
                f"{index}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from exc
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise WeightLoadError(
                f"{index}: expected an object with a 'weight_map' of tensor name -> file name"
            )
        root = index.parent
        name_to_file = {name: root / file for name, file in weight_map.items()}
        files = sorted(set(name_to_file.values()))
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"{index} names files that do not exist: {', '.join(missing)}")
        return files, name_to_file

    def _map(self) -> dict[str, Path]:
        if self._name_to_file is None:
            # No index: the tensor names come from each file's header (opening a file reads only
            # its header; tensor data stays memory-mapped until read).
            mapping: dict[str, Path] = {}
            for file in self.files:
                for name in self._handle(file).keys():
                    if name in mapping:
                        raise WeightLoadError(
                            f"tensor '{name}' is stored twice, in {mapping[name].name} and "
                            f"{file.name}; add a {INDEX_FILE} saying which one to use"
                        )
                    mapping[name] = file
            self._name_to_file = mapping
        return self._name_to_file

    def _handle(self, file: Path) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            from safetensors import safe_open

            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error type for bad headers
                raise WeightLoadError(f"cannot open safetensors file '{file}': {exc}") from exc
            self._handles[file] = handle
        return handle

    # ------------------------------------------------------------------------------ hook impls
    def _names(self) -> Sequence[str]:
        return list(self._map())

    def _name_set(self) -> Collection[str]:
        return self._map()

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str) -> Any:
        file = self._map()[name]
        try:
            return self._handle(file).get_slice(name)
        except Exception as exc:
            raise WeightLoadError(
                f"tensor '{name}' is listed for {file.name} but cannot be read from it: {exc}"
            ) from exc

    def _read(self, name: str, index: Index | None) -> torch.Tensor:
        if index is None:
            return self._handle(self._map()[name]).get_tensor(name)
        return self._slice(name)[index]

    def _dtype(self, name: str) -> torch.dtype | None:
        return SAFETENSORS_DTYPES.get(self._slice(name).get_dtype())

    def _describe_sources(self) -> str:
        return f"{self.model_dir} (files searched: {', '.join(f.name for f in self.files)})"

    def _total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def close(self) -> None:
        """Close every open safetensors file and the progress bar."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()
        super().close()


class DictWeightLoader(WeightLoader):
    """The :class:`WeightLoader` interface over tensors already in memory.

    Useful for tests and for weights produced by another library (e.g. an HF ``state_dict()``).
    When a read needs neither a device move nor a dtype change, the returned tensor may share
    memory with the given one.

    Args:
        weights: ``(name, tensor)`` pairs, or a mapping of name -> tensor.
        device: where every returned tensor is placed.
        dtype: dtype floating-point tensors are converted to; ``None`` keeps their own.
        rank: tensor-parallel rank, default of :meth:`get_sharded`.
        world_size: tensor-parallel world size, default of :meth:`get_sharded`.
        progress: force the progress bar on/off; ``None`` shows it above 1 GB.
    """

    def __init__(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        rank: int = 0,
        world_size: int = 1,
        progress: bool | None = None,
    ) -> None:
        super().__init__(device, dtype, rank, world_size, progress)
        items = weights.items() if isinstance(weights, Mapping) else weights
        self._tensors: dict[str, torch.Tensor] = {}
        for item in items:
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(f"expected (name, tensor) pairs, got {item!r:.80}")
            name, tensor = item
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"expected (str, torch.Tensor) pairs, got ({type(name).__name__}, "
                    f"{type(tensor).__name__}) for {name!r:.80}"
                )
            if name in self._tensors:
                raise WeightLoadError(f"tensor '{name}' is given twice")
            self._tensors[name] = tensor

    def _names(self) -> Sequence[str]:
        return list(self._tensors)

    def _name_set(self) -> Collection[str]:
        return self._tensors

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def _read(self, name: str, index: Index | None) -> torch.Tensor:
        tensor = self._tensors[name]
        return tensor if index is None else tensor[index]

    def _dtype(self, name: str) -> torch.dtype | None:
        return self._tensors[name].dtype

    def _describe_sources(self) -> str:
        return f"the in-memory weights ({len(self._tensors)} tensors)"

    def _total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())


def load_weights(
    weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> DictWeightLoader:
    """Wrap in-memory ``(name, tensor)`` pairs in a :class:`DictWeightLoader`.

    Args:
        weights: ``(name, tensor)`` pairs or a mapping, e.g. ``hf_model.state_dict()``.
        device: target device of every read.
        dtype: target dtype of floating-point reads; ``None`` keeps each tensor's.
        rank: tensor-parallel rank.
        world_size: tensor-parallel world size.

    Returns:
        A loader with the same interface as :class:`SafetensorFileLoader`.
    """
    return DictWeightLoader(weights, device=device, dtype=dtype, rank=rank, world_size=world_size)


def _pickle_refusal(path: Path, pickles: list[str]) -> str:
    shown = ", ".join(pickles[:5]) + (", ..." if len(pickles) > 5 else "")
    return (
        f"'{path}' holds only pickle checkpoints ({shown}). tgraph reads safetensors only and "
        f"never unpickles files, since unpickling can run arbitrary code. Convert the checkpoint "
        f"once, in an environment you trust:\n\n"
        f"    from transformers import AutoModelForCausalLM\n"
        f"    model = AutoModelForCausalLM.from_pretrained({str(path)!r}, dtype=\"auto\")\n"
        f"    model.save_pretrained({str(path)!r}, safe_serialization=True)\n"
    )
