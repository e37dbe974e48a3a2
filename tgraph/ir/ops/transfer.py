"""Device placement labels and the ``to_device`` op that copies a value between devices.

A *placement label* names where a module's weights live and its ops run: ``"cuda:1"``, or
``"cpu:0"`` / ``"cpu:1"``. CUDA labels are real devices. CPU labels all map to the one torch CPU
device: they let a test (or CI) split a network over two "devices" and check that the transfers,
the per-device segments and the per-device buffers are right, on a machine without GPUs.

Labels are normalised (``"cuda"`` -> ``"cuda:<current>"``, ``"cpu"`` -> ``"cpu:0"``) so that two
spellings of one device never produce a transfer between them.

``to_device(x, device=label)`` is a plain copy: its output has ``x``'s shape and dtype and lives on
``label``. Networks spread over several devices get one where a value crosses a boundary (see
:mod:`tgraph.nn.functional`), and the engine runs each one as a step of its own.
"""
from __future__ import annotations

import torch

from tgraph.ir.ops.registry import Meta, OpCategory, register_op, require

__all__ = ["normalize_placement", "placement_device", "check_placement_exists"]

_KINDS = ("cpu", "cuda")


def normalize_placement(device: str | torch.device) -> str:
    """The canonical label of a device: ``"<type>:<index>"``.

    Args:
        device: a label or torch device, e.g. ``"cuda:1"``, ``"cpu"``, ``torch.device("cuda")``.
            Types other than cpu and cuda (``meta``) keep their type with index 0.

    Returns:
        ``"cuda:0"``, ``"cpu:1"``, ... (``"cuda"`` means the current CUDA device, as in torch).

    Raises:
        ValueError: not a device string torch understands.
        TypeError: neither a string nor a torch.device.
    """
    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"invalid device {device!r}: expected e.g. 'cuda:1' or 'cpu:0' "
                             f"({err})") from None
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise TypeError(f"a device must be a string like 'cuda:1' or a torch.device, got "
                        f"{type(device).__name__} {device!r}")
    index = dev.index
    if index is None:
        index = torch.cuda.current_device() if dev.type == "cuda" and \
            torch.cuda.is_available() else 0
    return f"{dev.type}:{index}"


def placement_device(label: str) -> torch.device:
    """The torch device a placement label runs on (every ``cpu:N`` label is the CPU)."""
    dev = torch.device(label)
    return torch.device("cpu") if dev.type == "cpu" else dev


def check_placement_exists(device: str | torch.device) -> str:
    """Normalise ``device`` and check that this machine has it.

    Returns:
        The normalised label.

    Raises:
        ValueError: an unknown device type, a CUDA device with no CUDA, or an index past the
            last GPU; the message says what this machine has.
    """
    label = normalize_placement(device)
    kind, index = label.split(":")
    if kind not in _KINDS:
        raise ValueError(f"device {str(device)!r}: expected a cuda or cpu device, got a {kind} "
                         f"device")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {str(device)!r} does not exist: CUDA is not available on "
                             f"this machine (use 'cpu:N' labels to simulate devices on the CPU)")
        if int(index) >= count:
            raise ValueError(f"device {str(device)!r} does not exist: this machine has {count} "
                             f"CUDA device(s), cuda:0 to cuda:{count - 1}")
    return label


def _to_device_infer(x: Meta, *, device: str) -> Meta:
    require(isinstance(device, str) and ":" in device,
            f"to_device needs a placement label like 'cuda:1' or 'cpu:1', got {device!r}")
    return Meta(x.shape, x.dtype)


def to_device_reference(x: torch.Tensor, *, device: str) -> torch.Tensor:
    """A copy of ``x`` on ``device``'s torch device (a copy even when both are the CPU)."""
    return x.to(placement_device(device), copy=True)


register_op("to_device", infer=_to_device_infer, reference=to_device_reference,
            category=OpCategory.MEMORY,
            doc="copy a value to another device (inserted where a value crosses devices)")
