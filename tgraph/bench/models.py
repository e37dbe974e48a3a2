"""Model benchmark: tgraph against Hugging Face eager and HF StaticCache + torch.compile on
random-weight models of real shapes (presets), all in one run on one GPU.

For each preset it measures decode-step latency at context 512 for several batch sizes (tgraph
static with CUDA graphs, tgraph eager, HF eager, HF compiled), host overhead per tgraph step,
prefill time (1 x 2048 and 8 x 512 tokens), and engine build time (cold and with a warm Triton
cache, each in a fresh process). Ratios are printed against every peer and against the
weight-read bound (weight bytes / measured copy bandwidth). Peers that fail or are not installed
are reported as skipped, never faked.
"""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from tgraph import envs
from tgraph.bench.timing import Ceilings, host_ms, measure_ceilings, time_ms
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import DictWeightLoader
from tgraph.models.base.batch import BatchMeta
from tgraph.models.loading import build_model
from tgraph.models.presets import PRESETS, preset

CONTEXT = 512
SYSTEMS = ("tgraph static", "tgraph no graphs", "tgraph eager", "HF eager", "HF compile")
DEFAULT_PRESETS = ["llama-3.2-1b", "qwen2.5-0.5b", "llama-3-8b"]


@dataclass
class PresetResult:
    preset: str
    weight_bytes: int
    bound_ms: float
    decode_ms: dict = field(default_factory=dict)       # system -> {batch: ms}
    host_overhead_ms: dict = field(default_factory=dict)  # batch -> ms of CPU per step
    replay_ms: dict = field(default_factory=dict)        # batch -> ms per replay of the graphs
    prefill_ms: dict = field(default_factory=dict)      # "1x2048" -> ms
    build_s: dict = field(default_factory=dict)         # cold / warm -> s
    skipped: dict = field(default_factory=dict)         # system -> reason
    copy_gbps: float = 0.0                              # the run's copy bandwidth
    step_bound_ms: float | None = None                  # bytes a decode step reads / copy bw
    active_bound_ms: dict = field(default_factory=dict)  # MoE: batch -> bound of the experts read
    quant: dict = field(default_factory=dict)           # scheme -> tgraph.bench.quant.QuantResult


def random_weights(hf_config: dict, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Random tensors under the checkpoint names and shapes of the HF model of ``hf_config``."""
    from tgraph.bench.random_loader import checkpoint_shapes

    weights = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for name, shape in checkpoint_shapes(hf_config).items():
        w = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            w.fill_(1.0)
        else:
            w.normal_(0, 0.02, generator=gen)
        weights[name] = w
    return weights


def random_model(hf_config: dict, weights: dict[str, torch.Tensor], **llm_options):
    """A tgraph model of ``hf_config`` on the GPU from ``weights`` (see :func:`random_weights`)."""
    return build_model(ModelConfig.from_dict(hf_config),
                       DictWeightLoader(weights, device="cuda", dtype=torch.bfloat16),
                       **llm_options)


def captured_decode(model, batch: int) -> BatchMeta:
    """Allocate the KV cache for ``batch`` sequences at ``CONTEXT``, capture that decode bucket,
    run the decode batch once and return it.

    NOTE: the run matters to whoever replays the captured graphs directly: a graph reads its
    step inputs from staging buffers, which hold the capture's placeholder batch (short
    sequences) until a step writes them, so replays before any run time a shorter step than a
    real one (docs/performance.md).
    """
    model.allocate_kv_cache(batch * (CONTEXT // model.llm_config.block_size + 2) + 1)
    model.capture_decode_graphs([batch])
    meta = decode_batch(batch, CONTEXT, model.llm_config.block_size)
    model.run(meta)
    return meta


def bench_token(i: int, vocab: int = 32000) -> int:
    """The ``i``-th token of a bench batch: distinct tokens, so a MoE router spreads them over
    its experts as real text does (one repeated token would route every row alike); the
    default ``vocab`` is below every preset's vocabulary size."""
    return 1 + (i * 7919) % (vocab - 1)


