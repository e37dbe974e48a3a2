"""torch-style modules whose ``forward`` records ops on symbolic tensors.

Parameters hold real data and appear in the graph as named weights. Names are dotted paths from
the root module (``model.layers.0.self_attn.q_proj.weight``); they are assigned when the root
module is first called (or by :meth:`Module.assign_names`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from tgraph.errors import WeightLoadError
from tgraph.ir.ops.transfer import normalize_placement, placement_device
from tgraph.ir.value import ValueKind
from tgraph.nn import functional as F
from tgraph.nn.tensor import Tensor
from tgraph.quant import QuantizedWeight


class Parameter(Tensor):
    """A weight: a symbolic tensor backed by real data.

    Args:
        data: the tensor; may be omitted (with ``shape`` and ``dtype``) and loaded later.
        shape, dtype: the expected shape and dtype when ``data`` is not given yet.
        name: an explicit graph name; by default the module path assigns one.
    """

    __slots__ = ()

    def __init__(self, data: torch.Tensor | None = None, *, shape: tuple[int, ...] | None = None,
                 dtype: torch.dtype | None = None, name: str | None = None) -> None:
        if data is not None:
            if not isinstance(data, (torch.Tensor, QuantizedWeight)):
                raise TypeError("Parameter data must be a torch.Tensor or a QuantizedWeight, got "
                                f"{type(data).__name__}")
            shape, dtype = tuple(data.shape), data.dtype
        elif shape is None or dtype is None:
            raise TypeError("Parameter needs data, or both shape and dtype")
        self._setup(ValueKind.WEIGHT, name, dtype, tuple(shape), None, 0, data, False)

    def load(self, tensor: torch.Tensor) -> None:
        """Set the data, checking the shape and converting to the parameter's dtype."""
        if tuple(tensor.shape) != tuple(self.shape):
            raise WeightLoadError(f"weight {self.name or '?'}: expected shape {list(self.shape)}, "
                                  f"got {list(tensor.shape)}")
        self.data = tensor.to(self.dtype)

    def __repr__(self) -> str:
        state = "" if self.data is not None else " (not loaded)"
        return f"Parameter({self.describe()}{state})"


