"""Networks spread over several devices: placement while recording (``to_device`` copies made
once per value and device), partitioning per device, per-device buffers, input checks, and a
tiny Llama split by injection rules. On CPU, ``cpu:N`` labels stand for devices (they all run on
the one CPU, so results must equal the single-device run exactly); the GPU tests need two GPUs.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import poison_like
from tgraph.errors import ConfigError, EngineInputError, GraphError, RecordError
from tgraph.ir.ops.transfer import normalize_placement, placement_device
from tgraph.nn import functional as F
from tgraph.nn.module import Module, Parameter, apply_placement
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor
from tgraph.passes.partition import Placement, infer_placement, partition
from tgraph.rules import apply_rules, load_rules, predict_placement
from tgraph.testing import make_tiny_hf_model, run_greedy

RULES_DIR = Path(__file__).parents[2] / "configs" / "rules"
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


# ------------------------------------------------------------------------------- labels
def test_labels_are_normalised() -> None:
    assert normalize_placement("cpu") == "cpu:0"
    assert normalize_placement(torch.device("cpu", 1)) == "cpu:1"
    assert normalize_placement("cuda:1") == "cuda:1"
    assert placement_device("cpu:3") == torch.device("cpu")
    assert placement_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="invalid device 'gpu0'"):
        normalize_placement("gpu0")


# ------------------------------------------------------------------- a hand-built network
class Block(Module):
    """``silu(x @ w1.T) + x`` with a norm-like scale: enough ops for two segments."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w = Parameter(torch.randn(width, width, generator=gen) / width ** 0.5)
        self.g = Parameter(torch.rand(width, generator=gen) + 0.5)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        return F.rms_norm(F.silu(F.linear(x, self.w)) + x + bias, self.g)


class Stack(Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = [Block(width, seed=i) for i in range(depth)]
        for i, block in enumerate(self.blocks):
            setattr(self, f"b{i}", block)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x, bias)
        return x


def _record(model: Stack, name: str = "stack"):
    with recording(name) as net:
        x = Tensor("x", torch.float32, ("n", 16))
        bias = Tensor("bias", torch.float32, (16,))
        net.mark_output(model(x, bias), "y")
    return net


def _split_stack() -> Stack:
    model = Stack()
    model.b1.place("cpu:1")
    model.b2.place("cpu:1")
    warned = apply_placement(model, "cpu:0")
    assert warned == []
    return model


def test_copies_are_recorded_once_per_value_and_device() -> None:
    net = _record(_split_stack())
    copies = [n for n in net.nodes if n.op == "to_device"]
    # Block 0's output and the bias cross to cpu:1 once each, though both are read several
    # times there (the residual add, and the bias by two blocks).
    assert [n.attrs["device"] for n in copies] == ["cpu:1", "cpu:1"]
    assert copies[0].inputs[0].producer.op == "rms_norm" and copies[1].inputs[0].name == "bias"
    assert net.annotations["main_device"] == "cpu:0"
    placement = infer_placement(net)
    assert placement is not None and placement.devices == ["cpu:0", "cpu:1"]
    assert placement.of[net.outputs["y"]] == "cpu:1"  # the engine copies it back to cpu:0


def test_work_placed_on_the_cpu_of_a_gpu_model_runs_between_the_graphs() -> None:
    """With a GPU main device, the nodes a rule put on the CPU (experts) form host segments
    (one per run of them): they run between the CUDA graphs, never inside a capture."""
    net = _record(_split_stack())
    cpu = infer_placement(net)
    assert cpu is not None
    rename = {"cpu:0": "cuda:0", "cpu:1": "cpu:0"}
    gpu = Placement("cuda:0", {v: rename[d] for v, d in cpu.of.items()},
                    [rename[d] for d in cpu.devices])
    segments = partition(net, placement=gpu)
    on_cpu = [s for s in segments if s.device == "cpu:0" and s.nodes[0].op != "to_device"]
    assert on_cpu and all(not s.capturable and s.reason == "runs on cpu:0" for s in on_cpu)
    assert sum(len(s.nodes) for s in on_cpu) == sum(
        1 for n in net.nodes if gpu.node_device(n) == "cpu:0" and n.op != "to_device")
    assert all(s.capturable for s in segments if s.device == "cuda:0")
    # A CPU-only model keeps its device segments (nothing is captured there anyway).
    assert not any(s.reason.startswith("runs on") for s in partition(net, placement=cpu))


