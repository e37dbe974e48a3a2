"""Injection rules: replace or reconfigure modules of a built model, from a YAML file.

A rule file is a YAML list; each rule says which modules it matches and what becomes of them::

    - match: {name: "_proj$", class: tgraph.layers.linear.RowParallelLinear}
      replace: {class: tgraph.rules.LinearWithBackend, kwargs: {backend: cublas}}
    - match: {name: "^lm_head$"}
      replace: default          # keep the module (a short form of {class: default})
      recursive: false          # and let no rule reach its children

* ``match.name`` is a regex *searched* in the dotted module name (``model.layers.0.mlp``);
  ``match.class`` a class path tested with ``isinstance``. All given keys must match.
* ``replace.class`` is a class with ``from_module(cls, module, **kwargs)`` building the new
  module from the old one (sharing its Parameters: no weight is read again), or ``"default"``:
  keep the module, calling ``module.configure(**kwargs)`` when kwargs are given. ``replace`` may
  be left out (``default``, no kwargs): with ``recursive: false`` such a rule fences a subtree.
* Rules are tried in file order and the first match wins; the module tree is walked top-down, so
  a replaced module's children are visited next (unless the rule says ``recursive: false``).
* A class path (``match.class``, ``replace.class``) names a class of the ``tgraph`` package, of
  a module the rule file lists under ``modules:`` (then the file is a mapping
  ``{modules: [mypkg.layers], rules: [...]}``), of a module passed to :func:`load_rules` as
  ``modules``, or of the module map (``module_map``, named by its file's stem:
  ``my_models.MyLinear`` for ``my_models.py``). Any other path is refused by name before anything
  is imported. A rule file runs the code of the classes it names: it is trusted like code.
* ``kwargs.device`` (``"cuda:1"``, or ``"cpu:1"``: CPU labels simulate devices) is understood for
  every module and never passed on: the module (replaced or kept) and the children that no rule
  places elsewhere run on that device, their weights move there, their KV caches are allocated
  there, and the engine copies values across device boundaries (``to_device`` steps). Modules no
  rule places stay on their parent's device, the root on the model's device, which is also where
  the batch inputs are expected and the logits come back.

:func:`load_rules` checks everything it can before a model exists (keys, regexes, imports, the
kwargs against ``from_module`` / ``configure`` and their classes' ``check_kwargs``), so a typo
fails in a second, not after minutes of weight loading. Every error names the rule index and the
field. The dry run (:func:`dry_run`, ``tgraph rules``) only matches: it calls no ``check_kwargs``,
``from_module`` or ``configure``.
"""
from __future__ import annotations

import importlib
import inspect
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from tgraph.errors import ConfigError, TGraphError
from tgraph.ir.ops.transfer import check_placement_exists, normalize_placement
from tgraph.layers.linear import LinearBase, RowParallelLinear
from tgraph.nn import functional as F
from tgraph.nn.module import Module, apply_placement
from tgraph.nn.tensor import Tensor

__all__ = ["DEFAULT", "LinearWithBackend", "Rule", "apply_rules", "dry_run", "format_matches",
           "load_rules", "predict_placement"]

DEFAULT = "default"
_FILE_KEYS = ("modules", "rules")
_RULE_KEYS = ("match", "replace", "recursive")
_MATCH_KEYS = ("name", "class")
_REPLACE_KEYS = ("class", "kwargs")


@dataclass(frozen=True)
class Rule:
    """One validated rule.

    Attributes:
        index: position in the rule file (errors and reports use it).
        name: compiled ``match.name`` regex, or ``None``.
        match_class: the ``match.class`` class, or ``None``.
        replace_class: the replacement class, or ``None`` for ``"default"``.
        kwargs: ``replace.kwargs`` without ``device``.
        recursive: whether rules still visit the children of a module this rule matched.
        device: the normalised ``replace.kwargs.device`` label, or ``None``.
    """

    index: int
    name: re.Pattern[str] | None
    match_class: type | None
    replace_class: type | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    recursive: bool = True
    device: str | None = None

    def matches(self, name: str, module: Module) -> bool:
        """Whether every given ``match`` key holds for ``module`` at dotted path ``name``."""
        if self.name is not None and self.name.search(name) is None:
            return False
        return self.match_class is None or isinstance(module, self.match_class)

    def describe(self) -> str:
        """A one-line summary, e.g. ``name~'_proj$' -> LinearWithBackend(backend='cublas')``."""
        parts = []
        if self.name is not None:
            parts.append(f"name~{self.name.pattern!r}")
        if self.match_class is not None:
            parts.append(f"class={self.match_class.__name__}")
        target = self.replace_class.__name__ if self.replace_class is not None else DEFAULT
        kwargs = dict(self.kwargs, **({"device": self.device} if self.device else {}))
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        text = f"{' & '.join(parts)} -> {target}({args})"
        return text if self.recursive else text + " [not recursive]"


