"""Runs the benchmark matrix: models x token counts x quantizations, plus ceilings and baselines.

Per case (one model, one token count, one quant) the same routed rows feed:

* ``experts``: the kernel ``select_kernel`` picks, on the routed rows (graph-replayed);
* ``layer``: ``MoELayer`` on one GPU, local backend, from hidden states to output
  (router, quantization, dispatch, experts, combine, shared experts; graph-replayed);
* ``shared``: the layer's shared experts alone on the same hidden states, for the models that
  have them (graph-replayed): with ``experts`` the expert work of the layer, what is left of
  the layer's time being the router, quantization, dispatch and combine around it;
* baselines for bf16 (``moeshard.bench.baselines``) and row-scaled fp8.

Ratios are derived from figures of the same run only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from moeshard.bench import baselines
from moeshard.bench.ceilings import copy_gbps, matmul_tflops
from moeshard.bench.device import describe, require_cuda
from moeshard.bench.timing import L2Flush, graphed, release_memory, time_cuda
from moeshard.bench.workload import (
    ModelOnDevice,
    active_experts,
    bytes_per_expert,
    check_choices,
    expert_flops,
    experts_for,
    hidden_states,
    layer_flops,
    make_model,
    routed_input,
)
from moeshard.config import QuantConfig, shared_schemes
from moeshard.experts import GroupedExperts
from moeshard.kernel_choice import kernel_choice, select_kernel
from moeshard.layer import MoELayer
from moeshard.quant.schemes import BUILTIN_SCHEMES
from moeshard.validate import positive_int

BENCH_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")


@dataclass(frozen=True)
class BenchOptions:
    """What to run. Token counts: prefill 4096..16384, decode 1..128 by default. shared_quant:
    the layer's shared experts' scheme (``QuantConfig.shared``) with a quantized routed scheme,
    for the models that have shared experts ("none": the model dtype)."""

    models: tuple[str, ...] = BENCH_MODELS
    quants: tuple[str, ...] = BUILTIN_SCHEMES
    prefill_tokens: tuple[int, ...] = (4096, 16384)
    decode_tokens: tuple[int, ...] = (1, 16, 64, 128)
    prefill_reps: int = 10
    decode_reps: int = 40
    layer: bool = True
    baselines: bool = True
    seed: int = 0
    shared_quant: str = "none"

    def validate(self) -> None:
        check_choices(self.models, self.quants)
        if self.shared_quant not in ("none", *shared_schemes()):
            raise ValueError(f"BenchOptions.shared_quant: {self.shared_quant!r} is not 'none' or one of "
                             f"{list(shared_schemes())} (quantized with per-row or per-block activation scales)")
        for name in ("prefill_tokens", "decode_tokens"):
            for tokens in getattr(self, name):
                positive_int("BenchOptions", name, tokens)
        positive_int("BenchOptions", "prefill_reps", self.prefill_reps)
        positive_int("BenchOptions", "decode_reps", self.decode_reps)

    def quant(self, scheme: str, cfg) -> QuantConfig:
        """The layer's ``QuantConfig`` for routed ``scheme`` on a model of ``cfg``: shared experts
        quantized with ``shared_quant`` where there are shared experts and the routed scheme is
        quantized."""
        shared = self.shared_quant if scheme != "none" and cfg.has_shared_experts else "none"
        return QuantConfig(scheme, shared=shared)


def _timed(rec: dict, key: str, fn: Callable[[], object], reps: int, flush: L2Flush, graph: bool = True) -> None:
    """Stores the median ms of ``fn`` (captured in a CUDA graph unless ``graph`` is False) as
    ``rec[key + "_ms"]``; a failure (capture refused, kernel error) is stored as ``key + "_error"``
    so that one broken implementation does not end the run."""
    g = None
    try:
        if graph:
            g = graphed(fn)
            rec[key + "_ms"] = time_cuda(g, warmup=2, reps=reps, flush=flush).median_ms
        else:
            rec[key + "_ms"] = time_cuda(fn, warmup=2, reps=max(3, reps // 2), flush=flush).median_ms
    except Exception as exc:
        torch.cuda.synchronize()
        rec[key + "_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        if g is not None:
            g.release()


def _case(model: ModelOnDevice, scheme: str, experts, kernel, layer: MoELayer | None, regime: str, tokens: int,
          opts: BenchOptions, flush: L2Flush) -> dict:
    cfg = model.cfg
    E = cfg.num_experts
    reps = opts.prefill_reps if regime == "prefill" else opts.decode_reps
    x = hidden_states(model, tokens, opts.seed + tokens)
    inp, _ = routed_input(model, x, QuantConfig(scheme))
    rows, active = inp.num_rows, active_experts(inp.expert_ids, E)
    rec = {"model": model.name, "regime": regime, "tokens": tokens, "quant": scheme, "rows": rows,
           "shared_quant": opts.quant(scheme, cfg).shared,
           "active_experts": active, "kernel": type(kernel).__name__,
           "expert_flops": expert_flops(rows, cfg), "layer_flops": layer_flops(tokens, cfg),
           "weight_bytes": bytes_per_expert(experts) * active}
    _timed(rec, "experts", lambda: kernel(inp, experts), reps, flush)
    if layer is not None:
        _timed(rec, "layer", lambda: layer(x), reps, flush)
        shared = layer.shared_experts
        rec["shared_experts"] = shared is not None
        if shared is not None:
            _timed(rec, "shared", lambda: shared(x), reps, flush)
    if opts.baselines and scheme == "none":
        x_sorted, offsets, counts = baselines.sorted_rows(inp, E)
        _timed(rec, "grouped_mm", baselines.grouped_mm(x_sorted, offsets, experts), reps, flush)
        portable = GroupedExperts(cfg.activation, cfg.dtype)
        _timed(rec, "portable", lambda: portable(inp, experts), reps, flush)
        _timed(rec, "loop", baselines.per_expert_loop(x_sorted, counts, experts, cfg.activation), reps, flush,
               graph=False)
    if opts.baselines and scheme in ("fp8_tensor", "fp8_token"):
        x_sorted, offsets, _ = baselines.sorted_rows(inp, E)
        fn = baselines.scaled_grouped_mm(x_sorted, offsets, experts)
        if fn is not None:
            _timed(rec, "scaled_grouped_mm", fn, reps, flush)
    return rec


def all_experts_ms(r: dict) -> float | None:
    """The record's expert work in ms: the routed experts, plus the shared experts timed alone
    where the model has them; None where that is not known (a record of a run made before the
    bench timed the shared experts, or whose shared timing failed)."""
    if "shared_experts" not in r:
        return None
    if not r["shared_experts"]:
        return r["experts_ms"]
    return r["experts_ms"] + r["shared_ms"] if "shared_ms" in r else None


def derive(records: list[dict], ceilings: dict) -> None:
    """Adds throughput figures and same-run ratios to every record, in place."""
    peak, copy = ceilings["matmul"]["tflops"], ceilings["copy"]["gbps"]
    bf16 = {(r["model"], r["tokens"]): r for r in records if r["quant"] == "none"}
    for r in records:
        if "experts_ms" not in r:
            r["ratios"] = {}
            continue
        t = r["experts_ms"] * 1e-3
        r["expert_tflops"] = r["expert_flops"] / t / 1e12
        r["weight_gbps"] = r["weight_bytes"] / t / 1e9
        ratios = {"vs_peak": r["expert_tflops"] / peak, "vs_copy": r["weight_gbps"] / copy}
        if "layer_ms" in r:
            r["layer_tflops"] = r["layer_flops"] / (r["layer_ms"] * 1e-3) / 1e12
            ratios["layer_over_experts"] = r["experts_ms"] / r["layer_ms"]
            ratios["layer_over_experts_flops"] = r["layer_tflops"] / r["expert_tflops"]
            all_experts = all_experts_ms(r)
            if all_experts is not None:
                ratios["layer_over_all_experts"] = all_experts / r["layer_ms"]
        for base in ("grouped_mm", "portable", "loop", "scaled_grouped_mm"):
            if f"{base}_ms" in r:
                ratios[f"vs_{base}"] = r[f"{base}_ms"] / r["experts_ms"]
                if base == "grouped_mm":
                    r["grouped_mm_tflops"] = r["expert_flops"] / (r["grouped_mm_ms"] * 1e-3) / 1e12
        ref = bf16.get((r["model"], r["tokens"]))
        if ref is not None and r["quant"] != "none" and "experts_ms" in ref:
            ratios["vs_bf16"] = ref["experts_ms"] / r["experts_ms"]
        r["ratios"] = ratios


def run(opts: BenchOptions, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Runs everything in ``opts``; returns the JSON-ready result (device, ceilings, records)."""
    opts.validate()
    device = require_cuda()
    flush = L2Flush(device)
    progress("ceilings: dense bf16 matmul 8192^3, device copy 2 GiB")
    ceilings = {"matmul": matmul_tflops(device), "copy": copy_gbps(device)}
    progress(f"  matmul {ceilings['matmul']['tflops']:.0f} TFLOP/s, copy {ceilings['copy']['gbps']:.0f} GB/s")
    records: list[dict] = []
    cases = [("prefill", t) for t in opts.prefill_tokens] + [("decode", t) for t in opts.decode_tokens]
    for name in opts.models:
        progress(f"{name}: weights on the GPU")
        model = make_model(name, device, opts.seed)
        for scheme in opts.quants:
            experts = experts_for(model, scheme)
            kernel = select_kernel(model.cfg.activation, model.cfg.dtype, device, scheme)
            layer = None
            if opts.layer:
                layer = MoELayer(model.cfg, opts.quant(scheme, model.cfg), weights=model.shell, local_experts=experts,
                                 device=device)
            for regime, tokens in cases:
                rec = _case(model, scheme, experts, kernel, layer, regime, tokens, opts, flush)
                records.append(rec)
                progress(f"  {name} {scheme:10s} {regime:7s} T={tokens:<6d} "
                         + ", ".join(f"{k[:-3]} {v:.3f} ms" for k, v in rec.items() if k.endswith("_ms"))
                         + "".join(f"; {k}: {v}" for k, v in rec.items() if k.endswith("_error")))
            del layer, experts, kernel
            release_memory(collect=True)
        del model
        release_memory(collect=True)
    derive(records, ceilings)
    choices = {q: kernel_choice(torch.bfloat16, device, q) for q in opts.quants}
    return {"device": describe(device), "options": asdict(opts), "ceilings": ceilings,
            "kernels": {q: {"name": n, "reason": why} for q, (n, why) in choices.items()}, "records": records}
