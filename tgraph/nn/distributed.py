"""Tensor parallelism through ``torch.distributed``: process-group set-up from torchrun's
environment, the collective graph functions that layers call, and a cross-rank config check.

A tensor-parallel script is launched with ``torchrun --nproc-per-node N script.py``; each rank
calls :func:`init_process_group` (NCCL on CUDA, gloo on CPU), loads the model with
``rank=rank(), world_size=world_size()`` and runs the same batches. Layers record
:func:`all_reduce` / :func:`all_gather` into their graphs when ``world_size > 1``.

On NCCL the collectives are recorded capturable (one CUDA graph can hold a whole decode step)
unless the group was joined with ``capture_collectives=False``; gloo collectives never are.

Failure handling: every collective waits at most the group's timeout, so a rank that died or
took another path makes the others fail instead of hanging. Under torchrun the usual end is
quicker: the failing rank exits nonzero and torchrun stops the others.
"""
from __future__ import annotations

import dataclasses
import datetime
import enum
import gc
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tgraph.ir.ops.collective  # noqa: F401  (registers all_reduce / all_gather)
from tgraph import envs
from tgraph.errors import ConfigError, RecordError, user_frame
from tgraph.nn import functional as F
from tgraph.nn.tensor import Tensor

__all__ = [
    "DEFAULT_TIMEOUT", "PER_RANK_FIELDS", "DistInfo", "all_gather", "all_gather_bytes",
    "all_reduce", "broadcast_from_rank0", "check_device_count", "check_same_config",
    "collectives_capturable", "comm_device", "config_json", "describe_differences",
    "destroy_process_group", "env_info", "init_process_group", "is_initialized",
    "launched_world_size", "min_over_ranks", "rank", "world_size",
]

# A collective that waits longer than this fails instead of hanging (e.g. a rank died).
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)

_BACKENDS = ("nccl", "gloo")

# NOTE: set once by init_process_group (like torch.distributed's own default group): whether
# NCCL collectives recorded from now on may be captured in CUDA graphs.
_capture_collectives = True


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the tensor-parallel group.

    Attributes:
        rank: global rank (``RANK``).
        world_size: number of ranks (``WORLD_SIZE``).
        local_rank: rank on this node (``LOCAL_RANK``); the CUDA device index.
        local_world_size: ranks on this node (``LOCAL_WORLD_SIZE``, else ``world_size``).
        master_addr, master_port: the rendezvous address.
        backend: ``"nccl"`` or ``"gloo"`` once initialized, ``""`` before.
        device: the device this rank computes on (``cuda:<local_rank>`` or ``cpu``).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str = ""
    device: torch.device = torch.device("cpu")


def _env_int(environ: Mapping[str, str] | None, name: str, default: int | None = None) -> int:
    value = envs.get(name, environ)
    if value is None:
        if default is not None:
            return default
        raise ConfigError(f"environment variable {name} is not set; launch tensor-parallel runs "
                          "with `torchrun --nproc-per-node N script.py` (or set RANK, WORLD_SIZE, "
                          "LOCAL_RANK, MASTER_ADDR and MASTER_PORT)")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def env_info(environ: Mapping[str, str] | None = None) -> DistInfo:
    """Parse torchrun's environment variables.

    Args:
        environ: the variables (default ``os.environ``).
    Returns:
        a :class:`DistInfo` with ``backend=""`` and a CPU device (not initialized yet).
    Raises:
        ConfigError: a variable is missing, not an int, or out of range.
    """
    ws = _env_int(environ, "WORLD_SIZE")
    r = _env_int(environ, "RANK")
    local_rank = _env_int(environ, "LOCAL_RANK", default=r)
    local_ws = _env_int(environ, "LOCAL_WORLD_SIZE", default=ws)
    port = _env_int(environ, "MASTER_PORT")
    addr = envs.get("MASTER_ADDR", environ)
    if not addr:
        raise ConfigError("environment variable MASTER_ADDR is not set; launch with torchrun")
    if ws < 1 or not 0 <= r < ws:
        raise ConfigError(f"RANK={r} and WORLD_SIZE={ws}: expected 0 <= RANK < WORLD_SIZE")
    if not 0 <= local_rank < local_ws or local_ws > ws:
        raise ConfigError(f"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_ws}, "
                          f"WORLD_SIZE={ws}: expected 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= "
                          "WORLD_SIZE")
    return DistInfo(r, ws, local_rank, local_ws, addr, port)


