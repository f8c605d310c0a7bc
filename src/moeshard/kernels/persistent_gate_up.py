"""The fp8 gate_up GEMM at prefill as a persistent, warp-specialized kernel (Gluon, Hopper).

Computes what ``grouped_gemm.moe_gemm`` computes for the fused gate_up projection of the fp8
schemes with gathered rows (``GemmConfig.engine == "gluon"``), with the same bits (silu alone
flushes to zero the products of at most 88 * 2^-126 * |up| that Triton's division keeps: ``_act_mul``).
Per-tensor and per-row scales (fp8_tensor, fp8_token):

    gate[p, n] = rnd((sum_k x[r(p), k] * w[e, n, k]) * a_scale[r(p)] * w_scale[e, n])
    up[p, n]   = rnd((sum_k x[r(p), k] * w[e, I + n, k]) * a_scale[r(p)] * w_scale[e, I + n])
    h[p, n]    = rnd(act(gate[p, n]) * up[p, n])

fp8_block's 128 x 128 blocks, summed over the 128-column K steps b in fp32:

    gate[p, n] = rnd(sum_b (sum_{k in b} x[r(p), k] * w[e, n, k]) * a_scale[r(p), b] * w_scale[e, n // 128, b])

and up likewise with the weight rows I + n.

for each padded position p of a tile of expert e, r(p) = sorted_rows[p] // a_row_div (the
token a routed row reads), rnd the rounding to the model dtype; x: fp8 [M / a_row_div, H],
w: fp8 [E, 2I, H], h: [P, I] in the model dtype, padding positions stored as zeros. With an amax
buffer it also max-reduces |h| of each expert's real rows into amax[e] (the per-tensor scale of
the down GEMM's input), or with a row_amax buffer |h| of each real row into row_amax[p]
(fp8_token's row scales).

Why warp specialization: Hopper's TMA loads blocks and cannot gather rows, so the input rows come
through cp.async, 16 bytes per thread. When the warps that issue the MMAs also issue those copies
(Triton's kernel, and a persistent Gluon version measured 4-16% slower than it), every K step
waits for all threads' copies behind a CTA-wide barrier. Here three partitions of 4 warps share a
ring of STAGES stages in shared memory, and one program per SM takes the tiles in use one at a
time from a counter in memory (the loader takes each and hands it to the MMA partitions):

* the loader gathers each step's 128 input rows with cp.async (each thread's copies arrive on the
  stage's ``ready`` mbarrier when they land, rows past the expert's count zero-filled without a
  read) and loads the gate and up weight tiles through TMA onto the same mbarrier;
* two MMA warpgroups each own 64 rows of the 128-row tile: they wait for ``ready``, issue one
  MMA over the stage's gate and up weight tiles, stacked into one operand of 2 BLOCK_N columns
  (the tensor cores' own accumulation across K, as the selected prefill tiles'
  ``fp8_acc="imprecise"``), release the stage on its ``empty`` mbarrier once the MMA that read it
  is done, and run their epilogue alone. One MMA for gate and another for up read the input tile
  from shared memory twice per step, and took up to 7% longer at all but one of the bench's
  prefill shapes (one H200, ``scripts/gluon_gate_up_study.py``, docs/performance.md). A
  warpgroup whose 64 rows hold no real row (an expert's last tile) issues no MMA and stores zeros,
  which leaves the tensor cores to the other one: the Triton kernel's half tiles, without a second
  code path. For fp8_block each K step's products start from zero and are scaled into fp32
  accumulators before the stage is released (``_block_scaled_k_loop``; one product at a time in
  128-column tiles, where a stacked product would not fit in registers beside the two
  accumulators); while one warpgroup scales, the other's MMAs can have the tensor cores. In
  128-column tiles at 4 stages it took 8-17% less time than the Triton kernel's selected tile on
  the bench's prefill shapes (one H200, ``scripts/gluon_gate_up_study.py``, docs/performance.md).

Why a counter: the tiles that run at one time must be neighbours in the grouped order, sharing
input rows and weight tiles in L2, as the programs of a non-persistent launch are. Walked at a
fixed stride per program they drift apart, and DeepSeek-V3's gate_up read 11.5 GB from DRAM at an
L2 hit rate of 20% (Triton's kernel: 8.6 GB, 33%; with the counter: 35%; one H200, Nsight
Compute, docs/performance.md).

The mbarriers, and who arrives on them (a wrong count hangs the kernel):

==============  ==========================================  =================================
barrier         arrivals per phase                          waited on by
==============  ==========================================  =================================
ready[stage]    1 + 128: the loader's expect of the weight  both MMA warpgroups
                tiles' bytes, and each loader thread's
                cp.async copies as they land (``.noinc``)
empty[stage]    2: each MMA warpgroup once its MMAs that    the loader
                read the stage are done (or at once,
                when it has no real rows)
tile_ready[j]   1: the loader, after all its threads        both MMA warpgroups
                stored the tile id
tile_empty[j]   2: each MMA warpgroup, after all its        the loader
                threads read the tile id
==============  ==========================================  =================================

A fresh mbarrier counts as having completed the phase before its first, so the loader's first
pass over ``empty`` and ``tile_empty`` waits for nothing. Every partition ends on the first tile
id past the tiles in use, which the loader publishes like any other.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from moeshard.kernels.align import RowAlignment
from moeshard.kernels.configs import GemmConfig, multiprocessors
from moeshard.kernels.modes import GLUON_ACT_MODES, act_mode, amax_mode, kernel_mode, one_w_scale_per_tile, scale_strides
from moeshard.kernels.persistent_down import _TMA_LOAD, _grouped, _tiles_in_use, operands_refusal
from moeshard.quant import QuantizedActivations, QuantizedWeight

# Names Triton 3.9 changed (3.6: async_copy_global_to_shared, thread_barrier).
_CP_ASYNC = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_BARRIER = getattr(gl, "barrier", None) or gl.thread_barrier

# The schemes this kernel computes: one scale per tensor or row, or fp8_block's 128 x 128 blocks.
GATE_UP_SCHEMES = ("fp8_tensor", "fp8_token", "fp8_block")
PARTITION_WARPS = gl.constexpr(4)  # each partition is one warpgroup
# Registers per thread of the loader and of an MMA partition: 12 warps share the 64K of an SM.
LOADER_REGS, MMA_REGS = gl.constexpr(40), gl.constexpr(232)


@gluon.jit
def _claim(counter_ptr, j, tile_ids, tile_ready, tile_empty):
    """The loader takes the next tile id t from the counter and hands it, its program's j-th, to
    both MMA partitions (a ring of two slots); returns t."""
    t = gl.atomic_add(counter_ptr, 1)
    slot = j % 2
    mbarrier.wait(tile_empty.index(slot), (j // 2 & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [PARTITION_WARPS], [0])
    tile_ids.index(slot).store(gl.full([1], t, gl.int32, layout))
    # Every loader thread's store is done before the arrival that publishes it.
    _BARRIER()
    mbarrier.arrive(tile_ready.index(slot))
    return t


@gluon.jit
def _take(j, tile_ids, tile_ready, tile_empty):
    """An MMA partition's j-th tile, as the loader published it."""
    slot = j % 2
    mbarrier.wait(tile_ready.index(slot), j // 2 & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [PARTITION_WARPS], [0])
    t = gl.max(tile_ids.index(slot).load(layout), axis=0)
    # Every thread of the partition has read the slot before it is released.
    _BARRIER()
    mbarrier.arrive(tile_empty.index(slot))
    return t


@gluon.jit
def _ring_and_handoff(STAGES: gl.constexpr, READY_ARRIVALS: gl.constexpr):
    """The mbarriers of a warp-specialized kernel with one loader and two MMA warpgroups: the
    ring's ``ready`` (READY_ARRIVALS per phase) and ``empty`` (one per MMA warpgroup) for each of
    STAGES stages, and the two-slot tile hand-over of ``_claim`` / ``_take`` (its ids, and
    ``tile_ready`` / ``tile_empty``: one arrival by the loader, one per MMA warpgroup)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(empty.index(i), count=2)
    tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(tile_ready.index(i), count=1)
        mbarrier.init(tile_empty.index(i), count=2)
    return ready, empty, tile_ids, tile_ready, tile_empty


@gluon.jit
def _release_stages(step, k_steps, ready, empty, STAGES: gl.constexpr):
    """An MMA warpgroup with no real rows in a tile: waits for each of its K steps' stages and
    releases it at once (the other warpgroup's MMAs read it). Returns the step count."""
    for _ in range(k_steps):
        index = step % STAGES
        mbarrier.wait(ready.index(index), step // STAGES & 1)
        mbarrier.arrive(empty.index(index))
        step += 1
    return step


@gluon.jit
def _loader(args, ACT: gl.constexpr, TRACK_AMAX: gl.constexpr, BLOCK_SCALES: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """The loader partition: for every K step of every tile, waits for the stage to be empty,
    then loads the weight tiles through TMA and gathers the input rows through cp.async, all
    completing on the stage's ``ready`` mbarrier."""
    (a_ptr, w_desc, out_ptr, amax_ptr, a_scale_ptr, w_scale_ptr, sorted_rows_ptr, tile_expert_ptr, start_ptr,
     count_ptr, num_experts, N, K, a_row_div, stride_am, stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk,
     stride_om, a_bufs, w_bufs, ready, empty, counter_ptr, tile_ids, tile_ready, tile_empty) = args
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    # 16 bytes of one input row per thread: BLOCK_K / 16 threads cover a row.
    gather: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // BLOCK_K, BLOCK_K // 16], [PARTITION_WARPS, 1],
                                            [1, 0])
    used, num_pid_n = _tiles_in_use(start_ptr, count_ptr, num_experts, N, BLOCK_M, BLOCK_N)
    total = used * num_pid_n
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gather))
    step = 0
    j = 0
    # Tiles are taken in the grouped order from one counter, as the hardware hands out the
    # programs of a non-persistent launch: the tiles that run at one time share their input rows
    # and weight tiles in L2. The first id past the last tile ends every partition's loop.
    t = _claim(counter_ptr, j, tile_ids, tile_ready, tile_empty)
    while t < total:
        off_m, _, off_n, expert = _grouped(t, used, num_pid_n, tile_expert_ptr, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_p = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gather))
        row_ok = offs_p - gl.load(start_ptr + expert) < gl.load(count_ptr + expert)
        # Divided in int32, as grouped_gemm does (sorted_rows is int32).
        rows = gl.load(sorted_rows_ptr + offs_p, mask=row_ok, other=0) // a_row_div
        base = a_ptr + rows.to(gl.int64)[:, None] * stride_am + offs_k[None, :]
        mask = gl.broadcast(base, row_ok[:, None])[1]
        off_w = expert * 2 * N + off_n
        for k in range(0, K, BLOCK_K):
            index = step % STAGES
            # A fresh mbarrier counts as having completed the phase before its first: the first
            # pass over the ring waits for nothing.
            mbarrier.wait(empty.index(index), (step // STAGES & 1) ^ 1)
            bar = ready.index(index)
            mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
            # The gate tile above the up tile: one [2 BLOCK_N, BLOCK_K] operand.
            _TMA_LOAD(w_desc, [off_w, k], bar, w_bufs.index(index).slice(0, BLOCK_N))
            _TMA_LOAD(w_desc, [off_w + N, k], bar, w_bufs.index(index).slice(BLOCK_N, BLOCK_N))
            # Whole 16-byte copies: K is a multiple of BLOCK_K (persistent_gate_up).
            _CP_ASYNC(a_bufs.index(index), base + k, mask=mask)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            step += 1
        j += 1
        t = _claim(counter_ptr, j, tile_ids, tile_ready, tile_empty)


@gluon.jit
def _act_mul(gate, up, ACT: gl.constexpr):
    """grouped_gemm's _silu_mul (ACT 0) / _gelu_mul (ACT 1) / _gelu_tanh_mul (ACT 2), in its
    operation order, with the same bits, except that silu flushes to zero the products Triton
    leaves at gate < -87.3, of at most 88 * 2^-126 * |up|."""
    if ACT == 0:
        # exp(-gate) as Triton computes it (2^(-gate * log2 e) by the approximate ex2), but with
        # denormal results flushed to zero: they only ever meet 1.0 + e, which is 1.0 either way.
        # That saves the range fix-up of each exp (a compare, a select and two multiplies).
        e = gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [-gate * 1.4426950408889634],
                                      dtype=gl.float32, is_pure=True, pack=1)
        # Triton's fp32 division (div.full) is the approximate reciprocal times gate, with a range
        # fix-up for divisors above 2^126 (gate < -87.3): a compare and two multiplies per
        # element. The flushing reciprocal has no fix-up; there it gives 0 where Triton gives
        # gate / (1 + e) of at most 88 * 2^-126, so h differs only by such products.
        r = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e], dtype=gl.float32,
                                      is_pure=True, pack=1)
        return gate * r * up
    elif ACT == 1:
        return 0.5 * gate * (1.0 + gl.erf(gate * 0.7071067811865476)) * up
    else:
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (1.0 + (2.0 / (1.0 + gl.exp(-2.0 * z)) - 1.0)) * up


