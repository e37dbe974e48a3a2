"""LoRA decode benchmark: the cost of serving adapters, on a random-weight model of real shape.

One model (default: the Llama-3.2-1B preset, bf16, random weights) is built with both LoRA
features (``multi_lora`` with ``max_loras`` slots and ``single_lora``, both at ``max_rank``),
given random PEFT-format adapters written to a temporary directory, and timed for one decode step
at context 512:

* ``base``: no adapter (the engine without LoRA inputs);
* ``multi_lora``: a mixed batch, request ``i`` using adapter ``i % max_loras`` (4 adapters x 4
  requests at batch 16: every slot is live and tokens of one adapter are not contiguous);
* ``single_lora``: one adapter applied to every request;
* ``single+multi``: both stacked, the mixed multi-LoRA batch with a single adapter active for
  every request.

The single adapter is measured both ways it can be applied (``single_lora``'s ``merge`` setting,
``llm.lora.merge_single``), one model build each: merged into the weights (the default: the base
and multi-LoRA engines serve it) and recorded in engines of its own (one engine built for the
combination when stacked, as for a quantized base).

Every adapted linear runs as one GEMM on ``[x | shrink]`` and the weight storage ``[W | B
columns]`` (see :mod:`tgraph.models.base.lora_features`); the base model runs on a view of the
same storage. CUDA graphs are on, as the model runs by default: ``capture_decode_graphs``
captures the base engine (after the adapters are loaded); whether each LoRA engine ran from a
captured graph is read from its ``captured_signatures`` and reported, never assumed. Each LoRA
run's logits are compared with the base run's (the adapters must move them) and the
single-adapter rows with the multi-adapter rows of the same adapter (two code paths, one
answer). On CPU the same measurement runs with wall-clock timing, which the tests use as a smoke
run at tiny shapes.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tgraph.bench.models import decode_batch, random_weights
from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import DictWeightLoader
from tgraph.models.loading import build_model
from tgraph.models.presets import PRESETS, preset

__all__ = ["LoraBenchResult", "lora_module_shapes", "measure_lora_decode", "print_table",
           "run_lora_bench", "write_random_adapter"]

CONTEXT = 512
BATCH = 16
MAX_LORAS = 4
RANK = 16
DEFAULT_PRESET = "llama-3.2-1b"
SYSTEMS = ("base", "multi_lora", "single_lora", "single+multi")
# system -> the features of its engine
_FEATURES = {"base": (), "multi_lora": ("multi_lora",), "single_lora": ("single_lora",),
             "single+multi": ("multi_lora", "single_lora")}

# PEFT module name -> the decoder-layer submodule that holds it (HF Llama-like layout).
_PARENTS: dict[str, str] = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}


# ---- adapters ------------------------------------------------------------------------------------
def lora_module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of every LoRA-targetable linear of a Llama-like layer.

    Args:
        config: the base model's config.

    Returns:
        PEFT module name (``q_proj`` ... ``down_proj``) -> ``(in, out)``.
    """
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    i = config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_random_adapter(path: str | Path, config: ModelConfig, *, rank: int = RANK,
                         alpha: float = 2.0 * RANK, seed: int = 0,
                         target_modules: Sequence[str] = tuple(_PARENTS),
                         b_std: float = 0.02) -> Path:
    """Write a random LoRA adapter for ``config`` as a PEFT directory: ``adapter_config.json``
    and ``adapter_model.safetensors`` under PEFT's tensor names
    (``base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight``), fp32.

    ``A [r, in]`` is ``N(0, 1/in)``, so ``x @ A.T`` keeps the scale of ``x``; ``B [out, r]`` is
    ``N(0, b_std^2)`` and non-zero (PEFT's default initialisation makes B zero, which would let a
    server that ignores adapters look correct).

    Args:
        path: the directory to create (parents too; an existing adapter is overwritten).
        config: the base model's config (shapes and layer count).
        rank: ``r``.
        alpha: ``lora_alpha`` (scaling ``alpha / r``).
        seed: seeds the weights; the same arguments give the same files.
        target_modules: PEFT module names among q/k/v/o/gate/up/down_proj.
        b_std: standard deviation of B.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        TypeError: ``config`` is not a :class:`ModelConfig`.
        ValueError: an unknown target module or a rank below 1.
    """
    from safetensors.torch import save_file

    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a tgraph ModelConfig (ModelConfig.from_dict / from_dir), "
                        f"got {type(config).__name__}")
    unknown = sorted(set(target_modules) - set(_PARENTS))
    if unknown or not target_modules:
        raise ValueError(f"target_modules must be a non-empty subset of {list(_PARENTS)}, got "
                         f"{list(target_modules)}")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shapes = lora_module_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for module in target_modules:
            n_in, n_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{_PARENTS[module]}.{module}"
            a = torch.randn(rank, n_in, generator=gen) / n_in ** 0.5
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * b_std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    # The keys PEFT's LoraConfig reads; everything tgraph refuses (DoRA, biases...) is off.
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": list(target_modules),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    return path


