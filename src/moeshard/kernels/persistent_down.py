"""The fp8 down GEMM at prefill as a persistent kernel with hand-issued loads (Gluon, Hopper).

Computes what ``grouped_gemm.moe_gemm`` computes for the down projection of the per-tensor and
per-row fp8 schemes (``GemmConfig.engine == "gluon"``), with the same bits:

    y[sorted_rows[p], n] = (sum_k h[p, k] * w[e, n, k]) * a_scale[p] * w_scale[e, n]

for each padded position p of a tile of expert e (rows past the expert's count are not stored),
h: fp8 [P, I] at the plan's padded positions, w: fp8 [E, H, I], y: [M, H] in the model dtype.

Why a second kernel: the prefill tiles fill a multiprocessor's shared memory, so under Triton's
pipeliner one program runs per SM and, between two tiles, the SM drains its pipeline, runs the
epilogue and fills the pipeline again. Here one program per SM walks the tiles in use and issues
its own TMA loads STAGES - 1 steps ahead of the MMAs across tile boundaries: the next tile's first
loads are in flight during this tile's last MMAs and its epilogue, and the epilogue's row data
(positions, row scales, routed rows) is asked for when the tile starts. One H200, down alone on
the bench workloads (``scripts/gluon_down_study.py``, docs/performance.md): 2-12% faster than the
Triton kernel at K = I of 768 and 2048 (Qwen3, DeepSeek-V3), within 3% either way at Mixtral's
14336, which keeps Triton (``configs.GLUON_DOWN_MAX_K``).

The accumulation is the tensor cores' own across K (Triton's default on Hopper, the selected
prefill tiles' ``fp8_acc="imprecise"``), one MMA in flight behind the one issued. The result goes
through shared memory into rows of 16 bytes per thread before the scattered store (from the MMA
layout each thread stores 4 bytes: up to 55% slower at Qwen3 and DeepSeek-V3 shapes, measured).

Gluon is Triton's experimental lower-level language; ``supported`` says where this kernel runs
(compute capability 9.x: it issues warpgroup MMAs). Names that moved between Triton releases are
looked up once here.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from moeshard.kernels.align import RowAlignment
from moeshard.kernels.configs import GemmConfig, multiprocessors
from moeshard.kernels.modes import scale_strides
from moeshard.quant import QuantizedActivations, QuantizedWeight

# Triton 3.9 named the TMA load async_load (3.6: async_copy_global_to_shared).
_TMA_LOAD = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@functools.cache
def supported(device: torch.device) -> bool:
    """Whether ``device`` runs this kernel: a CUDA device of compute capability 9.x (Hopper's
    warpgroup MMA; Blackwell has none)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


@gluon.jit
def _tile(idx, pid, programs, used, num_pid_n, tile_expert_ptr, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          GROUP_M: gl.constexpr):
    """(first padded position, first weight row, first column, expert) of this program's idx-th
    tile, tiles pid, pid + programs, ... of ``grouped_gemm``'s grouped launch order; past the
    last tile, the last tile (its loads are then predicated off)."""
    return _grouped(gl.minimum(pid + idx * programs, used * num_pid_n - 1), used, num_pid_n, tile_expert_ptr, N,
                    BLOCK_M, BLOCK_N, GROUP_M)


