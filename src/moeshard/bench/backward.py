"""``moeshard bench --backward``: the training cost of the experts and of the whole layer.

Per model and prefill token count, on the routed rows of ``moeshard.bench.workload`` (bf16):

* ``experts_fwd`` / ``experts_fwdbwd``: the experts as a training forward runs them
  (``GroupedExperts``: sort, gather, ``torch._grouped_mm``, activation, unsort), forward alone
  and forward plus the backward to the input rows and both weights;
* ``grouped_mm_fwd`` / ``grouped_mm_fwdbwd``: the baseline, the same computation written
  plainly on rows already sorted by expert (the sort, gather and unsort are not counted):
  ``torch._grouped_mm`` gate_up, the activation, ``torch._grouped_mm`` down, through autograd;
* ``layer_fwd`` / ``layer_fwdbwd``: ``MoELayer`` (local backend) from hidden states to output
  with every parameter requiring grad: router, dispatch, experts, combine, shared experts.

The backward time of each is fwdbwd - fwd. Gradients come from ``torch.autograd.grad`` with a
fixed random upstream gradient, so nothing accumulates between repetitions. Timing is eager (a
training step is not graph-captured here), median of the repetitions, each after an L2 flush on
the GPU. On CPU the same plan runs with host timing: that checks the plumbing, its times say
nothing about GPUs.

``weight_grad_rel_diff`` checks that both computed the same weight gradients (largest
difference over the largest gradient). Derived: ``experts_bwd_vs_grouped_mm`` (baseline
backward / ours, target >= 1.0) and, for the layer and the experts, ``bwd_over_fwd``
(backward time / forward time, target <= 2.2) and TFLOP/s counting the backward as twice the
forward's multiply-adds.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeshard.bench.timing import L2Flush, release_memory, time_cuda, time_host
from moeshard.bench.workload import (
    check_choices,
    expert_flops,
    hidden_states,
    layer_flops,
    make_model,
    routed_input,
)
from moeshard.config import QuantConfig
from moeshard.experts import GroupedExperts
from moeshard.experts.base import ExpertWeights, activate
from moeshard.experts.grouped import group_sizes
from moeshard.layer import MoELayer
from moeshard.validate import positive_int

BACKWARD_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
BWD_OVER_FWD_MAX = 2.2
# weight_grad_rel_diff above this is a wrong gradient, not rounding: the bench fails (exit 1).
WEIGHT_GRAD_BOUND = 2e-2
VS_GROUPED_MM_MIN = 1.0


@dataclass(frozen=True)
class BackwardOptions:
    """What to run: presets (at ``size``), prefill token counts, repetitions."""

    models: tuple[str, ...] = BACKWARD_MODELS
    tokens: tuple[int, ...] = (4096,)
    reps: int = 10
    size: str = "full"
    layer: bool = True
    seed: int = 0

    def validate(self) -> None:
        check_choices(self.models, ("none",))
        for t in self.tokens:
            positive_int("BackwardOptions", "tokens", t)
        positive_int("BackwardOptions", "reps", self.reps)
        if self.size not in ("full", "medium", "small"):
            raise ValueError(f"BackwardOptions.size must be full, medium or small, got {self.size!r}")


def _timer(device: torch.device, reps: int) -> Callable[[Callable[[], object]], float]:
    flush = L2Flush(device) if device.type == "cuda" else None

    def timed(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            return time_cuda(fn, warmup=2, reps=reps, flush=flush).median_ms
        return time_host(fn, warmup=1, reps=max(3, reps // 2)).median_ms
    return timed


def _trainable(t: torch.Tensor) -> torch.Tensor:
    """A leaf that requires grad and shares ``t``'s memory (full-size weights are not copied)."""
    return t.detach().requires_grad_(True)


def _experts_fns(gate_up: torch.Tensor, down: torch.Tensor, inp, activation: str, dtype: torch.dtype, seed: int):
    """(forward, forward + backward) of ``GroupedExperts`` with x and both weights trainable
    (gate_up [E, 2I, H], down [E, H, I], bf16)."""
    x = _trainable(inp.x)
    w13, w2 = _trainable(gate_up), _trainable(down)
    w = ExpertWeights(w13, w2)
    trained = dataclasses.replace(inp, x=x)
    kernel = GroupedExperts(activation, dtype)
    gen = torch.Generator(device=x.device).manual_seed(seed)
    g = torch.randn(inp.num_rows, x.shape[1], generator=gen, device=x.device).to(dtype)

    def fwd():
        return kernel(trained, w)

    def fwdbwd():
        return torch.autograd.grad(kernel(trained, w), (x, w13, w2), g)
    return fwd, fwdbwd