def decode_batch(b: int, ctx: int, block_size: int, vocab: int = 32000) -> BatchMeta:
    per = -(-(ctx + 1) // block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
    return BatchMeta(input_ids=[bench_token(i, vocab) for i in range(b)],
                     position_ids=[ctx - 1] * b,
                     slots_mapping=[t[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size
                            for t in tables],
                     query_lens=[1] * b, seq_len=[ctx] * b, block_table=tables, is_prefill=False)


def prefill_batch(n: int, length: int, block_size: int) -> BatchMeta:
    """``n`` prompts of ``length`` tokens each, in consecutive cache blocks from block 0."""
    per = -(-length // block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(n)]
    ids, pos, slots = [], [], []
    for i, t in enumerate(tables):
        ids += [bench_token(i * length + p) for p in range(length)]
        pos += list(range(length))
        slots += [t[p // block_size] * block_size + p % block_size for p in range(length)]
    return BatchMeta(ids, pos, slots, [length] * n, [length] * n, tables, is_prefill=True)


def bench_tgraph(model, batches: list[int], result: PresetResult, label: str) -> None:
    c = model.llm_config
    max_b = max(batches)
    blocks = max(max_b * (-(-(CONTEXT + 1) // c.block_size)),
                 8 * (-(-512 // c.block_size)), -(-2048 // c.block_size)) + 1
    model.allocate_kv_cache(blocks)
    graphs = label == "tgraph static"
    if graphs:
        model.capture_decode_graphs(batches)
    result.decode_ms[label] = {}
    for b in batches:
        meta = decode_batch(b, CONTEXT, c.block_size)
        iters = 5 if label == "tgraph eager" else 30
        result.decode_ms[label][b] = time_ms(lambda: model.run(meta), warmup=3, iters=iters)
        if graphs:
            result.host_overhead_ms[b] = host_ms(lambda: model.run(meta))
            # The GPU's part alone: the step's graphs replayed back to back on the inputs the
            # runs above staged (no input copy, no logits copy, no host work in between).
            decode_graphs = model.decode_graphs(b)
            if decode_graphs:
                result.replay_ms[b] = time_ms(lambda: [g.replay() for g in decode_graphs],
                                              warmup=3, iters=100)
    if graphs:
        for n, length in ((1, 2048), (8, 512)):
            meta = prefill_batch(n, length, c.block_size)
            result.prefill_ms[f"{n}x{length}"] = time_ms(lambda: model.run(meta), warmup=2,
                                                         iters=10)


def bench_hf(hf_config: dict, weights: dict, batches: list[int], result: PresetResult,
             compile_: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    name = "HF compile" if compile_ else "HF eager"
    cfg = AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.load_state_dict(weights, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    hf = hf.eval()
    for _buf_name, buf in list(hf.named_buffers()):
        if buf.device.type == "meta":  # rotary inv_freq: rebuild on the GPU
            hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg, device="cuda")
            break
    result.decode_ms[name] = {}
    with torch.no_grad():
        for b in batches:
            prompt = torch.randint(0, cfg.vocab_size, (b, CONTEXT - 1), device="cuda")
            if not compile_:
                out = hf(input_ids=prompt, use_cache=True)
                cache = out.past_key_values
                tok = torch.tensor([[bench_token(i)] for i in range(b)], device="cuda")
                result.decode_ms[name][b] = time_ms(
                    lambda: hf(input_ids=tok, past_key_values=cache, use_cache=True),
                    warmup=2, iters=10)
                del cache, out
            else:
                from transformers import StaticCache

                cache = StaticCache(config=cfg, max_batch_size=b, max_cache_len=CONTEXT + 64,
                                    device="cuda", dtype=torch.bfloat16)
                pos = torch.arange(CONTEXT - 1, device="cuda")
                hf(input_ids=prompt, past_key_values=cache, cache_position=pos, use_cache=True)
                step = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
                tok = torch.tensor([[bench_token(i)] for i in range(b)], device="cuda")
                cpos = torch.tensor([CONTEXT - 1], device="cuda")
                t0 = time.perf_counter()
                for _ in range(3):
                    step(input_ids=tok, past_key_values=cache, cache_position=cpos,
                         use_cache=True)
                torch.cuda.synchronize()
                result.build_s.setdefault("torch.compile warm-up", {})[b] = \
                    time.perf_counter() - t0
                result.decode_ms[name][b] = time_ms(
                    lambda: step(input_ids=tok, past_key_values=cache, cache_position=cpos,
                                 use_cache=True), warmup=3, iters=30)
                del cache
            gc.collect()
            torch.cuda.empty_cache()


def measure_build(preset_name: str) -> dict:
    """Engine build + first decode step, in fresh processes: cold then warm Triton cache."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = envs.child_environ(TRITON_CACHE_DIR=cache)
        for label in ("cold", "warm"):
            proc = subprocess.run([sys.executable, "-m", "tgraph.bench.build_time", preset_name],
                                  env=env, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                out[label] = f"failed: {proc.stderr.strip().splitlines()[-1:]}"
            else:
                out[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def run_preset(name: str, batches: list[int], peers: list[str], ceil: Ceilings,
               quant: list[str] | None = None, cpu_experts: bool = False) -> PresetResult:
    """One preset: every tgraph system and peer, or with ``quant`` the bf16 static model and
    each quantized scheme (no other systems, no build times). A preset too large for bf16
    (:data:`tgraph.bench.moe.PRESET_SCHEMES`) runs quantized, tgraph static only;
    ``cpu_experts``: tgraph static against the model with half the layers' experts on the CPU
    (a MoE preset; nothing else runs)."""
    from tgraph.bench.moe import PRESET_SCHEMES, dense_sizes, moe_step_bytes

    hf_config = preset(name)
    if name in PRESET_SCHEMES:
        return _run_quantized_preset(name, hf_config, PRESET_SCHEMES[name], batches, ceil,
                                     cpu_experts)
    weights = random_weights(hf_config, torch.bfloat16, "cuda")
    nbytes = sum(w.numel() * w.element_size() for w in weights.values())
    result = PresetResult(name, nbytes, nbytes / (ceil.copy_gbps * 1e9) * 1e3,
                          copy_gbps=ceil.copy_gbps)
    systems = (("tgraph static", "static", True), ("tgraph no graphs", "static", False),
               ("tgraph eager", "eager", False))
    if any(".experts." in n for n in weights):
        result.active_bound_ms = {b: moe_step_bytes(hf_config, dense_sizes(weights), b)
                                  / (ceil.copy_gbps * 1e9) * 1e3 for b in batches}
    if cpu_experts:  # the all-GPU model against the half-CPU one, nothing else
        peers, systems = [], systems[:1]
    if quant:
        from tgraph.bench.quant import bench_quantized, step_read_bytes

        systems = systems[:1]
        result.step_bound_ms = step_read_bytes(hf_config, weights, {}) / (ceil.copy_gbps * 1e9) \
            * 1e3
    for label, graph, cuda_graph in systems:
        model = random_model(hf_config, weights, max_model_len=4096, graph=graph,
                             cuda_graph=cuda_graph)
        try:
            bench_tgraph(model, batches, result, label)
        except Exception as err:
            result.skipped[label] = f"{type(err).__name__}: {err}"
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if cpu_experts and result.active_bound_ms:
        _bench_cpu_experts(lambda w=weights: random_model(hf_config, w, max_model_len=4096),
                           hf_config, batches, result)
    for peer, compile_ in (("hf", False), ("compile", True)):
        if peer not in peers:
            continue
        try:
            bench_hf(hf_config, weights, batches, result, compile_)
        except Exception as err:
            result.skipped["HF compile" if compile_ else "HF eager"] = \
                f"{type(err).__name__}: {str(err)[:200]}"
        gc.collect()
        torch.cuda.empty_cache()
    if quant:
        result.quant = bench_quantized(hf_config, weights, quant, batches, ceil.copy_gbps,
                                       bench_tgraph)
    del weights
    gc.collect()
    torch.cuda.empty_cache()
    if not quant and not cpu_experts:
        result.build_s.update(measure_build(name))
    return result


CPU_EXPERTS = "tgraph CPU experts"  # the decode_ms label of the half-experts-on-CPU run


def _bench_cpu_experts(make_model, hf_config: dict, batches: list[int],
                       result: PresetResult) -> None:
    """Decode with the first half of the layers' experts on the CPU (no CUDA graphs)."""
    from tgraph.bench.moe import cpu_experts_rules
    from tgraph.rules import apply_rules

    try:
        model = make_model()
        apply_rules(model, cpu_experts_rules(hf_config))
        gc.collect()
        torch.cuda.empty_cache()
        c = model.llm_config
        model.allocate_kv_cache(max(batches) * (-(-(CONTEXT + 1) // c.block_size)) + 1)
        timed = {}
        for b in (b for b in batches if b <= 16):
            meta = decode_batch(b, CONTEXT, c.block_size)
            timed[b] = time_ms(lambda m=model, meta=meta: m.run(meta), warmup=2, iters=5)
        result.decode_ms[CPU_EXPERTS] = timed
        del model
    except Exception as err:  # reported, never faked
        result.skipped[CPU_EXPERTS] = f"{type(err).__name__}: {str(err)[:300]}"
    gc.collect()
    torch.cuda.empty_cache()


def _run_quantized_preset(name: str, hf_config: dict, kind: str, batches: list[int],
                          ceil: Ceilings, cpu_experts: bool) -> PresetResult:
    from tgraph.bench.moe import moe_step_bytes, quantized_moe_model

    model, sizes = quantized_moe_model(hf_config, kind, max_model_len=4096)
    nbytes = sum(n for n, _ in sizes.values())
    result = PresetResult(f"{name} {kind}", nbytes, nbytes / (ceil.copy_gbps * 1e9) * 1e3,
                          copy_gbps=ceil.copy_gbps)
    result.active_bound_ms = {b: moe_step_bytes(hf_config, sizes, b) / (ceil.copy_gbps * 1e9)
                              * 1e3 for b in batches}
    result.skipped["HF eager / compile"] = f"{name} does not fit one GPU in bf16"
    try:
        bench_tgraph(model, batches, result, "tgraph static")
    except Exception as err:
        result.skipped["tgraph static"] = f"{type(err).__name__}: {str(err)[:300]}"
    del model
    gc.collect()
    torch.cuda.empty_cache()
    if cpu_experts:
        _bench_cpu_experts(lambda: quantized_moe_model(hf_config, kind, max_model_len=4096)[0],
                           hf_config, batches, result)
    return result


def print_table(results: list[PresetResult]) -> None:
    print(f"\n{'preset':<14} {'batch':>5} {'bound ms':>9} " + " ".join(
        f"{s:>15}" for s in SYSTEMS)
        + f" {'x bound':>8} {'vs HF':>7} {'vs compile':>10} {'host ms':>8} {'replay ms':>9}")
    for r in results:
        for b in sorted(r.decode_ms.get("tgraph static", {}) or {1: None}):
            row = [r.decode_ms.get(s, {}).get(b) for s in SYSTEMS]
            ours = row[0]
            cells = " ".join(f"{v:15.3f}" if v else f"{'-':>15}" for v in row)
            bound = r.bound_ms if b == 1 else r.bound_ms  # weights are read once per step
            ratio = f"{ours / bound:8.2f}" if ours else f"{'-':>8}"
            vs_hf = f"{row[3] / ours:6.1f}x" if ours and row[3] else f"{'-':>7}"
            vs_c = f"{row[4] / ours:9.2f}x" if ours and row[4] else f"{'-':>10}"
            host, replay = r.host_overhead_ms.get(b), r.replay_ms.get(b)
            print(f"{r.preset:<14} {b:>5} {bound:9.3f} {cells} {ratio} {vs_hf} {vs_c} "
                  f"{host if host is None else round(host, 3)!s:>8} "
                  f"{'-' if replay is None else f'{replay:.3f}':>9}")
        if r.prefill_ms:
            print("  prefill: " + ", ".join(f"{k} {v:.2f} ms" for k, v in r.prefill_ms.items()))
        if r.active_bound_ms:
            ours = r.decode_ms.get("tgraph static", {})
            print("  MoE bound of the experts a step reads: " + ", ".join(
                f"b{b} {v:.3f} ms" + (f" ({ours[b] / v:.2f}x)" if ours.get(b) else "")
                for b, v in r.active_bound_ms.items()))
        if r.decode_ms.get(CPU_EXPERTS):
            print("  half the layers' experts on the CPU (no CUDA graphs): " + ", ".join(
                f"b{b} {ms:.2f} ms" for b, ms in r.decode_ms[CPU_EXPERTS].items()))
        if r.quant:
            from tgraph.bench.quant import print_quant_table

            print_quant_table(r.preset, r.decode_ms.get("tgraph static", {}), r.prefill_ms,
                              r.step_bound_ms, r.quant, r.copy_gbps)
        print(f"  build: {r.build_s}")
        for k, v in r.skipped.items():
            print(f"  skipped {k}: {v}")


def draw_chart(results: list[PresetResult], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return
    systems = ["tgraph static", "HF compile", "HF eager"]
    kinds = sorted({k for r in results for k in r.quant})
    if kinds:  # the quantized comparison: bf16 and each scheme
        systems = ["tgraph static"] + [f"tgraph {k}" for k in kinds]
    labels, values = [], {s: [] for s in systems}
    for r in results:
        for b in sorted(r.decode_ms.get("tgraph static", {})):
            labels.append(f"{r.preset}\nbatch {b}")
            for s in systems:
                q = r.quant.get(s.removeprefix("tgraph "))
                got = q.decode_ms.get(b) if q is not None else r.decode_ms.get(s, {}).get(b)
                values[s].append(got or 0)
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 1.2), 4.5))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        ax.bar([x + i * width for x in range(len(labels))], values[s], width, label=s)
    ax.set_xticks([x + width for x in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("decode step (ms), context 512")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"tgraph vs peers on {torch.cuda.get_device_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_model_bench(presets: list[str] | None, batches: list[int], peers: list[str],
                    json_path: str | None, png_path: str | None,
                    quant: list[str] | None = None,
                    cpu_experts: bool = False) -> list[PresetResult]:
    """Every preset of ``presets`` (the defaults when None); with ``quant`` (schemes of
    :data:`tgraph.bench.quant.QUANT_SCHEMES`) the quantized models next to the bf16 one."""
    ceil = measure_ceilings()
    print(f"device: {torch.cuda.get_device_name()}  copy {ceil.copy_gbps:.0f} GB/s  "
          f"bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s  torch {torch.__version__}")
    results = []
    for name in presets or DEFAULT_PRESETS:
        if name not in PRESETS:
            print(f"unknown preset {name}; known: {list(PRESETS)}")
            continue
        results.append(run_preset(name, batches, peers, ceil, quant, cpu_experts))
        print_table(results[-1:])
    print_table(results)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "ceilings": asdict(ceil),
                       "results": [asdict(r) for r in results]}, f, indent=1, default=str)
    if png_path:
        draw_chart(results, png_path)
    return results
