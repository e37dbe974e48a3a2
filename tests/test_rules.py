"""Tests of injection rules (``tgraph.rules``): loading and validation, matching, replacement,
the linear-backend replacement on a real model, and the ``tgraph rules`` dry run."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tgraph.cli import main
from tgraph.errors import ConfigError
from tgraph.layers.linear import ColumnParallelLinear, LinearBase
from tgraph.nn.module import Module, ModuleList, Parameter
from tgraph.rules import LinearWithBackend, apply_rules, format_matches, load_rules
from tgraph.testing import make_tiny_hf_model, run_greedy

LWB = "tgraph.rules.LinearWithBackend"
HERE = __name__  # importable path of this module, for classes defined below


# ------------------------------------------------------------------------------ tiny trees
class Box(Module):
    """A container with named children."""

    def __init__(self, **children: Module) -> None:
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


class Configurable(Module):
    """A module that a ``replace: default`` rule can configure."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0
        self.mode = "plain"

    def configure(self, scale: float, mode: str = "plain") -> None:
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        self.scale, self.mode = scale, mode


class Wrapper(Module):
    """A replacement that keeps the original module as its child (like an adapter)."""

    def __init__(self, inner: Module) -> None:
        super().__init__()
        self.inner = inner

    @classmethod
    def from_module(cls, module: Module) -> Wrapper:
        return cls(module)


def lin(out_f: int = 4, in_f: int = 3, bias: bool = False) -> LinearBase:
    return LinearBase(torch.randn(out_f, in_f), torch.randn(out_f) if bias else None)


def tree() -> Box:
    """``blocks.{0,1}.{attn.q_proj, mlp.{up_proj, down_proj}}``, a ``head`` (column-parallel)
    and a configurable ``norm``."""
    blocks = ModuleList(
        Box(attn=Box(q_proj=lin()), mlp=Box(up_proj=lin(bias=True), down_proj=lin()))
        for _ in range(2))
    return Box(blocks=blocks, head=ColumnParallelLinear.tied(Parameter(torch.randn(5, 4))),
               norm=Configurable())


def matched(results: list[tuple[str, int | None]]) -> dict[str, int | None]:
    return dict(results)


# ---------------------------------------------------------------------------------- matching
def test_first_match_wins_and_params_are_shared() -> None:
    model = tree()
    old_up = model.get_submodule("blocks.0.mlp.up_proj")
    rules = load_rules([
        {"match": {"name": r"up_proj$"},
         "replace": {"class": LWB, "kwargs": {"backend": "cublas"}}},
        {"match": {"name": r"_proj$"}, "replace": {"class": LWB, "kwargs": {"backend": "triton"}}},
    ])
    result = matched(apply_rules(model, rules))
    assert result["blocks.0.mlp.up_proj"] == 0 and result["blocks.1.mlp.up_proj"] == 0
    assert result["blocks.0.mlp.down_proj"] == 1 and result["blocks.1.attn.q_proj"] == 1
    assert result["head"] is None and result["blocks.0"] is None
    new_up = model.get_submodule("blocks.0.mlp.up_proj")
    assert isinstance(new_up, LinearWithBackend) and new_up.backend == "cublas"
    assert model.get_submodule("blocks.0.mlp.down_proj").backend == "triton"
    # The very same Parameters: nothing was copied or reloaded.
    assert new_up.weight is old_up.weight and new_up.bias is old_up.bias
    assert new_up.in_features == 3 and new_up.out_features == 4


def test_recursive_false_fences_the_subtree() -> None:
    model = tree()
    rules = load_rules([
        {"match": {"name": r"^blocks\.0$"}, "recursive": False},
        {"match": {"name": r"_proj$"}, "replace": {"class": LWB}},
    ])
    result = matched(apply_rules(model, rules))
    assert result["blocks.0"] == 0
    assert not any(name.startswith("blocks.0.") for name in result)  # never visited
    assert type(model.get_submodule("blocks.0.mlp.up_proj")) is LinearBase
    assert isinstance(model.get_submodule("blocks.1.mlp.up_proj"), LinearWithBackend)