def launched_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The world size torchrun launched this process with (``WORLD_SIZE``), 1 outside torchrun.

    Args:
        environ: the variables (default ``os.environ``).
    Returns:
        the number of ranks; an initialized process group's size wins over the environment.
    Raises:
        ConfigError: ``WORLD_SIZE`` is set but not a positive integer.
    """
    if is_initialized():
        return dist.get_world_size()
    if envs.get("WORLD_SIZE", environ) is None:
        return 1
    ws = _env_int(environ, "WORLD_SIZE")
    if ws < 1:
        raise ConfigError(f"environment variable WORLD_SIZE={ws}: expected a positive integer")
    return ws


def check_device_count(local_world_size: int, device_count: int) -> None:
    """Refuse a group that needs more GPUs on this node than are visible.

    Args:
        local_world_size: ranks launched on this node (one GPU each).
        device_count: ``torch.cuda.device_count()``.
    Raises:
        ConfigError: naming both numbers and ``CUDA_VISIBLE_DEVICES``.
    """
    if local_world_size > device_count:
        visible = envs.get("CUDA_VISIBLE_DEVICES")
        visible = "<unset>" if visible is None else visible
        raise ConfigError(
            f"tensor parallelism with {local_world_size} ranks on this node needs "
            f"{local_world_size} GPUs (one per rank), but only {device_count} are visible "
            f"(CUDA_VISIBLE_DEVICES={visible}); lower --nproc-per-node or expose more GPUs")


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        raise ConfigError(f"tensor parallelism runs on cuda or cpu, got device {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    return dev


def _as_timedelta(timeout: datetime.timedelta | float) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta or seconds, got {timeout!r}")
    if not seconds > 0:
        raise ConfigError(f"the process-group timeout must be positive, got {seconds} s")
    return datetime.timedelta(seconds=seconds)


def init_process_group(device: str | torch.device | None = "auto", *,
                       backend: str | None = None,
                       timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
                       capture_collectives: bool = True,
                       environ: Mapping[str, str] | None = None) -> DistInfo:
    """Join the default process group described by torchrun's environment variables.

    On CUDA each rank uses GPU ``LOCAL_RANK`` (set as the current device) and NCCL; on CPU,
    gloo. Calling it again in an initialized process returns the current group's info.

    Args:
        device: ``"auto"`` (CUDA when available), ``"cuda"`` or ``"cpu"``; an explicit index is
            ignored, since the rank's GPU is ``LOCAL_RANK``.
        backend: ``"nccl"`` or ``"gloo"`` to override the choice above.
        timeout: how long init and every collective may wait for the other ranks (a
            ``timedelta`` or seconds); a rank that died makes the others fail after at most
            this long instead of hanging. Collectives replayed inside CUDA graphs are not
            covered (the watchdog does not see them): there torchrun's teardown ends the job.
        capture_collectives: on NCCL, record collectives as capturable in CUDA graphs
            (``llm.engine.capture_collectives``); gloo ignores it.
        environ: the environment to read (default ``os.environ``).
    Returns:
        this process's :class:`DistInfo`.
    Raises:
        ConfigError: missing/invalid environment, unknown backend, a timeout that is not
            positive, or fewer visible GPUs than ranks on this node.
        TypeError: a timeout that is neither a ``timedelta`` nor a number.
    """
    global _capture_collectives
    info = env_info(environ)
    timeout = _as_timedelta(timeout)
    dev = _resolve_device(device)
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend not in _BACKENDS:
        raise ConfigError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "nccl" and dev.type != "cuda":
        raise ConfigError("the nccl backend needs a CUDA device; use gloo on CPU")
    if dev.type == "cuda":
        # Checked before joining: a rank without a GPU would otherwise fail alone while the
        # others wait for it in the rendezvous.
        check_device_count(info.local_world_size, torch.cuda.device_count())
        dev = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(dev)
    _capture_collectives = bool(capture_collectives)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (info.rank, info.world_size):
            raise ConfigError(
                f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the environment says rank {info.rank} of "
                f"{info.world_size}")
        return dataclasses.replace(info, backend=str(dist.get_backend()), device=dev)
    dist.init_process_group(backend=backend, init_method="env://", rank=info.rank,
                            world_size=info.world_size, timeout=timeout)
    return dataclasses.replace(info, backend=backend, device=dev)


def destroy_process_group() -> None:
    """Leave the default process group (no-op when none was initialized).

    NOTE: CUDA graphs that captured NCCL collectives must be gone before the communicator is
    destroyed (release them first, e.g. ``model.release_graphs()``); queued work is finished and
    unreferenced graphs are collected here."""
    if is_initialized():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        gc.collect()
        dist.destroy_process_group()


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_initialized() else 1


def collectives_capturable() -> bool:
    """Whether collectives recorded now may run inside CUDA graphs: NCCL only (gloo runs on the
    host), and not when the group was joined with ``capture_collectives=False``."""
    return is_initialized() and _capture_collectives and dist.get_backend() == "nccl"


def comm_device() -> torch.device:
    """The device of host-side collectives' tensors: the current GPU on NCCL, else the CPU."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- graph functions -----------------------------------------------------------------------------