@gluon.jit
def _block_scaled_k_loop(acc_g, acc_u, step, k_steps, rows, row_ok, expert, off_n, N, a_scale_ptr, w_scale_ptr,
                         stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, a_bufs, w_bufs, ready,
                         empty, STAGES: gl.constexpr, WG: gl.constexpr, ROWS: gl.constexpr, layout: gl.constexpr):
    """fp8_block's K loop of one MMA partition: each 128-column step's gate and up products start
    from zero on the tensor cores, and are added to the fp32 accumulators scaled by the rows'
    block scales and the tile's weight block scale, as grouped_gemm's ``acc += dot * a_scale[row,
    kb] * w_scale[e, n // 128, kb]`` (one weight block per tile: N and the tile's columns lie in
    128-column blocks, ``persistent_gate_up``). In 64-column tiles both products are in flight at
    once and the up MMA runs while the gate product is scaled; a 128-column tile has registers for
    one product at a time (gate, then up). Either way the other MMA partition's MMAs run while this
    one scales. Returns (acc_g, acc_u, step)."""
    BLOCK_N: gl.constexpr = acc_g.shape[1]
    zero = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=layout)
    as_ptrs = a_scale_ptr + rows.to(gl.int64) * stride_asm
    ws_base = w_scale_ptr + expert.to(gl.int64) * stride_wse
    wg_ptr = ws_base + (off_n // 128) * stride_wsn
    wu_ptr = ws_base + ((off_n + N) // 128) * stride_wsn
    a_s = gl.load(as_ptrs, mask=row_ok, other=0.0)
    wg_s = gl.load(wg_ptr)
    wu_s = gl.load(wu_ptr)
    for s in range(k_steps):
        # The next step's scales are asked for before this step's MMAs, to arrive under them.
        following = gl.minimum(s + 1, k_steps - 1)
        a_next = gl.load(as_ptrs + following * stride_ask, mask=row_ok, other=0.0)
        wg_next = gl.load(wg_ptr + following * stride_wsk)
        wu_next = gl.load(wu_ptr + following * stride_wsk)
        index = step % STAGES
        mbarrier.wait(ready.index(index), step // STAGES & 1)
        # cp.async wrote through the generic proxy; the MMA reads through the async one.
        fence_async_shared()
        a = a_bufs.index(index).slice(WG * ROWS, ROWS)
        g_tile = w_bufs.index(index).slice(0, BLOCK_N).permute((1, 0))
        u_tile = w_bufs.index(index).slice(BLOCK_N, BLOCK_N).permute((1, 0))
        if BLOCK_N <= 64:
            part_g = warpgroup_mma(a, g_tile, zero, use_acc=False, is_async=True)
            part_u = warpgroup_mma(a, u_tile, zero, use_acc=False, is_async=True)
            part_g = warpgroup_mma_wait(num_outstanding=1, deps=(part_g, ))
            acc_g += part_g * a_s[:, None] * wg_s
        else:
            part_g = warpgroup_mma(a, g_tile, zero, use_acc=False, is_async=True)
            part_g = warpgroup_mma_wait(num_outstanding=0, deps=(part_g, ))
            acc_g += part_g * a_s[:, None] * wg_s
            part_u = warpgroup_mma(a, u_tile, zero, use_acc=False, is_async=True)
        part_u = warpgroup_mma_wait(num_outstanding=0, deps=(part_u, ))
        # Both MMAs that read the stage are done: it is free for the loader.
        _BARRIER()
        mbarrier.arrive(empty.index(index))
        acc_u += part_u * a_s[:, None] * wu_s
        a_s, wg_s, wu_s = a_next, wg_next, wu_next
        step += 1
    return acc_g, acc_u, step


@gluon.jit
def _mma_rows(args, ACT: gl.constexpr, TRACK_AMAX: gl.constexpr, BLOCK_SCALES: gl.constexpr,
              W_COL_SCALES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr, WG: gl.constexpr):
    """An MMA partition: rows [64 WG, 64 WG + 64) of every tile, their K loop and epilogue."""
    (a_ptr, w_desc, out_ptr, amax_ptr, a_scale_ptr, w_scale_ptr, sorted_rows_ptr, tile_expert_ptr, start_ptr,
     count_ptr, num_experts, N, K, a_row_div, stride_am, stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk,
     stride_om, a_bufs, w_bufs, ready, empty, counter_ptr, tile_ids, tile_ready, tile_empty) = args
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    ROWS: gl.constexpr = BLOCK_M // 2
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[PARTITION_WARPS, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    wide_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[PARTITION_WARPS, 1],
                                                          instr_shape=[16, 2 * BLOCK_N, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, layout)
    # 8 columns per thread (16 bytes of bf16); a 128-column tile as measured, narrower ones without
    # threads holding the same columns.
    STORE_TN: gl.constexpr = 32 if BLOCK_N >= 128 else BLOCK_N // 8
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // STORE_TN, STORE_TN], [PARTITION_WARPS, 1], [1, 0])
    out_ty: gl.constexpr = out_ptr.dtype.element_ty

    used, num_pid_n = _tiles_in_use(start_ptr, count_ptr, num_experts, N, BLOCK_M, BLOCK_N)
    total = used * num_pid_n
    k_steps = gl.cdiv(K, BLOCK_K)
    step = 0
    j = 0
    t = _take(j, tile_ids, tile_ready, tile_empty)
    while t < total:
        off_m, _, off_n, expert = _grouped(t, used, num_pid_n, tile_expert_ptr, N, BLOCK_M, BLOCK_N, GROUP_M)
        first = off_m + WG * ROWS
        offs_p = first + gl.arange(0, ROWS, layout=rows_layout)
        start = gl.load(start_ptr + expert)
        count = gl.load(count_ptr + expert)
        row_ok = offs_p - start < count
        rows = gl.load(sorted_rows_ptr + offs_p, mask=row_ok, other=0) // a_row_div
        if not BLOCK_SCALES:
            # The row scales of the per-row schemes, asked for under the K loop.
            a_s = gl.load(a_scale_ptr + rows.to(gl.int64) * stride_asm, mask=row_ok, other=0.0)
        if first - start < count:
            if BLOCK_SCALES:
                acc_g = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=layout)
                acc_u = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=layout)
                acc_g, acc_u, step = _block_scaled_k_loop(acc_g, acc_u, step, k_steps, rows, row_ok, expert, off_n, N,
                                                          a_scale_ptr, w_scale_ptr, stride_asm, stride_ask, stride_wse,
                                                          stride_wsn, stride_wsk, a_bufs, w_bufs, ready, empty,
                                                          STAGES, WG, ROWS, layout)
            else:
                # One MMA over the stage's stacked gate and up tiles (2 BLOCK_N columns) per step:
                # the warpgroup's input tile is read from shared memory once per step, not once
                # for a gate MMA and again for an up MMA.
                acc = gl.zeros((ROWS, 2 * BLOCK_N), dtype=gl.float32, layout=wide_layout)
                for s in range(k_steps):
                    index = step % STAGES
                    mbarrier.wait(ready.index(index), step // STAGES & 1)
                    # cp.async wrote through the generic proxy; the MMA reads through the async one.
                    fence_async_shared()
                    a = a_bufs.index(index).slice(WG * ROWS, ROWS)
                    acc = warpgroup_mma(a, w_bufs.index(index).permute((1, 0)), acc, use_acc=s > 0, is_async=True)
                    # The step before's MMA is done: its stage is free for the loader.
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                    _BARRIER()
                    mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=s > 0)
                    step += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                _BARRIER()
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
                # Columns n and BLOCK_N + n sit in the same thread's registers: the split and the
                # layout conversion move no data (the SASS has no more shared-memory traffic).
                acc_g, acc_u = gl.split(gl.permute(gl.reshape(acc, [ROWS, 2, BLOCK_N]), (0, 2, 1)))
                acc_g = gl.convert_layout(acc_g, layout)
                acc_u = gl.convert_layout(acc_u, layout)

            offs_n = off_n + gl.arange(0, BLOCK_N, layout=cols_layout)
            col_ok = offs_n < N
            if BLOCK_SCALES:
                # Scaled at every K step already.
                gate = acc_g.to(out_ty).to(gl.float32)
                up = acc_u.to(out_ty).to(gl.float32)
            else:
                # grouped_gemm's arithmetic in its order: (acc * row scale) * column scale, rounded
                # to the model dtype, the activation in fp32, rounded again.
                ws_base = w_scale_ptr + expert.to(gl.int64) * stride_wse
                if W_COL_SCALES:
                    # Each thread loads one column's scales and the layout conversion hands them to
                    # the threads that hold the column: 2 loads per thread, not 64.
                    flat: gl.constexpr = gl.BlockedLayout([1], [32], [PARTITION_WARPS], [0])
                    offs_f = off_n + gl.arange(0, BLOCK_N, layout=flat)
                    f_ok = offs_f < N
                    wg_s = gl.load(ws_base + offs_f * stride_wsn, mask=f_ok, other=0.0)
                    wu_s = gl.load(ws_base + (offs_f + N) * stride_wsn, mask=f_ok, other=0.0)
                    wg_s = gl.convert_layout(wg_s, cols_layout)
                    wu_s = gl.convert_layout(wu_s, cols_layout)
                    gate = (acc_g * a_s[:, None] * wg_s[None, :]).to(out_ty).to(gl.float32)
                    up = (acc_u * a_s[:, None] * wu_s[None, :]).to(out_ty).to(gl.float32)
                else:
                    # One weight scale per expert (fp8_tensor): one load, not one per column
                    # each thread holds (64 loads and their addresses in every tile's epilogue).
                    w_s = gl.load(ws_base)
                    gate = (acc_g * a_s[:, None] * w_s).to(out_ty).to(gl.float32)
                    up = (acc_u * a_s[:, None] * w_s).to(out_ty).to(gl.float32)
            result = _act_mul(gate, up, ACT).to(out_ty)
            if TRACK_AMAX == 1:
                seen = gl.where(row_ok[:, None] & col_ok[None, :], gl.abs(result.to(gl.float32)), 0.0)
                gl.atomic_max(amax_ptr + expert, gl.max(gl.max(seen, axis=1), axis=0), sem="relaxed")
            elif TRACK_AMAX == 2:
                # Padding rows are left at the plan's zero: their h is exactly zero.
                seen = gl.where(col_ok[None, :], gl.abs(result.to(gl.float32)), 0.0)
                gl.atomic_max(amax_ptr + offs_p, gl.max(seen, axis=1), mask=row_ok, sem="relaxed")
            # Padding rows are stored too (their input rows read as zeros, so they hold exact
            # zeros): the next stage may read whole tiles without masking.
            result = gl.convert_layout(result, store_layout)
        else:
            # Rows of padding only: no MMA (the other warpgroup has the tensor cores), the stages
            # released as they come, and zeros stored as the whole tile's padding rows would be.
            step = _release_stages(step, k_steps, ready, empty, STAGES)
            result = gl.zeros((ROWS, BLOCK_N), dtype=out_ty, layout=store_layout)
        # The output's addresses are made after the K loop, not held in registers across it.
        offs_ps = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, store_layout))
        cols_s = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
        out_ptrs = out_ptr + offs_ps.to(gl.int64)[:, None] * stride_om + cols_s[None, :]
        out_mask = gl.broadcast(out_ptrs, (cols_s < N)[None, :])[1]
        gl.store(out_ptrs, result, mask=out_mask)
        j += 1
        t = _take(j, tile_ids, tile_ready, tile_empty)


