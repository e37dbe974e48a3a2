"""Compiling ``kernels.c`` once per machine into the cache directory.

The library is built by the system C compiler (``cc``, else ``gcc``) with ``-O3 -march=native``
(again without ``-march=native`` where that fails) and OpenMP, into
``TGRAPH_CACHE_DIR/native/<key>/libtgraph_cpu.so``: the key hashes the source, the flags, the
compiler's version, the CPU's features and torch's library folder, so a changed source or another
machine sharing the cache builds its own. The compiler writes into a temporary folder beside it
and the finished file is moved into place in one ``os.replace``: a concurrent process sees no
file or a whole one, never half of one.

OpenMP is linked against the ``libgomp`` torch bundles when ``torch/lib`` has one (the objects
are compiled with ``-fopenmp`` and linked without the system's ``-lgomp``), so the process keeps a
single OpenMP thread pool for torch's kernels and these.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from tgraph import envs

__all__ = ["LIBRARY_NAME", "SOURCE", "build", "find_compiler"]

logger = logging.getLogger("tgraph.kernels")

SOURCE = Path(__file__).with_name("kernels.c")
LIBRARY_NAME = "libtgraph_cpu.so"
_COMPILE = ("-std=c11", "-O3", "-fPIC", "-fopenmp", "-Wall")
_ARCH = "-march=native"
_TIMEOUT_S = 300  # one compile of a small file: far less, unless the machine is stalled


def find_compiler() -> str | None:
    """The system C compiler's path (``cc``, else ``gcc``), or ``None``."""
    for name in ("cc", "gcc"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def _torch_gomp_dir() -> Path | None:
    """torch's library folder when it bundles ``libgomp.so.1``."""
    lib = Path(torch.__file__).parent / "lib"
    return lib if (lib / "libgomp.so.1").is_file() else None


def _link_flags(gomp_dir: Path | None) -> list[str]:
    if gomp_dir is None:
        return ["-fopenmp", "-lm"]  # the system's OpenMP runtime
    return [f"-L{gomp_dir}", "-l:libgomp.so.1", f"-Wl,-rpath,{gomp_dir}", "-lm"]


def _cpu_features() -> str:
    """The CPU's feature line (``flags`` on x86, ``Features`` on ARM), so that a library built
    with ``-march=native`` is never loaded on a CPU that lacks what it uses."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor()
    for line in text.splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            return line
    return platform.processor()


def _version(cc: str) -> str:
    done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60,
                          check=True)
    return done.stdout


def _compile(cc: str, flags: Sequence[str], link: Sequence[str], target: Path) -> None:
    """``kernels.c`` into ``target`` (raises on failure); the object and the library are made
    in a temporary folder beside ``target`` and moved into place whole."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        obj, lib = Path(tmp) / "kernels.o", Path(tmp) / LIBRARY_NAME
        for cmd in ([cc, *flags, "-c", str(SOURCE), "-o", str(obj)],
                    [cc, "-shared", str(obj), *link, "-o", str(lib)]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(lib, target)


def build(cache_dir: Path | None = None, compiler: str | None = None,
          extra_flags: Sequence[str] = ()) -> Path | None:
    """The built library's path, compiled now unless the cache has it.

    Args:
        cache_dir: the cache root (default ``TGRAPH_CACHE_DIR``).
        compiler: the C compiler (default :func:`find_compiler`).
        extra_flags: more compile flags (part of the cache key), e.g. ``-mno-avx512f`` to build
            the portable loops on an AVX-512 machine.
    Returns:
        The path, or ``None`` after one warning saying what failed (no compiler, a failed
        build): the CPU backend then keeps torch's kernels.
    """
    cc = compiler or find_compiler()
    if cc is None:
        logger.warning("tgraph: no C compiler (cc or gcc) found; the CPU backend runs torch's "
                       "kernels instead of its native ones")
        return None
    root = (cache_dir if cache_dir is not None else envs.TGRAPH_CACHE_DIR) / "native"
    gomp_dir = _torch_gomp_dir()
    link = _link_flags(gomp_dir)
    try:
        version = _version(cc)
        source = SOURCE.read_bytes()
    except (OSError, subprocess.SubprocessError) as err:
        logger.warning("tgraph: the native CPU kernels cannot be built (%s); the CPU backend "
                       "runs torch's kernels", err)
        return None
    failure = ""
    for arch in ((_ARCH,), ()):
        flags = [*_COMPILE, *arch, *extra_flags]
        key = hashlib.sha256(b"\0".join(
            [source, " ".join(flags).encode(), " ".join(link).encode(), version.encode(),
             _cpu_features().encode(), platform.machine().encode()])).hexdigest()[:20]
        target = root / key / LIBRARY_NAME
        if target.is_file():
            return target
        try:
            _compile(cc, flags, link, target)
            return target
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            failure = str(err)
            logger.debug("tgraph: native CPU kernels with %s: %s", flags, err)
    logger.warning("tgraph: building the native CPU kernels failed (%s); the CPU backend runs "
                   "torch's kernels", failure)
    return None