# ---------------------------------------------------------------------------------- loading
def _fail(where: str, message: str) -> ConfigError:
    return ConfigError(f"{where}: {message}")


@dataclass(frozen=True)
class _Scope:
    """Where class paths may point: module roots (``tgraph`` and the named modules) and the
    module map's module under its file's stem; ``any_module`` lifts the limit (rules built by
    Python code, which could import anything itself)."""

    roots: tuple[str, ...] = ("tgraph",)
    files: Mapping[str, ModuleType] = field(default_factory=dict)
    any_module: bool = False

    def describe(self) -> str:
        names = [*self.roots, *(f"{stem} (the module map)" for stem in self.files)]
        return ", ".join(repr(n) if " " not in n else n for n in names)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")


def _import_class(path: Any, where: str, scope: _Scope = _Scope()) -> type:
    """Import ``package.module.Class`` (attribute chains after the module are allowed), only from
    the modules ``scope`` allows: anything else is refused before any import."""
    if not isinstance(path, str) or "." not in path:
        raise _fail(where, f"expected an importable class path like "
                           f"'tgraph.layers.linear.RowParallelLinear', got {path!r}")
    parts = path.split(".")
    stem = parts[0]
    if stem in scope.files:
        return _walk_to_class(scope.files[stem], parts[1:], path, stem, where)
    roots = [r for r in scope.roots if _within(path, r)]
    if not roots and not scope.any_module:
        raise _fail(where, f"class {path!r} is outside the modules rules may use "
                           f"({scope.describe()}); name its module under the rule file's "
                           f"'modules:' list if you trust it")
    # The shortest module a prefix may be: the allowed root itself (never a parent of it).
    least = min((len(r.split(".")) for r in roots), default=1)
    # The longest importable module prefix, then attributes (a class nested in a class works).
    for split in range(len(parts) - 1, least - 1, -1):
        module_name = ".".join(parts[:split])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            # Only "this prefix is not a module" means try a shorter one; a module that fails
            # inside its own imports is a real error worth showing.
            if err.name is not None and module_name.startswith(err.name):
                continue
            raise _fail(where, f"importing {module_name!r} for {path!r} failed: {err}") from err
        except Exception as err:
            raise _fail(where, f"importing {module_name!r} for {path!r} failed: "
                               f"{type(err).__name__}: {err}") from err
        return _walk_to_class(obj, parts[split:], path, module_name, where)
    raise _fail(where, f"cannot import {path!r}: no module {'.'.join(parts[:least])!r}")


def _walk_to_class(obj: Any, attrs: Sequence[str], path: str, module_name: str,
                   where: str) -> type:
    try:
        for attr in attrs:
            obj = getattr(obj, attr)
    except AttributeError:
        raise _fail(where, f"module {module_name!r} has no {'.'.join(attrs)!r} "
                           f"(for {path!r})") from None
    if not isinstance(obj, type):
        raise _fail(where, f"{path!r} is a {type(obj).__name__}, not a class")
    return obj