@gluon.jit
def _mma_rows_0(args, ACT: gl.constexpr, TRACK_AMAX: gl.constexpr, BLOCK_SCALES: gl.constexpr,
                W_COL_SCALES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                GROUP_M: gl.constexpr):
    _mma_rows(args, ACT, TRACK_AMAX, BLOCK_SCALES, W_COL_SCALES, BLOCK_M, BLOCK_K, STAGES, GROUP_M, 0)


@gluon.jit
def _mma_rows_1(args, ACT: gl.constexpr, TRACK_AMAX: gl.constexpr, BLOCK_SCALES: gl.constexpr,
                W_COL_SCALES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                GROUP_M: gl.constexpr):
    _mma_rows(args, ACT, TRACK_AMAX, BLOCK_SCALES, W_COL_SCALES, BLOCK_M, BLOCK_K, STAGES, GROUP_M, 1)


@gluon.jit
def persistent_gate_up_kernel(a_ptr, w_desc, out_ptr, amax_ptr, a_scale_ptr, w_scale_ptr, sorted_rows_ptr,
                              tile_expert_ptr, start_ptr, count_ptr, counter_ptr, num_experts, N, K, a_row_div,
                              stride_am, stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_om,
                              ACT: gl.constexpr, TRACK_AMAX: gl.constexpr, BLOCK_SCALES: gl.constexpr,
                              W_COL_SCALES: gl.constexpr, BLOCK_M: gl.constexpr,
                              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                              num_warps: gl.constexpr):
    gl.static_assert(num_warps == PARTITION_WARPS, "the MMA partition the kernel starts in is one warpgroup")
    gl.static_assert(BLOCK_M == 128, "two MMA warpgroups of 64 rows")
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 2 * w_desc.block_type.shape[0], BLOCK_K],
                                       w_desc.layout)
    # ready: the loader's expect (one arrival plus the weight tiles' bytes) and each loader
    # thread's copies.
    ready, empty, tile_ids, tile_ready, tile_empty = _ring_and_handoff(STAGES, 1 + PARTITION_WARPS * 32)
    args = (a_ptr, w_desc, out_ptr, amax_ptr, a_scale_ptr, w_scale_ptr, sorted_rows_ptr, tile_expert_ptr, start_ptr,
            count_ptr, num_experts, N, K, a_row_div, stride_am, stride_asm, stride_ask, stride_wse, stride_wsn,
            stride_wsk, stride_om, a_bufs, w_bufs, ready, empty, counter_ptr, tile_ids, tile_ready, tile_empty)
    gl.warp_specialize([(_mma_rows_0, (args, ACT, TRACK_AMAX, BLOCK_SCALES, W_COL_SCALES, BLOCK_M, BLOCK_K, STAGES,
                                       GROUP_M)),
                        (_mma_rows_1, (args, ACT, TRACK_AMAX, BLOCK_SCALES, W_COL_SCALES, BLOCK_M, BLOCK_K, STAGES,
                                       GROUP_M)),
                        (_loader, (args, ACT, TRACK_AMAX, BLOCK_SCALES, BLOCK_M, BLOCK_K, STAGES, GROUP_M))],
                       [PARTITION_WARPS, PARTITION_WARPS], [MMA_REGS, LOADER_REGS])