def _recording_world_size(op: str) -> int:
    if not is_initialized():
        raise RecordError(f"{op}: no process group; call tgraph.nn.distributed."
                          "init_process_group() in every rank before recording a "
                          f"tensor-parallel model\n  at {user_frame()}")
    return dist.get_world_size()


def all_reduce(x: Tensor, capturable: bool | None = None) -> Tensor:
    """Record the sum of ``x`` over every rank of the default process group.

    Args:
        x: the rank's partial result (any shape; not bool).
        capturable: allow the node inside a CUDA graph (NCCL only); ``None`` follows
            :func:`collectives_capturable`, ``False`` runs it between captured segments.
    Returns:
        a tensor of ``x``'s shape and dtype, equal on every rank.
    Raises:
        RecordError: without a process group.
    """
    ws = _recording_world_size("all_reduce")
    if capturable is None:
        capturable = collectives_capturable()
    out = F.record("all_reduce", [x], world_size=ws, capturable=bool(capturable))
    assert isinstance(out, Tensor)
    return out


def all_gather(x: Tensor, dim: int, capturable: bool | None = None) -> Tensor:
    """Record the concatenation of every rank's ``x`` along ``dim``, in rank order.

    The group size at record time is stored on the node; a run in a group of another size is
    refused.

    Args:
        x: the rank's slice (equal shapes on every rank).
        dim: the dim to concatenate along (may be negative).
        capturable: allow the node inside a CUDA graph (NCCL only); ``None`` follows
            :func:`collectives_capturable`.
    Returns:
        ``x``'s shape with ``dim`` multiplied by the world size.
    Raises:
        RecordError: without a process group, or ``dim`` out of range.
    """
    ws = _recording_world_size("all_gather")
    if capturable is None:
        capturable = collectives_capturable()
    out = F.record("all_gather", [x], dim=dim, world_size=ws, capturable=bool(capturable))
    assert isinstance(out, Tensor)
    return out


# ---- cross-rank config check ------------------------------------------------------------------

# Fields that legitimately differ between ranks.
PER_RANK_FIELDS = ("rank", "local_rank")


