"""fp8_block's down GEMM at prefill as a persistent, warp-specialized kernel (Gluon, Hopper).

Computes what ``grouped_gemm.moe_gemm`` computes for the down projection of fp8_block experts
(``GemmConfig.engine == "gluon"``), with the same bits:

    y[sorted_rows[p], n] = rnd(sum_b (sum_{k in b} h[p, k] * w[e, n, k]) * h_scale[p, b] * w_scale[e, n // 128, b])

for each padded position p holding a routed row of a tile of expert e, summed in fp32 over the
128-column K steps b; h: fp8 [P, I] at the plan's padded positions with its scales [P, I / 128]
(``quant.quantize_h``), w: fp8 [E, H, I] with scales [E, H / 128, I / 128], y: [M, H] in the model
dtype, rnd the rounding to it. Rows past an expert's count are not stored.

Why this kernel: each K step's products must be scaled before they are added, so the warps
that issue the MMAs wait for them every step and then spend CUDA-core time on the scaling. Here,
as in ``kernels.persistent_gate_up``, a loader warpgroup feeds a ring of STAGES stages through
TMA (h's tile and the weight tile, both blocks) and two MMA warpgroups own 64 rows each of every
128-row tile, so that one can scale while the other's MMAs run. Tiles come from a counter in the
grouped order (``persistent_gate_up`` says why), handed from the loader to the MMA partitions
through ``_claim`` / ``_take``. One H200, down alone at 6 stages (``scripts/gluon_down_study.py``,
docs/performance.md): 13-16% faster than the Triton kernel's selected tile at Qwen3's and
Mixtral's prefill shapes, 3-4% at DeepSeek-V3's.

The mbarriers (a wrong count hangs the kernel):

==============  ==========================================  =================================
barrier         arrivals per phase                          waited on by
==============  ==========================================  =================================
ready[stage]    1: the loader's expect of both tiles' bytes  both MMA warpgroups
empty[stage]    2: each MMA warpgroup once its MMA that      the loader
                read the stage is done (or at once, when
                it has no real rows)
tile_ready[j]   1: the loader, after it stored the tile id   both MMA warpgroups
tile_empty[j]   2: each MMA warpgroup, after reading it      the loader
==============  ==========================================  =================================
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from moeshard.kernels.align import RowAlignment
from moeshard.kernels.configs import GemmConfig, multiprocessors
from moeshard.kernels.modes import scale_strides
from moeshard.kernels.persistent_down import _TMA_LOAD, _grouped, _tiles_in_use, operands_refusal, tma_descriptors
from moeshard.kernels.persistent_gate_up import (
    _BARRIER,
    _MAXNREG,
    LOADER_REGS,
    MMA_REGS,
    PARTITION_WARPS,
    _claim,
    _release_stages,
    _ring_and_handoff,
    _take,
)
from moeshard.quant import QuantizedActivations, QuantizedWeight


@gluon.jit
def _loader(args, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """The loader partition: for every K step of every tile, waits for the stage to be empty and
    loads h's tile and the weight tile through TMA onto its ``ready`` mbarrier."""
    (a_desc, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, sorted_rows_ptr, tile_expert_ptr, start_ptr, count_ptr,
     num_experts, N, K, stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_om,
     a_bufs, w_bufs, ready, empty, counter_ptr, tile_ids, tile_ready, tile_empty) = args
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    used, num_pid_n = _tiles_in_use(start_ptr, count_ptr, num_experts, N, BLOCK_M, BLOCK_N)
    total = used * num_pid_n
    step = 0
    j = 0
    t = _claim(counter_ptr, j, tile_ids, tile_ready, tile_empty)
    while t < total:
        off_m, off_w, _, _ = _grouped(t, used, num_pid_n, tile_expert_ptr, N, BLOCK_M, BLOCK_N, GROUP_M)
        for k in range(0, K, BLOCK_K):
            index = step % STAGES
            # A fresh mbarrier counts as having completed the phase before its first.
            mbarrier.wait(empty.index(index), (step // STAGES & 1) ^ 1)
            bar = ready.index(index)
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _TMA_LOAD(a_desc, [off_m, k], bar, a_bufs.index(index))
            _TMA_LOAD(w_desc, [off_w, k], bar, w_bufs.index(index))
            step += 1
        j += 1
        t = _claim(counter_ptr, j, tile_ids, tile_ready, tile_empty)


@gluon.jit
def _mma_rows(args, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
              WG: gl.constexpr):
    """An MMA partition: rows [64 WG, 64 WG + 64) of every tile, their K loop and epilogue."""
    (a_desc, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, sorted_rows_ptr, tile_expert_ptr, start_ptr, count_ptr,
     num_experts, N, K, stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_om,
     a_bufs, w_bufs, ready, empty, counter_ptr, tile_ids, tile_ready, tile_empty) = args
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    ROWS: gl.constexpr = BLOCK_M // 2
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[PARTITION_WARPS, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    # 8 columns (16 bytes of bf16) per thread for the scattered rows' stores.
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_N // 8), BLOCK_N // 8],
                                                  [PARTITION_WARPS, 1], [1, 0])
    out_ty: gl.constexpr = out_ptr.dtype.element_ty

    used, num_pid_n = _tiles_in_use(start_ptr, count_ptr, num_experts, N, BLOCK_M, BLOCK_N)
    total = used * num_pid_n
    k_steps = gl.cdiv(K, BLOCK_K)
    zero = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=layout)
    step = 0
    j = 0
    t = _take(j, tile_ids, tile_ready, tile_empty)
    while t < total:
        off_m, _, off_n, expert = _grouped(t, used, num_pid_n, tile_expert_ptr, N, BLOCK_M, BLOCK_N, GROUP_M)
        first = off_m + WG * ROWS
        start = gl.load(start_ptr + expert)
        count = gl.load(count_ptr + expert)
        if first - start < count:
            offs_p = first + gl.arange(0, ROWS, layout=rows_layout)
            row_ok = offs_p - start < count
            as_ptrs = a_scale_ptr + offs_p.to(gl.int64) * stride_asm
            # One weight block per tile: the tile's columns lie in one 128-row block of w.
            ws_ptr = w_scale_ptr + expert.to(gl.int64) * stride_wse + (off_n // 128) * stride_wsn
            a_s = gl.load(as_ptrs, mask=row_ok, other=0.0)
            w_s = gl.load(ws_ptr)
            acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=layout)
            for s in range(k_steps):
                # The next step's scales are asked for before this step's MMA, to arrive under it.
                following = gl.minimum(s + 1, k_steps - 1)
                a_next = gl.load(as_ptrs + following * stride_ask, mask=row_ok, other=0.0)
                w_next = gl.load(ws_ptr + following * stride_wsk)
                index = step % STAGES
                mbarrier.wait(ready.index(index), step // STAGES & 1)
                part = warpgroup_mma(a_bufs.index(index).slice(WG * ROWS, ROWS), w_bufs.index(index).permute((1, 0)),
                                     zero, use_acc=False, is_async=True)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
                # The MMA that read the stage is done: it is free for the loader.
                _BARRIER()
                mbarrier.arrive(empty.index(index))
                # grouped_gemm's order: acc += dot * a_scale[row, kb] * w_scale[e, n // 128, kb].
                acc += part * a_s[:, None] * w_s
                a_s, w_s = a_next, w_next
                step += 1
            offs_ps = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, store_layout))
            ok_s = offs_ps - start < count
            orig = gl.load(sorted_rows_ptr + offs_ps, mask=ok_s, other=0).to(gl.int64)
            cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
            gl.store(out_ptr + orig[:, None] * stride_om + cols[None, :],
                     gl.convert_layout(acc.to(out_ty), store_layout), mask=ok_s[:, None] & (cols < N)[None, :])
        else:
            # Rows of padding only: no MMA and nothing stored; the stages released as they come.
            step = _release_stages(step, k_steps, ready, empty, STAGES)
        j += 1
        t = _take(j, tile_ids, tile_ready, tile_empty)


