"""The layering of DESIGN.md, checked on the source: no module imports a layer above its own.

Every ``import`` of every module under ``tgraph/`` is parsed (function-level and
``TYPE_CHECKING`` imports included) and resolved to the module it names. Layers, bottom up::

    errors, config, envs, tuning, quant < ir < nn < passes < kernels < engine < io < layers < models
        < runtime, demo, testing (and the package's own ``tgraph/__init__``) < serve
        < bench, cli

An import within one layer, or downward, is fine. The few upward imports that are right by
design are listed in ``ALLOWED`` with the reason.

Also here: ``import tgraph`` stays cheap, and the public names resolve lazily.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tgraph"

# Top-level part of a module name (``tgraph.<part>``) -> its layer, bottom up.
LAYERS: dict[str, int] = {
    # quant: the quantized weight layouts, which op references dequantize.
    "errors": 0, "config": 0, "envs": 0, "tuning": 0, "quant": 0,
    "ir": 1,
    "nn": 2,
    "passes": 3,
    "kernels": 4,
    "engine": 5,
    "io": 6,
    "layers": 7,
    # rules place and replace the modules of a built model: they live beside the models.
    "models": 8, "rules": 8,
    "runtime": 9, "demo": 9, "testing": 9, "": 9,
    # the HTTP server runs on the runtime's engine core; the CLI and benchmarks start it.
    "serve": 10,
    "bench": 11, "cli": 11, "__main__": 11,
}

# (importing module, imported module) pairs that go upward on purpose.
ALLOWED: dict[tuple[str, str], str] = {
    # DESIGN.md's first entry point: ``get_default_net().build_engine()``; the engine is
    # imported inside the method, when it is called.
    ("tgraph.ir.network", "tgraph.engine"): "Network.build_engine",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path) -> set[str]:
    """Every tgraph module ``path`` imports; ``from a import b`` names ``a.b`` when that is a
    module, else ``a``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if is_module(target) else base)
    return {m for m in found if m == "tgraph" or m.startswith("tgraph.")}


def layer_of(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    if part not in LAYERS:
        raise AssertionError(f"{module}: tgraph.{part} has no place in LAYERS; add it (and to "
                             "DESIGN.md's table)")
    return LAYERS[part]


SOURCES = sorted(PACKAGE.rglob("*.py"))


def upward_imports() -> list[tuple[str, str]]:
    found = []
    for path in SOURCES:
        importer = module_name(path)
        for imported in sorted(imported_modules(path)):
            if layer_of(imported) > layer_of(importer) and \
                    not any(imported == t or imported.startswith(t + ".")
                            for (m, t) in ALLOWED if m == importer):
                found.append((importer, imported))
    return found


def test_the_checker_sees_imports_of_every_kind():
    # A checker that resolved nothing would pass any tree: pin what it finds on known files.
    assert "tgraph.engine" in imported_modules(PACKAGE / "ir" / "network.py")  # in a method
    assert "tgraph.nn.functional" in imported_modules(PACKAGE / "layers" / "linear.py")
    assert "tgraph.io.model_config" in imported_modules(PACKAGE / "models" / "registry.py")
    assert layer_of("tgraph.layers.linear") > layer_of("tgraph.io.weights") > \
        layer_of("tgraph.engine") > layer_of("tgraph.kernels.registry")


def test_no_module_imports_upward():
    found = upward_imports()
    assert not found, "upward imports (importer -> imported):\n" + "\n".join(
        f"  {a} -> {b}  ({layer_of(a)} -> {layer_of(b)})" for a, b in found)


def test_every_allowed_exception_is_still_needed():
    for importer, imported in ALLOWED:
        path = ROOT.joinpath(*importer.split("."))
        path = path.with_suffix(".py") if path.with_suffix(".py").is_file() else \
            path / "__init__.py"
        assert any(m == imported or m.startswith(imported + ".")
                   for m in imported_modules(path)), f"{importer} no longer imports {imported}"


# ---- the package's own namespace -----------------------------------------------------------------
def _python(code: str) -> dict:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_import_tgraph_loads_nothing_else():
    got = _python("import json, sys, tgraph\n"
                  "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
                  "('tgraph', 'torch', 'transformers', 'triton'))))")
    assert got == ["tgraph"]


def test_the_serving_api_imports_from_the_package():
    got = _python("import json, sys\n"
                  "from tgraph import LLM, RequestOutput, SamplingParams, StreamEvent\n"
                  "import tgraph.runtime.llm as llm\n"
                  "print(json.dumps([LLM is llm.LLM, RequestOutput is llm.RequestOutput, "
                  "StreamEvent is llm.StreamEvent, SamplingParams.__module__, "
                  "'transformers' in sys.modules]))")
    assert got == [True, True, True, "tgraph.runtime.sampling_params", False]


def test_public_names_resolve_and_are_listed():
    import tgraph

    for name in tgraph.__all__:
        assert getattr(tgraph, name) is not None
        assert name in dir(tgraph)
    assert tgraph.nn.__name__ == "tgraph.nn"
    from tgraph.engine import Engine
    assert tgraph.Engine is Engine
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        tgraph.Nope  # noqa: B018
