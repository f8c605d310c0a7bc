"""A hand-pipelined persistent down GEMM in Gluon against the Triton grouped GEMM, at prefill.

Triton's automatic pipeliner runs one K loop per program; between two tiles a multiprocessor
drains its pipeline, runs the epilogue and fills the pipeline again (the prefill tiles fill its
shared memory, so nothing else overlaps that). Gluon (Triton's lower-level dialect) lets a kernel
issue the TMA loads and warpgroup MMAs itself. This kernel is the per-tensor / per-row fp8 down
GEMM of ``moeshard.kernels.grouped_gemm`` (h at padded positions times each tile's expert's
[H, I] weights, scaled per row and column, rows scattered to their routed order), run by one
program per SM that walks the tiles in use, with the next tile's first loads issued while the
last MMAs of this tile drain (the structure of Gluon's persistence tutorial; written here for
the grouped layout). Its accumulation is Triton's default on Hopper (the MMA's own across K),
as the selected prefill tiles' ``fp8_acc="imprecise"``.

For each model, token count and scheme (fp8_tensor, fp8_token) it times, on the bench's
workload (``moeshard.bench.workload``, CUDA graphs, an L2 flush before every repetition, rounds
alternating), the selected Triton down GEMM and the Gluon kernel at 3 and 4 stages, storing from
the MMA layout or through shared memory in whole rows, and
checks that each gives the Triton kernel's y bit for bit (reported, not assumed).

    PYTHONPATH=src python3 scripts/gluon_down_study.py --json results/h200/gluon_down_study.json
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from moeshard.bench.study import run_on_gpu, study_parser
from moeshard.bench.timing import alternating_medians
from moeshard.bench.workload import experts_for, hidden_states, routed_input
from moeshard.config import QuantConfig
from moeshard.kernels.align import align_rows, split_tiles
from moeshard.kernels.configs import multiprocessors, select_config
from moeshard.kernels.grouped_gemm import moe_gemm
from moeshard.kernels.quant import quantize_h
from moeshard.quant import QuantizedActivations, QuantizedWeight, get_scheme

MODELS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")
TOKENS = (4096, 16384)
SCHEMES = ("fp8_tensor", "fp8_token")
# (stages, coalesced stores) of the Gluon kernel
VARIANTS = ((3, False), (4, False), (3, True), (4, True))


@gluon.jit
def _tile(idx, pid, programs, used, num_pid_n, tile_expert_ptr, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          GROUP_M: gl.constexpr):
    """(first padded position, first weight row, column, expert) of this program's idx-th tile, in
    the grouped launch order of the Triton kernel (clamped to the last tile past the end, for the
    predicated loads of a next tile that does not exist)."""
    t = gl.minimum(pid + idx * programs, used * num_pid_n - 1)
    per_group = GROUP_M * num_pid_n
    first_m = (t // per_group) * GROUP_M
    group_size = gl.minimum(used - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % group_size
    pid_n = (t % per_group) // group_size
    expert = gl.load(tile_expert_ptr + pid_m)
    return pid_m * BLOCK_M, expert * N + pid_n * BLOCK_N, pid_n * BLOCK_N, expert


@gluon.jit
def _load(producer, a_desc, w_desc, off_m, off_w, k, bars, a_bufs, w_bufs, STAGES: gl.constexpr, pred=True):
    """Issues the TMA loads of one K step into the next ring slot; returns the producer count."""
    index = producer % STAGES
    bar = bars.index(index)
    mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(index), pred)
    tma.async_copy_global_to_shared(w_desc, [off_w, k], bar, w_bufs.index(index), pred)
    return producer + 1


@gluon.jit
def _mma(consumer, acc, use_acc, bars, a_bufs, w_bufs, STAGES: gl.constexpr):
    """Waits for the next ring slot's loads, issues this step's MMA and waits until only it is in
    flight (so the slot of the step before is free to load into)."""
    index = consumer % STAGES
    mbarrier.wait(bars.index(index), consumer // STAGES & 1)
    acc = warpgroup_mma(a_bufs.index(index), w_bufs.index(index).permute((1, 0)), acc, use_acc=use_acc,
                        is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    return consumer + 1, acc


@gluon.jit
def persistent_down_kernel(a_desc, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, sorted_rows_ptr, tile_expert_ptr,
                           start_ptr, count_ptr, num_experts, N, K, stride_asm, stride_wse, stride_wsn, stride_om,
                           STAGES: gl.constexpr, GROUP_M: gl.constexpr, COALESCE: gl.constexpr,
                           num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(STAGES >= 2, "expected at least 2 stages")
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, layout)
    # COALESCE: the result goes through shared memory into rows of 16-byte pieces per thread, so
    # that a warp stores whole 512-byte rows (the MMA layout stores 4 bytes per thread).
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    last = num_experts - 1
    used = gl.load(start_ptr + last) // BLOCK_M + gl.cdiv(gl.load(count_ptr + last), BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = gl.cdiv(used * num_pid_n - pid, programs)
    k_steps = gl.cdiv(K, BLOCK_K)
    own_steps = k_steps - (STAGES - 1)  # steps whose MMA is followed by a load of this tile
    producer = 0
    consumer = 0
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)

    # The loads run STAGES - 1 steps ahead of the MMAs, across tiles: the next tile's first loads
    # go out during this tile's last MMAs and its epilogue. A program without tiles loads nothing
    # (it must not exit with loads in flight).
    off_m, off_w, off_n, expert = _tile(0, pid, programs, used, num_pid_n, tile_expert_ptr, N, BLOCK_M, BLOCK_N,
                                        GROUP_M)
    for ki in gl.static_range(STAGES - 1):
        producer = _load(producer, a_desc, w_desc, off_m, off_w, ki * BLOCK_K, bars, a_bufs, w_bufs, STAGES,
                         num_tiles > 0)

    for idx in range(num_tiles):
        # Everything the epilogue and the next tile's loads need is asked for now, so that its
        # latency passes under this tile's MMAs.
        next_m, next_w, next_n, next_expert = _tile(idx + 1, pid, programs, used, num_pid_n, tile_expert_ptr, N,
                                                    BLOCK_M, BLOCK_N, GROUP_M)
        offs_p = off_m + gl.arange(0, BLOCK_M, layout=rows_layout)
        row_ok = offs_p - gl.load(start_ptr + expert) < gl.load(count_ptr + expert)
        a_s = gl.load(a_scale_ptr + offs_p.to(gl.int64) * stride_asm, mask=row_ok, other=0.0)
        orig = gl.load(sorted_rows_ptr + offs_p, mask=row_ok, other=0).to(gl.int64)

        for s in range(own_steps):
            consumer, acc = _mma(consumer, acc, s > 0, bars, a_bufs, w_bufs, STAGES)
            producer = _load(producer, a_desc, w_desc, off_m, off_w, (s + STAGES - 1) * BLOCK_K, bars, a_bufs,
                             w_bufs, STAGES)
        has_next = idx + 1 < num_tiles
        for s in range(own_steps, k_steps):
            consumer, acc = _mma(consumer, acc, s > 0, bars, a_bufs, w_bufs, STAGES)
            producer = _load(producer, a_desc, w_desc, next_m, next_w, (s - own_steps) * BLOCK_K, bars, a_bufs,
                             w_bufs, STAGES, has_next)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

        # Epilogue: per-row (h) and per-column (weight) scales, rounded to the model dtype, stored
        # at the routed rows (the Triton kernel's arithmetic in its order).
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=cols_layout)
        w_s = gl.load(w_scale_ptr + expert.to(gl.int64) * stride_wse + offs_n * stride_wsn)
        result = (acc * a_s[:, None] * w_s[None, :]).to(out_ptr.dtype.element_ty)
        if COALESCE:
            result = gl.convert_layout(result, store_layout)
            orig_s = gl.convert_layout(orig, gl.SliceLayout(1, store_layout))
            ok_s = gl.convert_layout(row_ok, gl.SliceLayout(1, store_layout))
            cols_s = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
            gl.store(out_ptr + orig_s[:, None] * stride_om + cols_s[None, :], result, mask=ok_s[:, None])
        else:
            gl.store(out_ptr + orig[:, None] * stride_om + offs_n[None, :], result, mask=row_ok[:, None])
        off_m, off_w, off_n, expert = next_m, next_w, next_n, next_expert

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def persistent_down(h: QuantizedActivations, w: QuantizedWeight, plan, out: torch.Tensor, stages: int,
                    coalesce: bool = False, block_m: int = 128, block_n: int = 256, block_k: int = 128,
                    group_m: int = 8) -> torch.Tensor:
    """y[sorted_rows[p]] = (h[p] @ w[expert of p].T) * scales, as ``moe_gemm``'s down (gather=False)
    for per-tensor / per-row fp8 schemes; h at padded positions [P, I], w [E, H, I], out [M, H]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    assert plan.block_m == block_m and w.scheme in ("fp8_tensor", "fp8_token")
    e, n, k = w.shape
    a_scale = h.row_scale if h.row_scale is not None else h.tensor_scale
    assert a_scale is not None and a_scale.dim() == 2 and a_scale.shape[1] == 1, a_scale.shape
    stride_asm = a_scale.stride(0) if a_scale.shape[0] > 1 else 0
    ws = w.scale  # fp8_tensor [E], fp8_token [E, N]
    stride_wse, stride_wsn = (ws.stride(0), ws.stride(1)) if ws.dim() == 2 else (ws.stride(0), 0)
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(h.data, [block_m, block_k], a_layout)
    w_desc = TensorDescriptor.from_tensor(w.data.view(e * n, k), [block_n, block_k], w_layout)
    grid = (min(multiprocessors(out.device.index), plan.max_tiles * triton.cdiv(n, block_n)), )
    persistent_down_kernel[grid](a_desc, w_desc, out, a_scale, ws, plan.sorted_rows, plan.tile_expert, plan.start,
                                 plan.count, plan.start.shape[0], n, k, stride_asm, stride_wse, stride_wsn,
                                 out.stride(0), STAGES=stages, GROUP_M=group_m, COALESCE=coalesce, num_warps=8)
    return out