def _jsonable(obj: Any, exclude: frozenset[str], path: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, torch.device):
        return obj.type  # the index is the rank's own GPU by design
    if isinstance(obj, enum.Enum):
        return _jsonable(obj.value, exclude, path)
    if isinstance(obj, Path):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items: Iterable[tuple[str, Any]] = ((f.name, getattr(obj, f.name))
                                            for f in dataclasses.fields(obj))
    elif isinstance(obj, Mapping):
        items = ((str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        return [_jsonable(v, exclude, f"{path}[{i}]") for i, v in enumerate(obj)]
    elif isinstance(obj, (set, frozenset)):
        return sorted(json.dumps(_jsonable(v, exclude, path), sort_keys=True) for v in obj)
    else:
        raise TypeError(f"check_same_config: cannot serialize {type(obj).__name__} at "
                        f"{path or '<root>'}; pass a dataclass, a dict, or JSON-like values")
    return {k: _jsonable(v, exclude, f"{path}.{k}" if path else k)
            for k, v in items if k not in exclude}


def config_json(obj: Any, exclude: Iterable[str] = PER_RANK_FIELDS) -> str:
    """Canonical JSON of a config (dataclasses, dicts, lists, scalars, dtypes, devices).

    Args:
        obj: the config.
        exclude: keys left out at every level (per-rank fields).
    Returns:
        JSON with sorted keys and no whitespace, equal for equal configs.
    """
    return json.dumps(_jsonable(obj, frozenset(exclude), ""), sort_keys=True,
                      separators=(",", ":"))


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
        return out or {prefix: {}}
    return {prefix or "<root>": obj}


def describe_differences(configs: list[str], max_fields: int = 8) -> str:
    """Name the ranks whose config differs from rank 0's and the fields that differ.

    Args:
        configs: each rank's :func:`config_json`, in rank order.
        max_fields: fields listed per rank at most.
    Returns:
        one line per differing rank (empty when all are equal).
    """
    base = _flatten(json.loads(configs[0]))
    lines = []
    for r, text in enumerate(configs[1:], start=1):
        if text == configs[0]:
            continue
        other = _flatten(json.loads(text))
        keys = sorted(k for k in base.keys() | other.keys() if base.get(k) != other.get(k))
        shown = ", ".join(f"{k} (rank 0: {base.get(k, '<missing>')!r}, rank {r}: "
                          f"{other.get(k, '<missing>')!r})" for k in keys[:max_fields])
        more = f" and {len(keys) - max_fields} more" if len(keys) > max_fields else ""
        lines.append(f"  rank {r} differs from rank 0 in {shown}{more}")
    return "\n".join(lines)


def all_gather_bytes(data: bytes) -> list[bytes]:
    """All-gather a byte string of any length from every rank (no pickle crosses ranks).

    Args:
        data: this rank's bytes.
    Returns:
        every rank's bytes, in rank order (``[data]`` without a process group).
    """
    if world_size() == 1:
        return [data]
    return _gather_bytes(data, comm_device())


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's ``value`` (``value`` itself without a process group), e.g.
    the KV-cache blocks that fit on every GPU, so that all ranks schedule alike."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_from_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with rank 0's (in place; on :func:`comm_device`).

    Args:
        tensor: the same shape and dtype on every rank.
    Returns:
        ``tensor``.
    """
    if world_size() > 1:
        dist.broadcast(tensor, src=0)
    return tensor


def _gather_bytes(data: bytes, device: torch.device) -> list[bytes]:
    """All-gather a byte string of any length from every rank (lengths first, then padded)."""
    n = dist.get_world_size()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(n)]
    dist.all_gather(lengths, length)
    sizes = [int(t.item()) for t in lengths]
    buf = torch.zeros(max(max(sizes), 1), dtype=torch.uint8, device=device)
    if data:  # torch.frombuffer refuses an empty buffer
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    parts = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(parts, buf)
    return [bytes(p[:s].cpu().tolist()) for p, s in zip(parts, sizes)]


def check_same_config(obj: Any, *, what: str = "config",
                      exclude: Iterable[str] = PER_RANK_FIELDS) -> None:
    """Check that every rank was given the same config; every rank raises if not.

    Each rank all-gathers a SHA-256 of :func:`config_json` (no pickle crosses ranks); only when
    the hashes differ are the JSON texts gathered to name the differing fields. Every rank
    reaches the same decision, so none is left waiting in a collective. Without a process group
    (or with one rank) there is nothing to compare.

    Args:
        obj: the config (e.g. ``model.llm_config``): dataclasses, dicts, lists and scalars.
        what: how the error names the config.
        exclude: keys that legitimately differ per rank (default ``rank``, ``local_rank``).
    Raises:
        ConfigError: naming each rank that differs from rank 0 and the differing fields.
        TypeError: when ``obj`` holds a value that has no JSON form.
    """
    text = config_json(obj, exclude)
    if world_size() == 1:
        return
    device = comm_device()
    digest = torch.tensor(list(hashlib.sha256(text.encode()).digest()), dtype=torch.uint8,
                          device=device)
    digests = [torch.empty_like(digest) for _ in range(world_size())]
    dist.all_gather(digests, digest)
    if all(torch.equal(d, digests[0]) for d in digests[1:]):
        return
    texts = [b.decode() for b in _gather_bytes(text.encode(), device)]
    differing = [r for r, d in enumerate(digests) if not torch.equal(d, digests[0])]
    raise ConfigError(f"the {what} differs between ranks (ranks {differing} differ from rank 0); "
                      "every rank must be launched with the same model and settings:\n"
                      + describe_differences(texts))