def test_single_device_networks_carry_no_placement() -> None:
    net = _record(Stack())
    assert "main_device" not in net.annotations and infer_placement(net) is None
    engine = net.build_engine()
    assert engine.placement is None and all(s.device is None for s in engine.segments)
    assert "to_device" not in str(engine)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_split_network_runs_like_the_single_device_one(backend: str) -> None:
    x, bias = torch.randn(5, 16), torch.randn(16)
    ref = _record(Stack()).build_engine(backend=backend).forward({"x": x, "bias": bias})["y"]
    engine = _record(_split_stack()).build_engine(backend=backend)
    text = str(engine)
    assert "devices cpu:0, cpu:1 (main cpu:0)" in text
    assert "[host: to_device cpu:0 -> cpu:1] on cpu:1" in text
    assert "[host: to_device cpu:1 -> cpu:0] on cpu:0" in text
    # One segment per device run, the copies between them in one host segment per direction.
    kinds = [(s.device, s.capturable) for s in engine.segments]
    assert kinds == [("cpu:0", True), ("cpu:1", False), ("cpu:1", True), ("cpu:0", False)]
    assert engine.specs["x"].placement == "cpu:0" and engine.specs["bias"].placement == "cpu:0"
    out = poison_like(ref)
    engine.forward({"x": x, "bias": bias}, {"y": out})
    # Copies are exact and the kernels are the same: equal bit for bit.
    assert torch.equal(out, ref)
    if backend == "triton":  # one arena per device, both planned
        binding = engine._latest
        assert binding is not None and set(binding.memory) == {"cpu:0", "cpu:1"}
        assert all(m.arena_bytes > 0 for m in binding.memory.values())


def test_explicit_copy_and_glue_code_outside_modules() -> None:
    with recording("glue") as net:
        x = Tensor("x", torch.float32, ("n", 4))
        with F.placement("cpu:0"):
            a = F.exp(x)
        moved = F.to_device(a, "cpu:1")
        b = F.neg(moved)  # outside any placement: runs where its first operand lives
        c = F.add(b, a)  # so on cpu:1, where ``a`` is read through the explicit copy
        net.mark_output(c, "c")
    ops = [(n.op, n.attrs.get("device")) for n in net.nodes]
    assert ops == [("exp", None), ("to_device", "cpu:1"), ("neg", None), ("add", None)]
    assert net.nodes[3].inputs[1] is moved
    x_val = torch.randn(3, 4)
    out = net.build_engine().forward({"x": x_val})["c"]
    assert torch.equal(out, -torch.exp(x_val) + torch.exp(x_val))


def test_an_input_written_in_place_lives_where_it_is_written() -> None:
    cache = Tensor("cache", torch.float32, (4, 2, 1, 8))
    with recording("cache") as net:
        k = Tensor("k", torch.float32, ("n", 1, 8))
        slots = Tensor("slots", torch.int32, ("n",))
        with F.placement("cpu:0"):
            k2 = F.exp(k)
        with F.placement("cpu:1"):
            kc, _ = F.reshape_and_cache(k2, k2, cache, cache, slots)
        net.mark_output(kc, "kc")
    assert net.annotations["placement"][cache] == "cpu:1"
    # Declared on another device: writing it through a copy would lose the write.
    other = F.place(Tensor("other", torch.float32, (4, 2, 1, 8)), "cpu:0")
    with recording("bad"), pytest.raises(RecordError, match=r"reshape_and_cache on cpu:1 writes "
                                                            r"other.* lives on cpu:0"):
        with F.placement("cpu:0"):
            k = F.exp(Tensor("k", torch.float32, ("n", 1, 8)))
        with F.placement("cpu:1"):
            F.reshape_and_cache(k, k, other, other, Tensor("slots", torch.int32, ("n",)))


