"""LoRA adapters changed while the engine runs: load or unload a per-request adapter, set or
clear the adapter applied to every request.

An :class:`AdapterCommand` says what to change; the engine's loop applies it between two steps
(:meth:`EngineCore.apply_adapters <tgraph.runtime.engine_core.EngineCore.apply_adapters>`)
through the model's :class:`AdapterManager`, in two phases:

* ``prepare`` reads and checks the adapter files and, for a new adapter, writes them into a free
  multi-LoRA slot or a new single-LoRA entry, which no request uses yet. It raises on a bad
  directory, a malformed file, a rank above ``max_rank``, a full bank (``max_loras``) or an
  adapter still used by requests in flight; whatever it wrote is undone then.
* ``commit`` makes the change visible: from the next step requests may name the new adapter, the
  unloaded one is gone, the single adapter is switched.

Under tensor parallelism every rank prepares the same command at the same step; the ranks
compare their outcomes and commit only if every rank prepared, else each undoes its part and
raises the same error. No engine is built for any command: the adapters' weights are written in
place (see :mod:`tgraph.models.base.lora_features`).

Requests in flight: unloading (or replacing) an adapter that a request still uses is refused
with :class:`AdapterInUseError` (the caller retries once those requests end, or aborts them);
switching the single adapter applies to every request from the next step, those in flight
included.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from safetensors import SafetensorError

from tgraph.errors import ConfigError, InvalidRequestError, TGraphError, WeightLoadError
from tgraph.layers.lora import check_adapter, load_peft_adapter
from tgraph.models.base.lora_features import shard_adapter

__all__ = ["AdapterCommand", "AdapterInUseError", "AdapterManager", "AdapterNotFoundError",
           "AdapterState", "shared_error"]

CommandKind = Literal["load", "unload", "single"]


class AdapterInUseError(TGraphError, RuntimeError):
    """An adapter cannot be unloaded or replaced while requests in flight use it."""


class AdapterNotFoundError(TGraphError, LookupError):
    """The named per-request adapter is not loaded."""


# Errors re-raised by name on the ranks whose own part of a command succeeded.
_SHARED: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (AdapterInUseError, AdapterNotFoundError, ConfigError,
                                  InvalidRequestError, WeightLoadError, ValueError, TypeError)}


def shared_error(kind: str, message: str) -> Exception:
    """The error another rank reported as ``(kind, message)``, of the same type where known
    (a ``RuntimeError`` otherwise)."""
    return _SHARED.get(kind, RuntimeError)(message)


@dataclass(frozen=True)
class AdapterCommand:
    """One change of the model's adapters; build it with :meth:`load`, :meth:`unload` or
    :meth:`single`.

    Attributes:
        kind: ``"load"`` / ``"unload"`` a per-request adapter, or set the ``"single"`` one.
        name: the per-request adapter's name (load, unload).
        path: the PEFT adapter directory (load; single, where ``None`` clears it).
        replace: loading a name that is loaded replaces that adapter (else it is refused).
    """

    kind: CommandKind
    name: str | None = None
    path: str | None = None
    replace: bool = True

    @classmethod
    def load(cls, name: str, path: str | Path, replace: bool = True) -> AdapterCommand:
        return cls("load", name, _path(path), replace)

    @classmethod
    def unload(cls, name: str) -> AdapterCommand:
        return cls("unload", name)

    @classmethod
    def single(cls, path: str | Path | None) -> AdapterCommand:
        return cls("single", None, None if path is None else _path(path))

    def to_json(self) -> dict[str, Any]:
        """The command as JSON values (what tensor-parallel ranks exchange)."""
        return {"kind": self.kind, "name": self.name, "path": self.path, "replace": self.replace}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AdapterCommand:
        return cls(data["kind"], data["name"], data["path"], bool(data["replace"]))

    def check(self) -> None:
        """Refuse a malformed command (wrong kind or types) before it is queued.

        Raises:
            InvalidRequestError: with what was expected.
        """
        if self.kind not in ("load", "unload", "single"):
            raise InvalidRequestError(f"adapter command kind {self.kind!r} is not one of "
                                      "'load', 'unload', 'single'")
        if self.kind != "single" and (not isinstance(self.name, str) or not self.name.strip()):
            raise InvalidRequestError(f"a LoRA adapter name must be a non-empty string, got "
                                      f"{self.name!r}")
        if self.kind == "load" and not isinstance(self.path, str):
            raise InvalidRequestError(f"loading LoRA adapter {self.name!r} needs a directory, "
                                      f"got {self.path!r}")
        if self.kind == "single" and self.path is not None and not isinstance(self.path, str):
            raise InvalidRequestError(f"the single LoRA adapter is a directory or None, got "
                                      f"{self.path!r}")


def _path(path: str | Path) -> str:
    if isinstance(path, Path):
        return str(path)
    return path  # anything else is refused by check() with its type


@dataclass(frozen=True)
class AdapterState:
    """The adapters a model serves (a snapshot; any thread may read it).

    Attributes:
        loras: per-request adapters, name -> directory it was loaded from.
        single_lora: the directory of the adapter applied to every request (None: none).
    """

    loras: Mapping[str, str] = field(default_factory=dict)
    single_lora: str | None = None

    @property
    def names(self) -> list[str]:
        """The per-request adapters' names, sorted."""
        return sorted(self.loras)


@dataclass
class _Prepared:
    """A prepared command: what makes it visible, and what undoes what preparing wrote."""

    commit: Callable[[], None]
    undo: Callable[[], None] = lambda: None


