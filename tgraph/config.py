"""Engine and runtime settings: packaged defaults, a user JSON file, ``key.path=value`` overrides.

The packaged defaults (``tgraph/default_config.json``, identical to the repository's
``configs/config.json``) hold every setting. A user file may give any subset of them and
command-line overrides win over both::

    settings = load_settings("my.json", overrides=["llm.engine.graph=eager"])
    settings.llm.engine.graph            # "eager"
    settings.get("llm.cache.block_size") # 16

Every key and value is checked against :data:`SCHEMA`; an unknown key, a wrong type or an invalid
choice raises :class:`~tgraph.errors.ConfigError` naming the key, the value and what was expected.
To add a setting, add it to both JSON files and one line to :data:`SCHEMA`.

The kernels' launch settings, ``llm.engine.tuning.*``, come from the dataclasses of
:mod:`tgraph.tuning` (their schema, types, docs and defaults), so the JSON files need not list
them; :func:`tuning_of` builds the :class:`~tgraph.tuning.Tuning` an engine holds.
``python -m tgraph.config --tuning`` prints every tuning key with its default and reason.
"""
from __future__ import annotations

import copy
import difflib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tgraph import tuning
from tgraph.errors import ConfigError

__all__ = ["Settings", "load_settings", "default_settings_path", "SCHEMA", "Field", "tuning_of"]

_DEFAULTS_FILE = Path(__file__).with_name("default_config.json")
_MISSING = object()


# ------------------------------------------------------------------------------------ validators
Check = Callable[[str, Any], Any]


@dataclass(frozen=True)
class Field:
    """One leaf setting: a check that returns the (normalized) value or raises, and its meaning."""

    check: Check
    doc: str


def _fail(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"setting '{key}' = {json.dumps(value)} is invalid: expected {expected}")


