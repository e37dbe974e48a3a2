"""Modules: registration, dotted names, traversal, parameters as named graph weights whose data the
engine uses, loading and moving weights."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close, poison_like
from tgraph.errors import GraphError, WeightLoadError
from tgraph.ir.value import ValueKind
from tgraph.nn import functional as F
from tgraph.nn.module import Module, ModuleDict, ModuleList, Parameter
from tgraph.nn.network_manager import recording
from tgraph.nn.tensor import Tensor

HIDDEN, HEADS, VOCAB, LAYERS = 16, 2, 11, 2


class Linear(Module):
    def __init__(self, n_in: int, n_out: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)
        self.register_parameter("bias", Parameter(torch.randn(n_out)) if bias else None)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = Parameter(torch.rand(n) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight, 1e-6)


class Attention(Module):
    """Only the projections (enough for naming); the 'attention' is a per-token gate."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = Linear(HIDDEN, HIDDEN, bias=True)
        self.o_proj = Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor) -> Tensor:
        q = self.q_proj(x).view(-1, HEADS, HIDDEN // HEADS)      # (tokens, heads, head_dim)
        return self.o_proj(F.sigmoid(q).view(-1, HIDDEN))


class Layer(Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = Attention()
        self.mlp = ModuleDict({"up": Linear(HIDDEN, 2 * HIDDEN), "down": Linear(HIDDEN, HIDDEN)})

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        up = self.mlp["up"](x)
        return x + self.mlp["down"](F.activation(up, F.ActType.SWIGLU))


class Model(Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = Parameter(torch.randn(VOCAB, HIDDEN))
        self.layers = ModuleList(Layer() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)

    def forward(self, ids: Tensor) -> Tensor:
        x = F.embedding(ids, self.embed_tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class CausalLM(Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.lm_head = Linear(HIDDEN, VOCAB)
        self.scale = 0.5  # a plain attribute, not a module or parameter

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm_head(self.model(ids)) * self.scale


def torch_forward(lm: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The same model written with plain torch on the parameters' data, in fp64."""
    def lin(m: Linear, x: torch.Tensor) -> torch.Tensor:
        out = x @ m.weight.data.double().t()
        return out if m.bias is None else out + m.bias.data.double()

    def rms(m: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * m.weight.data.double()

    x = lm.model.embed_tokens.data.double()[ids]
    for layer in lm.model.layers:
        h = rms(layer.input_layernorm, x)
        gate = torch.sigmoid(lin(layer.self_attn.q_proj, h))
        x = x + lin(layer.self_attn.o_proj, gate)
        up = lin(layer.mlp["up"], x)
        g, u = up[:, :HIDDEN], up[:, HIDDEN:]
        x = x + lin(layer.mlp["down"], g * torch.sigmoid(g) * u)
    return lin(lm.lm_head, rms(lm.model.norm, x)) * 0.5


EXPECTED_PARAMS = ["model.embed_tokens"] + [
    f"model.layers.{i}.{name}" for i in range(LAYERS) for name in (
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
        "self_attn.o_proj.weight", "mlp.up.weight", "mlp.down.weight")
] + ["model.norm.weight", "lm_head.weight"]


def test_named_parameters_and_modules_use_dotted_paths() -> None:
    lm = CausalLM()
    names = [n for n, _ in lm.named_parameters()]
    assert names == EXPECTED_PARAMS
    modules = dict(lm.named_modules())
    assert "model.layers.1.self_attn.q_proj" in modules and "" in modules
    assert modules["model.layers.0.mlp.up"] is lm.model.layers[0].mlp["up"]
    assert len(list(lm.parameters())) == len(EXPECTED_PARAMS)
    assert [n for n, _ in lm.model.layers[0].named_parameters("x")][:2] == \
        ["x.input_layernorm.weight", "x.self_attn.q_proj.weight"]
    assert lm.get_submodule("model.layers.1.self_attn") is lm.model.layers[1].self_attn
    assert lm.scale == 0.5 and "scale" not in dict(lm.named_children())
    assert lm.model.layers[0].self_attn.o_proj.bias is None


def test_names_are_assigned_on_the_first_call_and_explicit_names_are_kept() -> None:
    lm = CausalLM()
    lm.lm_head.weight.name = "output.weight"  # explicit name: kept
    assert lm.model.layers[0].self_attn.q_proj.weight.name is None
    with recording("names"):
        lm(Tensor("ids", torch.int64, ("num_tokens",)))
    q_proj = lm.model.layers[0].self_attn.q_proj
    assert q_proj.weight.name == "model.layers.0.self_attn.q_proj.weight"
    assert lm.lm_head.weight.name == "output.weight"
    lm.assign_names(overwrite=True)
    assert lm.lm_head.weight.name == "lm_head.weight"


def test_parameters_are_named_graph_weights_and_their_data_is_used() -> None:
    lm = CausalLM()
    with recording("causal_lm") as net:
        logits = lm(Tensor("ids", torch.int64, ("num_tokens",)))
        assert logits.shape == ("num_tokens", VOCAB)
        net.mark_output(logits, "logits")
    assert sorted(v.name for v in net.weights) == sorted(EXPECTED_PARAMS)
    assert all(v.kind is ValueKind.WEIGHT for v in net.weights)
    assert net.inputs[0].name == "ids" and len(net.inputs) == 1
    assert "weight model.layers.0.self_attn.q_proj.weight: float32[16, 16]" in str(net)

    ids = torch.tensor([3, 10, 0, 7, 7])
    for passes in (True, False):
        engine = net.build_engine(passes=passes)
        out = poison_like(torch.empty(5, VOCAB))
        engine.forward({"ids": ids}, {"logits": out})
        # fp32 through two layers of 16-wide matmuls vs fp64: a few ulp, well below 1e-4
        assert_close(out, torch_forward(lm, ids), rtol=1e-4, atol=1e-4, msg=f"passes={passes}")

    # New data through set_weights is used without a rebuild ...
    engine = net.build_engine()
    head = torch.zeros(VOCAB, HIDDEN)
    head[3] = 1.0
    engine.set_weights({"lm_head.weight": head})
    out = engine.forward({"ids": ids})["logits"]
    assert torch.count_nonzero(out[:, [i for i in range(VOCAB) if i != 3]]) == 0
    # ... and a mis-shaped one is refused.
    with pytest.raises(ValueError, match=r"'lm_head.weight' must be torch.float32\[11, 16\]"):
        engine.set_weights({"lm_head.weight": torch.zeros(VOCAB, HIDDEN + 1)})


def test_shared_parameter_is_listed_once_and_is_one_graph_weight() -> None:
    lm = CausalLM()
    lm.lm_head.weight = lm.model.embed_tokens  # tied embeddings
    names = [n for n, _ in lm.named_parameters()]
    assert names.count("model.embed_tokens") == 1 and "lm_head.weight" not in names
    with recording("tied") as net:
        net.mark_output(lm(Tensor("ids", torch.int64, (3,))), "logits")
    assert [v.name for v in net.weights].count("model.embed_tokens") == 1
    ids = torch.tensor([1, 2, 3])
    assert_close(net.build_engine().forward({"ids": ids})["logits"], torch_forward(lm, ids),
                 rtol=1e-4, atol=1e-4)


def test_module_list_and_dict_behave_like_containers() -> None:
    layers = ModuleList([Linear(2, 2), Linear(2, 3)])
    assert len(layers) == 2 and layers[-1].weight.shape == (3, 2)
    layers.append(Linear(3, 1))
    assert [n for n, _ in layers.named_children()] == ["0", "1", "2"]
    replacement = Linear(2, 2)
    layers[0] = replacement
    assert layers[0] is replacement and list(layers)[0] is replacement
    d = ModuleDict({"a": Linear(1, 1)})
    d["b"] = Linear(1, 2)
    assert "a" in d and "c" not in d and len(d) == 2 and list(d) == ["a", "b"]
    assert list(d.keys()) == ["a", "b"] and d["b"] is dict(d.items())["b"]
    assert [n for n, _ in d.named_parameters()] == ["a.weight", "b.weight"]


def test_module_registration_errors_and_attribute_handling() -> None:
    class Forgot(Module):
        def __init__(self) -> None:
            self.weight = Parameter(torch.zeros(2))

    with pytest.raises(AttributeError, match=r"must call super\(\).__init__\(\) before "
                                             r"assigning 'weight'"):
        Forgot()

    m = Linear(2, 2)
    with pytest.raises(AttributeError, match="Linear has no attribute 'wieght'"):
        _ = m.wieght
    m.weight = Linear(2, 2)  # a module replaces a parameter of the same name
    assert "weight" not in dict(m.named_parameters()) and isinstance(m.weight, Linear)
    del m.weight
    with pytest.raises(AttributeError):
        _ = m.weight
    m.extra = None  # a plain value, then a module or parameter under its name: the latter wins
    m.extra = Linear(2, 2)
    assert isinstance(m.extra, Linear) and "extra" in dict(m.named_modules())
    m.scale = None
    m.scale = Parameter(torch.ones(2))
    assert isinstance(m.scale, Parameter) and "scale" in dict(m.named_parameters())
    m.extra = None  # and back to a plain value
    assert m.extra is None and "extra" not in dict(m.named_modules())
    with pytest.raises(NotImplementedError, match="Module does not define forward"):
        Module()()
    root = CausalLM()
    with pytest.raises(AttributeError, match="no sub-module 'layer'"):
        root.get_submodule("model.layer.0")
    new_head = Linear(HIDDEN, VOCAB)
    root.set_submodule("lm_head", new_head)
    assert root.lm_head is new_head


def test_parameter_without_data_load_and_to() -> None:
    p = Parameter(shape=(2, 3), dtype=torch.bfloat16)
    assert p.data is None and "not loaded" in repr(p)
    with pytest.raises(TypeError, match="needs data, or both shape and dtype"):
        Parameter(shape=(2, 3))
    with pytest.raises(TypeError, match="must be a torch.Tensor or a QuantizedWeight, got list"):
        Parameter([1.0, 2.0])
    with pytest.raises(WeightLoadError, match=r"expected shape \[2, 3\], got \[3, 2\]"):
        p.load(torch.zeros(3, 2))
    p.load(torch.ones(2, 3, dtype=torch.float32))
    assert p.data.dtype == torch.bfloat16  # converted to the declared dtype

    # A network using an unloaded weight can be recorded but not built.
    lin = Linear(3, 2)
    lin.weight = Parameter(shape=(2, 3), dtype=torch.float32)
    with recording("unloaded") as net:
        net.mark_output(lin(Tensor("x", torch.float32, (1, 3))), "y")
    with pytest.raises(GraphError, match=r"weight 'weight' .*has no data; load the weights"):
        net.build_engine()

    lm = CausalLM()
    state = {n: torch.zeros_like(p.data) for n, p in lm.named_parameters()}
    lm.load_state(state)
    assert all(torch.count_nonzero(p.data) == 0 for p in lm.parameters())
    state.pop("lm_head.weight")
    state["lm_head.weights"] = torch.zeros(VOCAB, HIDDEN)
    with pytest.raises(WeightLoadError, match=r"missing \['lm_head.weight'\], unexpected "
                                              r"\['lm_head.weights'\]"):
        lm.load_state(state)
    lm.load_state({"model.norm.weight": torch.full((HIDDEN,), 2.0)}, strict=False)
    assert float(lm.model.norm.weight.data[0]) == 2.0
    lm.to(dtype=torch.float16)
    assert all(p.dtype == p.data.dtype == torch.float16 for p in lm.parameters())