def test_a_node_reading_two_devices_without_a_copy_is_refused() -> None:
    net = _record(_split_stack())
    copy = next(n for n in net.nodes if n.op == "to_device")
    # (identity tests: == on symbolic tensors records an op)
    reader, index = next((n, i) for n in net.nodes for i, v in enumerate(n.inputs)
                         if v is copy.outputs[0])
    net.set_input(reader, index, copy.inputs[0])
    with pytest.raises(GraphError, match="reads values on several devices with no to_device"):
        net.build_engine(passes=False)


def test_inputs_are_checked_against_their_placement() -> None:
    with recording("caches") as net:
        ids = Tensor("ids", torch.float32, ("n", 4))
        table = F.place(Tensor("table", torch.float32, (4,)), "cpu:1")
        with F.placement("cpu:0"):
            h = F.exp(ids)
        with F.placement("cpu:1"):
            out = h * table
        net.mark_output(out, "out")
    engine = net.build_engine()
    assert engine.specs["table"].describe() == "table: float32[4] on cpu:1"
    good = {"ids": torch.randn(2, 4), "table": torch.randn(4)}
    assert torch.equal(engine.forward(good)["out"], torch.exp(good["ids"]) * good["table"])
    with pytest.raises(EngineInputError, match=r"input 'table' is on meta, expected table: "
                                               r"float32\[4\] on cpu:1"):
        engine.forward({"ids": good["ids"], "table": torch.empty(4, device="meta")})
    with pytest.raises(GraphError, match="spread over"):
        engine.to("cpu")


def test_shared_parameter_on_two_devices_warns() -> None:
    model = Stack(depth=2)
    model.b1.g = model.b0.g  # tied, like an LM head sharing the embedding
    model.b1.place("cpu:1")
    warned = apply_placement(model, "cpu:0")
    assert len(warned) == 1 and "'b0' on cpu:0" in warned[0] and "reads a copy" in warned[0]
    x, bias = torch.randn(3, 16), torch.randn(16)
    engine = _record(model).build_engine()
    assert any(n.op == "to_device" and n.inputs[0] is model.b0.g for n in engine.net.nodes)
    ref = Stack(depth=2)
    ref.b1.g = ref.b0.g
    expected = _record(ref).build_engine().forward({"x": x, "bias": bias})["y"]
    assert torch.equal(engine.forward({"x": x, "bias": bias})["y"], expected)


# ------------------------------------------------------------------------------ rules
def test_device_rules_are_checked_at_load_time(monkeypatch: pytest.MonkeyPatch) -> None:
    rules = [{"match": {"name": "^a$"}},
             {"match": {"name": "^b$"}, "replace": {"class": "default",
                                                   "kwargs": {"device": "cuda:3"}}}]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^rule 1\.replace\.kwargs\.device: device 'cuda:3' "
                                          r"does not exist: CUDA is not available"):
        load_rules(rules)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"^rule 1\.replace\.kwargs\.device: device 'cuda:3' "
                                          r"does not exist: this machine has 2 CUDA device\(s\)"):
        load_rules(rules)
    assert load_rules(rules, check_devices=False)[1].device == "cuda:3"  # dry runs
    rules[1]["replace"]["kwargs"]["device"] = "cuda:1"
    parsed = load_rules(rules)
    assert parsed[1].device == "cuda:1" and parsed[1].kwargs == {}  # never passed on
    assert "device='cuda:1'" in parsed[1].describe()
    for bad, message in (("gpu:1", "invalid device 'gpu:1'"), (1, "expected a device string"),
                         ("meta", "expected a cuda or cpu device")):
        rules[1]["replace"]["kwargs"]["device"] = bad
        with pytest.raises(ConfigError, match=rf"^rule 1\.replace\.kwargs\.device: .*{message}"):
            load_rules(rules)