def test_children_of_a_replaced_module_are_visited_unless_not_recursive() -> None:
    for recursive, expect_configured in ((True, True), (False, False)):
        model = tree()
        model.get_submodule("blocks.0.attn.q_proj").extra = Configurable()
        rules = load_rules([
            {"match": {"name": r"q_proj$"}, "replace": {"class": LWB}, "recursive": recursive},
            {"match": {"name": r"extra$"}, "replace": {"class": "default",
                                                       "kwargs": {"scale": 3.0}}},
        ])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rule 1 matches nothing when not recursive
            result = matched(apply_rules(model, rules))
        new = model.get_submodule("blocks.0.attn.q_proj")
        assert isinstance(new, LinearWithBackend)
        assert ("blocks.0.attn.q_proj.extra" in result) is expect_configured
        assert (new.extra.scale == 3.0) is expect_configured


def test_name_and_class_must_both_match() -> None:
    model = tree()
    model.blocks[1].attn.o_proj = ColumnParallelLinear.tied(Parameter(torch.randn(3, 4)))
    rules = load_rules([{"match": {"name": r"_proj$",
                                   "class": "tgraph.layers.linear.ColumnParallelLinear"},
                         "replace": {"class": LWB}}])
    result = matched(apply_rules(model, rules))
    # o_proj: name and class; head: class only; q_proj etc.: name only.
    assert [n for n, i in result.items() if i == 0] == ["blocks.1.attn.o_proj"]
    assert model.get_submodule("blocks.1.attn.o_proj").source_class == "ColumnParallelLinear"
    assert type(model.head) is ColumnParallelLinear


def test_default_with_kwargs_calls_configure() -> None:
    model = tree()
    norm = model.norm
    rules = load_rules([{"match": {"name": "^norm$"},
                         "replace": {"class": "default", "kwargs": {"scale": 2.5, "mode": "x"}}}])
    assert matched(apply_rules(model, rules))["norm"] == 0
    assert model.norm is norm and (norm.scale, norm.mode) == (2.5, "x")


def test_default_short_form_keeps_the_module() -> None:
    model = tree()
    head = model.head
    result = matched(apply_rules(model, load_rules([{"match": {"name": "head"},
                                                     "replace": "default"}])))
    assert result["head"] == 0 and model.head is head


def test_default_reconfigures_a_linear_backend() -> None:
    model = tree()
    apply_rules(model, load_rules([{"match": {"name": "_proj$"},
                                    "replace": {"class": LWB, "kwargs": {"backend": "cublas"}}}]))
    apply_rules(model, load_rules([{"match": {"class": LWB, "name": r"^blocks\.1\."},
                                    "replace": {"class": "default",
                                                "kwargs": {"backend": "triton"}}}]))
    assert model.get_submodule("blocks.0.mlp.up_proj").backend == "cublas"
    assert model.get_submodule("blocks.1.mlp.up_proj").backend == "triton"


def test_attributes_of_the_linear_are_kept() -> None:
    model = tree()
    up = model.get_submodule("blocks.0.mlp.up_proj")
    up.output_sizes = [2, 2]
    apply_rules(model, load_rules([{"match": {"name": "up_proj$"}, "replace": {"class": LWB}}]))
    assert model.get_submodule("blocks.0.mlp.up_proj").output_sizes == [2, 2]
    assert model.head.rank == 0  # untouched module keeps its own


def test_wrapping_replacement_is_not_re_matched() -> None:
    model = tree()
    old = model.get_submodule("blocks.0.attn.q_proj")
    rules = load_rules([{"match": {"class": "tgraph.layers.linear.LinearBase",
                                   "name": r"blocks\.0\.attn"},
                         "replace": {"class": f"{HERE}.Wrapper"}}])
    result = apply_rules(model, rules)  # would recurse forever if inner were matched again
    new = model.get_submodule("blocks.0.attn.q_proj")
    assert isinstance(new, Wrapper) and new.inner is old
    assert [n for n, i in result if i == 0] == ["blocks.0.attn.q_proj"]


def test_no_match_warns_and_report_lists_rules() -> None:
    model = tree()
    rules = load_rules([{"match": {"name": "^head$"}},
                        {"match": {"name": "nothing_has_this_name"}}])
    with pytest.warns(UserWarning, match=r"rule 1 .*matched no module") as record:
        result = apply_rules(model, rules)
    assert len(record) == 1  # rule 0 matched, so only rule 1 warns
    text = format_matches(result, rules)
    assert "rule 0: name~'^head$' -> default()" in text
    assert any(line.startswith("blocks.0.mlp.up_proj") and line.endswith("-")
               for line in text.splitlines())


