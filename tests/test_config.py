"""Tests of engine settings: defaults, user file, overrides, validation, immutability."""
from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest

from tgraph import tuning
from tgraph.config import (
    SCHEMA,
    Field,
    Settings,
    default_settings_path,
    load_settings,
    main,
    tuning_of,
)
from tgraph.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, data, name: str = "user.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def leaves(tree, prefix=""):
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            yield from leaves(value, path)
        else:
            yield path


# ------------------------------------------------------------------------------------- defaults
def test_packaged_defaults_equal_repo_config():
    packaged = default_settings_path()
    assert packaged.parent.name == "tgraph"
    assert packaged.read_bytes() == (REPO / "configs" / "config.json").read_bytes()


def test_defaults_cover_schema_exactly():
    # The JSON defaults give every setting but the kernel tuning, whose defaults are the
    # dataclasses' (tgraph.tuning).
    defaults = json.loads(default_settings_path().read_text())
    defaults["llm"]["engine"]["tuning"] = tuning.to_dict(tuning.Tuning())
    assert sorted(leaves(defaults)) == sorted(leaves(SCHEMA))
    sections = SCHEMA["llm"].values()
    assert all(isinstance(field, Field) for section in sections
               for name, field in section.items() if name != "tuning")
    assert all(isinstance(SCHEMA["llm"]["engine"]["tuning"][k], dict)
               for k in ("gemv", "decode_attention", "lora", "prefetch"))


def test_default_values():
    s = load_settings()
    assert s.llm.engine.graph == "static" and s.llm.engine.cuda_graph is True
    assert s.llm.engine.batch_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert s.llm.engine.prefill_graph_tokens == 4096
    assert s.llm.engine.disabled_passes == () and s.llm.engine.rules is None
    assert s.llm.cache.block_size == 16 and s.llm.cache.num_blocks is None
    assert s.llm.cache.gpu_memory_utilization == 0.9
    assert s.llm.scheduler.max_num_seqs == 64 and s.llm.scheduler.max_num_batched_tokens == 4096
    assert s.get("llm.model.dtype") == "auto" and s.get("llm.model.device") == "auto"
    tree = s.to_dict()
    assert tree["llm"]["engine"].pop("tuning") == tuning.to_dict(tuning.Tuning())
    assert tree == json.loads(default_settings_path().read_text())
    assert tuning_of(s) == tuning.Tuning()


# ---------------------------------------------------------------------------- merge / override
def test_user_file_deep_merges(tmp_path):
    path = write(tmp_path, {"llm": {"engine": {"graph": "eager"}, "cache": {"num_blocks": 512}}})
    s = load_settings(path)
    assert s.llm.engine.graph == "eager" and s.llm.cache.num_blocks == 512
    assert s.llm.engine.cuda_graph is True and s.llm.cache.block_size == 16  # siblings kept


@pytest.mark.parametrize("override, key, value", [
    ("llm.engine.graph=eager", "llm.engine.graph", "eager"),          # bare word -> string
    ('llm.engine.graph="eager"', "llm.engine.graph", "eager"),        # JSON string
    ("llm.engine.cuda_graph=false", "llm.engine.cuda_graph", False),
    ("llm.cache.num_blocks=null", "llm.cache.num_blocks", None),
    ("llm.cache.num_blocks=100", "llm.cache.num_blocks", 100),
    ("llm.cache.gpu_memory_utilization=1", "llm.cache.gpu_memory_utilization", 1.0),
    ("llm.engine.batch_buckets=[1, 3, 5]", "llm.engine.batch_buckets", (1, 3, 5)),
    ('llm.engine.disabled_passes=["cse"]', "llm.engine.disabled_passes", ("cse",)),
    ("llm.model.device=cuda:1", "llm.model.device", "cuda:1"),
    ("llm.engine.rules=rules/my.json", "llm.engine.rules", "rules/my.json"),
])
def test_override_values(override, key, value):
    assert load_settings(overrides=[override]).get(key) == value


def test_precedence_defaults_file_overrides(tmp_path):
    path = write(tmp_path, {"llm": {"engine": {"graph": "eager", "cuda_graph": False}}})
    s = load_settings(path, overrides=["llm.engine.graph=static", "llm.engine.graph=eager",
                                       "llm.cache.block_size=32"])
    assert s.llm.engine.graph == "eager"  # the later override wins
    assert s.llm.engine.cuda_graph is False and s.llm.cache.block_size == 32
    s = load_settings(path, overrides=["llm.engine.graph=static"])
    assert s.llm.engine.graph == "static"  # override beats file
    s = load_settings(overrides={"llm.engine.cuda_graph": False, "llm.cache": {"block_size": 8}})
    assert s.llm.engine.cuda_graph is False and s.llm.cache.block_size == 8
    assert s.llm.cache.gpu_memory_utilization == 0.9  # a section override merges
    assert load_settings(overrides="llm.engine.graph=eager").llm.engine.graph == "eager"


