"""Where a decode step's expert time goes, and what the L2 flush before each repetition costs (one GPU).

``moeshard bench`` flushes L2 before every timed repetition by overwriting a buffer several times
the cache, so every line left in L2 is dirty: the timed call then writes those lines back to HBM
while it streams its weights. The 2 GiB copy that the bench's bandwidth ceiling comes from pays
that once over about a millisecond; a one-token MoE call pays it within about a hundred
microseconds. This study times, for each model, token count and scheme:

* the whole ``TritonExperts`` call, the same call with its tile plan made ahead (what the plan
  costs inside the chain, where the launches after it wait on it), and each of its stages alone
  (tile plan, gate_up, quantize_h, down), captured in CUDA graphs, under three flushes:
  ``write`` (the bench's), ``read`` (a reduction over the same buffer: L2 is left full of clean
  lines, as after a layer that only read its weights) and ``none`` (the weights may stay in L2:
  a floor, not a figure);
* a read of the same number of bytes as the call's weights under each flush: what streaming those
  bytes costs with nothing else to do, as ``torch.sum`` over a buffer of that size and as a
  purpose-built Triton reader (``read_stream``: wide loads, a checksum per program so that
  nothing is elided) at several grid sizes and load widths, the fastest of which is kept as
  ``read_fastest`` and every one listed under ``read_sweep``; that reader also reads the gate_up
  GEMM's share of the bytes and the down GEMM's alone (``read_gate_up_bytes``,
  ``read_down_bytes``), the floors of those kernels timed alone;
* the GPU time of each kernel inside the graphed call under the ``write`` flush (the CUDA
  profiler), so that the call's time splits into kernels and the gaps between them;
* where one token's rows run as matrix-vector products (``ExpertsConfig.gemv``: the GPU's
  selected config, or with ``--gemv`` ``configs.ONE_TOKEN_BLOCK_GEMV`` at every fp8 scheme),
  each GEMV alone (``gemv_gate_up``, ``gemv_down``), against the reader's floors above.

    PYTHONPATH=src python3 scripts/decode_study.py --json results/h200/decode_study.json
    PYTHONPATH=src python3 scripts/decode_study.py --cases deepseek-v3:1,mixtral-8x7b:1 --schemes fp8_tensor

``--ncu MODEL:SCHEME:TOKENS`` instead runs that call eagerly a few times without flushes, for
``ncu`` to profile its kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from moeshard.bench.study import plan_made_ahead
from moeshard.bench.timing import L2Flush, graph_median_ms, graphed
from moeshard.bench.workload import bytes_per_expert, experts_for, hidden_states, make_model, projection_bytes, routed_input
from moeshard.config import QuantConfig
from moeshard.kernels.align import align_rows, split_tiles
from moeshard.kernels.configs import FP8, FP8_TOKEN, ONE_TOKEN_BLOCK_GEMV, GemvConfig, gpu_kind, multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts
from moeshard.kernels.gemv import down_gemv, gate_up_gemv
from moeshard.kernels.grouped_gemm import moe_gemm
from moeshard.kernels.quant import quantize_h
from moeshard.quant import get_scheme

CASES = (("deepseek-v3", (1, 16)), ("qwen3-30b-a3b", (1,)), ("mixtral-8x7b", (1,)))
SCHEMES = ("none", "fp8_tensor", "fp8_block")
# The Triton reader's variants: (programs per multiprocessor, int32 elements a program loads per step).
READ_SWEEP = tuple((per_sm, block) for per_sm in (1, 2, 4, 8, 16) for block in (2048, 4096, 8192))


@triton.jit
def _read_kernel(src_ptr, out_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums src[p * CHUNK : (p + 1) * CHUNK] (int32, wrapping) into out[p]."""
    start = tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + idx, mask=idx < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def read_stream(src: torch.Tensor, programs: int, block: int):
    """(a call that streams the int32 tensor ``src`` once with at most ``programs`` programs, each
    reading a contiguous chunk ``block`` elements a step (8 warps: 16-byte loads), the int32 [grid]
    it writes one checksum per program into)."""
    n = src.numel()
    chunk = triton.cdiv(triton.cdiv(n, programs), block) * block
    grid = triton.cdiv(n, chunk)
    out = torch.empty(grid, dtype=torch.int32, device=src.device)
    return (lambda: _read_kernel[(grid,)](src, out, n, CHUNK=chunk, BLOCK=block, num_warps=8)), out


class ReadFlush:
    """Reads a buffer several times the L2 size before each repetition (a sum into a scalar):
    the lines it leaves in L2 are clean, so evicting them costs the timed call nothing."""

    def __init__(self, device: torch.device) -> None:
        self.buffer = L2Flush(device).buffer
        self.out = torch.empty((), dtype=self.buffer.dtype, device=device)

    def __call__(self) -> None:
        torch.sum(self.buffer, dim=0, out=self.out)


def _flushes(device: torch.device) -> dict:
    return {"write": L2Flush(device), "read": ReadFlush(device), "none": None}


def _ms(fn, flush, reps: int) -> float:
    return graph_median_ms(fn, reps=reps, flush=flush, warmup=3)