@gluon.jit
def _mma_rows_0(args, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    _mma_rows(args, BLOCK_M, BLOCK_K, STAGES, GROUP_M, 0)


@gluon.jit
def _mma_rows_1(args, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    _mma_rows(args, BLOCK_M, BLOCK_K, STAGES, GROUP_M, 1)


@gluon.jit
def persistent_block_down_kernel(a_desc, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, sorted_rows_ptr, tile_expert_ptr,
                                 start_ptr, count_ptr, counter_ptr, num_experts, N, K, stride_asm, stride_ask,
                                 stride_wse, stride_wsn, stride_wsk, stride_om,
                                 STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    gl.static_assert(num_warps == PARTITION_WARPS, "the MMA partition the kernel starts in is one warpgroup")
    gl.static_assert(BLOCK_M == 128, "two MMA warpgroups of 64 rows")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    # ready: the loader's expect of both tiles' bytes, one arrival.
    ready, empty, tile_ids, tile_ready, tile_empty = _ring_and_handoff(STAGES, 1)
    args = (a_desc, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, sorted_rows_ptr, tile_expert_ptr, start_ptr, count_ptr,
            num_experts, N, K, stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_om,
            a_bufs, w_bufs, ready, empty, counter_ptr, tile_ids, tile_ready, tile_empty)
    gl.warp_specialize([(_mma_rows_0, (args, BLOCK_M, BLOCK_K, STAGES, GROUP_M)),
                        (_mma_rows_1, (args, BLOCK_M, BLOCK_K, STAGES, GROUP_M)),
                        (_loader, (args, BLOCK_M, BLOCK_K, STAGES, GROUP_M))],
                       [PARTITION_WARPS, PARTITION_WARPS], [MMA_REGS, LOADER_REGS])


def persistent_block_down(h: QuantizedActivations, w: QuantizedWeight, plan: RowAlignment, out: torch.Tensor,
                          config: GemmConfig, programs: int | None = None) -> torch.Tensor:
    """``moe_gemm(h, w, plan, out, config, activation=None, gather=False)`` for fp8_block with
    ``config.engine == "gluon"``; writes and returns ``out``.

    h: fp8 [P, I] at the plan's padded positions with its block scales fp32 [P, I / 128]
    (``quant.quantize_h``); w: fp8 [E, H, I] with scales [E, H / 128, I / 128]; out: [M, H] in the
    model dtype, written at the routed rows (``plan.sorted_rows``); programs: how many persistent
    programs (None: one per multiprocessor of out's device; at most one per tile). config: 128 x
    128 x 128 tiles, num_stages the ring's stages. I and H must be multiples of 128 (whole K
    steps; one weight block per tile). Refuses (ValueError) what this kernel does not compute,
    naming the value.
    """
    where = "moe_gemm (engine 'gluon', fp8_block down)"
    refusal = operands_refusal(out.device, h, w, "down", ("fp8_block",))
    if refusal:
        raise ValueError(f"{where}: {refusal}")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if (bm, bn, bk) != (128, 128, 128):
        raise ValueError(f"{where}: computes 128 x 128 x 128 tiles, got {bm} x {bn} x {bk}")
    if plan.block_m != bm:
        raise ValueError(f"{where}: config.block_m={bm} but the plan's block_m={plan.block_m}")
    _, n, k = w.shape
    if h.shape != (plan.padded_rows, k) or out.shape != (plan.num_rows, n):
        raise ValueError(f"{where}: h {tuple(h.shape)} must be [P={plan.padded_rows}, I={k}] and out "
                         f"{tuple(out.shape)} [M={plan.num_rows}, H={n}]")
    if n % bn or k % bk:
        raise ValueError(f"{where}: H={n} and I={k} must be multiples of the tile's {bn} columns and {bk}-column "
                         f"K step (one weight block per tile and K step)")
    if out.stride(1) != 1 or not h.data.is_contiguous() or not w.data.is_contiguous():
        raise ValueError(f"{where}: needs contiguous h and w and out's rows contiguous; got out strides "
                         f"{out.stride()}")
    stride_asm, stride_ask = scale_strides(h.row_scale, 2)
    stride_wse, stride_wsn, stride_wsk = scale_strides(w.scale, 3)
    a_desc, w_desc = tma_descriptors(h, w, config)
    tiles = plan.max_tiles * triton.cdiv(n, bn)
    programs = programs or multiprocessors(out.device.index)
    if tiles:  # no launch for an empty plan
        persistent_block_down_kernel[(min(programs, tiles), )](
            a_desc, w_desc, out, h.row_scale, w.scale, plan.sorted_rows, plan.tile_expert, plan.start, plan.count,
            torch.zeros(1, dtype=torch.int32, device=out.device), plan.start.shape[0], n, k, stride_asm, stride_ask,
            stride_wse, stride_wsn, stride_wsk, out.stride(0), STAGES=config.num_stages, GROUP_M=config.group_m,
            num_warps=PARTITION_WARPS.value, maxnreg=_MAXNREG)
    return out