@gluon.jit
def _tiles_in_use(start_ptr, count_ptr, num_experts, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(row tiles in use, column tiles): the tiles in use end with the last expert's (tiles past
    them hold padding only)."""
    last = num_experts - 1
    used = gl.load(start_ptr + last) // BLOCK_M + gl.cdiv(gl.load(count_ptr + last), BLOCK_M)
    return used, gl.cdiv(N, BLOCK_N)


@gluon.jit
def _grouped(t, used, num_pid_n, tile_expert_ptr, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             GROUP_M: gl.constexpr):
    """(first padded position, first weight row, first column, expert) of tile t of
    ``grouped_gemm``'s grouped launch order: GROUP_M consecutive row tiles sweep the column tiles
    together, the row tiles fastest."""
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
    _TMA_LOAD(a_desc, [off_m, k], bar, a_bufs.index(index), pred)
    _TMA_LOAD(w_desc, [off_w, k], bar, w_bufs.index(index), pred)
    return producer + 1


@gluon.jit
def _mma(consumer, acc, use_acc, bars, a_bufs, w_bufs, STAGES: gl.constexpr):
    """Waits for the next ring slot's loads, issues this step's MMA and waits until only it is in
    flight (so the slot of the step before is free to load into); returns the consumer count."""
    index = consumer % STAGES
    mbarrier.wait(bars.index(index), consumer // STAGES & 1)
    acc = warpgroup_mma(a_bufs.index(index), w_bufs.index(index).permute((1, 0)), acc, use_acc=use_acc,
                        is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    return consumer + 1, acc


@gluon.jit
def persistent_down_kernel(a_desc, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, sorted_rows_ptr, tile_expert_ptr,
                           start_ptr, count_ptr, num_experts, N, K, stride_asm, stride_wse, stride_wsn, stride_om,
                           W_COL_SCALES: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                           num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    # Precondition (persistent_down): 2 <= STAGES <= K steps + 1.
    gl.static_assert(STAGES >= 2, "expected at least 2 stages")
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, layout)
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    used, num_pid_n = _tiles_in_use(start_ptr, count_ptr, num_experts, N, BLOCK_M, BLOCK_N)
    num_tiles = gl.cdiv(used * num_pid_n - pid, programs)
    k_steps = gl.cdiv(K, BLOCK_K)
    own_steps = k_steps - (STAGES - 1)  # steps whose MMA is followed by a load of the same tile
    producer = 0
    consumer = 0
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)

    # The loads run STAGES - 1 steps ahead of the MMAs, across tiles. A program without tiles
    # loads nothing: it must not exit with loads in flight.
    off_m, off_w, off_n, expert = _tile(0, pid, programs, used, num_pid_n, tile_expert_ptr, N, BLOCK_M, BLOCK_N,
                                        GROUP_M)
    for ki in gl.static_range(STAGES - 1):
        producer = _load(producer, a_desc, w_desc, off_m, off_w, ki * BLOCK_K, bars, a_bufs, w_bufs, STAGES,
                         num_tiles > 0)

    for idx in range(num_tiles):
        # What the epilogue and the next tile's loads need is asked for now, so that its latency
        # passes under this tile's MMAs.
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

        # grouped_gemm's arithmetic in its order: (acc * row scale) * column scale, then rounded.
        ws_base = w_scale_ptr + expert.to(gl.int64) * stride_wse
        if W_COL_SCALES:
            # Each thread loads one column's scale and the layout conversion hands it to the
            # threads that hold the column: one load per thread, not one per column it holds.
            flat: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
            offs_f = off_n + gl.arange(0, BLOCK_N, layout=flat)
            w_s = gl.load(ws_base + offs_f * stride_wsn, mask=offs_f < N, other=0.0)
            scaled = acc * a_s[:, None] * gl.convert_layout(w_s, cols_layout)[None, :]
        else:
            # One weight scale per expert (fp8_tensor).
            scaled = acc * a_s[:, None] * gl.load(ws_base)
        result = gl.convert_layout(scaled.to(out_ptr.dtype.element_ty), store_layout)
        orig_s = gl.convert_layout(orig, gl.SliceLayout(1, store_layout))
        ok_s = gl.convert_layout(row_ok, gl.SliceLayout(1, store_layout))
        cols_s = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
        gl.store(out_ptr + orig_s[:, None] * stride_om + cols_s[None, :], result,
                 mask=ok_s[:, None] & (cols_s < N)[None, :])
        off_m, off_w, off_n, expert = next_m, next_w, next_n, next_expert

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def operands_refusal(device: torch.device, a, w, gemm: str,
                     schemes: tuple[str, ...] = ("fp8_tensor", "fp8_token")) -> str | None:
    """Why a Gluon GEMM (``gemm``: "gate_up" or "down") cannot run on ``device`` with activations
    ``a`` and weights ``w`` (None when it can): it needs compute capability 9.x and operands of one
    of ``schemes``, the same for both."""
    if not supported(device):
        return f"needs a CUDA device of compute capability 9.x, got {device}"
    if not isinstance(a, QuantizedActivations) or not isinstance(w, QuantizedWeight) or \
            w.scheme not in schemes or a.scheme != w.scheme:
        return (f"computes {' / '.join(schemes)} {gemm} GEMMs, got activations "
                f"{getattr(a, 'scheme', type(a).__name__)!r} and weights {getattr(w, 'scheme', type(w).__name__)!r}")
    return None


def tma_descriptors(h: QuantizedActivations, w: QuantizedWeight, config: GemmConfig):
    """The down GEMM's TMA descriptors: h's fp8 [P, I] in [block_m, block_k] blocks and the
    weights' fp8 [E, H, I], viewed [E * H, I], in [block_n, block_k] blocks (contiguous, checked by
    the caller)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bm, bn, bk = config.block_m, config.block_n, config.block_k
    e, n, k = w.shape
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.float8e4nv)
    return (TensorDescriptor.from_tensor(h.data, [bm, bk], a_layout),
            TensorDescriptor.from_tensor(w.data.view(e * n, k), [bn, bk], w_layout))


