"""Rule files run code, so what they may name is limited: a ``class:`` path resolves only inside
``tgraph``, the modules the file (or the caller) lists under ``modules``, and the module map;
anything else is refused by name before it is imported. The ``tgraph rules`` dry run only
matches: it never calls ``check_kwargs``, ``from_module`` or ``configure``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tgraph.cli import main
from tgraph.errors import ConfigError
from tgraph.rules import apply_rules, load_rules
from tgraph.testing import make_tiny_hf_model

# A module that records being imported and its hooks being called, written next to the rules.
PLANTED = '''
import os
from tgraph.rules import LinearWithBackend

open(os.environ["PLANTED_LOG"], "a").write("imported\\n")


class Loud(LinearWithBackend):
    @classmethod
    def check_kwargs(cls, **kwargs):
        open(os.environ["PLANTED_LOG"], "a").write("check_kwargs\\n")

    @classmethod
    def from_module(cls, module, **kwargs):
        open(os.environ["PLANTED_LOG"], "a").write("from_module\\n")
        return super().from_module(module)
'''


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``planted_mod.py`` in the working directory (which ``python -m`` puts on ``sys.path``);
    returns the log file it writes to."""
    name = "planted_mod"
    (tmp_path / f"{name}.py").write_text(PLANTED)
    log = tmp_path / "log.txt"
    log.write_text("")
    monkeypatch.setenv("PLANTED_LOG", str(log))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield log
    sys.modules.pop(name, None)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("field", ["match", "replace"])
def test_a_rule_file_naming_an_unlisted_module_is_refused_before_import(planted: Path,
                                                                        field: str) -> None:
    rule = ("- match: {class: planted_mod.Loud}\n" if field == "match" else
            "- match: {name: x}\n  replace: {class: planted_mod.Loud}\n")
    rules = _write(planted.parent / "rules.yaml", rule)
    with pytest.raises(ConfigError, match=rf"rule 0\.{field}\.class: class 'planted_mod\.Loud' "
                       r"is outside the modules rules may use \('tgraph'\)"):
        load_rules(rules)
    assert planted.read_text() == ""  # never imported
    assert "planted_mod" not in sys.modules


def test_parsed_rules_from_a_setting_are_limited_like_a_file(planted: Path) -> None:
    with pytest.raises(ConfigError, match="outside the modules rules may use"):
        load_rules([{"match": {"class": "planted_mod.Loud"}}], any_module=False)
    assert planted.read_text() == ""


def test_a_module_the_file_lists_may_be_named(planted: Path) -> None:
    rules = _write(planted.parent / "rules.yaml",
                   "modules: [planted_mod]\n"
                   "rules:\n"
                   "- match: {name: x}\n"
                   "  replace: {class: planted_mod.Loud, kwargs: {backend: cublas}}\n")
    parsed = load_rules(rules)
    assert parsed[0].replace_class.__name__ == "Loud"
    assert planted.read_text().split() == ["imported", "check_kwargs"]


def test_a_module_the_caller_names_may_be_used(planted: Path) -> None:
    rules = _write(planted.parent / "rules.yaml", "- match: {class: planted_mod.Loud}\n")
    assert load_rules(rules, modules=["planted_mod"])[0].match_class.__name__ == "Loud"


@pytest.mark.parametrize("modules, fragment", [
    ("planted_mod", "rules.modules: expected a list of dotted module names"),
    ("[os; rm]", "rules.modules: expected a list of dotted module names"),
])
def test_a_bad_modules_list_is_refused(tmp_path: Path, modules: str, fragment: str) -> None:
    rules = _write(tmp_path / "rules.yaml", f"modules: {modules}\nrules: []\n")
    with pytest.raises(ConfigError, match=fragment):
        load_rules(rules)


def test_tgraph_classes_need_no_listing(tmp_path: Path) -> None:
    rules = _write(tmp_path / "rules.yaml",
                   "- match: {name: x, class: tgraph.layers.linear.LinearBase}\n"
                   "  replace: {class: tgraph.rules.LinearWithBackend}\n")
    assert load_rules(rules)[0].replace_class.__name__ == "LinearWithBackend"
    # A root is matched by whole components: 'tgraphx' is not inside 'tgraph'.
    _write(tmp_path / "bad.yaml", "- match: {class: tgraphx.Thing}\n")
    with pytest.raises(ConfigError, match="class 'tgraphx.Thing' is outside"):
        load_rules(tmp_path / "bad.yaml")


def test_the_module_map_may_be_named_by_its_stem(planted: Path) -> None:
    module_map = _write(planted.parent / "my_models.py",
                        "from tgraph.rules import LinearWithBackend\n\n\n"
                        "class MapLinear(LinearWithBackend):\n    pass\n")
    rules = _write(planted.parent / "rules.yaml",
                   "- match: {name: x}\n  replace: {class: my_models.MapLinear}\n")
    with pytest.raises(ConfigError, match="outside the modules"):
        load_rules(rules)
    parsed = load_rules(rules, module_map=module_map)
    assert parsed[0].replace_class.__name__ == "MapLinear"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("trust-llama"), seed=3,
                              tie_word_embeddings=False)


def test_the_dry_run_calls_no_hook(planted: Path, llama_dir: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    rules = _write(planted.parent / "rules.yaml",
                   "modules: [planted_mod]\n"
                   "rules:\n"
                   "- match: {name: '_proj$'}\n"
                   "  replace: {class: planted_mod.Loud, kwargs: {backend: cublas}}\n")
    assert main(["rules", "--model", str(llama_dir), "--rules", str(rules)]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("model.layers.0.mlp.down_proj "))
    assert "rule 0: name~'_proj$' -> Loud(backend='cublas')" in line
    # Imported (the file listed it), but neither check_kwargs nor from_module ran.
    assert planted.read_text().split() == ["imported"]


def test_match_only_leaves_the_model_alone(planted: Path) -> None:
    from tests.test_rules import tree

    model = tree()
    up = model.get_submodule("blocks.0.mlp.up_proj")
    rules = load_rules([{"match": {"name": "_proj$"},
                         "replace": {"class": "planted_mod.Loud", "kwargs": {"device": "cpu:1"}}}],
                       hooks=False)
    result = dict(apply_rules(model, rules, replace=False))
    assert result["blocks.0.mlp.up_proj"] == 0
    assert model.get_submodule("blocks.0.mlp.up_proj") is up and up.placement is None
    assert planted.read_text().split() == ["imported"]


def test_inline_rules_in_llm_settings_are_limited(planted: Path, llama_dir: Path) -> None:
    from tgraph.runtime.llm import LLM

    with pytest.raises(ConfigError, match="outside the modules rules may use"):
        LLM(llama_dir, device="cpu", dtype="float32", graph="eager", max_model_len=32,
            num_blocks=8, **{"llm.engine.rules": [{"match": {"class": "planted_mod.Loud"}}]})
    assert planted.read_text() == ""
