"""A step's engine inputs: the captured decode step's staging (a host array of every integer
input, written per step, block-table rows only when they change, copied to the device by the
graph itself), and the agreement of the staged forms with the uncaptured one."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tgraph.models.base.batch import BatchMeta, block_table_array, pad_prefill_arrays
from tgraph.models.base.step_inputs import BATCH_FIELDS, Staging, StepInputs

WIDTH = 6


def _batch(tables, seq_len, block_size=4):
    n = len(tables)
    return BatchMeta(input_ids=list(range(10, 10 + n)), position_ids=[k - 1 for k in seq_len],
                     slots_mapping=[t[(k - 1) // block_size] * block_size + (k - 1) % block_size
                            if k else -1 for t, k in zip(tables, seq_len)],
                     query_lens=[1] * n, seq_len=seq_len, block_table=tables, is_prefill=False)


def _staging(bucket=3):
    shapes = {name: (bucket,) for name in ("input_ids", "position_ids", "slots_mapping", "seq_len")}
    shapes["block_table"] = (bucket, WIDTH)
    return Staging(shapes, torch.device("cpu"), {})


def _check(staging: Staging, batch: BatchMeta) -> None:
    v = staging.views
    assert v["input_ids"].tolist() == list(batch.input_ids)
    assert v["position_ids"].tolist() == list(batch.position_ids)
    assert v["slots_mapping"].tolist() == list(batch.slots_mapping)
    assert v["seq_len"].tolist() == list(batch.seq_len)
    want = block_table_array(batch.block_table, WIDTH)
    for i, row in enumerate(batch.block_table):  # entries past a row's length are never read
        assert v["block_table"][i, :len(row)].tolist() == want[i, :len(row)].tolist()
    # The tensors the engine reads get the host array on upload (the graph's prologue).
    staging.upload()
    assert torch.equal(staging.inputs["input_ids"], torch.from_numpy(v["input_ids"]))
    assert torch.equal(staging.inputs["block_table"], torch.from_numpy(v["block_table"]))


def test_rows_follow_every_kind_of_change():
    staging = _staging()
    steps = [
        [[1, 2], [3], []],              # a padded bucket row
        [[1, 2], [3], []],              # unchanged: nothing converted
        [[1, 2, 7], [3], []],           # a row grows by a block
        [[1, 2, 7], [5], []],           # a sequence replaced by another of the same length
        [(4, 4, 4, 4), [5], [8, 9]],    # tuples, and the pad row becomes a sequence
        [[6]],                          # fewer rows (bucket padding is the caller's)
    ]
    for tables in steps:
        kv = [len(t) * 4 - 1 if t else 0 for t in tables]
        batch = _batch(tables + [[]] * (3 - len(tables)), kv + [0] * (3 - len(tables)))
        staging.write(batch, {})
        _check(staging, batch)


def test_a_row_wider_than_the_table_is_refused():
    staging = _staging()
    with pytest.raises(ValueError, match="more than the table width 6"):
        staging.write(_batch([[1] * 7, [], []], [25, 0, 0]), {})


def test_feature_arrays_are_written():
    shapes = {name: (2,) for name in ("input_ids", "position_ids", "slots_mapping", "seq_len")}
    shapes.update(block_table=(2, WIDTH), lora_token_slots=(2,))
    staging = Staging(shapes, torch.device("cpu"), {})
    staging.write(_batch([[1], [2]], [1, 1]), {"lora_token_slots": np.array([3, 0], np.int32)})
    staging.upload()  # what the captured graph's prologue does
    assert staging.inputs["lora_token_slots"].tolist() == [3, 0]


@pytest.mark.gpu
def test_captured_decode_equals_uncaptured_across_block_boundaries(tmp_path):
    """Greedy decode through the captured graph (staging written per step, block-table rows
    rewritten as sequences cross 16-token blocks) is bit-identical to the same model run without
    CUDA graphs: same kernels, same batch."""
    from tgraph.models import load_model
    from tgraph.testing import make_tiny_hf_model, run_greedy

    path = make_tiny_hf_model("llama", tmp_path / "llama", seed=3, hidden_size=256,
                              intermediate_size=512, num_attention_heads=8,
                              num_key_value_heads=2, num_hidden_layers=2, vocab_size=512)
    prompts = [list(range(3, 30)), [5, 6, 7], list(range(40, 54))]  # 27, 3, 14 tokens
    traces = []
    for cuda_graph in (True, False):
        model = load_model(path, device="cuda", dtype="bfloat16", max_model_len=256,
                           cuda_graph=cuda_graph, batch_buckets=(3,))
        model.allocate_kv_cache(64)
        if cuda_graph:
            assert model.capture_decode_graphs([3]) == [3]
        traces.append(run_greedy(model, prompts, 24))  # every sequence crosses a block
    got, ref = traces
    assert got.generated == ref.generated
    for a, b in zip(got.step_logits, ref.step_logits):
        assert torch.equal(a, b)


# ---- StepInputs: the three forms of a step's inputs agree --------------------------------------
def _step_inputs() -> StepInputs:
    # StepInputs reads only the device and the block-table width of the serving config.
    config = SimpleNamespace(device=torch.device("cpu"), max_blocks_per_seq=WIDTH)
    inputs = StepInputs(config, {})  # type: ignore[arg-type]
    inputs.reset([(torch.zeros(2), torch.ones(2))])
    return inputs


def test_decode_staging_holds_what_an_uncaptured_step_sends():
    step = _step_inputs()
    batch = _batch([[1, 2], [3], []], [7, 2, 0])
    staging = step.decode_staged("sig", batch, ())
    staging.upload()
    want = step.uncaptured(batch)
    assert set(staging.inputs) == set(want) == {*BATCH_FIELDS, "block_table", "k_cache_0",
                                                "v_cache_0"}
    for name, t in want.items():
        assert torch.equal(staging.inputs[name], t), name
    assert staging.inputs["k_cache_0"] is step.kv_caches[0][0]  # resident: the very tensor
    # The next step of the signature reuses the same buffers.
    assert step.decode_staged("sig", _batch([[1, 2], [3], [4]], [8, 3, 1]), ()) is staging


def test_prefill_staging_holds_the_padded_step():
    step = _step_inputs()
    batch = BatchMeta(input_ids=[5, 6, 7, 8, 9], position_ids=[0, 1, 2, 0, 1],
                      slots_mapping=[0, 1, 2, 4, 5], query_lens=[3, 2], seq_len=[3, 2],
                      block_table=[[0], [1]])
    staging = step.prefill_staged("sig", batch, tokens=8, seqs=4)
    staging.upload()
    want = pad_prefill_arrays(step.arrays(batch), tokens=8, seqs=4)
    for name, a in want.items():
        assert staging.inputs[name].tolist() == a.tolist(), name
    assert staging.inputs["query_start_loc"].tolist() == [0, 3, 5, 5, 5]
    # The unpadded step's inputs are the padded ones' leading rows.
    plain = step.uncaptured(batch)
    assert plain["input_ids"].tolist() == staging.inputs["input_ids"][:5].tolist()
    assert plain["lm_head_indices"].tolist() == [2, 4]
    step.reset(step.kv_caches)
    assert not step.stagings  # new caches drop every staging