def _kernel_us(fn, flush, reps: int) -> list[tuple[str, float]]:
    """(kernel, GPU us per call) inside the graphed ``fn``, each call after ``flush``; the
    flush's own kernels are told apart by profiling the flush alone first."""
    from torch.profiler import ProfilerActivity, profile

    def names(prof) -> dict[str, float]:
        return {e.key: e.device_time_total / reps for e in prof.key_averages() if e.device_time_total > 0}

    g = graphed(fn)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as p_flush:
            for _ in range(reps):
                flush()
            torch.cuda.synchronize()
        flush_names = set(names(p_flush))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                flush()
                g()
            torch.cuda.synchronize()
        return sorted(((k, v) for k, v in names(prof).items() if k not in flush_names), key=lambda r: -r[1])
    finally:
        g.release()


class Call:
    """One routed call's inputs and stages, as ``TritonExperts`` runs them."""

    def __init__(self, model, tokens: int, scheme: str, gemv: GemvConfig | None = None) -> None:
        """gemv: the GEMVs to time alone at one token (fp8 schemes), in place of the selected
        config's (None: the selected config's, which may be none)."""
        device = model.gate_up.device
        cfg = model.cfg
        self.spec = get_scheme(scheme)
        self.experts = experts_for(model, scheme)
        x = hidden_states(model, tokens, tokens)
        self.inp, _ = routed_input(model, x, QuantConfig(scheme))
        M, E, H, I = self.inp.num_rows, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.sel = select_config(M, E, H, I, scheme, multiprocessors(device.index), gpu=gpu_kind(device.index))
        self.amax = torch.empty(E, dtype=torch.float32, device=device) if self.spec.per_tensor_activation else None
        self.plan = align_rows(self.inp.expert_ids, E, self.sel.block_m, amax=self.amax)
        self.h = torch.empty(self.plan.padded_rows, I, dtype=cfg.dtype, device=device)
        self.cfg, self.scheme, self.E = cfg, scheme, E
        self.gate_up()
        self.hq = quantize_h(self.h, scheme, self.plan, self.amax) if self.spec.quantized else self.h
        self.y = torch.empty(M, H, dtype=cfg.dtype, device=device)
        self.down_plan = split_tiles(self.plan, self.sel.down.block_m)
        self.kernel = TritonExperts(cfg.activation, cfg.dtype)
        active = int((torch.bincount(self.inp.expert_ids, minlength=E) > 0).sum())
        self.weight_bytes = bytes_per_expert(self.experts) * active
        # Each GEMM's share of them (data, scales and global scales of that projection).
        self.gate_up_bytes = active * projection_bytes(self.experts.gate_up) / E
        self.rows, self.active = M, active
        # The same call with the plan made before it (what the plan costs inside the chain).
        self.experts_plan_ahead = plan_made_ahead(self.experts_call)
        # One token's GEMVs alone, with h and the scale maxima in buffers of their own (the maxima
        # are not zeroed again between repetitions: the same loads, atomics and stores).
        one_token = self.inp.repeat == M and self.spec.kernel_mode in FP8
        self.gemv = (gemv or self.sel.gemv) if one_token else None
        if self.gemv is not None:
            mode = self.spec.kernel_mode
            self.ids = self.inp.expert_ids.contiguous()
            self.gemv_h = torch.empty(M, I, dtype=cfg.dtype, device=device)
            self.gemv_amax = torch.zeros(E, dtype=torch.float32, device=device) if mode == 1 else None
            self.gemv_row_amax = torch.zeros(M, dtype=torch.float32, device=device) if mode == FP8_TOKEN else None
            self.gemv_gate_up()

    def experts_call(self):
        return self.kernel(self.inp, self.experts)

    def align(self):
        return align_rows(self.inp.expert_ids, self.E, self.sel.block_m, amax=self.amax)

    def gate_up(self):
        return moe_gemm(self.inp.x, self.experts.gate_up, self.plan, self.h, self.sel.gate_up,
                        activation=self.cfg.activation, gather=True, amax=self.amax, a_row_div=self.inp.repeat)

    def quant_h(self):
        return quantize_h(self.h, self.scheme, self.plan, self.amax)

    def down(self):
        return moe_gemm(self.hq, self.experts.down, self.down_plan, self.y, self.sel.down, activation=None,
                        gather=False)

    def gemv_gate_up(self):
        return gate_up_gemv(self.inp.x, self.experts.gate_up, self.ids, self.gemv_h, self.gemv,
                            activation=self.cfg.activation, x_row_div=self.inp.repeat, amax=self.gemv_amax,
                            row_amax=self.gemv_row_amax, bias=self.experts.gate_up_bias)

    def gemv_down(self):
        return down_gemv(self.gemv_h, self.experts.down, self.ids, self.y, self.gemv,
                         h_amax=self.gemv_amax if self.gemv_amax is not None else self.gemv_row_amax,
                         bias=self.experts.down_bias)


