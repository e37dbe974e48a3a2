"""Every environment variable tgraph reads, declared once: name, type, default and meaning.

Code reads a variable only through this module, at the moment it needs it::

    from tgraph import envs
    envs.TGRAPH_CACHE_DIR        # a Path, the default when unset
    envs.get("RANK", environ)    # the same from another mapping (e.g. a child's environment)

``python -m tgraph.envs`` prints the table the README shows. Launch and kernel settings are not
environment variables: they are typed settings (``tgraph.config``, ``tgraph.tuning``).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgraph.errors import ConfigError

__all__ = ["EnvVar", "VARIABLES", "child_environ", "get", "markdown_table", "set_default"]


def _flag(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"environment variable {name}={text!r} is invalid: expected 1 or 0")


def _text(name: str, text: str) -> str:
    return text


def _path(name: str, text: str) -> Path:
    return Path(text).expanduser()


@dataclass(frozen=True)
class EnvVar:
    """One environment variable.

    Attributes:
        name: the variable.
        parse: turns its text into the typed value (raises ConfigError on bad text).
        default: the value when unset (a callable computes it at read time).
        doc: what it does, in one line.
        reader: who reads it: ``tgraph``, ``scripts/setup.sh``, ``tests``, or ``torchrun``
            (set by the launcher, read as text and checked by :mod:`tgraph.nn.distributed`).
    """

    name: str
    parse: Callable[[str, str], Any]
    default: Any
    doc: str
    reader: str = "tgraph"

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The typed value in ``environ`` (default ``os.environ``)."""
        env = os.environ if environ is None else environ
        text = env.get(self.name)
        if text is None:
            return self.default() if callable(self.default) else self.default
        return self.parse(self.name, text)


_TORCHRUN = "tgraph (from torchrun)"


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "tgraph"


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("TGRAPH_CACHE_DIR", _path, _default_cache_dir,
           "where the demo's model, the generated pointwise kernels, the compiled CPU "
           "kernels and GGUF files' tokenizers are cached (default ~/.cache/tgraph)"),
    EnvVar("TGRAPH_PDL", _flag, True,
           "0 launches every Triton kernel without programmatic dependent launch (debugging)"),
    EnvVar("TRITON_INTERPRET", _flag, False,
           "1 runs Triton kernels in Triton's interpreter, on CPU tensors too (the CPU test "
           "suite sets it)"),
    EnvVar("WORLD_SIZE", _text, None, "tensor-parallel ranks in all (set by torchrun)",
           "tgraph (from torchrun)"),
    EnvVar("RANK", _text, None, "this process's rank (set by torchrun)", "tgraph (from torchrun)"),
    EnvVar("LOCAL_RANK", _text, None, "this process's GPU on its host (set by torchrun)",
           "tgraph (from torchrun)"),
    EnvVar("LOCAL_WORLD_SIZE", _text, None, "ranks on this host (set by torchrun)",
           "tgraph (from torchrun)"),
    EnvVar("MASTER_ADDR", _text, None, "the rendezvous host (set by torchrun)",
           "tgraph (from torchrun)"),
    EnvVar("MASTER_PORT", _text, None, "the rendezvous port (set by torchrun)",
           "tgraph (from torchrun)"),
    EnvVar("CUDA_VISIBLE_DEVICES", _text, None,
           "the GPUs a process may see; named in the error when a rank has no GPU",
           "tgraph (from torchrun)"),
    EnvVar("TGRAPH_API_KEY", _text, "",
           "the key `tgraph serve` requires as 'Authorization: Bearer KEY' when --api-key is "
           "not given", "tgraph serve"),
    EnvVar("TGRAPH_CUDA", _text, "",
           "1 or 0: install a CUDA or the CPU build of torch (default: CUDA where nvidia-smi "
           "exists)", "scripts/setup.sh"),
    EnvVar("TGRAPH_ISOLATED_VENV", _flag, False,
           "1 makes .venv without access to the system's packages", "scripts/setup.sh"),
    EnvVar("TGRAPH_EXTRA_INDEX_URL", _text, "",
           "an extra package index for pip, besides pip's configured sources",
           "scripts/setup.sh"),
    EnvVar("TGRAPH_TEST_LOG", _text, "",
           "a file the test suite appends each test's duration to as it ends", "tests"),
)}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The typed value of the declared variable ``name`` in ``environ`` (default ``os.environ``).

    Raises:
        KeyError: ``name`` is not declared here.
        ConfigError: the variable's text does not parse.
    """
    if name not in VARIABLES:
        raise KeyError(f"{name} is not declared in tgraph.envs; declared: "
                       f"{', '.join(VARIABLES)}")
    return VARIABLES[name].read(environ)


def set_default(name: str, value: str) -> None:
    """Set the declared variable ``name`` in this process's environment unless it is set (for a
    library that reads it itself, e.g. Triton's ``TRITON_INTERPRET``)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not declared in tgraph.envs")
    os.environ.setdefault(name, value)


def child_environ(**values: str) -> dict[str, str]:
    """This process's environment with ``values`` set, for a child process."""
    return {**os.environ, **values}


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return VARIABLES[name].read()
    raise AttributeError(f"module 'tgraph.envs' has no attribute {name!r}")


def markdown_table() -> str:
    """The README's table of the variables (torchrun's launch variables in one row)."""
    lines = ["| variable | read by | meaning |", "|---|---|---|"]
    launch = [v.name for v in VARIABLES.values() if v.reader == _TORCHRUN]
    for v in VARIABLES.values():
        if v.reader != _TORCHRUN:
            lines.append(f"| `{v.name}` | {v.reader} | {v.doc} |")
        elif v.name == launch[0]:
            names = ", ".join(f"`{n}`" for n in launch)
            lines.append(f"| {names} | {_TORCHRUN} | set by torchrun: the tensor-parallel group; "
                         "checked by tgraph.nn.distributed |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