def study(name: str, model, tokens: int, scheme: str, flush, args) -> dict:
    cfg = model.cfg
    device = model.gate_up.device
    spec = get_scheme(scheme)
    experts = experts_for(model, scheme)
    x = hidden_states(model, tokens, tokens)
    inp, _ = routed_input(model, x, QuantConfig(scheme))
    M, E, H, I = inp.num_rows, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    sel = select_config(M, E, H, I, scheme, multiprocessors(device.index))
    plan = align_rows(inp.expert_ids, E, sel.block_m)
    amax = torch.zeros(E, dtype=torch.float32, device=device) if spec.per_tensor_activation else None
    h = torch.empty(plan.padded_rows, I, dtype=cfg.dtype, device=device)
    moe_gemm(inp.x, experts.gate_up, plan, h, sel.gate_up, activation=cfg.activation, gather=True, amax=amax,
             a_row_div=inp.repeat)
    hq = quantize_h(h, scheme, plan, amax)
    down_plan = split_tiles(plan, sel.down.block_m)
    rec = {"model": name, "tokens": tokens, "scheme": scheme, "rows": M, "config": sel.down.as_dict()}
    y_ref = torch.full((M, H), float("nan"), dtype=cfg.dtype, device=device)
    moe_gemm(hq, experts.down, down_plan, y_ref, sel.down, activation=None, gather=False)
    calls = {"triton_ms": lambda: moe_gemm(hq, experts.down, down_plan, y_ref, sel.down, activation=None,
                                           gather=False)}
    rec["same_bits"], rec["max_rel_diff"] = {}, {}
    for stages, coalesce in VARIANTS:
        key = f"gluon_s{stages}{'_coalesced' if coalesce else ''}"
        y = torch.full((M, H), float("nan"), dtype=cfg.dtype, device=device)
        try:
            persistent_down(hq, experts.down, plan, y, stages, coalesce)
            torch.cuda.synchronize()
        except Exception as exc:  # a variant that does not compile or launch is a finding too
            rec.setdefault("errors", {})[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            continue
        rec["same_bits"][key] = bool(torch.equal(y, y_ref))
        diff = (y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max().clamp_min(1e-30)
        rec["max_rel_diff"][key] = float(diff)
        calls[f"{key}_ms"] = lambda y=y, stages=stages, coalesce=coalesce: persistent_down(
            hq, experts.down, plan, y, stages, coalesce)
    rec["rounds"], rec["median_ms"] = alternating_medians(calls, rounds=args.rounds, reps=args.reps, flush=flush)
    return rec


def summary(rec: dict) -> str:
    m = rec["median_ms"]
    parts = [f"{k[:-3]} {v:.3f}" for k, v in m.items()]
    bits = " ".join(f"{k}:" + ("same" if v else f"DIFF {rec['max_rel_diff'][k]:.2g}") for k, v in rec["same_bits"].items())
    return (f"{rec['model']:14s} T={rec['tokens']:<6d} {rec['scheme']:10s} down ms: " + " | ".join(parts)
            + f" | {bits}" + (f" | errors {rec['errors']}" if rec.get("errors") else ""))


def main() -> None:
    ap = study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=10)
    run_on_gpu(ap.parse_args(), "scripts/gluon_down_study.py", study, summary)


if __name__ == "__main__":
    main()