# ---------------------------------------------------------------------------------- errors
ERROR_CASES: list[tuple[Any, str]] = [
    ({"match": {"name": "x"}}, "expected a list of rules"),
    ([["not", "a", "mapping"]], "rule 0: expected a mapping"),
    ([{"match": {"name": "a"}}, {"match": {"name": "b"}, "replce": {}}], "rule 1.replce: unknown"),
    ([{"replace": {"class": LWB}}], "rule 0.match: missing"),
    ([{"match": {}}], "rule 0.match: empty"),
    ([{"match": {"nme": "x"}}], "rule 0.match.nme: unknown key"),
    ([{"match": {"name": "("}}], "rule 0.match.name: invalid regex"),
    ([{"match": {"name": 3}}], "rule 0.match.name: expected a regex"),
    ([{"match": {"class": "no_such_pkg.Thing"}}], "rule 0.match.class: cannot import"),
    ([{"match": {"class": "tgraph.layers.linear.Nope"}}], "rule 0.match.class: module "
                                                          "'tgraph.layers.linear' has no 'Nope'"),
    ([{"match": {"class": "tgraph.rules.load_rules"}}], "rule 0.match.class: 'tgraph.rules.load"
                                                        "_rules' is a function, not a class"),
    ([{"match": {"class": "Module"}}], "rule 0.match.class: expected an importable class path"),
    ([{"match": {"name": "x"}, "replace": {"class": "tgraph.nope.Linear"}}],
     "rule 0.replace.class: module 'tgraph' has no 'nope.Linear'"),
    ([{"match": {"name": "x"}, "replace": {"class": "tgraph.nn.module.ModuleList"}}],
     "rule 0.replace.class: 'tgraph.nn.module.ModuleList' has no from_module"),
    ([{"match": {"name": "x"}, "replace": {"klass": LWB}}], "rule 0.replace.klass: unknown key"),
    ([{"match": {"name": "x"}, "replace": {"class": LWB, "kwargs": {"bakend": "cublas"}}}],
     "rule 0.replace.kwargs: LinearWithBackend.from_module does not accept {'bakend'"),
    ([{"match": {"name": "x"}, "replace": {"class": LWB, "kwargs": {"backend": "cutlass"}}}],
     "rule 0.replace.kwargs: backend must be one of ['cublas', 'triton'], got 'cutlass'"),
    ([{"match": {"name": "x"}, "replace": {"class": LWB, "kwargs": ["backend"]}}],
     "rule 0.replace.kwargs: expected a mapping"),
    ([{"match": {"class": "tgraph.nn.module.ModuleList"},
       "replace": {"class": "default", "kwargs": {"scale": 2}}}],
     "rule 0.replace.kwargs: 'default' keeps the module and passes kwargs to its configure(), "
     "but ModuleList has none"),
    ([{"match": {"class": "tgraph.layers.linear.LinearBase"},
       "replace": {"class": "default", "kwargs": {"quant": "int2"}}}],
     "rule 0.replace.kwargs: quant must be one of ['kernel', 'reference', 'dense'], got 'int2'"),
    ([{"match": {"class": f"{HERE}.Configurable"},
       "replace": {"class": "default", "kwargs": {"factor": 2}}}],
     "rule 0.replace.kwargs: Configurable.configure does not accept {'factor': 2}"),
    ([{"match": {"class": f"{HERE}.Configurable"},
       "replace": {"class": "default", "kwargs": {"mode": "x"}}}],  # scale is required
     "rule 0.replace.kwargs: Configurable.configure does not accept"),
    ([{"match": {"name": "x"}, "recursive": "no"}], "rule 0.recursive: expected true or false"),
    ([{"match": {"name": "x"}, "replace": {"class": "default", "kwargs": {"device": "cuda:99"}}}],
     "rule 0.replace.kwargs.device: device 'cuda:99' does not exist"),
    ([{"match": {"name": "x"}},
      {"match": {"name": "y"}, "replace": {"class": LWB, "kwargs": {"backend": "cublas",
                                                                    "device": "gpu"}}}],
     "rule 1.replace.kwargs.device: invalid device 'gpu'"),
    ([{"match": {"class": "tgraph.layers.attention.Attention"},
       "replace": {"class": "default", "kwargs": {"backend": "flash"}}}],
     "rule 0.replace.kwargs: attention backend must be one of ['sdpa', 'triton'], got 'flash'"),
]