class AdapterManager:
    """A model's LoRA adapters, changed by commands on the engine's loop thread (or before the
    engine exists). :meth:`state` may be read from any thread.

    Args:
        model: the loaded model; its ``features["multi_lora"]`` and ``["single_lora"]`` hold
            the adapters (a command for a feature it lacks raises ConfigError).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._loras: dict[str, str] = {}
        self._single: str | None = None
        self._keys = itertools.count(1)
        self._state = AdapterState()

    def state(self) -> AdapterState:
        """The adapters as of the last committed command."""
        return self._state

    def apply(self, command: AdapterCommand, in_use: Mapping[str, int] | None = None
              ) -> AdapterState:
        """Prepare and commit ``command`` at once (one process; no engine step in between).

        Raises:
            see :meth:`prepare`.
        """
        self.prepare(command, in_use or {}).commit()
        return self._state

    def prepare(self, command: AdapterCommand, in_use: Mapping[str, int]) -> _Prepared:
        """Check ``command`` and read its adapter (see the module doc).

        Args:
            command: the change.
            in_use: requests in flight by the per-request adapter they name.

        Returns:
            Its ``commit`` (makes the change visible) and ``undo`` (drops what was read).

        Raises:
            InvalidRequestError: a malformed command, or loading a loaded name without
                ``replace``.
            ConfigError: the model lacks the feature, the bank is full (``max_loras``), or
                the adapter does not fit the feature (rank above ``max_rank``, unknown module).
            WeightLoadError: the directory or its files are missing or malformed.
            AdapterNotFoundError: unloading a name that is not loaded.
            AdapterInUseError: unloading or replacing an adapter that requests use.
        """
        command.check()
        if command.kind == "load":
            return self._prepare_load(command, in_use)
        if command.kind == "unload":
            return self._prepare_unload(command, in_use)
        return self._prepare_single(command)

    # ---- the commands --------------------------------------------------------------------------
    def _prepare_load(self, command: AdapterCommand, in_use: Mapping[str, int]) -> _Prepared:
        multi = self._feature("multi_lora")
        name, path = command.name, command.path
        assert name is not None and path is not None
        if name not in multi.slots:
            _read(multi, name, path)  # a free slot that no request names yet

            def commit() -> None:
                self._loras[name] = path
                self._refresh()

            return _Prepared(commit, lambda: multi.unload(name))
        if not command.replace:
            raise InvalidRequestError(f"LoRA adapter {name!r} is already loaded (from "
                                      f"{self._loras.get(name, '?')!r}); unload it first")
        _refuse_in_use(name, in_use, "replace")
        _check_readable(multi, name, path)  # its slot is written at commit, once every rank read

        def replace() -> None:
            _read(multi, name, path)
            self._loras[name] = path
            self._refresh()

        return _Prepared(replace)

    def _prepare_unload(self, command: AdapterCommand, in_use: Mapping[str, int]) -> _Prepared:
        multi = self._feature("multi_lora")
        name = command.name
        assert name is not None
        if name not in multi.slots:
            raise AdapterNotFoundError(f"LoRA adapter {name!r} is not loaded; loaded: "
                                       f"{sorted(multi.slots)}")
        _refuse_in_use(name, in_use, "unload")

        def commit() -> None:
            multi.unload(name)
            self._loras.pop(name, None)
            self._refresh()

        return _Prepared(commit)

    def _prepare_single(self, command: AdapterCommand) -> _Prepared:
        single = self._feature("single_lora")
        path = command.path
        key = None if path is None else path
        if key is not None:
            while key in single.adapters:  # the active one stays intact until commit
                key = f"{path}#{next(self._keys)}"
            _read(single, key, path)

        def commit() -> None:
            single.activate(key)
            for old in [n for n in single.adapters if n != key]:
                single.unload(old)
            self._single = path
            self._refresh()

        def undo() -> None:
            if key is not None:
                single.unload(key)

        return _Prepared(commit, undo)

    # ---- helpers -------------------------------------------------------------------------------
    def _feature(self, name: str) -> Any:
        feature = getattr(self.model, "features", {}).get(name)
        if feature is None:
            what = "multi-LoRA (per-request adapters)" if name == "multi_lora" else \
                "single-LoRA (one adapter for every request)"
            raise ConfigError(f"{type(self.model).__name__} has no {what} feature")
        return feature

    def _refresh(self) -> None:
        multi = getattr(self.model, "features", {}).get("multi_lora")
        names = sorted(multi.slots) if multi is not None else []
        self._state = AdapterState({n: self._loras.get(n, "") for n in names}, self._single)


def _refuse_in_use(name: str, in_use: Mapping[str, int], what: str) -> None:
    count = in_use.get(name, 0)
    if count:
        raise AdapterInUseError(f"cannot {what} LoRA adapter {name!r}: {count} request(s) in "
                                "flight use it; retry once they finish (or abort them)")


def _read(feature: Any, name: str, path: str) -> None:
    """``feature.load(name, path)``, with an unreadable file reported as a WeightLoadError."""
    try:
        feature.load(name, path)
    except TGraphError:
        raise
    except (OSError, SafetensorError, UnicodeDecodeError) as err:
        raise WeightLoadError(f"LoRA adapter {path!r} cannot be read: {type(err).__name__}: "
                              f"{err}") from err


def _check_readable(feature: Any, name: str, path: str) -> None:
    """Read and check the adapter at ``path`` as ``feature.load`` would, keeping nothing."""
    try:
        adapter = shard_adapter(load_peft_adapter(path, name), feature.targets)
    except TGraphError:
        raise
    except (OSError, SafetensorError, UnicodeDecodeError) as err:
        raise WeightLoadError(f"LoRA adapter {path!r} cannot be read: {type(err).__name__}: "
                              f"{err}") from err
    check_adapter(adapter, feature.targets, feature.max_rank,
                  feature.model.llm_config.model.num_hidden_layers)