class Module:
    """Base class of tgraph modules, in the style of ``torch.nn.Module``.

    ``placement`` (a label such as ``"cuda:1"``, or ``None``) says where the module's weights live
    and its ops run; see :meth:`place` and :func:`apply_placement`.
    """

    placement: str | None = None

    def __init__(self) -> None:
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_named", False)

    # ---- attribute registration ----------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if "_modules" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ must call super().__init__() "
                                 f"before assigning {name!r}")
        self._modules.pop(name, None)
        self._parameters.pop(name, None)
        if isinstance(value, (Parameter, Module)):
            self.__dict__.pop(name, None)  # a plain value assigned earlier would shadow it
            (self._parameters if isinstance(value, Parameter) else self._modules)[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        if "_parameters" in d and name in d["_parameters"]:
            return d["_parameters"][name]
        if "_modules" in d and name in d["_modules"]:
            return d["_modules"][name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        if name in self._parameters:
            del self._parameters[name]
        elif name in self._modules:
            del self._modules[name]
        else:
            object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        if param is None:
            object.__setattr__(self, name, None)
        else:
            setattr(self, name, param)

    def add_module(self, name: str, module: Module) -> None:
        setattr(self, name, module)

    # ---- traversal -----------------------------------------------------------------------------
    def named_children(self) -> Iterator[tuple[str, Module]]:
        yield from self._modules.items()

    def children(self) -> Iterator[Module]:
        for _, m in self.named_children():
            yield m

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """This module and all sub-modules with dotted names (the root has ``prefix``)."""
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """All parameters with dotted names, each parameter once."""
        seen: set[int] = set()
        for mod_name, module in self.named_modules(prefix):
            for name, param in module._parameters.items():
                if id(param) in seen:
                    continue
                seen.add(id(param))
                yield (f"{mod_name}.{name}" if mod_name else name), param

    def parameters(self) -> Iterator[Parameter]:
        for _, p in self.named_parameters():
            yield p

    def get_submodule(self, target: str) -> Module:
        module: Module = self
        for part in target.split(".") if target else []:
            if part not in module._modules:
                raise AttributeError(f"{type(module).__name__} has no sub-module {part!r} "
                                     f"(looking up {target!r})")
            module = module._modules[part]
        return module

    def set_submodule(self, target: str, module: Module) -> None:
        parent_name, _, leaf = target.rpartition(".")
        parent = self.get_submodule(parent_name)
        if leaf not in parent._modules:
            raise AttributeError(f"{target!r} is not a sub-module")
        parent._modules[leaf] = module

    # ---- weights ---------------------------------------------------------------------------------
    def assign_names(self, prefix: str = "", overwrite: bool = False) -> None:
        """Name every parameter by its dotted path (parameters named explicitly keep theirs)."""
        for name, param in self.named_parameters(prefix):
            if param.name is None or overwrite:
                param.name = name
        object.__setattr__(self, "_named", True)

    def load_state(self, weights: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load parameter data by dotted name; with ``strict`` every name must match."""
        params = dict(self.named_parameters())
        if strict:
            missing = sorted(set(params) - set(weights))
            unexpected = sorted(set(weights) - set(params))
            if missing or unexpected:
                raise WeightLoadError(f"load_state: missing {missing}, unexpected {unexpected}")
        for name, tensor in weights.items():
            if name in params:
                params[name].load(tensor)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
           ) -> Module:
        """Move (and optionally cast floating) parameter data in place."""
        for p in self.parameters():
            if p.data is None:
                continue
            target = dtype if dtype is not None and p.data.is_floating_point() else p.data.dtype
            p.data = p.data.to(device=device, dtype=target)
            p.dtype = target
        return self

    def place(self, device: str | torch.device) -> Module:
        """Run this module (and its children without a placement of their own) on ``device``.

        Only marks the module; :func:`apply_placement` moves the weights (``tgraph.rules`` calls
        it after applying ``device`` kwargs).

        Args:
            device: a placement label (``"cuda:1"``, ``"cpu:1"``) or torch device.

        Returns:
            ``self``.
        """
        object.__setattr__(self, "placement", normalize_placement(device))
        return self

    # ---- calling ---------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._named:
            self.assign_names()
        if self.placement is None:
            return self.forward(*args, **kwargs)
        with F.placement(self.placement):
            return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, child in self._modules.items():
            body = repr(child).replace("\n", "\n  ")
            lines.append(f"  ({name}): {body}")
        return lines[0] + ")" if len(lines) == 1 else "\n".join(lines) + "\n)"


def apply_placement(root: Module, default: str | torch.device) -> list[str]:
    """Give every module a placement and move every weight to its module's device.

    A module without a placement takes its parent's (the root takes ``default``). Each
    Parameter moves once, to the device of the first module that owns it (top-down), and is
    declared there for recording; its old copy is dropped, not kept. Data on the ``meta`` device
    (a dry run) is not moved.

    Args:
        root: the model.
        default: the root's placement when it has none (the model's device).

    Returns:
        Warnings: Parameters shared by modules on different devices (they stay on the first;
        the others read a copy made at every step).
    """
    if root.placement is None:
        root.place(default)
    owner: dict[int, tuple[str, str]] = {}  # param id -> (label, module name)
    warnings: list[str] = []

    def visit(module: Module, name: str, label: str) -> None:
        for pname, param in module._parameters.items():
            first = owner.get(id(param))
            if first is None:
                owner[id(param)] = (label, name)
                data = param.data
                if isinstance(data, (torch.Tensor, QuantizedWeight)) \
                        and data.device.type != "meta":
                    target = placement_device(label)
                    if data.device != target:
                        param.data = data.to(target)
                F.place(param, label)
            elif first[0] != label:
                full = f"{name}.{pname}" if name else pname
                warnings.append(f"parameter {full!r} is shared with module {first[1]!r} on "
                                f"{first[0]}: it stays there and {name!r} on {label} reads a "
                                f"copy made at every step; place both on one device")
        for child_name, child in module._modules.items():
            if child.placement is None:
                child.place(label)
            visit(child, f"{name}.{child_name}" if name else child_name, child.placement)

    visit(root, "", root.placement)
    return warnings


class ModuleList(Module):
    """A list of modules, named ``0``, ``1``, ... ."""

    def __init__(self, modules: Iterable[Module] = ()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> ModuleList:
        self.add_module(str(len(self._modules)), module)
        return self

    def __getitem__(self, index: int) -> Module:
        items = list(self._modules.values())
        return items[index]

    def __setitem__(self, index: int, module: Module) -> None:
        key = list(self._modules)[index]
        self._modules[key] = module

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())


class ModuleDict(Module):
    """A dict of modules, named by their keys."""

    def __init__(self, modules: Mapping[str, Module] | None = None) -> None:
        super().__init__()
        for k, m in (modules or {}).items():
            self[k] = m

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __contains__(self, key: str) -> bool:
        return key in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def keys(self):
        return self._modules.keys()

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()