def _check_keys(value: Any, allowed: Sequence[str], where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(where, f"expected a mapping with keys {list(allowed)}, "
                           f"got {type(value).__name__} {value!r}")
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise _fail(f"{where}.{unknown[0]}", f"unknown key; expected one of {list(allowed)}")
    return value


def _check_call(fn: Callable[..., Any], kwargs: Mapping[str, Any], what: str, where: str,
                leading: int) -> None:
    """Refuse kwargs ``fn`` cannot take (``leading`` positional slots are filled by us)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: nothing to check before the call
    try:
        sig.bind(*([None] * leading), **kwargs)
    except TypeError as err:
        raise _fail(where, f"{what} does not accept {dict(kwargs)!r}: {err} "
                           f"(signature {sig})") from None


def _parse_device(value: Any, where: str, check_exists: bool) -> str:
    if not isinstance(value, str):
        raise _fail(where, f"expected a device string like 'cuda:1' or 'cpu:1', got {value!r}")
    try:
        return check_placement_exists(value) if check_exists else normalize_placement(value)
    except (ValueError, TypeError) as err:
        raise _fail(where, str(err)) from None


def _check_values(cls: type, kwargs: Mapping[str, Any], where: str) -> None:
    """The optional ``check_kwargs`` hook: values, not just names, checked before loading."""
    check = getattr(cls, "check_kwargs", None)
    if callable(check):
        try:
            check(**kwargs)
        except (ValueError, TypeError) as err:
            raise _fail(where, str(err)) from None


def _parse_rule(raw: Any, index: int, check_devices: bool = True, scope: _Scope = _Scope(),
                hooks: bool = True) -> Rule:
    where = f"rule {index}"
    raw = _check_keys(raw, _RULE_KEYS, where)
    if "match" not in raw:
        raise _fail(f"{where}.match", "missing; a rule needs match.name and/or match.class")
    match = _check_keys(raw["match"], _MATCH_KEYS, f"{where}.match")
    if not match:
        raise _fail(f"{where}.match", "empty; give name (a regex) and/or class")

    pattern = None
    if "name" in match:
        if not isinstance(match["name"], str):
            raise _fail(f"{where}.match.name", f"expected a regex string, got {match['name']!r}")
        try:
            pattern = re.compile(match["name"])
        except re.error as err:
            raise _fail(f"{where}.match.name", f"invalid regex {match['name']!r}: {err}") from None
    match_class = _import_class(match["class"], f"{where}.match.class", scope) \
        if "class" in match else None

    replace = raw.get("replace", DEFAULT)
    if isinstance(replace, str):  # short form: ``replace: default`` or ``replace: pkg.Class``
        replace = {"class": replace}
    replace = _check_keys(replace, _REPLACE_KEYS, f"{where}.replace")
    class_path = replace.get("class", DEFAULT)
    kwargs = replace.get("kwargs") or {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise _fail(f"{where}.replace.kwargs", f"expected a mapping of argument names to "
                                               f"values, got {kwargs!r}")
    kwargs = dict(kwargs)
    device = None
    if "device" in kwargs:
        device = _parse_device(kwargs.pop("device"), f"{where}.replace.kwargs.device",
                               check_devices)

    replace_class = None
    if class_path == DEFAULT:
        # The module's class is known here only through match.class; otherwise configure()
        # is checked when the rule meets a module (apply_rules).
        if kwargs and match_class is not None:
            configure = getattr(match_class, "configure", None)
            if not callable(configure):
                raise _fail(f"{where}.replace.kwargs", f"'default' keeps the module and passes "
                            f"kwargs to its configure(), but {match_class.__name__} has none")
            _check_call(configure, kwargs, f"{match_class.__name__}.configure",
                        f"{where}.replace.kwargs", leading=1)
            if hooks:
                _check_values(match_class, kwargs, f"{where}.replace.kwargs")
    else:
        replace_class = _import_class(class_path, f"{where}.replace.class", scope)
        from_module = getattr(replace_class, "from_module", None)
        if not callable(from_module):
            raise _fail(f"{where}.replace.class", f"{class_path!r} has no from_module(module, "
                                                  f"**kwargs) classmethod")
        _check_call(from_module, kwargs, f"{replace_class.__name__}.from_module",
                    f"{where}.replace.kwargs", leading=1)
        if hooks:
            _check_values(replace_class, kwargs, f"{where}.replace.kwargs")

    recursive = raw.get("recursive", True)
    if not isinstance(recursive, bool):
        raise _fail(f"{where}.recursive", f"expected true or false, got {recursive!r}")
    return Rule(index, pattern, match_class, replace_class, kwargs, recursive, device)


def load_rules(source: str | Path | Sequence[Mapping[str, Any]] | Mapping[str, Any], *,
               check_devices: bool = True, modules: Sequence[str] = (),
               module_map: str | Path | None = None, any_module: bool | None = None,
               hooks: bool = True) -> list[Rule]:
    """Read and validate injection rules.

    Args:
        source: a YAML file path, or the already-parsed rules: a list of rule mappings, or a
            mapping ``{modules: [...], rules: [...]}`` (the form a file listing modules takes).
        check_devices: refuse ``kwargs.device`` values this machine does not have (``cuda:3``
            on a 2-GPU machine, any ``cuda`` without CUDA); ``False`` only checks the spelling
            (a dry run of a GPU rule file on a laptop).
        modules: module names whose classes the rules may name, besides ``tgraph`` and the
            source's own ``modules:`` list.
        module_map: the user's module map file (imported if it is not yet): its classes may be
            named by the file's stem (``my_models.MyLinear``).
        any_module: let class paths name any importable module. ``None`` (default): only for
            rules given as Python objects (built by code, which could import anything itself);
            a YAML file is always limited. Pass ``False`` for parsed rules that came from a
            file or a setting.
        hooks: call the classes' ``check_kwargs`` (``False``: the dry run, which only matches).

    Returns:
        The rules, in file order.

    Raises:
        ConfigError: an unreadable file, an invalid rule or a class outside the allowed modules
            (refused before anything is imported); the message names the rule index and the
            field (``rule 2.replace.kwargs: ...``).
    """
    from_file = isinstance(source, (str, Path))
    if from_file:
        import yaml

        path = Path(source)
        try:
            text = path.read_text()
        except OSError as err:
            raise ConfigError(f"cannot read rules file {str(path)!r}: {err}") from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"rules file {str(path)!r} is not valid YAML: {err}") from None
        if raw is None:
            raw = []  # an empty file: no rules
    else:
        raw = source
    listed: Sequence[Any] = ()
    if isinstance(raw, Mapping) and raw and all(k in _FILE_KEYS for k in raw):
        listed = raw.get("modules") or ()
        raw = raw.get("rules") or []
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"rules: expected a list of rules (or a mapping with keys "
                          f"{list(_FILE_KEYS)}), got {type(raw).__name__}")
    scope = _Scope(("tgraph", *_module_names(modules, "modules"),
                    *_module_names(listed, "rules.modules")),
                   _module_map_scope(module_map),
                   (not from_file) if any_module is None else any_module)
    return [_parse_rule(r, i, check_devices, scope, hooks) for i, r in enumerate(raw)]


_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _module_names(names: Any, where: str) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or \
            not all(isinstance(n, str) and _MODULE_NAME.fullmatch(n) for n in names):
        raise _fail(where, f"expected a list of dotted module names like ['mypkg.layers'], "
                           f"got {names!r}")
    return tuple(names)


def _module_map_scope(module_map: str | Path | None) -> dict[str, ModuleType]:
    """The module map's module under its file's stem (imported here if it is not yet)."""
    if module_map is None:
        return {}
    path = Path(module_map).resolve()

    def loaded() -> ModuleType | None:
        for module in list(sys.modules.values()):
            file = getattr(module, "__file__", None)
            if file is not None and Path(file).resolve() == path:
                return module
        return None

    module = loaded()
    if module is None:
        from tgraph.models.registry import load_module_map

        load_module_map(path)
        module = loaded()
    if module is None:
        raise ConfigError(f"module map {str(module_map)!r} could not be imported")
    return {path.stem: module}


# ---------------------------------------------------------------------------------- applying
def _apply_one(rule: Rule, name: str, module: Module) -> Module:
    """The module that replaces ``module`` under ``rule`` (``module`` itself for default)."""
    where = f"rule {rule.index}"
    if rule.replace_class is None:
        if rule.kwargs:
            configure = getattr(module, "configure", None)
            if not callable(configure):
                raise _fail(f"{where}.replace.kwargs", f"'default' passes kwargs to configure(), "
                            f"but module {name!r} ({type(module).__name__}) has none")
            _check_call(configure, rule.kwargs, f"{type(module).__name__}.configure",
                        f"{where}.replace.kwargs", leading=0)
            try:
                configure(**rule.kwargs)
            except (TGraphError, ValueError, TypeError) as err:
                raise _fail(f"{where}.replace.kwargs", f"configuring {name!r}: {err}") from err
        return module
    try:
        new = rule.replace_class.from_module(module, **rule.kwargs)
    except (TGraphError, ValueError, TypeError) as err:
        raise _fail(f"{where}.replace.class", f"{rule.replace_class.__name__}.from_module on "
                    f"{name!r} ({type(module).__name__}): {err}") from err
    if not isinstance(new, Module):
        raise _fail(f"{where}.replace.class", f"{rule.replace_class.__name__}.from_module "
                    f"returned {type(new).__name__}, not a tgraph Module")
    return new


def apply_rules(model: Module, rules: Sequence[Rule], *, warn_unused: bool = True,
                replace: bool = True) -> list[tuple[str, int | None]]:
    """Apply ``rules`` to ``model``'s sub-modules in place, top-down.

    Call it before the model's first ``run``: engines already built keep the old modules' graph.
    The root itself is never matched (there is no parent to put a replacement in). Each module
    object is visited once: one reached again (shared under a second name, or kept as a child
    of its own replacement) is left alone.

    When a rule placed a module on a device (``kwargs.device``), every module then gets a
    placement (its parent's unless a rule said otherwise; the root the model's device) and every
    weight is moved to its module's device (see :func:`tgraph.nn.module.apply_placement`).

    Args:
        model: the root module (e.g. what :func:`tgraph.models.load_model` returns).
        rules: from :func:`load_rules`.
        warn_unused: ``warnings.warn`` for each rule that matched no module.
        replace: ``False`` only matches (the dry run): no ``from_module`` or ``configure`` is
            called, no module is replaced or placed, and the walk goes on into the matched
            module's own children.

    Returns:
        ``(dotted module name, index of the rule that matched or None)`` for every module the
        walk visited, in visiting order; modules under a ``recursive: false`` match are not
        visited and not listed.

    Raises:
        ConfigError: a replacement failed; the message names the rule index, field and module.
    """
    results: list[tuple[str, int | None]] = []
    used: set[int] = set()
    seen: set[int] = {id(model)}
    keep_alive: list[Module] = [model]  # ids in `seen` must not be reused by new objects

    def visit(parent: Module, prefix: str) -> None:
        for child_name, child in list(parent._modules.items()):
            if child is None or id(child) in seen:
                continue
            seen.add(id(child))
            keep_alive.append(child)
            name = f"{prefix}.{child_name}" if prefix else child_name
            rule = next((r for r in rules if r.matches(name, child)), None)
            results.append((name, rule.index if rule is not None else None))
            if rule is None:
                visit(child, name)
                continue
            used.add(rule.index)
            new = _apply_one(rule, name, child) if replace else child
            if new is not child:
                model.set_submodule(name, new)
                seen.add(id(new))
                keep_alive.append(new)
            if rule.device is not None and replace:
                new.place(rule.device)
            if rule.recursive:
                visit(new, name)

    visit(model, "")
    if replace and any(r.device is not None and r.index in used for r in rules):
        for message in apply_placement(model, model_device(model)):
            warnings.warn(message, stacklevel=2)
    if warn_unused:
        for r in rules:
            if r.index not in used:
                warnings.warn(f"injection rule {r.index} ({r.describe()}) matched no module",
                              stacklevel=2)
    return results


def model_device(model: Module) -> str:
    """The placement label of a model as a whole: its configured device (``llm_config``),
    else the device of its first weight, else the CPU."""
    llm_config = getattr(model, "llm_config", None)
    if llm_config is not None and getattr(llm_config, "device", None) is not None:
        return normalize_placement(llm_config.device)
    for p in model.parameters():
        if p.data is not None:
            return normalize_placement(p.data.device)
    return "cpu:0"


def predict_placement(rules: Sequence[Rule], tensor_name: str) -> str | None:
    """The device a checkpoint tensor will be placed on, guessed from the rules' names alone.

    The weight loader uses it to read a tensor straight onto its device. Each dotted prefix of
    the name (``model``, ``model.layers``, ``model.layers.3``, ...) is tried as a module name,
    top-down, as :func:`apply_rules` does; rules with ``match.class`` are skipped (no module
    exists yet). A wrong guess costs a copy when the rules are applied, nothing else.

    Args:
        rules: from :func:`load_rules`.
        tensor_name: e.g. ``model.layers.17.mlp.down_proj.weight``.

    Returns:
        A placement label, or ``None`` (the model's device).
    """
    parts = tensor_name.split(".")
    device = None
    for end in range(1, len(parts)):
        prefix = ".".join(parts[:end])
        rule = next((r for r in rules if r.match_class is None and r.matches(prefix, None)), None)
        if rule is None:
            continue
        if rule.device is not None:
            device = rule.device
        if not rule.recursive:
            break
    return device


def format_matches(matches: Sequence[tuple[str, int | None]], rules: Sequence[Rule]) -> str:
    """The report of :func:`apply_rules` as text, one module a line.

    Args:
        matches: what :func:`apply_rules` returned.
        rules: the rules it applied (to describe each match).

    Returns:
        Lines ``<module>  rule <i>: <summary>`` or ``<module>  -`` when no rule matched.
    """
    by_index = {r.index: r for r in rules}
    width = max((len(n) for n, _ in matches), default=0)
    lines = []
    for name, idx in matches:
        what = "-" if idx is None else f"rule {idx}: {by_index[idx].describe()}"
        lines.append(f"{name.ljust(width)}  {what}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- replacements
class LinearWithBackend(LinearBase):
    """A linear whose GEMM formulation is chosen by a rule, sharing the original's weights.

    ``"triton"`` records ``F.linear`` (the fused linear path: epilogue fusion, the GEMV/GEMM
    kernels); ``"cublas"`` records ``matmul(x, transpose(weight))``, which no linear pass
    rewrites, so it reaches the engine as a plain matmul. Same numbers, different graphs.

    Every plain attribute of the wrapped linear (``output_sizes``, ``num_heads``, ``rank``...)
    is copied, so the parent module reads it as before; a row-parallel linear keeps its
    all-reduce.
    """

    BACKENDS = ("cublas", "triton")

    @classmethod
    def check_kwargs(cls, backend: str = "triton") -> None:
        """Refuse an unknown backend (called by :func:`load_rules` before any model exists)."""
        if backend not in cls.BACKENDS:
            raise ValueError(f"backend must be one of {list(cls.BACKENDS)}, got {backend!r}")

    @classmethod
    def from_module(cls, module: Module, backend: str = "triton") -> LinearWithBackend:
        """Wrap ``module``'s weight and bias (the same Parameters, nothing copied).

        Args:
            module: a :class:`~tgraph.layers.linear.LinearBase` (any linear of the layer zoo).
            backend: ``"cublas"`` or ``"triton"``.

        Returns:
            The new module.
        """
        if not isinstance(module, LinearBase):
            raise TypeError(f"LinearWithBackend replaces a LinearBase, got "
                            f"{type(module).__name__}")
        cls.check_kwargs(backend)
        layer = cls.__new__(cls)
        Module.__init__(layer)
        for key, value in module.__dict__.items():
            if key not in ("_modules", "_parameters", "_named"):
                object.__setattr__(layer, key, value)
        layer._parameters.update(module._parameters)
        layer._modules.update(module._modules)
        layer.backend = backend
        layer.source_class = type(module).__name__
        # NOTE: checked by type, not by a flag of the original, because only RowParallelLinear
        # reduces in its own forward, which this class replaces.
        layer.reduce_output = isinstance(module, RowParallelLinear) and module.world_size > 1
        return layer

    def configure(self, backend: str) -> None:
        """Switch the backend (a ``replace: default`` rule with ``kwargs: {backend: ...}``)."""
        self.check_kwargs(backend)
        self.backend = backend

    def forward(self, x: Tensor) -> Tensor:
        if self.backend == "cublas":
            out = F.matmul(x, F.transpose(self.weight, 0, 1))  # (tokens, in) @ (in, out)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = F.linear(x, self.weight, self.bias)
        if self.reduce_output:
            from tgraph.nn import distributed

            out = distributed.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend}, from={self.source_class}"


# ---------------------------------------------------------------------------------- dry run
def dry_run(model_dir: str | Path, rules: str | Path | Sequence[Mapping[str, Any]], *,
            module_map: str | Path | None = None) -> tuple[str, list[str]]:
    """Match rules against a model built on the ``meta`` device (no weight is read) and report.

    Only matching: no ``check_kwargs``, ``from_module`` or ``configure`` is called, so the report
    shows which rule hits which module of the model as built (the children a replacement would
    bring are not listed).

    Args:
        model_dir: a checkpoint directory (``config.json`` + safetensors headers are read).
        rules: a rule file or parsed rules; validated (keys, regexes, allowed class paths,
            kwargs names) before the model is built.
        module_map: a Python file registering custom models; rules may name its classes.

    Returns:
        ``(report, warnings)``: :func:`format_matches` text, and the no-match warnings.
    """
    import torch

    from tgraph.io.checkpoint import open_checkpoint, read_config
    from tgraph.models.base.llm_config import LlmConfig
    from tgraph.models.registry import resolve_model_class

    # check_devices=False: a GPU rule file may be checked anywhere. The module map is imported
    # here (its classes may be named by the rules), before the model class is resolved.
    parsed = load_rules(rules, check_devices=False, module_map=module_map, hooks=False)
    config = read_config(model_dir)
    cls = resolve_model_class(config)
    llm = LlmConfig(config, dtype=torch.float32, device="meta",
                    max_model_len=min(config.max_position_embeddings, 64))
    _, loader = open_checkpoint(model_dir, config, device="meta", dtype=torch.float32,
                                progress=False)
    model = cls(llm, loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matches = apply_rules(model, parsed, replace=False)
    return format_matches(matches, parsed), [str(w.message) for w in caught]