# ---- measuring -----------------------------------------------------------------------------------
@dataclass
class LoraBenchResult:
    """One decode-step measurement of base, multi-LoRA and single-LoRA on one model.

    Attributes:
        preset: the model preset (or ``"custom"``).
        device, dtype: where and in which dtype the model ran.
        batch, context: decode batch size and tokens in the cache per request.
        max_loras, rank: the multi-LoRA slots and the adapters' rank (= the features' max_rank).
        cuda_graph_buckets: buckets ``capture_decode_graphs`` captured (empty: no CUDA graphs).
        capture_s: seconds of ``capture_decode_graphs`` (base decode engine build + capture).
        decode_ms: system -> median milliseconds of one decode step (``model.run``: input
            preparation, graph launch and logits, timed with CUDA events on a GPU).
        replay_ms: system -> median milliseconds of its captured graph replayed alone (the
            device time of the step; CUDA only).
        host_ms: system -> median CPU milliseconds of ``model.run`` started on an idle GPU
            (CUDA only).
        first_step_s: system -> seconds of the first step (engine build and any lazy capture).
        captured_signatures: system -> ``captured_signatures`` of its decode engine after the
            timed steps (> 0: the step replayed a CUDA graph).
        logit_change: LoRA system -> ``max|logits - base| / max|base|`` (adapters are active).
        single_vs_multi: ``max|single - multi| / max|multi|`` over the requests that used the
            single run's adapter in the multi run.
        skipped: system -> why it was not measured.
        merge_single: the single adapter was merged into the weights (else recorded in its
            engines).
    """

    preset: str
    device: str
    dtype: str
    batch: int
    context: int
    max_loras: int
    rank: int
    cuda_graph_buckets: list[int] = field(default_factory=list)
    capture_s: float = 0.0
    decode_ms: dict[str, float] = field(default_factory=dict)
    replay_ms: dict[str, float] = field(default_factory=dict)
    host_ms: dict[str, float] = field(default_factory=dict)
    first_step_s: dict[str, float] = field(default_factory=dict)
    captured_signatures: dict[str, int] = field(default_factory=dict)
    logit_change: dict[str, float] = field(default_factory=dict)
    single_vs_multi: float | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    merge_single: bool = True

    @property
    def ratios(self) -> dict[str, float]:
        """System -> its decode time over the base model's."""
        base = self.decode_ms.get("base")
        return {k: v / base for k, v in self.decode_ms.items() if base}

    @property
    def captured(self) -> dict[str, bool]:
        """System -> whether its decode engine ran from a captured CUDA graph."""
        return {k: v > 0 for k, v in self.captured_signatures.items()}

    def to_json(self) -> dict[str, Any]:
        """The fields plus ``ratios`` and ``captured``, JSON-ready."""
        return {**asdict(self), "ratios": self.ratios, "captured": self.captured}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """CUDA-event median on a GPU (:func:`tgraph.bench.timing.time_ms`), wall clock on CPU."""
    if device.type == "cuda":
        from tgraph.bench.timing import time_ms

        return time_ms(fn, warmup=warmup, iters=iters)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def measure_lora_decode(hf_config: dict[str, Any], *, batch: int = BATCH, context: int = CONTEXT,
                        max_loras: int = MAX_LORAS, rank: int = RANK,
                        dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                        warmup: int = 3, iters: int = 30, preset_name: str = "custom",
                        cuda_graph: bool = True, profile: bool = False,
                        merge_single: bool = True) -> LoraBenchResult:
    """Time one decode step of the base model, a mixed multi-LoRA batch, a single adapter, and
    both stacked.

    Builds the model of ``hf_config`` with random weights and both LoRA features, writes
    ``max_loras`` random rank-``rank`` PEFT adapters to a temporary directory, loads them, and
    times each system on the same batch (every request at ``context`` cached tokens).

    Args:
        hf_config: Hugging Face config fields (a preset, or a tiny config in tests).
        batch: decode batch size.
        context: tokens in the cache per request (the step decodes token ``context``).
        max_loras: multi-LoRA slots, all filled; request ``i`` uses adapter ``i % max_loras``.
        rank: rank of every adapter and the features' ``max_rank``.
        dtype, device: of the model.
        warmup, iters: untimed and timed steps per system.
        preset_name: recorded in the result.
        cuda_graph: capture decode CUDA graphs (only on CUDA).
        profile: also print each system's CUDA kernels by total time (torch profiler, 20 steps)
            and one step kernel by kernel (:mod:`tgraph.bench.timeline`), after every system is
            timed (the profiler leaves graph launches slower for the rest of the process).
        merge_single: merge the single adapter into the weights (else record it in engines).

    Returns:
        The measurement; a system that raised is listed in ``skipped`` with the error.

    Raises:
        ValueError: ``batch``, ``context``, ``max_loras``, ``rank`` or ``iters`` below 1.
    """
    sizes = {"batch": batch, "context": context, "max_loras": max_loras, "rank": rank,
             "iters": iters}
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"measure_lora_decode: expected positive ints, got {bad}")
    device = torch.device(device)
    config = ModelConfig.from_dict(hf_config)
    weights = random_weights(hf_config, dtype, str(device))
    features = {"multi_lora": {"max_rank": rank, "max_loras": max_loras},
                "single_lora": {"max_rank": rank, "merge": merge_single}}
    model = build_model(config, DictWeightLoader(weights, device=device, dtype=dtype),
                        max_model_len=context + 64, features=features, cuda_graph=cuda_graph)
    del weights
    block_size = model.llm_config.block_size
    model.allocate_kv_cache(batch * -(-(context + 1) // block_size) + 1)
    result = LoraBenchResult(preset_name, str(device), str(dtype).replace("torch.", ""), batch,
                             context, max_loras, rank, merge_single=merge_single)
    # Adapters first: the first load lays the target weights out beside their LoRA columns, which
    # engines built (and graphs captured) before would have to be rebound to.
    multi, single = model.features["multi_lora"], model.features["single_lora"]
    names = [f"lora{i}" for i in range(max_loras)]
    with tempfile.TemporaryDirectory(prefix="tgraph-lora-bench-") as tmp:
        for i, name in enumerate(names):
            path = write_random_adapter(Path(tmp) / name, config, rank=rank, seed=i + 1)
            multi.load(name, path)
            if i == 0:
                single.load(name, path)
    start = time.perf_counter()
    result.cuda_graph_buckets = list(model.capture_decode_graphs([batch]))
    _sync(device)
    result.capture_s = time.perf_counter() - start

    meta = decode_batch(batch, context, block_size, config.vocab_size)
    mixed = dataclasses.replace(meta, loras=[names[i % max_loras] for i in range(batch)])
    # system -> (batch, the single adapter active during its steps)
    runs = {"base": (meta, None), "multi_lora": (mixed, None), "single_lora": (meta, names[0]),
            "single+multi": (mixed, names[0])}
    logits: dict[str, torch.Tensor] = {}
    for system, (batch_meta, active) in runs.items():
        single.activate(active)
        step = functools.partial(model.run, batch_meta)
        try:
            _sync(device)
            start = time.perf_counter()
            out = step()
            _sync(device)
            result.first_step_s[system] = time.perf_counter() - start
            logits[system] = out.float().cpu()
            result.decode_ms[system] = _median_ms(step, device, warmup, iters)
            features = tuple(f for f in _FEATURES[system]
                             if not (f == "single_lora" and single.merged))
            engine = model.engines.get((False, features))
            result.captured_signatures[system] = int(getattr(engine, "captured_signatures", 0))
            if device.type == "cuda" and engine is not None and engine.captured_graphs:
                from tgraph.bench.timing import host_ms, time_ms

                graphs = engine.captured_graphs
                result.replay_ms[system] = time_ms(lambda: [g.replay() for g in graphs],
                                                   warmup=warmup, iters=iters)
                result.host_ms[system] = host_ms(step, iters=iters)
        except Exception as err:  # a failing system is reported, the others still measured
            result.skipped[system] = f"{type(err).__name__}: {str(err)[:300]}"
        finally:
            single.activate(None)
    # Profiles last: once the profiler has run, graph launches cost more host time for the rest
    # of the process, which would slow every system timed after it.
    for system, (batch_meta, active) in runs.items():
        if profile and system not in result.skipped:
            single.activate(active)
            try:
                _print_profile(system, functools.partial(model.run, batch_meta), device)
            finally:
                single.activate(None)

    if "base" in logits:
        for system in SYSTEMS[1:]:
            if system in logits:
                result.logit_change[system] = _rel(logits[system], logits["base"])
    if "multi_lora" in logits and "single_lora" in logits:
        rows = torch.arange(0, batch, max_loras)  # the requests that used names[0]
        result.single_vs_multi = _rel(logits["single_lora"][rows], logits["multi_lora"][rows])
    if "single+multi" in logits and "multi_lora" in logits:
        result.logit_change["single+multi vs multi"] = _rel(logits["single+multi"],
                                                            logits["multi_lora"])
    return result


def _print_profile(system: str, step: Callable[[], object], device: torch.device) -> None:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(20):
            step()
        _sync(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(f"--- {system}: 20 steps by kernel")
    print(prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=60))
    if device.type == "cuda":
        from tgraph.bench.timeline import print_timeline, profile_step

        print(f"--- {system}: one step, kernel by kernel")
        print_timeline(profile_step(step), limit=None)


# ---- reporting -----------------------------------------------------------------------------------
def print_table(results: Sequence[LoraBenchResult]) -> None:
    """Print one row per system of every result: ms, ratio to base, captured, first step."""
    print(f"\n{'preset':<14} {'batch':>5} {'single':<8} {'system':<12} {'decode ms':>10} "
          f"{'x base':>7} "
          f"{'replay ms':>10} {'x base':>7} {'host ms':>8} "
          f"{'captured':>9} {'first step s':>13} {'logit change':>13}")
    for r in results:
        ratios, captured = r.ratios, r.captured
        mode = "merged" if r.merge_single else "recorded"
        for system in SYSTEMS:
            if system in r.skipped:
                print(f"{r.preset:<14} {r.batch:>5} {mode:<8} {system:<12} skipped: "
                      f"{r.skipped[system]}")
                continue
            change = r.logit_change.get(system)
            replay, base_replay = r.replay_ms.get(system), r.replay_ms.get("base")
            replay_ratio = replay / base_replay if replay and base_replay else float("nan")
            print(f"{r.preset:<14} {r.batch:>5} {mode:<8} {system:<12} "
                  f"{r.decode_ms[system]:10.3f} "
                  f"{ratios.get(system, float('nan')):7.2f} "
                  f"{replay if replay else float('nan'):10.3f} {replay_ratio:7.2f} "
                  f"{r.host_ms.get(system, float('nan')):8.3f} "
                  f"{'yes' if captured.get(system) else 'no':>9} "
                  f"{r.first_step_s[system]:13.2f} "
                  f"{'-' if change is None else f'{change:.3f}':>13}")
        if r.single_vs_multi is not None:
            print(f"  single vs multi, same adapter: {r.single_vs_multi:.2e} relative")
        stacked = r.logit_change.get("single+multi vs multi")
        if stacked is not None:
            print(f"  single+multi vs multi: {stacked:.3f} relative (the single adapter's delta)")
        for system, change in r.logit_change.items():
            if change == 0.0:
                print(f"  WARNING {system}: logits equal the base model's; adapters had no effect")


def run_lora_bench(presets: Sequence[str] | None = None, batches: Sequence[int] = (1, 16, 64),
                   json_path: str | None = None, profile: bool = False) -> list[LoraBenchResult]:
    """The ``python -m tgraph.bench lora`` entry point (needs CUDA).

    Args:
        presets: model presets (default: ``llama-3.2-1b``).
        batches: decode batch sizes, two model builds each (the single adapter merged, then
            recorded).
        json_path: write the results (and the device) as JSON here.
        profile: print each system's kernels by time (see :func:`measure_lora_decode`).

    Returns:
        The results, in order.
    """
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"max_loras {MAX_LORAS}, rank {RANK}, context {CONTEXT}")
    results = []
    for name in presets or [DEFAULT_PRESET]:
        if name not in PRESETS:
            print(f"unknown preset {name}; known: {list(PRESETS)}")
            continue
        for b in batches:
            for merge in (True, False):
                results.append(measure_lora_decode(preset(name), batch=b, preset_name=name,
                                                      profile=profile, merge_single=merge))
                print_table(results[-1:])
                gc.collect()  # this run's model is garbage now: free its memory for the next
                torch.cuda.empty_cache()
    if len(results) > 1:
        print_table(results)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "results": [r.to_json() for r in results]}, f, indent=1, default=str)
    return results