def study(name: str, tokens: int, scheme: str, model, flushes: dict, reps: int, log,
          gemv: GemvConfig | None = None) -> dict:
    call = Call(model, tokens, scheme, gemv)
    device = model.gate_up.device
    stream = torch.empty(int(call.weight_bytes) // 4, dtype=torch.float32, device=device).uniform_()
    stream_out = torch.empty((), dtype=torch.float32, device=device)
    sms = multiprocessors(device.index)
    readers = {f"{per_sm}x{block}": read_stream(stream.view(torch.int32), per_sm * sms, block)[0]
               for per_sm, block in READ_SWEEP}
    stages = {"experts": call.experts_call, "experts_plan_ahead": call.experts_plan_ahead,
              "align": call.align, "gate_up": call.gate_up, "down": call.down,
              "read_weight_bytes": lambda: torch.sum(stream, dim=0, out=stream_out)}
    if call.spec.quantized:
        stages["quant_h"] = call.quant_h
    if call.gemv is not None:
        stages.update(gemv_gate_up=call.gemv_gate_up, gemv_down=call.gemv_down)
    rec = {"model": name, "tokens": tokens, "scheme": scheme, "rows": call.rows, "active": call.active,
           "weight_bytes": call.weight_bytes,
           "config": {"gate_up": call.sel.gate_up.as_dict(), "down": call.sel.down.as_dict(),
                      "selected_gemv": call.sel.gemv.as_dict() if call.sel.gemv is not None else None,
                      "timed_gemv": call.gemv.as_dict() if call.gemv is not None else None}, "ms": {}}
    rec["read_sweep"] = {}
    for flush_name, flush in flushes.items():
        rec["ms"][flush_name] = {stage: _ms(fn, flush, reps) for stage, fn in stages.items()}
        sweep = {key: _ms(fn, flush, reps) for key, fn in readers.items()}
        rec["read_sweep"][flush_name] = sweep
        best = min(sweep, key=sweep.__getitem__)
        rec["ms"][flush_name]["read_fastest"] = sweep[best]
        rec["ms"][flush_name]["read_fastest_variant"] = best
        # Each GEMM's bytes alone through the fastest reader: the floor each kernel timed alone
        # (gate_up, down above) is held to, the flush's cost included.
        per_sm, block = (int(v) for v in best.split("x"))
        ints = stream.view(torch.int32)
        split = int(call.gate_up_bytes) // 4
        for part, src in (("gate_up", ints[:split]), ("down", ints[split:])):
            rec["ms"][flush_name][f"read_{part}_bytes"] = _ms(read_stream(src, per_sm * sms, block)[0], flush, reps)
        log(f"{name} T={tokens} {scheme} flush={flush_name}: " +
            " ".join(f"{k} {1e3 * v:.1f}us" if isinstance(v, float) else f"{k} {v}"
                     for k, v in rec["ms"][flush_name].items()))
    rec["kernels_us_write_flush"] = _kernel_us(call.experts_call, flushes["write"], reps)
    log("   kernels (write flush): " + ", ".join(f"{k[:40]} {v:.1f}" for k, v in rec["kernels_us_write_flush"]))
    return rec


def empty_call(device: torch.device, flushes: dict, reps: int, log) -> dict:
    """A one-element add under each flush: the flush's cost to a call that reads almost nothing."""
    t = torch.zeros(1, device=device)
    rec = {"model": "empty", "ms": {k: {"add_one": _ms(lambda: t.add_(1), f, reps)} for k, f in flushes.items()}}
    log("empty call: " + " ".join(f"{k} {1e3 * v['add_one']:.1f}us" for k, v in rec["ms"].items()))
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--ncu", default=None, help="MODEL:SCHEME:TOKENS: run that call eagerly for ncu, then stop")
    ap.add_argument("--cases", default=None, help="MODEL:TOKENS[,...] instead of the default cases")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated schemes (default: %(default)s)")
    ap.add_argument("--gemv", action="store_true",
                    help="time one token's GEMVs alone (configs.ONE_TOKEN_BLOCK_GEMV) at every fp8 scheme, also "
                         "where the GPU's config takes the tile GEMMs")
    args = ap.parse_args()
    cases: dict[str, list[int]] = {}
    for item in args.cases.split(",") if args.cases else [f"{m}:{t}" for m, ts in CASES for t in ts]:
        model_name, _, tokens = item.partition(":")
        if not tokens.isdigit():
            ap.error(f"--cases: {item!r} is not MODEL:TOKENS")
        cases.setdefault(model_name, []).append(int(tokens))
    schemes = args.schemes.split(",")
    device = torch.device("cuda", 0)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.ncu:
        name, scheme, tokens = args.ncu.split(":")
        call = Call(make_model(name, device), int(tokens), scheme)
        for _ in range(3):
            call.experts_call()
        torch.cuda.synchronize()
        return
    flushes = _flushes(device)
    out = [empty_call(device, flushes, args.reps, log)]
    for name, token_counts in cases.items():
        model = make_model(name, device)
        for tokens in token_counts:
            for scheme in schemes:
                out.append(study(name, tokens, scheme, model, flushes, args.reps, log,
                                 ONE_TOKEN_BLOCK_GEMV if args.gemv else None))
                if args.json:
                    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
