"""The quantized model bench's bookkeeping, on the CPU: which weights it quantizes, the bytes a
decode step reads, and the table it prints (the GPU timings themselves run in the bench)."""
from __future__ import annotations

import re

import torch

from tgraph.bench.quant import QuantResult, print_quant_table, quantize_linears, step_read_bytes

CONFIG = {"tie_word_embeddings": False}


def _weights() -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.randn(100, 128),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 128),
        "model.layers.0.mlp.down_proj.weight": torch.randn(128, 256),
        "model.layers.0.input_layernorm.weight": torch.ones(128),
        "model.norm.weight": torch.ones(128),
        "lm_head.weight": torch.randn(100, 128),
    }


def test_only_the_decoder_linears_are_quantized():
    q = quantize_linears(_weights(), "int4")
    assert sorted(q) == ["model.layers.0.mlp.down_proj.weight",
                         "model.layers.0.self_attn.q_proj.weight"]
    assert q["model.layers.0.mlp.down_proj.weight"].scheme.describe((128, 256)) == "int4 g128 sym"


def test_a_step_reads_codes_scales_dense_weights_and_its_embedding_rows():
    w = _weights()
    q = quantize_linears(w, "int8")
    dense = sum(w[n].numel() * 4 for n in ("model.layers.0.input_layernorm.weight",
                                           "model.norm.weight", "lm_head.weight"))
    codes = sum(x.nbytes for x in q.values())
    assert codes == 64 * 128 + 64 * 4 + 128 * 256 + 128 * 4  # int8 codes + an fp32 scale a row
    assert step_read_bytes(CONFIG, w, q, batch=3) == dense + codes + 3 * 128 * 4
    # A tied table is read whole (it is lm_head too).
    assert step_read_bytes({"tie_word_embeddings": True}, w, q) == dense + codes + 100 * 128 * 4


def test_the_table_shows_each_scheme_against_bf16(capsys):
    quant = {"int4": QuantResult("int4 g128", 10, 2_000_000, 1.0, {1: 2.0}, {}, {"8x512": 5.0}),
             "fp8": QuantResult("fp8 channel", 10, 0, 1.0, skipped="RuntimeError: no")}
    print_quant_table("tiny", {1: 4.0}, {"8x512": 10.0}, 2.0, quant, copy_gbps=1000.0)
    out = capsys.readouterr().out
    bf16 = next(line for line in out.splitlines() if line.startswith("tgraph bf16"))
    int4 = next(line for line in out.splitlines() if line.startswith("tgraph int4 g128"))
    assert bf16.split()[2:4] == ["2000", "2.000"]  # step MB = bound x bandwidth
    assert int4.split()[3:8] == ["2", "1.000", "2.000", "2.00", "2.00x"]
    assert "5.00" in int4 and "2.00x" in int4.split()[-1]
    assert re.search(r"tgraph fp8 +skipped: RuntimeError: no", out)


def test_a_moe_step_reads_the_experts_its_tokens_touch():
    from tgraph.bench.moe import dense_sizes, moe_step_bytes

    weights = {"model.embed_tokens.weight": torch.zeros(10, 8),
               "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 6, 8),
               "model.layers.0.mlp.gate.weight": torch.zeros(4, 8)}
    config = {"num_experts": 4, "num_experts_per_tok": 2}
    experts, gate, row = 4 * 6 * 8 * 4, 4 * 8 * 4, 8 * 4
    assert moe_step_bytes(config, dense_sizes(weights), 1) == gate + row + experts * 0.5
    # 3 tokens touch 4 * (1 - (1/2) ** 3) = 3.5 experts on average
    assert moe_step_bytes(config, dense_sizes(weights), 3) == gate + 3 * row + experts * 0.875
