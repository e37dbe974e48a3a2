"""No tgraph module imports or reads another module's private (underscore) names: what is shared
is public, so a module's internals can change without breaking another."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_uses_another_modules_private_names():
    found = []
    for path in sorted((REPO / "tgraph").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules = set()  # local names bound to tgraph modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tgraph"):
                for alias in node.names:
                    if _private(alias.name):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} imports "
                                     f"{node.module}.{alias.name}")
                    modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name.split(".")[0] for a in node.names
                            if a.name.startswith("tgraph")}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in modules and _private(node.attr):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} reads "
                             f"{node.value.id}.{node.attr}")
    assert found == []