def _bool() -> Check:
    def check(key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise _fail(key, value, "true or false")
        return value

    return check


def _int(minimum: int = 1, nullable: bool = False) -> Check:
    expected = f"an integer >= {minimum}" + (" or null" if nullable else "")

    def check(key: str, value: Any) -> int | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise _fail(key, value, expected)
        return value

    return check


def _fraction() -> Check:
    def check(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise _fail(key, value, "a number in (0, 1]")
        return float(value)

    return check


def _choice(*choices: str) -> Check:
    expected = "one of " + ", ".join(f'"{c}"' for c in choices)

    def check(key: str, value: Any) -> str:
        if value not in choices or not isinstance(value, str):
            raise _fail(key, value, expected)
        return value

    return check


def _device() -> Check:
    def check(key: str, value: Any) -> str:
        ok = isinstance(value, str) and (
            value in ("auto", "cpu", "cuda")
            or (value.startswith("cuda:") and value[5:].isdigit())
        )
        if not ok:
            raise _fail(key, value, '"auto", "cpu", "cuda" or "cuda:<index>"')
        return value

    return check


def _increasing_ints() -> Check:
    def check(key: str, value: Any) -> tuple[int, ...]:
        ok = (
            isinstance(value, list)
            and value
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
            and all(a < b for a, b in zip(value, value[1:]))
        )
        if not ok:
            raise _fail(key, value, "a non-empty, strictly increasing list of positive integers")
        return tuple(value)

    return check


def _strings() -> Check:
    def check(key: str, value: Any) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _fail(key, value, "a list of strings")
        return tuple(value)

    return check


def _rules() -> Check:
    def check(key: str, value: Any) -> Any:
        # Opaque to this module: the pass manager interprets it (a rules file path or inline rules).
        if value is not None and not isinstance(value, (str, list, dict)):
            raise _fail(key, value, "null, a file path, or a list/object of rules")
        return value

    return check


def _tuning_leaf(tp: Any, minimum: int) -> Check:
    def check(key: str, value: Any) -> Any:
        try:
            return tuning.to_dict(tuning.convert(key, tp, value, minimum))
        except ValueError as exc:
            raise _fail(key, value, str(exc).replace(f"'{key}' must be ", "")) from None

    return check


def _tuning_schema(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {name: _tuning_schema(node) if isinstance(node, dict) else
            Field(_tuning_leaf(node[0], node[2]), node[1]) for name, node in tree.items()}


#: Every setting: nested dicts mirror the JSON; leaves are :class:`Field`.
SCHEMA: dict[str, Any] = {
    "llm": {
        "engine": {
            "graph": Field(_choice("static", "eager"),
                           "static: capture, fuse and build engines; eager: run ops one by one"),
            "cuda_graph": Field(_bool(), "capture decode steps into CUDA graphs (static only)"),
            "capture_collectives": Field(
                _bool(), "tensor parallel on NCCL: put all-reduce/all-gather inside the CUDA "
                "graphs (one graph per decode step); false runs them between graphs"),
            "batch_buckets": Field(_increasing_ints(), "decode batch sizes given a CUDA graph"),
            "prefill_graph_tokens": Field(
                _int(0), "prefill steps of up to this many tokens run from CUDA graphs captured "
                "at token buckets (0: prefill runs uncaptured)"),
            "disabled_passes": Field(_strings(), "names of graph passes to skip"),
            "rules": Field(_rules(), "extra fusion rules (path or inline), or null"),
            "cpu_threads": Field(
                _int(1, nullable=True),
                "torch threads of a model on the CPU; null: every core this process may use "
                "(divided among tensor-parallel ranks)"),
            "tuning": _tuning_schema(tuning.leaf_types()),
        },
        "cache": {
            "block_size": Field(_int(1), "tokens per KV-cache block"),
            "num_blocks": Field(
                _int(1, nullable=True),
                "KV-cache blocks; null sizes the cache from gpu_memory_utilization",
            ),
            "gpu_memory_utilization": Field(_fraction(),
                                            "fraction of GPU memory the engine may use"),
            "prefix_caching": Field(
                _bool(), "reuse the KV-cache blocks of prompt prefixes already computed"),
        },
        "lora": {
            "max_loras": Field(_int(1), "per-request (multi-LoRA) adapters loaded at once"),
            "max_rank": Field(_int(1), "the largest LoRA rank an adapter may have"),
            "merge_single": Field(
                _bool(), "add the adapter applied to every request (single_lora) into the "
                "weights, so steps cost what the base model's do; the adapted weights are kept "
                "on the host to restore them exactly (a quantized base is never merged)"),
        },
        "scheduler": {
            "max_num_seqs": Field(_int(1), "most sequences in one batch"),
            "max_num_batched_tokens": Field(_int(1), "most tokens in one prefill batch"),
        },
        "model": {
            "dtype": Field(_choice("auto", "float16", "bfloat16", "float32"),
                           "weight/activation dtype; auto follows the checkpoint"),
            "device": Field(_device(), "auto picks cuda when available, else cpu"),
        },
    }
}


# --------------------------------------------------------------------------------- tree helpers
def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _unknown_key(prefix: str, key: Any, known: Iterable[str]) -> ConfigError:
    known = sorted(known)
    where = f"'{prefix}'" if prefix else "the top level"
    msg = f"unknown setting '{_join(prefix, str(key))}': {where} has {', '.join(known)}"
    close = difflib.get_close_matches(str(key), known, n=1)
    if close:
        msg += f" (did you mean '{_join(prefix, close[0])}'?)"
    return ConfigError(msg)


def _validate(tree: Any, schema: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Check a (partial) settings tree against the schema; return it with normalized leaves."""
    if not isinstance(tree, Mapping):
        raise ConfigError(
            f"setting '{prefix or '<root>'}' must be an object with keys "
            f"{', '.join(sorted(schema))}, got {json.dumps(tree)}"
        )
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if key not in schema:
            raise _unknown_key(prefix, key, schema)
        node, path = schema[key], _join(prefix, key)
        if isinstance(node, Field):
            out[key] = node.check(path, value)
        else:
            out[key] = _validate(value, node, path)
    return out


def _merge(
    base: dict[str, Any], update: Mapping[str, Any], schema: Mapping[str, Any]
) -> dict[str, Any]:
    """Deep-merge ``update`` into a copy of ``base``: sections merge key by key, leaves replace.

    The schema, not the value, says what a section is, so a leaf whose value is an object (such
    as ``rules``) is replaced whole.
    """
    out = dict(base)
    for key, value in update.items():
        node = schema[key]
        if not isinstance(node, Field) and key in out:
            out[key] = _merge(out[key], value, node)
        else:
            out[key] = value
    return out


def _check_complete(tree: Mapping[str, Any], schema: Mapping[str, Any], prefix: str = "") -> None:
    for key, node in schema.items():
        path = _join(prefix, key)
        if key not in tree:
            raise ConfigError(f"setting '{path}' has no value (missing from the defaults file)")
        if not isinstance(node, Field):
            _check_complete(tree[key], node, path)


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


# ------------------------------------------------------------------------------------- Settings
class Settings:
    """Immutable, validated settings tree with attribute access.

    ``settings.llm.engine.graph`` and ``settings.get("llm.engine.graph")`` read a value; a
    sub-tree is again a :class:`Settings`; lists are returned as tuples.
    """

    __slots__ = ("_data", "_prefix")

    def __init__(self, data: Mapping[str, Any], prefix: str = "") -> None:
        object.__setattr__(self, "_data", _freeze(data))
        object.__setattr__(self, "_prefix", prefix)

    def _wrap(self, key: str, value: Any) -> Any:
        return _wrap(value, _join(self._prefix, key))

    def __getattr__(self, name: str) -> Any:
        data = object.__getattribute__(self, "_data")
        if name.startswith("__") or name not in data:
            raise AttributeError(
                f"no setting '{_join(self._prefix, name)}'; known: {', '.join(sorted(data))}"
            )
        return self._wrap(name, data[name])

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            "Settings are immutable; pass overrides to load_settings(..., overrides=[...])"
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Settings are immutable")

    def get(self, path: str, default: Any = _MISSING) -> Any:
        """Read a setting by dotted path, relative to this sub-tree.

        Args:
            path: e.g. ``"llm.engine.graph"``.
            default: returned when the path does not exist; without it a missing path raises.

        Returns:
            The value (a :class:`Settings` for a sub-tree).

        Raises:
            KeyError: the path does not exist and no default was given.
        """
        node: Any = self._data
        walked = self._prefix
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                if default is not _MISSING:
                    return default
                known = ", ".join(sorted(node)) if isinstance(node, Mapping) else "nothing"
                raise KeyError(f"no setting '{_join(walked, part)}'; '{walked}' has {known}")
            node, walked = node[part], _join(walked, part)
        return _wrap(node, walked)

    def to_dict(self) -> dict[str, Any]:
        """Return a plain, mutable deep copy (lists as lists), e.g. to dump as JSON."""
        return _thaw(self._data)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Settings):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def __repr__(self) -> str:
        return f"Settings({json.dumps(self.to_dict(), sort_keys=True)})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable (e.g. to send to worker processes) despite the immutability guards.
        return (Settings, (self.to_dict(), self._prefix))

    def __copy__(self) -> Settings:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Settings:
        return self


def _wrap(value: Any, path: str) -> Any:
    """A section becomes a :class:`Settings`; a leaf (even an object-valued one) stays a value."""
    if not isinstance(value, Mapping):
        return value
    node: Any = SCHEMA
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return value if isinstance(node, Field) else Settings(value, path)


# ---------------------------------------------------------------------------------- load/merge
def default_settings_path() -> Path:
    """Return the packaged defaults file (``tgraph/default_config.json``)."""
    return _DEFAULTS_FILE


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise ConfigError(f"{what} '{path}' does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{what} '{path}': invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from exc


def parse_override(item: str) -> tuple[str, Any]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(
            f"override {item!r} must look like key.path=value, e.g. llm.engine.graph=eager"
        )
    key, _, text = item.partition("=")
    key = key.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text  # a bare word such as `eager` is a string
    return key, value


def _nest(key: str, value: Any) -> dict[str, Any]:
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"override key {key!r} must be a dotted path such as llm.engine.graph")
    tree: Any = value
    for part in reversed(parts):
        tree = {part: tree}
    return tree


def load_settings(
    path: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    base: Settings | None = None,
) -> Settings:
    """Build the settings: packaged defaults (or ``base``), then the user file, then overrides.

    Args:
        path: a JSON file holding any subset of the settings, or ``None``.
        overrides: ``"key.path=value"`` strings (value parsed as JSON, else taken as a string, so
            ``llm.engine.graph=eager`` and ``llm.cache.num_blocks=null`` both work), or a mapping
            of dotted key -> already-typed value. Later overrides win.
        base: settings to start from instead of the packaged defaults.

    Returns:
        The validated, immutable :class:`Settings`.

    Raises:
        ConfigError: unreadable file, invalid JSON, unknown key, wrong type or invalid choice.
    """
    if base is not None:
        merged = base.to_dict()
    else:
        defaults = _read_json(_DEFAULTS_FILE, "packaged defaults file")
        # The tuning defaults are the dataclasses' own (the JSON files may still give some).
        engine = defaults.get("llm", {}).get("engine", {})
        engine["tuning"] = _merge(tuning.to_dict(tuning.Tuning()), engine.get("tuning", {}),
                                  SCHEMA["llm"]["engine"]["tuning"])
        merged = _validate(defaults, SCHEMA)
    _check_complete(merged, SCHEMA)
    if path is not None:
        user = _read_json(Path(path), "settings file")
        try:
            merged = _merge(merged, _validate(user, SCHEMA), SCHEMA)
        except ConfigError as exc:
            raise ConfigError(f"settings file '{path}': {exc}") from None
    if isinstance(overrides, str):
        overrides = [overrides]  # one override given bare, not a sequence of characters
    pairs = list(overrides.items()) if isinstance(overrides, Mapping) else [
        parse_override(item) for item in overrides
    ]
    for key, value in pairs:
        try:
            merged = _merge(merged, _validate(_nest(key, value), SCHEMA), SCHEMA)
        except ConfigError as exc:
            raise ConfigError(f"override '{key}': {exc}") from None
    return Settings(copy.deepcopy(merged))


def tuning_of(settings: Settings) -> tuning.Tuning:
    """The kernels' launch settings (``llm.engine.tuning``) of ``settings`` as a typed object."""
    return tuning.from_dict(tuning.Tuning, settings.get("llm.engine.tuning").to_dict())


def main(argv: list[str] | None = None) -> None:
    """``python -m tgraph.config [--tuning] [--set KEY=VALUE ...]``: print the settings."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tgraph.config", description=main.__doc__)
    parser.add_argument("--config", help="a JSON settings file")
    parser.add_argument("--set", nargs="*", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--tuning", action="store_true",
                        help="list the kernel tuning keys with their values and reasons")
    args = parser.parse_args(argv)
    settings = load_settings(args.config, args.overrides)
    if args.tuning:
        for key, value, doc in tuning.describe(tuning_of(settings)):
            print(f"{key} = {json.dumps(value)}\n    {doc}")
    else:
        print(json.dumps(settings.to_dict(), indent=2))


if __name__ == "__main__":
    main()