def input_refusal(x) -> str | None:
    """Why this kernel cannot read the experts' input x (None when it can): it copies each row in
    16-byte pieces and reads one scale per row or per tensor."""
    if not isinstance(x, QuantizedActivations):
        return f"x must be fp8 activations, got {type(x).__name__}"
    if x.data.stride(1) != 1 or x.data.stride(0) % 16 or x.data.data_ptr() % 16:
        return f"x's rows must be contiguous and 16-byte aligned, got strides {x.data.stride()}"
    if x.row_scale is not None and x.tensor_scale is not None:
        return "x has both row and tensor scales (a scheme with a global scale)"
    return None


def persistent_gate_up(x: QuantizedActivations, w: QuantizedWeight, plan: RowAlignment, out: torch.Tensor,
                       config: GemmConfig, *, activation: str, amax: torch.Tensor | None = None,
                       a_row_div: int = 1, programs: int | None = None,
                       row_amax: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_gemm(x, w, plan, out, config, activation=activation, gather=True, amax=amax,
    a_row_div=a_row_div, row_amax=row_amax)`` for fp8_tensor / fp8_token / fp8_block with
    ``config.engine == "gluon"``; writes and returns ``out``.

    x: fp8 [M / a_row_div, H] with one scale per row ([rows, 1]) or per tensor, or fp8_block's
    [rows, H / 128]; w: fp8 [E, 2I, H] (gate rows, then up rows) with fp8_tensor [E], fp8_token
    [E, 2I] or fp8_block [E, 2I / 128, H / 128] scales (fp8_block: I a multiple of 128, no amax
    or row_amax); out: [P, I] in the
    model dtype, written at every position of the tiles in use; amax: fp32 [E], zeroed by the
    caller, or None; row_amax: fp32 [P], zeroed by the caller (``align_rows``), or None: the row
    maxima of |h| at the positions holding routed rows (not with amax); programs: how many
    persistent programs (None: one per multiprocessor of out's device; at most one per tile).
    config: 128 x 128 x 128 or 128 x 64 x 128 tiles, num_stages the ring's stages. Refuses
    (ValueError) what this kernel does not compute, naming the value.
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    where = "moe_gemm (engine 'gluon', gate_up)"
    mode = act_mode(activation)
    if mode not in GLUON_ACT_MODES:
        raise ValueError(f"{where}: computes the activation modes {GLUON_ACT_MODES}; {activation!r} has mode {mode} "
                         f"(the Triton gate_up computes it)")
    refusal = operands_refusal(out.device, x, w, "gate_up", GATE_UP_SCHEMES)
    if refusal:
        raise ValueError(f"{where}: {refusal}")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if (bm, bk) != (128, 128) or bn not in (64, 128):
        raise ValueError(f"{where}: computes 128 x 128 x 128 and 128 x 64 x 128 tiles, got {bm} x {bn} x {bk}")
    if plan.block_m != bm:
        raise ValueError(f"{where}: config.block_m={bm} but the plan's block_m={plan.block_m}")
    e, n_w, k = w.shape
    n = n_w // 2
    if n_w % 2:
        raise ValueError(f"{where}: fused gate_up needs an even number of weight rows, got {n_w}")
    if not isinstance(a_row_div, int) or isinstance(a_row_div, bool) or a_row_div < 1 or \
            x.shape[0] * a_row_div != plan.num_rows:
        raise ValueError(f"{where}: x has {x.shape[0]} rows and a_row_div={a_row_div!r}; the plan needs "
                         f"M = {plan.num_rows} = rows * a_row_div")
    refusal = input_refusal(x)
    if refusal:
        raise ValueError(f"{where}: {refusal}")
    a_scale = x.row_scale if x.row_scale is not None else x.tensor_scale
    stride_asm, stride_ask = scale_strides(a_scale, 2)
    if x.shape[1] != k or out.shape != (plan.padded_rows, n):
        raise ValueError(f"{where}: x {tuple(x.shape)} must be [rows, H={k}] and out {tuple(out.shape)} "
                         f"[P={plan.padded_rows}, I={n}]")
    if n < bn or k % bk:
        # A TMA box larger than its tensor is not a case this kernel is measured or tested on, and
        # the gathered rows are copied in whole K steps.
        raise ValueError(f"{where}: I={n} must be at least the tile's {bn} columns and H={k} a multiple of its "
                         f"{bk}-column K step")
    if out.stride(1) != 1 or not w.data.is_contiguous():
        raise ValueError(f"{where}: needs contiguous w and out's rows contiguous; got out strides {out.stride()}")
    if amax is not None and (amax.shape != (plan.start.shape[0],) or amax.dtype != torch.float32):
        raise ValueError(f"{where}: amax must be fp32 [E={plan.start.shape[0]}], got {amax.dtype} "
                         f"{tuple(amax.shape)}")
    if row_amax is not None and (amax is not None or row_amax.shape != (plan.padded_rows,)
                                 or row_amax.dtype != torch.float32 or row_amax.stride(0) != 1):
        raise ValueError(f"{where}: row_amax must be a contiguous fp32 [P={plan.padded_rows}] buffer, without amax; "
                         f"got {row_amax.dtype} {tuple(row_amax.shape)}, amax given: {amax is not None}")
    block_scales = w.scheme == "fp8_block"
    if block_scales and (amax is not None or row_amax is not None
                         or not one_w_scale_per_tile(kernel_mode(w.scheme), bn, n, True)):
        # Each K step scales the tile by one weight block's scale; fp8_block's h is quantized per
        # 128-column group by quantize_h, from h.
        raise ValueError(f"{where}: fp8_block needs I={n} a multiple of 128 and no amax or row_amax; got amax "
                         f"given: {amax is not None}, row_amax given: {row_amax is not None}")
    stride_wse, stride_wsn, stride_wsk = scale_strides(w.scale, 3)
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.float8e4nv)
    w_desc = TensorDescriptor.from_tensor(w.data.view(e * n_w, k), [bn, bk], w_layout)
    tiles = plan.max_tiles * triton.cdiv(n, bn)
    programs = programs or multiprocessors(out.device.index)
    if tiles:  # no launch for an empty plan
        persistent_gate_up_kernel[(min(programs, tiles), )](
            x.data, w_desc, out, amax if amax is not None else row_amax if row_amax is not None else out, a_scale,
            w.scale, plan.sorted_rows,
            plan.tile_expert, plan.start, plan.count, torch.zeros(1, dtype=torch.int32, device=out.device),
            plan.start.shape[0], n, k, a_row_div, x.data.stride(0),
            stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, out.stride(0),
            ACT=mode, TRACK_AMAX=amax_mode(amax, row_amax), BLOCK_SCALES=block_scales,
            W_COL_SCALES=stride_wsn != 0, BLOCK_M=bm, BLOCK_K=bk,
            STAGES=config.num_stages, GROUP_M=config.group_m, num_warps=PARTITION_WARPS.value,
            maxnreg=_MAXNREG)
    return out


# The registers each thread starts with (12 warps, 3 x 4): a multiple of 8 with 12 x 32 x it
# within the 65536 of an SM; warp_specialize then moves them between the partitions.
_MAXNREG = 65536 // (3 * PARTITION_WARPS.value * 32) // 8 * 8