def test_predicted_placement_follows_rule_semantics() -> None:
    import yaml

    raw = yaml.safe_load((RULES_DIR / "cpu_two_devices.yaml").read_text()) + [
        {"match": {"name": r"^model\.layers\.5\.mlp$"}, "replace": {
            "class": "default", "kwargs": {"device": "cpu:2"}}},
        {"match": {"name": r"^fenced$"}, "recursive": False},
        {"match": {"name": r"inner"}, "replace": {"class": "default",
                                                  "kwargs": {"device": "cpu:3"}}},
        {"match": {"name": r"^model\.embed_tokens$", "class": "tgraph.nn.module.Module"},
         "replace": {"class": "default", "kwargs": {"device": "cpu:4"}}}]
    rules = load_rules(raw)
    assert predict_placement(rules, "model.layers.0.mlp.down_proj.weight") is None
    assert predict_placement(rules, "model.layers.12.self_attn.q_proj.weight") == "cpu:1"
    assert predict_placement(rules, "model.norm.weight") == "cpu:1"
    # Each prefix is a module: layers.5 takes cpu:1 (rule 0), its mlp cpu:2 (rule 2).
    assert predict_placement(rules, "model.layers.5.mlp.up_proj.weight") == "cpu:2"
    assert predict_placement(rules, "model.layers.5.self_attn.o_proj.weight") == "cpu:1"
    assert predict_placement(rules, "fenced.inner.weight") is None  # not recursive
    assert predict_placement(rules, "other.inner.weight") == "cpu:3"
    # A class can't be checked before the module exists: such rules are left to apply time.
    assert predict_placement(rules, "model.embed_tokens.weight") is None


# ------------------------------------------------------------------------------ a real model
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("md-llama"), seed=7,
                              tie_word_embeddings=False)


def _load(path: Path, rules: Any = None, **options: Any) -> Any:
    from tgraph.models import load_model

    options = {"device": "cpu", "dtype": "float32", "max_model_len": 32, "block_size": 4,
               **options}
    model = load_model(path, rules=rules, **options)
    model.allocate_kv_cache(24)
    return model


@pytest.mark.parametrize("graph", ["static", "eager"])
def test_model_split_by_rules_gives_identical_logits(llama_dir: Path, graph: str) -> None:
    prompts = [[1, 5, 9, 22, 7], [3, 4, 100]]
    ref = run_greedy(_load(llama_dir, graph=graph), prompts, 3)
    model = _load(llama_dir, RULES_DIR / "cpu_two_devices.yaml", graph=graph)
    layers = model.model.layers
    assert [layer.placement for layer in layers] == ["cpu:0", "cpu:1", "cpu:1"]
    assert layers[2].mlp.down_proj.placement == "cpu:1"  # children follow their layer
    assert model.model.embed_tokens.placement == "cpu:0" and model.lm_head.placement == "cpu:0"
    assert model.model.norm.placement == "cpu:1"
    got = run_greedy(model, prompts, 3)
    # Copies are exact and every kernel runs on the same numbers: bit-identical logits.
    for a, b in zip(got.prefill_logits + got.step_logits, ref.prefill_logits + ref.step_logits):
        assert torch.equal(a, b)
    assert got.generated == ref.generated
    for key, engine in model.engines.items():
        assert engine.placement is not None and engine.placement.main == "cpu:0"
        assert engine.specs["k_cache_0"].placement == "cpu:0"
        assert engine.specs["k_cache_1"].placement == "cpu:1"
        assert engine.specs["input_ids"].placement == "cpu:0"
        devices = [s.device for s in engine.segments if s.capturable]
        # cpu:0 (embedding, layer 0), cpu:1 (layers 1-2, norm), cpu:0 (LM head).
        assert devices == ["cpu:0", "cpu:1", "cpu:0"], (key, devices)
        assert "to_device cpu:0 -> cpu:1" in str(engine)