def _grouped_mm_fns(gate_up: torch.Tensor, down: torch.Tensor, inp, num_experts: int, activation: str,
                    dtype: torch.dtype, seed: int):
    """The plain baseline on rows sorted by expert: grouped_mm, activation, grouped_mm."""
    order = torch.argsort(inp.expert_ids, stable=True)
    offsets = torch.cumsum(group_sizes(inp.expert_ids, num_experts), 0).to(torch.int32)
    xs = _trainable(inp.x[order // inp.repeat])
    w13, w2 = _trainable(gate_up), _trainable(down)
    gen = torch.Generator(device=xs.device).manual_seed(seed)
    # The upstream gradient of the experts' rows, in the sorted order these rows are in.
    g = torch.randn(xs.shape[0], xs.shape[1], generator=gen, device=xs.device).to(dtype)[order]

    def fwd():
        h = activate(torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offsets), activation, dtype)
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)

    def fwdbwd():
        return torch.autograd.grad(fwd(), (xs, w13, w2), g)
    return fwd, fwdbwd


def _layer_fns(model, tokens: int, device: torch.device, seed: int):
    layer = MoELayer(model.cfg, QuantConfig("none"), weights=model.shell,
                     local_experts=ExpertWeights(model.gate_up, model.down), device=device).requires_grad_(True)
    x = _trainable(hidden_states(model, tokens, seed + tokens))
    params = [p for p in layer.parameters() if p.requires_grad]
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    g = torch.randn(tokens, model.cfg.hidden_size, generator=gen, device=device).to(model.cfg.dtype)

    def fwd():
        return layer(x)

    def fwdbwd():
        return torch.autograd.grad(layer(x), [x, *params], g)
    return fwd, fwdbwd, layer


def _weight_grad_diff(ours: Callable[[], tuple], base: Callable[[], tuple]) -> float | None:
    """Largest |difference| of the two implementations' weight gradients (gate_up, down), over
    the largest |gradient|: both ran on the same rows with the same upstream gradient, so this
    is rounding only (bf16). None where either failed."""
    try:
        with torch.enable_grad():
            a, b = ours()[1:], base()[1:]
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        return None
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        diff = scale = 0.0
        for e in range(x.shape[0]):  # one expert at a time: fp32 copies of all of them need tens of GB
            diff = max(diff, float((x[e].float() - y[e].float()).abs().max()))
            scale = max(scale, float(y[e].float().abs().max()))
        worst = max(worst, diff / max(scale, 1e-30))
    return worst


def _derive(rec: dict, flops: int, prefix: str) -> None:
    fwd, both = rec.get(f"{prefix}_fwd_ms"), rec.get(f"{prefix}_fwdbwd_ms")
    if fwd is None or both is None:
        return
    bwd = max(both - fwd, 1e-6)
    rec[f"{prefix}_bwd_ms"] = bwd
    rec[f"{prefix}_bwd_over_fwd"] = bwd / fwd
    rec[f"{prefix}_fwd_tflops"] = flops / (fwd * 1e-3) / 1e12
    rec[f"{prefix}_bwd_tflops"] = 2 * flops / (bwd * 1e-3) / 1e12