def test_object_leaf_is_replaced_not_merged():
    s = load_settings(overrides=['llm.engine.rules={"a": 1}', 'llm.engine.rules={"b": 2}'])
    assert s.llm.engine.rules == {"b": 2} and not isinstance(s.llm.engine.rules, Settings)


# -------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("override, expected", [
    ("llm.engine.graph=lazy", r"'llm.engine.graph' = \"lazy\".*one of \"static\", \"eager\""),
    ("llm.engine.cuda_graph=yes", r"'llm.engine.cuda_graph' = \"yes\".*true or false"),
    ("llm.engine.cuda_graph=1", r"'llm.engine.cuda_graph' = 1.*true or false"),
    ("llm.cache.block_size=0", r"'llm.cache.block_size' = 0.*integer >= 1"),
    ("llm.cache.block_size=16.0", r"'llm.cache.block_size' = 16.0.*integer >= 1"),
    ("llm.cache.block_size=null", r"'llm.cache.block_size' = null.*integer >= 1$"),
    ("llm.cache.gpu_memory_utilization=1.5", r"= 1.5.*number in \(0, 1\]"),
    ("llm.engine.batch_buckets=[4, 2]", r"strictly increasing"),
    ("llm.engine.batch_buckets=[]", r"non-empty"),
    ("llm.engine.prefill_graph_tokens=-1", r"'llm.engine.prefill_graph_tokens' = -1.*integer >= 0"),
    ('llm.engine.disabled_passes="cse"', r"a list of strings"),
    ("llm.model.dtype=fp8", r"'llm.model.dtype' = \"fp8\".*\"bfloat16\""),
    ("llm.model.device=tpu", r"'llm.model.device' = \"tpu\".*cuda:<index>"),
    ("llm.engine.rules=3", r"'llm.engine.rules' = 3"),
    ("llm.engine.grpah=eager", r"unknown setting 'llm.engine.grpah'.*mean 'llm.engine.graph'"),
    ("llm.engine.graph.mode=eager", r"'llm.engine.graph' = \{\"mode\": \"eager\"\}"),
    ("llm.engine=eager", r"'llm.engine' must be an object with keys batch_buckets"),
    ("runtime.port=1", r"unknown setting 'runtime'.*the top level has llm"),
    ("llm.engine.graph", r"must look like key.path=value"),
    ("llm..graph=eager", r"dotted path"),
])
def test_bad_overrides(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_settings(overrides=[override])


def test_bad_user_files(tmp_path):
    with pytest.raises(ConfigError, match="settings file .*nope.json' does not exist"):
        load_settings(tmp_path / "nope.json")
    path = write(tmp_path, '{\n  "llm": {\n    "engine": {"graph": "eager",}\n  }\n}')
    with pytest.raises(ConfigError, match="invalid JSON at line 3 column 33"):
        load_settings(path)
    with pytest.raises(ConfigError, match="'<root>' must be an object"):
        load_settings(write(tmp_path, "[1, 2]"))
    path = write(tmp_path, {"llm": {"cache": {"blocksize": 8}}})
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    msg = str(info.value)
    assert str(path) in msg and "'llm.cache.blocksize'" in msg and "'llm.cache.block_size'" in msg
    with pytest.raises(ConfigError, match="'llm.engine.graph' = \"Static\""):
        load_settings(write(tmp_path, {"llm": {"engine": {"graph": "Static"}}}))


def test_config_error_is_value_error():
    with pytest.raises(ValueError):
        load_settings(overrides=["llm.engine.graph=lazy"])


# -------------------------------------------------------------------------------- Settings API
def test_settings_are_immutable():
    s = load_settings()
    with pytest.raises(AttributeError, match="immutable"):
        s.llm = None
    with pytest.raises(AttributeError, match="immutable"):
        s.llm.engine.graph = "eager"
    with pytest.raises(TypeError):
        s.llm.engine._data["graph"] = "eager"  # the stored tree is read-only too
    d = s.to_dict()
    d["llm"]["engine"]["graph"] = "eager"
    d["llm"]["engine"]["batch_buckets"].append(128)
    assert s.llm.engine.graph == "static" and s.llm.engine.batch_buckets[-1] == 64


def test_settings_lookup():
    s = load_settings()
    engine = s.llm.engine
    assert isinstance(engine, Settings) and engine.get("graph") == "static"
    assert s.get("llm.engine") == engine and "graph" in engine
    assert sorted(engine)[0] == "batch_buckets"
    assert s.get("llm.engine.nope", 7) == 7
    with pytest.raises(KeyError, match="no setting 'llm.engine.nope'"):
        s.get("llm.engine.nope")
    with pytest.raises(KeyError, match="no setting 'llm.engine.graph.x'"):
        s.get("llm.engine.graph.x")
    with pytest.raises(AttributeError, match="no setting 'llm.engine.nope'; known: batch_buckets"):
        _ = engine.nope
    assert not hasattr(s, "nope")


def test_settings_copy_pickle_and_equality():
    s = load_settings(overrides=["llm.engine.graph=eager"])
    assert pickle.loads(pickle.dumps(s)) == s
    assert copy.deepcopy(s) is s and copy.copy(s) is s
    assert s != load_settings()
    assert hash(s) == hash(load_settings(overrides=["llm.engine.graph=eager"]))
    assert "eager" in repr(s)


# ------------------------------------------------------------------------------------- tuning
def test_tuning_overrides_build_the_engine_tuning(tmp_path):
    s = load_settings(overrides=[
        "llm.engine.tuning.gemv.tma_weights=false",
        "llm.engine.tuning.gemv.m1_block_n=8",
        'llm.engine.tuning.decode_attention.override={"block_n": 128, "num_warps": 8}',
        'llm.engine.tuning.gemv.overrides=[{"block_m": 16, "n": 2048, "k": 8192, '
        '"config": {"block_n": 64, "block_k": 128, "split_k": 4, "num_warps": 4, '
        '"num_stages": 4}}]',
    ])
    t = tuning_of(s)
    assert t.gemv.tma_weights is False and t.gemv.m1_block_n == 8
    assert t.gemv.m1_stages == 3  # siblings keep their defaults
    assert t.decode_attention.override == tuning.DecodeTiles(128, 8, 3)
    assert t.gemv.override_for((16, 2048, 8192, False, False)) == tuning.GemvConfig(64, 128, 4, 4,
                                                                                    4)
    # A user file may give a partial tuning section too.
    path = write(tmp_path, {"llm": {"engine": {"tuning": {"prefetch": {"l2_fraction": 0.25}}}}})
    t = tuning_of(load_settings(path))
    assert t.prefetch.l2_fraction == 0.25 and t.prefetch.max_rows == 1


@pytest.mark.parametrize("override, expected", [
    ("llm.engine.tuning.gemv.tma=false", "unknown setting 'llm.engine.tuning.gemv.tma'.*"
                                         "has .*tma_weights"),
    ("llm.engine.tuning.gemv.m1_stages=0", "integer >= 1, got 0"),
    ("llm.engine.tuning.gemv.tma_weights=1", "true or false"),
    ("llm.engine.tuning.prefetch.l2_fraction=2", r"number in \(0, 1\]"),
    ('llm.engine.tuning.decode_attention.override={"block_m": 1}', "unknown tuning key"),
    ('llm.engine.tuning.gemv.overrides=[{"n": 0}]', "integer >= 1, got 0"),
    ("llm.engine.tuning.decode_attention.early_kv_max_programs_per_sm=-1", "integer >= 0"),
])
def test_bad_tuning_overrides(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_settings(overrides=[override])


def test_every_tuning_field_has_a_reason_and_is_listed(capsys):
    rows = tuning.describe()
    assert rows and all(doc for _, _, doc in rows)
    main(["--tuning"])
    printed = capsys.readouterr().out
    assert all(key in printed for key, _, _ in rows)
    assert "llm.engine.tuning.gemv.tma_weights = true" in printed


def test_tuning_dataclasses_are_frozen_and_checked():
    t = tuning.Tuning()
    with pytest.raises(AttributeError):
        t.gemv.tma_weights = False  # type: ignore[misc]
    with pytest.raises(ValueError, match="GemvTuning.small_m_max"):
        tuning.GemvTuning(small_m_max=0)


@pytest.mark.parametrize("value", [0, -1, 1.5, "4", True])
def test_cpu_threads_is_a_positive_int_or_null(value):
    with pytest.raises(ConfigError, match="llm.engine.cpu_threads"):
        load_settings(None, {"llm.engine.cpu_threads": value})


def test_cpu_threads_default_is_every_core():
    from tgraph.runtime.llm import cpu_threads

    assert load_settings().llm.engine.cpu_threads is None
    assert load_settings(None, {"llm.engine.cpu_threads": 3}).llm.engine.cpu_threads == 3
    assert cpu_threads(3) == 3
    cores = cpu_threads(None)
    assert cores >= 1 and cpu_threads(None, world_size=cores * 2) == 1