def test_kv_caches_follow_their_layers(llama_dir: Path) -> None:
    model = _load(llama_dir, RULES_DIR / "cpu_two_devices.yaml")
    assert model._graph_state()._kv_cache_placements() == ["cpu:0", "cpu:1", "cpu:1"]
    plain = _load(llama_dir)
    assert plain._graph_state()._kv_cache_placements() == [None, None, None]
    assert all(e.placement is None for e in plain.engines.values())


def test_loader_reads_straight_to_the_predicted_device(llama_dir: Path) -> None:
    from tgraph.models.loading import _PlacingLoader

    def device_of(name: str) -> torch.device | None:
        return torch.device("meta") if name.startswith("model.layers.1.") else None

    loader = _PlacingLoader(llama_dir, device="cpu", dtype=torch.float32, progress=False,
                            device_of=device_of)
    moved = loader.get_tensor("model.layers.1.mlp.down_proj.weight")
    kept = loader.get_tensor("model.layers.0.mlp.down_proj.weight")
    merged = loader.get_merged(["model.layers.1.mlp.gate_proj.weight",
                                "model.layers.1.mlp.up_proj.weight"])
    assert moved.device.type == "meta" and merged.device.type == "meta"
    assert kept.device == torch.device("cpu") and loader.device == torch.device("cpu")


def test_rules_applied_after_loading_move_nothing_twice(llama_dir: Path) -> None:
    # The LLM path: load, then apply (placement by .to() at apply time) gives the same model.
    model = _load(llama_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_rules(model, load_rules(RULES_DIR / "cpu_two_devices.yaml"))
    assert model.model.layers[1].placement == "cpu:1"
    assert model.model.rotary.placement == "cpu:0"


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_two_gpus_with_cuda_graphs(tmp_path: Path, dtype: str) -> None:
    from tgraph.models import load_model

    # 16 layers like Llama-3.2-1B (narrow, tied embeddings), split by the example rule file.
    path = make_tiny_hf_model("llama", tmp_path / "llama16", seed=4, hidden_size=256,
                              intermediate_size=512, num_attention_heads=8,
                              num_key_value_heads=2, num_hidden_layers=16, vocab_size=1024,
                              tie_word_embeddings=True)
    prompts = [list(range(3, 70)), [5, 6, 7], [9] * 20]

    def run(rules: Any) -> Any:
        model = load_model(path, device="cuda:0", dtype=dtype, max_model_len=256, rules=rules)
        model.allocate_kv_cache(64)
        assert model.capture_decode_graphs([1, 2, 4]) == [4, 2, 1]
        return model, run_greedy(model, prompts, 6)

    _, ref = run(None)
    model, got = run(RULES_DIR / "two_gpus.yaml")
    layers = model.model.layers
    assert layers[7].mlp.down_proj.weight.data.device == torch.device("cuda", 0)
    assert layers[8].mlp.down_proj.weight.data.device == torch.device("cuda", 1)
    assert model.kv_caches[7][0].device == torch.device("cuda", 0)
    assert model.kv_caches[8][0].device == torch.device("cuda", 1)
    decode = model.engines[(False, ())]
    assert decode.captured_signatures >= 3
    assert {s.device for s in decode.segments if s.capturable} == {"cuda:0", "cuda:1"}
    for a, b in zip(got.prefill_logits + got.step_logits, ref.prefill_logits + ref.step_logits):
        assert a.device == torch.device("cuda", 0)
        # The split graph fuses differently at the two boundaries (add + RMSNorm stays
        # unfused across a copy), so half-precision roundings differ there: bf16 (8 mantissa
        # bits) 5% of the logit scale, fp16 1%.
        tol = 5e-2 if dtype == "bfloat16" else 1e-2
        scale = float(b.float().abs().max())
        assert float((a.float() - b.float()).abs().max()) <= tol * scale