@pytest.mark.parametrize("rules,message", ERROR_CASES,
                         ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(ERROR_CASES)])
def test_load_errors_name_rule_and_field(rules: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_rules(rules)
    assert message in str(info.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read rules file"):
        load_rules(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- match: {name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_rules(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("- match: {name: a}\n- match: {name: b}\n  recursve: false\n")
    with pytest.raises(ConfigError, match=r"rule 1\.recursve: unknown key"):
        load_rules(typo)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# no rules yet\n")
    assert load_rules(empty) == []


def test_apply_errors_name_rule_field_and_module() -> None:
    # configure() missing: known only when the rule meets a module (match by name only).
    rules = load_rules([{"match": {"name": "^blocks$"},
                         "replace": {"class": "default", "kwargs": {"scale": 2}}}])
    with pytest.raises(ConfigError, match=r"rule 0\.replace\.kwargs: .*'blocks' "
                                          r"\(ModuleList\) has none"):
        apply_rules(tree(), rules)
    # configure() itself refuses the value.
    rules = load_rules([{"match": {"name": "^norm$"},
                         "replace": {"class": "default", "kwargs": {"scale": -1}}}])
    with pytest.raises(ConfigError, match=r"rule 0\.replace\.kwargs: configuring 'norm': "
                                          r"scale must be positive"):
        apply_rules(tree(), rules)
    # from_module refuses the module type.
    rules = load_rules([{"match": {"name": "^blocks$"}}, {"match": {"name": "^norm$"},
                                                          "replace": {"class": LWB}}])
    with pytest.raises(ConfigError, match=r"rule 1\.replace\.class: LinearWithBackend\.from_module"
                                          r" on 'norm' \(Configurable\): .*replaces a LinearBase"):
        apply_rules(tree(), rules)


# ------------------------------------------------------------------------- a real model
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("rules-llama"), seed=3,
                              tie_word_embeddings=False)


def _load(path: Path) -> Any:
    from tgraph.models import load_model

    model = load_model(path, device="cpu", dtype="float32", max_model_len=32, block_size=4)
    model.allocate_kv_cache(32)
    return model


def _ops(model: Any) -> set[str]:
    return {node.op for engine in model.engines.values() for node in engine.net.nodes}


def test_linear_backend_rule_gives_same_logits(llama_dir: Path) -> None:
    prompts = [[1, 5, 9, 22, 7], [3, 4, 100]]
    base = _load(llama_dir)
    ref = run_greedy(base, prompts, 2)

    model = _load(llama_dir)
    rules = load_rules([{"match": {"name": "_proj$"},
                         "replace": {"class": LWB, "kwargs": {"backend": "cublas"}}}])
    result = apply_rules(model, rules)
    replaced = [n for n, i in result if i == 0]
    assert len(replaced) == 3 * 4  # qkv, o, gate_up, down in each of 3 layers; not lm_head
    got = run_greedy(model, prompts, 2)

    # Two different graphs: the rule's linears reach the engine as matmuls.
    assert "matmul" in _ops(model) and "matmul" not in _ops(base)
    # fp32 on CPU: the same products summed in possibly different order -> 1e-5 of logit scale.
    for a, b in zip(got.prefill_logits + got.step_logits, ref.prefill_logits + ref.step_logits):
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= 1e-5 * scale
    assert got.generated == ref.generated


# ------------------------------------------------------------------------------------- CLI
def test_cli_dry_run(llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                     monkeypatch: pytest.MonkeyPatch) -> None:
    import tgraph.rules

    devices: set[str] = set()
    real_apply = tgraph.rules.apply_rules

    def spy(model: Module, rules: Any, **kwargs: Any) -> Any:
        devices.update(p.data.device.type for p in model.parameters() if p.data is not None)
        return real_apply(model, rules, **kwargs)

    monkeypatch.setattr(tgraph.rules, "apply_rules", spy)
    rules_file = Path(__file__).parents[1] / "configs" / "rules" / "example.yaml"
    model_dir = llama_dir
    assert main(["rules", "--model", str(model_dir), "--rules", str(rules_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    by_module = {line.split()[0]: line for line in lines}
    assert "rule 1:" in by_module["model.layers.0.self_attn.qkv_proj"]
    assert "backend='cublas'" in by_module["model.layers.0.self_attn.o_proj"]
    assert "rule 2:" in by_module["model.layers.2.mlp.down_proj"]
    assert "rule 0:" in by_module["lm_head"]
    assert by_module["model.norm"].endswith("-")
    assert not any(line.startswith("WARNING") for line in lines)
    assert devices == {"meta"}  # a dry run: the model holds no weight data

    unused = tmp_path / "unused.yaml"
    unused.write_text("- match: {name: '^no_such_module$'}\n")
    assert main(["rules", "--model", str(model_dir), "--rules", str(unused)]) == 0
    assert "WARNING: injection rule 0" in capsys.readouterr().out


def test_device_kwarg_places_replaced_and_kept_modules() -> None:
    model = tree()
    rules = load_rules([
        {"match": {"name": r"^blocks\.1$"}, "replace": {"class": "default",
                                                        "kwargs": {"device": "cpu:1"}}},
        {"match": {"name": r"up_proj$"}, "replace": {"class": LWB, "kwargs": {
            "backend": "cublas", "device": "cpu:2"}}},
    ])
    assert rules[0].kwargs == {} and rules[0].device == "cpu:1"
    apply_rules(model, rules)
    assert model.blocks[1].placement == "cpu:1"
    assert model.blocks[1].attn.q_proj.placement == "cpu:1"  # a child follows its parent
    up = model.get_submodule("blocks.1.mlp.up_proj")
    assert isinstance(up, LinearWithBackend) and up.backend == "cublas"
    assert up.placement == "cpu:2"  # a rule of its own wins
    assert model.blocks[0].placement == "cpu:0" and model.placement == "cpu:0"  # the root's


def test_no_device_rule_leaves_modules_unplaced() -> None:
    model = tree()
    apply_rules(model, load_rules([{"match": {"name": "_proj$"}, "replace": {"class": LWB}}]))
    assert all(m.placement is None for m in model.modules())


def test_cli_dry_run_of_a_gpu_rule_file(llama_dir: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    # Checked for spelling only: the file is meant for a 2-GPU machine, this may have none.
    rules_file = Path(__file__).parents[1] / "configs" / "rules" / "two_gpus.yaml"
    assert main(["rules", "--model", str(llama_dir), "--rules", str(rules_file)]) == 0
    out = capsys.readouterr().out
    norm = next(line for line in out.splitlines() if line.startswith("model.norm "))
    assert "rule 1: name~" in norm and "device='cuda:1'" in norm
    # The tiny model has 3 layers: rule 0 (layers 8-15) matches nothing, and says so.
    assert "WARNING: injection rule 0" in out


def test_cli_bad_rules_fail_before_the_model(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("- match: {name: '('}\n")
    # The model dir does not even exist: the rule error must come first.
    assert main(["rules", "--model", str(tmp_path / "none"), "--rules", str(bad)]) == 2
    assert "rule 0.match.name: invalid regex" in capsys.readouterr().err


def test_rules_through_llm_settings_and_cli(llama_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from tgraph.cli import main
    from tgraph.runtime.llm import LLM
    from tgraph.runtime.sampling_params import SamplingParams

    rules = tmp_path / "cublas.yaml"
    rules.write_text("- match: {name: '_proj$'}\n"
                     "  replace: {class: tgraph.rules.LinearWithBackend,"
                     " kwargs: {backend: cublas}}\n")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[1, 5, 9, 22], [3, 4]]
    base = LLM(llama_dir, device="cpu", max_model_len=32, num_blocks=16)
    ruled = LLM(llama_dir, device="cpu", max_model_len=32, num_blocks=16,
                **{"llm.engine.rules": str(rules)})
    assert isinstance(ruled.model.model.layers[0].mlp.down_proj, LinearWithBackend)
    assert [o.token_ids for o in ruled.generate(prompts, params)] == \
        [o.token_ids for o in base.generate(prompts, params)]
    bad = tmp_path / "bad.yaml"
    bad.write_text("- match: {name: '('}\n")
    assert main(["generate", "--model", str(llama_dir), "--prompt", "x", "--rules", str(bad)]) == 2
    assert "rule 0.match.name" in capsys.readouterr().err