def _timed(rec: dict, key: str, timed: Callable[[Callable[[], object]], float], fn: Callable[[], object]) -> None:
    """rec[key + "_ms"] = the median time of fn; a failure is kept as key + "_error"."""
    try:
        with torch.enable_grad():
            rec[key + "_ms"] = timed(fn)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rec[key + "_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"


def run(opts: BackwardOptions, device: torch.device, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Runs every (model, tokens) case; returns {"options", "records"}."""
    opts.validate()
    timed = _timer(device, opts.reps)
    records: list[dict] = []
    for name in opts.models:
        progress(f"{name} ({opts.size}): weights on {device.type}")
        model = make_model(name, device, opts.seed, size=opts.size)
        cfg = model.cfg
        for tokens in opts.tokens:
            x = hidden_states(model, tokens, opts.seed + tokens)
            inp, _ = routed_input(model, x, QuantConfig("none"))
            rec: dict = {"model": name, "tokens": tokens, "rows": inp.num_rows,
                         "expert_flops": expert_flops(inp.num_rows, cfg), "layer_flops": layer_flops(tokens, cfg)}
            fwd, both = _experts_fns(model.gate_up, model.down, inp, cfg.activation, cfg.dtype, opts.seed)
            _timed(rec, "experts_fwd", timed, fwd)
            _timed(rec, "experts_fwdbwd", timed, both)
            ours = both
            fwd, both = _grouped_mm_fns(model.gate_up, model.down, inp, cfg.num_experts, cfg.activation, cfg.dtype, opts.seed)
            _timed(rec, "grouped_mm_fwd", timed, fwd)
            _timed(rec, "grouped_mm_fwdbwd", timed, both)
            rec["weight_grad_rel_diff"] = _weight_grad_diff(ours, both)
            del fwd, both, ours
            if opts.layer:
                fwd, both, layer = _layer_fns(model, tokens, device, opts.seed)
                _timed(rec, "layer_fwd", timed, fwd)
                _timed(rec, "layer_fwdbwd", timed, both)
                del fwd, both, layer
            for prefix, flops in (("experts", rec["expert_flops"]), ("grouped_mm", rec["expert_flops"]),
                                  ("layer", rec["layer_flops"])):
                _derive(rec, flops, prefix)
            if "experts_bwd_ms" in rec and "grouped_mm_bwd_ms" in rec:
                rec["experts_bwd_vs_grouped_mm"] = rec["grouped_mm_bwd_ms"] / rec["experts_bwd_ms"]
            records.append(rec)
            progress(f"  {name} T={tokens:<6d} " + ", ".join(
                f"{k[:-3]} {v:.3f} ms" for k, v in rec.items() if k.endswith("_ms"))
                + "".join(f"; {k}: {v}" for k, v in rec.items() if k.endswith("_error")))
            gc.collect()
            if device.type == "cuda":
                release_memory()
        del model
        gc.collect()
        if device.type == "cuda":
            release_memory()
    return {"options": {"models": list(opts.models), "tokens": list(opts.tokens), "reps": opts.reps,
                        "size": opts.size, "layer": opts.layer, "seed": opts.seed},
            "records": records, "targets": targets(records)}


def targets(records: list[dict]) -> list[dict]:
    """The two backward targets over every record that has their figures."""
    out = []
    for name, key, threshold, better in (
            ("experts_bwd_vs_grouped_mm", "experts_bwd_vs_grouped_mm", VS_GROUPED_MM_MIN, "higher"),
            ("layer_bwd_over_fwd", "layer_bwd_over_fwd", BWD_OVER_FWD_MAX, "lower"),
            ("experts_bwd_over_fwd", "experts_bwd_over_fwd", BWD_OVER_FWD_MAX, "lower")):
        values = [(r["model"], r["tokens"], r[key]) for r in records if key in r]
        met = [v for v in values if (v[2] >= threshold if better == "higher" else v[2] <= threshold)]
        out.append({"name": name, "threshold": threshold, "better": better, "cases": len(values), "met": len(met),
                    "values": [{"model": m, "tokens": t, "value": v} for m, t, v in values]})
    return out


def print_tables(result: dict, out=None) -> None:
    """One line per case and one per target, plain text."""
    import sys
    out = out or sys.stdout
    print("model            tokens  experts fwd/bwd ms  grouped_mm fwd/bwd ms  bwd vs grouped_mm  "
          "layer fwd/bwd ms  layer bwd/fwd  layer bwd TFLOP/s", file=out)
    for r in result["records"]:
        def f(key, fmt="{:.3f}", r=r):
            return fmt.format(r[key]) if key in r else "-"
        print(f"{r['model']:16s} {r['tokens']:6d}  {f('experts_fwd_ms'):>8s}/{f('experts_bwd_ms'):<8s}  "
              f"{f('grouped_mm_fwd_ms'):>10s}/{f('grouped_mm_bwd_ms'):<10s}  {f('experts_bwd_vs_grouped_mm', '{:.2f}x'):>17s}  "
              f"{f('layer_fwd_ms'):>7s}/{f('layer_bwd_ms'):<8s}  {f('layer_bwd_over_fwd', '{:.2f}x'):>13s}  "
              f"{f('layer_bwd_tflops', '{:.0f}'):>17s}", file=out)
    for t in result["targets"]:
        sign = ">=" if t["better"] == "higher" else "<="
        print(f"target {t['name']} {sign} {t['threshold']}: {t['met']} of {t['cases']} met", file=out)
