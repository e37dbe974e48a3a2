"""Environment variables: declared once in tgraph/envs.py, read only through it, listed in the
README, parsed with clear errors; and no package index is named in the repository."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from tgraph import envs
from tgraph.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _python_files() -> list[Path]:
    return sorted((REPO / "tgraph").rglob("*.py"))


def test_only_envs_reads_the_environment():
    readers = []
    for path in _python_files():
        if path.name == "envs.py" and path.parent.name == "tgraph":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "os" and node.attr in ("environ", "getenv", "putenv"):
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module == "os" \
                    and any(a.name in ("environ", "getenv") for a in node.names):
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert readers == [], f"read the environment through tgraph.envs: {readers}"


def test_every_variable_named_in_code_and_scripts_is_declared():
    named = set()
    sources = _python_files() + sorted((REPO / "scripts").glob("*.sh")) + [
        REPO / "tests" / "conftest.py"]
    for path in sources:
        named |= set(re.findall(r"\bTGRAPH_[A-Z_]+\b", path.read_text(encoding="utf-8")))
    assert named - set(envs.VARIABLES) == set()


def test_readme_lists_every_variable():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- envs:begin -->\n", 1)[1].split("<!-- envs:end -->", 1)[0]
    assert block.strip() == envs.markdown_table()


def test_values_are_typed_and_bad_text_is_refused(tmp_path):
    assert envs.get("TGRAPH_PDL", {}) is True
    assert envs.get("TGRAPH_PDL", {"TGRAPH_PDL": "0"}) is False
    assert envs.get("TRITON_INTERPRET", {"TRITON_INTERPRET": "1"}) is True
    assert envs.get("TGRAPH_CACHE_DIR", {"TGRAPH_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert envs.get("TGRAPH_CACHE_DIR", {}) == Path.home() / ".cache" / "tgraph"
    assert envs.get("RANK", {}) is None and envs.get("RANK", {"RANK": "3"}) == "3"
    with pytest.raises(ConfigError, match="TGRAPH_PDL='maybe' is invalid: expected 1 or 0"):
        envs.get("TGRAPH_PDL", {"TGRAPH_PDL": "maybe"})
    with pytest.raises(KeyError, match="not declared in tgraph.envs"):
        envs.get("TGRAPH_NOPE")
    with pytest.raises(AttributeError):
        envs.TGRAPH_NOPE  # noqa: B018


def test_no_package_index_is_named_in_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    pattern = re.compile(r"(--(extra-)?index-url\s+https?://|download\.pytorch\.org|"
                         r"pypi\.org/simple)")
    hits = [f for f in files if (REPO / f).is_file() and f.endswith((".sh", ".py", ".toml",
                                                                      ".md", ".txt", ".cfg"))
            and pattern.search((REPO / f).read_text(encoding="utf-8", errors="replace"))
            and f != "tests/test_envs.py"]
    assert hits == []