def persistent_down(h: QuantizedActivations, w: QuantizedWeight, plan: RowAlignment, out: torch.Tensor,
                    config: GemmConfig, programs: int | None = None) -> torch.Tensor:
    """``moe_gemm(h, w, plan, out, config, activation=None, gather=False)`` for fp8_tensor /
    fp8_token with ``config.engine == "gluon"``; writes and returns ``out``.

    h: fp8 [P, I] at the plan's padded positions, its scales per row ([P, 1]: fp8_token's own,
    fp8_tensor's expert scale on every row of the expert, as ``quant.quantize_h`` gives them);
    w: fp8 [E, H, I] with fp8_tensor [E] or fp8_token [E, H] scales; out: [M, H], written at the
    routed rows (``plan.sorted_rows``); programs: how many persistent programs (None: one per
    multiprocessor of out's device; at most one per tile). Refuses (ValueError) what this
    kernel does not compute, naming the value.
    """
    where = "moe_gemm (engine 'gluon')"
    refusal = operands_refusal(out.device, h, w, "down")
    if refusal:
        raise ValueError(f"{where}: {refusal}")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if plan.block_m != bm:
        raise ValueError(f"{where}: config.block_m={bm} but the plan's block_m={plan.block_m}")
    _, n, k = w.shape
    a_scale = h.row_scale if h.row_scale is not None else h.tensor_scale
    if a_scale is None or a_scale.shape != (h.shape[0], 1):
        raise ValueError(f"{where}: h needs one scale per row [P, 1], got "
                         f"{None if a_scale is None else tuple(a_scale.shape)}")
    if h.shape != (plan.padded_rows, k) or out.shape != (plan.num_rows, n):
        raise ValueError(f"{where}: h {tuple(h.shape)} must be [P={plan.padded_rows}, I={k}] and out "
                         f"{tuple(out.shape)} [M={plan.num_rows}, H={n}]")
    if n < bn or k < bk:
        # A TMA box larger than its tensor is not a case this kernel is measured or tested on.
        raise ValueError(f"{where}: H={n} and I={k} must be at least the tile's {bn} columns and {bk}-column "
                         f"K step")
    if out.stride(1) != 1 or k % 16 or not h.data.is_contiguous() or not w.data.is_contiguous():
        raise ValueError(f"{where}: needs contiguous h and w, I % 16 == 0 (TMA rows of 16-byte multiples) and "
                         f"out's rows contiguous; got I={k}, out strides {out.stride()}")
    scale = w.scale  # fp8_tensor [E], fp8_token [E, H]
    stride_wse, stride_wsn, _ = scale_strides(scale, 3)
    a_desc, w_desc = tma_descriptors(h, w, config)
    tiles = plan.max_tiles * triton.cdiv(n, bn)
    programs = programs or multiprocessors(out.device.index)
    # The ring runs STAGES - 1 loads ahead within a tile's K steps: no more stages than steps + 1.
    stages = max(2, min(config.num_stages, triton.cdiv(k, bk) + 1))
    if tiles:  # no launch for an empty plan
        persistent_down_kernel[(min(programs, tiles), )](
            a_desc, w_desc, out, a_scale, scale, plan.sorted_rows, plan.tile_expert, plan.start, plan.count,
            plan.start.shape[0], n, k, a_scale.stride(0), stride_wse, stride_wsn, out.stride(0),
            W_COL_SCALES=stride_wsn != 0, STAGES=stages, GROUP_M=config.group_m, num_warps=config.num_warps)
    return out
