"""Tile shapes of the grouped GEMM (and quantize_h's column spans) and which of the experts'
kernels launch under PDL, chosen on the host from shapes alone (graph-safe).

Regimes, by expected rows per active expert r = M / min(M, E):

* decode and small batches (r <= 42): every tile streams its expert's weights once, so the
  kernel is bound by weight bytes. BLOCK_M (16, 32 or 64) is the smallest that holds 1.5 r rows,
  so that most experts take one tile (a second tile reads the weights again: Mixtral at 64
  tokens, 16 rows per expert, reached 71% of copy bandwidth with 16-row tiles). BLOCK_N is the
  widest that still gives one program per multiprocessor (one token of Mixtral touches two
  experts: its down projection needs 32-column tiles to spread 2 x 4096 weight rows over 132
  SMs; measured best against 16 and 64), and the pipeline is as deep as shared memory allows.
  The fp8 schemes' 16-row tiles (and on an H100 the 64-row ones) from 16 routed rows on instead
  take 256-column K steps in narrower tiles (``_deep_k``).
* mid (r <= 96, BLOCK_M 64): less padding per expert than 128-row tiles.
* prefill (BLOCK_M 128): compute-bound tiles, 8 warps, grouped launch order so that a group of
  row tiles reuses one expert's weight tiles from L2; weights through TMA (the down GEMM's of
  bf16 once experts have >= 1024 rows), and for bf16 and fp8_block from 1024 rows per expert
  and 4096 intermediate columns the input laid out at the plan's positions so that gate_up
  loads it through TMA too.

The bf16, nvfp4 and decode entries are the fastest candidates of ``moeshard bench --tune`` on an
H200 (2026-11-30, Triton 3.6): bf16 gate_up 128x128x64 w8 s4 TMA 590 TFLOP/s and down
128x256x64 w8 s3 TMA 653 TFLOP/s on Mixtral prefill; the exact fp8 gate_up (widened to fp16,
``fp8_gate_up="exact"``) 128x64x64 w8 s4 223 TFLOP/s; nvfp4 gate_up 128x128x64 and down
128x128x128. The fp8 prefill entries come from the later stage sweeps of ``scripts/fp8_study.py``
(each GEMM timed alone on the bench workloads; the measurements are quoted at each entry below),
after the fp8_block weight scale became one scalar per tile and K step, which let 128 x 128
fused fp8 tiles fit without spilling. The mid entries were chosen from the compiler's register
report (no spills) and not tuned on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton

from moeshard.kernels.align import max_tiles
from moeshard.kernels.modes import one_w_scale_per_tile
from moeshard.quant import get_scheme

# Kernel modes (``moeshard.quant.schemes.KERNEL_MODES``) that pick tile shapes.
FP8 = (1, 2, 3)
FP8_TOKEN = 2
FP8_BLOCK = 3
NVFP4 = 4
# How the fp8 tensor cores accumulate (modes 1 and 2): a fresh fp32 tile per BLOCK_K step added
# in fp32; one accumulator promoted to fp32 every BLOCK_K terms; or reduced precision across K.
FP8_ACCUMULATIONS = ("split", "promote", "imprecise")
# Which kernel computes a GEMM (``GemmConfig.engine``): the Triton grouped GEMM, or the Gluon
# persistent GEMMs (``kernels.persistent_gate_up``: fp8_tensor, fp8_token and fp8_block;
# ``kernels.persistent_down``: fp8_tensor / fp8_token; prefill, Hopper).
ENGINES = ("triton", "gluon")
# The Gluon down GEMM is chosen for K (the intermediate size) in this range. One H200, down
# alone (scripts/gluon_down_study.py, 2026-12-04): 2-12% faster at K = 768 and 2048, within 3%
# either way at 14336; shorter K was not measured (the kernel computes it, with fewer stages).
GLUON_DOWN_MIN_K, GLUON_DOWN_MAX_K = 512, 8192
# The warp-specialized Gluon gate_up GEMM is chosen for hidden sizes (its K) in this range. One H200,
# gate_up alone and the whole experts, alternating (scripts/gluon_gate_up_study.py, 2026-12-04):
# gate_up 1-9% faster than the Triton kernel's selected tiles at Qwen3 (H = 2048) and Mixtral
# (4096) but Mixtral fp8_tensor at 16384 tokens (3% slower), the experts 1-7% faster there but
# Qwen3 at 4096 tokens (even). DeepSeek-V3 (7168) was left out then (experts within 2% at 4096
# tokens, 2-6% slower at 16384); with the kernel's one MMA over gate and up per K step, its
# experts took 3.91-3.97 against 4.05-4.12 ms at 4096 tokens and 11.69-11.90 against
# 12.32-13.19 at 16384 (fp8_tensor; fp8_token 4.06-4.08 / 11.82-11.87 against 4.18-4.20 /
# 12.36-13.45), two rounds each (results/h200/gluon_gate_up_study-2026-12-04-ef2d65f).
# Smaller hidden sizes were not measured (the kernel computes them: tests/gpu).
GLUON_GATE_UP_MIN_H, GLUON_GATE_UP_MAX_H = 2048, 7168
# fp8_block's prefill gate_up is the Gluon kernel with block scales for hidden sizes in this range.
# One H200, gate_up alone and the whole experts, two alternating rounds
# (scripts/gluon_gate_up_study.py --schemes fp8_block, 2026-12-04; the same bits): 128-column tiles
# at 4 stages against the Triton kernel's selected tile, experts Qwen3 (H = 2048) 0.541 against
# 0.598 ms at 4096 tokens and 1.849 against 2.076 at 16384, Mixtral (4096) 3.715 against 4.051
# and 14.889 against 14.909 (there the Triton gate_up reads the input laid out and quantizes h
# itself), DeepSeek-V3 (7168) 5.120 against 5.603 and 16.28 against 17.31. 64-column tiles were
# slower than the Triton kernel at Mixtral and DeepSeek-V3 and even at Qwen3.
GLUON_BLOCK_GATE_UP_MIN_H, GLUON_BLOCK_GATE_UP_MAX_H = 2048, 7168
# ... and its down GEMM the warp-specialized Gluon kernel with block scales
# (``kernels.persistent_block_down``, 128 x 128 x 128 tiles, 6 stages) for hidden sizes (its N) in
# this range. One H200, down alone and the whole experts, two alternating rounds
# (scripts/gluon_down_study.py --schemes fp8_block, 2026-12-04; the same bits): down 13-16% faster
# than the Triton tile at Qwen3 (H = 2048; experts 0.511 against 0.542 ms at 4096 tokens, 1.708
# against 1.794 at 16384) and Mixtral (4096; 3.498 against 3.719, 14.17 against 15.97-16.54); at
# DeepSeek-V3 (7168) down 3-4% faster, the experts 4% faster at 4096 tokens and 2% slower at 16384
# (16.26-16.30 against 15.97-16.00) in that study; in three alternating rounds of its experts on
# one lease (moeshard bench, 2026-12-04, results/h200/block_down_ab-2026-12-04-51e63e8) within the
# rounds' spread at 4096 tokens (4.41-4.55 against 4.52-4.60 ms) and 1.2-4.5% faster at 16384 in
# every round (14.99-15.33 against 15.36-15.69).
GLUON_BLOCK_DOWN_MIN_H, GLUON_BLOCK_DOWN_MAX_H = 2048, 7168
# Which of the experts' kernels launch under PDL (``ExpertsConfig.pdl``).
PDL_CHAINS = ("off", "gate_up", "all")
# Which nvfp4 operands are decoded to fp16 values before the GEMMs (``ExpertsConfig.decode_nvfp4``).
NVFP4_DECODES = ("off", "activations", "all")
# Where h is quantized between the GEMMs (``ExpertsConfig.h_quant``).
H_QUANTS = ("pass", "gate_up", "row_max")


@dataclass(frozen=True)
class GemmConfig:
    """BLOCK_M x BLOCK_N output tile, BLOCK_K reduction step, GROUP_M launch grouping,
    num_warps / num_stages as Triton takes them; tma: weight tiles (and contiguous A tiles)
    through Hopper's tensor memory accelerator instead of per-thread loads; fp8_acc: how the
    per-tensor / per-row fp8 modes accumulate on the fp8 tensor cores (``FP8_ACCUMULATIONS``:
    what ``moe_gemm`` documents), ignored by the other modes. Every one of them stays within
    ``ACCUMULATION["fp8_mma"]`` (``scripts/accumulation_contract.py``); half_tiles: an expert's
    last tile computes only its first block_m / 2 rows when the rest is padding (``moe_gemm``);
    engine (``ENGINES``): "triton", or "gluon" for the persistent fp8 GEMMs (128-row tiles with
    128-column K steps, 8 MMA warps, the MMA's own accumulation, whole tiles; num_stages is their
    ring of loads): the gate_up of ``kernels.persistent_gate_up`` (128 columns; its 8 MMA warps
    are two warpgroups, with a third that loads) and the down GEMM of
    ``kernels.persistent_down`` (256 columns)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False
    fp8_acc: str = "split"
    half_tiles: bool = False
    engine: str = "triton"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"GemmConfig.engine: {self.engine!r} is not one of {list(ENGINES)}")
        gluon_tile = (self.block_m, self.block_k, self.num_warps) == (128, 128, 8) and self.block_n in (64, 128, 256)
        if self.engine == "gluon" and not (gluon_tile and self.fp8_acc == "imprecise" and not self.half_tiles
                                           and self.num_stages >= 2):
            raise ValueError(f"GemmConfig: engine 'gluon' computes 128 x 64, 128 or 256 x 128 tiles with "
                             f"8 warps, fp8_acc='imprecise', whole tiles and num_stages >= 2; got {self}")
        if self.fp8_acc not in FP8_ACCUMULATIONS:
            raise ValueError(f"GemmConfig.fp8_acc: {self.fp8_acc!r} is not one of {list(FP8_ACCUMULATIONS)}")
        if self.half_tiles and (self.block_m < 32 or self.block_m % 32):
            # A half tile is a tile of its own: at least 16 rows, as every tl.dot operand.
            raise ValueError(f"GemmConfig.half_tiles needs block_m a multiple of 32, got block_m={self.block_m}")

    def as_dict(self) -> dict:
        return {"block_m": self.block_m, "block_n": self.block_n, "block_k": self.block_k, "group_m": self.group_m,
                "num_warps": self.num_warps, "num_stages": self.num_stages, "tma": self.tma, "fp8_acc": self.fp8_acc,
                "half_tiles": self.half_tiles, "engine": self.engine}


@dataclass(frozen=True)
class GemvConfig:
    """One token's experts as matrix-vector products (``kernels.gemv``): gate_up_block_n gate rows
    (and as many up rows) and down_block_n down rows of one routed row's expert per program, K in
    steps of block_k columns (a multiple of 128: fp8_block's scale groups), num_warps per program.
    Powers of two; block widths up to 128, so that an fp8_block tile lies in one 128-row weight
    block (one weight scale per tile and group)."""

    gate_up_block_n: int = 16
    down_block_n: int = 16
    block_k: int = 256
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("gate_up_block_n", "down_block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name}: expected a power of two, got {value!r}")
        if self.block_k % 128:
            raise ValueError(f"GemvConfig.block_k: a multiple of 128 (fp8_block's scale groups), got {self.block_k}")
        if max(self.gate_up_block_n, self.down_block_n) > 128 or self.num_warps > 16:
            raise ValueError(f"GemvConfig: block widths up to 128 and up to 16 warps, got {self}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ExpertsConfig:
    """Tile shapes of the two GEMMs. The tile plan is built for gate_up's block_m, which
    ``block_m`` names; down's block_m divides it. pdl (``PDL_CHAINS``): which kernels launch
    under programmatic dependent launch (``moeshard.kernels.pdl``; compute capability 9.0 or
    later), each overlapping the end of the kernel before it: none ("off"), the tile plan and
    the gate_up GEMM ("gate_up"), or those, quantize_h and the down GEMM ("all"). lay_out_a:
    the experts' input is first laid out at the plan's padded positions (``kernels.layout``),
    and gate_up reads each tile's rows as one block (through TMA where ``gate_up.tma``) instead
    of gathering them row by row: the same bits, one more pass over the input. decode_nvfp4
    (``NVFP4_DECODES``, nvfp4 experts only): which operands are decoded to fp16 values once,
    before the GEMMs, instead of in every program that reads them (``kernels.nvfp4_values``; the
    same bits): none, the activations (x and h), or the activations and the weights (a transient
    fp16 copy of one projection's weights at a time). decode_experts (decode_nvfp4 "all"): how
    many experts' weights are decoded and multiplied per pass (each GEMM launched once per
    window of experts, ``moe_gemm``'s ``experts``), so that the fp16 copy stays small; 0 decodes
    a projection whole. h_quant (``H_QUANTS``, quantized experts): h is quantized for the down
    GEMM by ``quantize_h``'s own pass over it ("pass"), or by the gate_up GEMM as it stores h
    ("gate_up": fp8_block experts whose intermediate size is a multiple of 128, gate_up in
    128-column Triton tiles; ``moe_gemm``'s ``out_scale``; the same bits, and no model-dtype h
    written and read again), or by ``quantize_h`` in one pass with the row maxima the gate_up
    GEMM max-reduced as it stored h ("row_max": fp8_token experts; ``moe_gemm``'s ``row_amax``;
    the same bits, without the row-max pass over h). direct: a call whose routed rows are one
    token's choices (``ExpertInput.repeat`` equal to its rows, which top-k routing gives distinct
    experts) runs on ``align.direct_rows``' plan, one tile per row in input order, instead of
    ``align_rows``': the same bits, and no plan kernel for the GEMM to wait on (both GEMMs on
    the Triton engine, one tile height, the input not laid out). quantize_in_down (with direct;
    fp8_tensor, fp8_token and fp8_block experts): on the direct plan, h stays in the model dtype
    and the down GEMM quantizes each tile's one row as it loads it (``moe_gemm``'s
    ``quantize_a``; the same bits), in place of ``h_quant``'s way, which calls on the sorted plan
    keep. down_prefetch (pdl "all", down on the Triton engine): each down GEMM program asks L2 for
    the first down_prefetch columns of K of each of its weight rows before it waits on the kernel
    ahead (``moe_gemm``'s ``prefetch_w``), so that the down weights stream while that kernel
    ends; the same bits. 0: none. gemv (with direct; fp8_tensor, fp8_token and fp8_block experts): one
    token's rows run as matrix-vector products on the CUDA cores (``kernels.gemv``) in place of both
    tile GEMMs, h quantized as the down GEMV loads it (the tiles' gate_up and down are then unused);
    fp32 sums of exact products, not the tiles' bits. None: the tile GEMMs."""

    gate_up: GemmConfig
    down: GemmConfig
    pdl: str = "off"
    lay_out_a: bool = False
    decode_nvfp4: str = "off"
    decode_experts: int = 0
    h_quant: str = "pass"
    direct: bool = False
    quantize_in_down: bool = False
    down_prefetch: int = 0
    gemv: GemvConfig | None = None

    def __post_init__(self) -> None:
        if self.pdl not in PDL_CHAINS:
            raise ValueError(f"ExpertsConfig.pdl: {self.pdl!r} is not one of {list(PDL_CHAINS)}")
        if self.decode_nvfp4 not in NVFP4_DECODES:
            raise ValueError(f"ExpertsConfig.decode_nvfp4: {self.decode_nvfp4!r} is not one of {list(NVFP4_DECODES)}")
        if not isinstance(self.decode_experts, int) or isinstance(self.decode_experts, bool) or self.decode_experts < 0:
            raise ValueError(f"ExpertsConfig.decode_experts: expected an int >= 0 (0: all experts at once), "
                             f"got {self.decode_experts!r}")
        if self.h_quant not in H_QUANTS:
            raise ValueError(f"ExpertsConfig.h_quant: {self.h_quant!r} is not one of {list(H_QUANTS)}")
        if self.h_quant == "row_max" and self.decode_nvfp4 != "off":
            raise ValueError(f"ExpertsConfig.h_quant='row_max' takes fp8_token's row maxima from the gate_up GEMM; "
                             f"decode_nvfp4={self.decode_nvfp4!r} decodes nvfp4 operands")
        if self.h_quant == "gate_up" and (self.gate_up.block_n != 128 or self.gate_up.engine != "triton"
                                          or self.decode_nvfp4 != "off"):
            raise ValueError(f"ExpertsConfig.h_quant='gate_up' quantizes h in the Triton gate_up GEMM's 128-column "
                             f"tiles; got gate_up block_n={self.gate_up.block_n}, engine={self.gate_up.engine!r}, "
                             f"decode_nvfp4={self.decode_nvfp4!r}")
        if self.lay_out_a and self.gate_up.engine == "gluon":
            raise ValueError("ExpertsConfig.lay_out_a lays the input out for a gate_up GEMM that reads it by tile; "
                             "the Gluon gate_up (engine 'gluon') gathers its rows")
        if self.decode_experts and self.decode_nvfp4 != "all":
            raise ValueError(f"ExpertsConfig.decode_experts={self.decode_experts} windows the decoded weights, but "
                             f"decode_nvfp4={self.decode_nvfp4!r} decodes none (it needs 'all')")
        if self.direct and (self.gate_up.block_m != self.down.block_m or self.lay_out_a
                            or "gluon" in (self.gate_up.engine, self.down.engine)):
            raise ValueError(f"ExpertsConfig.direct runs both Triton GEMMs on one direct plan; got block_m "
                             f"{self.gate_up.block_m} / {self.down.block_m}, engines {self.gate_up.engine!r} / "
                             f"{self.down.engine!r}, lay_out_a={self.lay_out_a} (select_config sets direct=True "
                             f"for decode sizes: replace(config, direct=False, quantize_in_down=False, ...) to change these)")
        if self.quantize_in_down and (not self.direct or self.decode_nvfp4 != "off"):
            raise ValueError(f"ExpertsConfig.quantize_in_down quantizes h in the down GEMM of the direct plan; it needs "
                             f"direct=True and decode_nvfp4='off', got direct={self.direct}, "
                             f"decode_nvfp4={self.decode_nvfp4!r}")
        if not isinstance(self.down_prefetch, int) or isinstance(self.down_prefetch, bool) or self.down_prefetch < 0:
            raise ValueError(f"ExpertsConfig.down_prefetch: expected an int >= 0 (columns of K; 0: none), "
                             f"got {self.down_prefetch!r}")
        if self.down_prefetch and (self.pdl != "all" or self.down.engine != "triton"):
            raise ValueError(f"ExpertsConfig.down_prefetch={self.down_prefetch} asks for the down weights while the "
                             f"kernel ahead runs; it needs pdl='all' and the Triton down engine, got "
                             f"pdl={self.pdl!r}, down.engine={self.down.engine!r}")
        if self.gemv is not None and (not self.direct or self.decode_nvfp4 != "off" or self.down_prefetch):
            raise ValueError(f"ExpertsConfig.gemv runs one token's rows on the direct plan as matrix-vector products; "
                             f"it needs direct=True, decode_nvfp4='off' and down_prefetch=0, got direct={self.direct}, "
                             f"decode_nvfp4={self.decode_nvfp4!r}, down_prefetch={self.down_prefetch}")
        # One tile plan, built for gate_up, serves both GEMMs: down may run it in tiles of a
        # divisor of its height (``align.split_tiles``), never taller ones, which would read past it.
        if self.gate_up.block_m % self.down.block_m:
            raise ValueError(f"ExpertsConfig: down.block_m={self.down.block_m} must divide gate_up.block_m="
                             f"{self.gate_up.block_m}; both GEMMs run on one tile plan")

    @property
    def block_m(self) -> int:
        return self.gate_up.block_m


def rows_per_expert(num_rows: int, num_experts: int) -> float:
    """Expected rows per active expert under balanced routing."""
    return num_rows / max(1, min(num_rows, num_experts))


@functools.cache
def multiprocessors(device_index: int | None) -> int:
    """SM count of a CUDA device (132 on an H200); 132 where there is none (CPU interpreter)."""
    if device_index is None or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Shared memory for the software pipeline, of the 227 KB a block may use on Hopper (the rest
# is left to the epilogue's layout conversion). Triton keeps num_stages tiles for wgmma
# (BLOCK_M >= 64) and num_stages - 1 for mma.sync.
PIPELINE_BYTES = 200 * 1024
# Prefill tiles compute half tiles below this many expected rows per expert (``select_config``).
HALF_TILES_BELOW = 384
# Up to this many expected rows per expert the tiles stream weights (decode and small batches).
DECODE_ROWS = 42
# From this many expected rows per expert the prefill tiles read weights through TMA, and the
# bf16 and fp8_block gate_up GEMMs read their input laid out at padded positions (``_tiles``).
TMA_ROWS = 1024
# ... and intermediate sizes of at least this many columns (the experts' input is laid out at
# padded positions only where gate_up's width repays the pass over it: Mixtral, not Qwen3).
LAY_OUT_INTER = 4096


# The most fp16 bytes of decoded nvfp4 weights (one window of experts of one projection at a
# time) the experts may hold transiently at prefill (``ExpertsConfig.decode_nvfp4 = "all"``).
NVFP4_DECODED_MAX_BYTES = 2 * 2**30


def decoded_weight_bytes(num_experts: int, hidden: int, inter: int) -> int:
    """fp16 bytes of the larger projection's decoded weights: gate_up, E x 2I x H."""
    return 2 * num_experts * 2 * inter * hidden


def decode_window(num_experts: int, hidden: int, inter: int) -> int:
    """``ExpertsConfig.decode_experts`` for nvfp4 weights decoded at prefill: 0 (whole) where
    gate_up's fp16 copy fits in ``NVFP4_DECODED_MAX_BYTES``, else the fewest equal windows that
    fit (DeepSeek-V3: 8 windows of 32 experts, 1.9 GB each, in place of 15 GB)."""
    total = decoded_weight_bytes(num_experts, hidden, inter)
    if total <= NVFP4_DECODED_MAX_BYTES:
        return 0
    fits = max(1, NVFP4_DECODED_MAX_BYTES // decoded_weight_bytes(1, hidden, inter))
    windows = -(-num_experts // fits)
    return -(-num_experts // windows)


# nvfp4's prefill tiles where its weights stay codes, decoded in each program
# (``moeshard bench --tune``, 2026-11-30).
NVFP4_GATE_UP = GemmConfig(128, 128, 64, 8, 8, 3)
NVFP4_DOWN = GemmConfig(128, 128, 128, 8, 8, 3)


# quantize_h's grid (kernels/quant.py): QUANT_ROWS positions x a span of columns per program, a
# multiple of SPAN_UNIT (one fp8_block scale group, eight nvfp4 blocks). Programs the column split
# aims for: two per multiprocessor of an H100 / H200 (132 SMs), so that a decode step's few row
# blocks still fill the GPU. Measured on one H200 (``scripts/fp8_study.py``, quantize_h alone at
# every span, 2026-12-01): narrow spans win everywhere. Up to 2^24 elements of h (decode and small
# batches: Mixtral 128 tokens is 11M, DeepSeek-V3 128 tokens 10.5M) 128 columns is fastest (Mixtral
# 1 token 6.8 us against 37 us at 4096 columns; 128 tokens 13.0 us against 24.7 us at 2048); above
# it 512 columns is (Mixtral 4096 tokens 0.104 ms against 0.371 ms for whole rows, DeepSeek-V3
# 0.092 against 0.099 ms).
QUANT_ROWS = 16
SPAN_UNIT = 128
SMALL_H_ELEMENTS = 2**24
SMALL_SPAN, LARGE_SPAN = SPAN_UNIT, 4 * SPAN_UNIT


def column_span(rows: int, K: int) -> int:
    """quantize_h's columns per program for h of ``rows`` rows and K columns: 128 for h of at
    most ``SMALL_H_ELEMENTS`` elements, else 512 (never wider than the row rounded up to 128).
    A function of the shapes only (graph-safe)."""
    span = SMALL_SPAN if rows * K <= SMALL_H_ELEMENTS else LARGE_SPAN
    return min(span, SPAN_UNIT * triton.cdiv(K, SPAN_UNIT))


def quantize_h_programs(padded_rows: int, K: int) -> int:
    """quantize_h's grid size for h of ``padded_rows`` x K (the row-max pass of fp8_token, when
    there is one, has the same grid)."""
    return padded_rows // QUANT_ROWS * triton.cdiv(K, column_span(padded_rows, K))


# The fp8 GEMMs on the MMA stream their weights in 16-row decode tiles with 256-column K steps
# where K is a multiple of 256, from DEEP_K_MIN_ROWS routed rows on: gate_up 32 columns wide at 4
# stages and down 64 wide at 3; on an H100 also in 64-row tiles, both 64 wide, gate_up at 2
# stages and down at 3 (each narrower where fewer programs than multiprocessors would run).
# fp8_block's steps are two 128-column sub-steps, one per scale group (``moe_gemm``), the same
# bits as 128-column steps.
# Measured, the whole experts against the tiles of ``_streaming``, alternating rounds
# (scripts/decode_tile_study.py):
# - fp8_tensor, one H100, 2026-12-05 (results/h100/decode_tile_study-2026-12-05-2950028): 16-row
#   tiles at 16 tokens 0.939-0.953 of the time at DeepSeek-V3, Mixtral and Qwen3, and 0.939-0.952
#   at 128 tokens (DeepSeek-V3, Qwen3). The K step is what moves it: 256-column steps at the
#   chosen 128-column width gave 0.957-0.976, 128-column steps at 32 columns and 6 stages
#   0.985-0.996.
# - 64-row tiles (Mixtral's 128 tokens) take 256-column steps on an H100 only (``GPU_KINDS``).
#   Both 64 columns wide with 256-column steps (gate_up at 2 stages, down at 3) were faster on one
#   H100 80GB HBM3 (the decode tile study, results/h100/decode_tile_study-2026-12-05-904eb10-block:
#   fp8_token 0.972, fp8_block 0.976; the bench, results/h100/deep_k_ab-2026-12-05-50cce4d:
#   0.963-0.974) and slower on one H200, the bench against the code with 128-column steps, two
#   alternating rounds (results/h200/deep_k_ab-2026-12-05-83c9047): fp8_tensor 1.044, fp8_token
#   1.052, fp8_block 1.086 of the time.
# - fp8_block's 16-row tiles, one H100, the bench against the code before, two alternating rounds
#   (scripts/bench_ab.py, results/h100/block_deep_k_ab-2026-12-05-904eb10): 0.954-0.958 at
#   DeepSeek-V3's 16 and 128 tokens and Mixtral's 16, 0.985-0.986 at Qwen3's; on one H200
#   (results/h200/deep_k_ab-2026-12-05-83c9047) 0.972 and 0.988 at DeepSeek-V3's 16 and 128
#   tokens, 0.970 at Mixtral's 16.
# One token's rows (2 and 8 routed rows measured) keep the tiles of ``_streaming``: on one H200
# (``scripts/bench_ab.py``, two alternating rounds of the bench,
# results/h200/decode_tile_ab-2026-12-05-2950028) the deep-K tiles took 1.06-1.08x the time at one
# DeepSeek-V3 token and 1.01-1.02x at one Mixtral token, and 0.93-0.97x at 16 and 128 tokens
# (DeepSeek-V3 0.9554 -> 0.9022 ms at 16 tokens, Mixtral 0.380 -> 0.355, Qwen3 0.1378 -> 0.1340).
# From 16 routed rows on they gain as from 32 (results/h100/deep_k_ab-2026-12-05-6306923-few-tokens).
# 32-row tiles were not measured and keep 128-column steps.
DEEP_K = 256
DEEP_K_MIN_ROWS = 16
# Which GPU's measured decode tiles ``select_config`` takes (``gpu_kind``): "h200" for every GPU
# but an H100 (the tiles were tuned on an H200), "h100" for an H100.
GPU_KINDS = ("h200", "h100")
# gpu kind -> block_m -> ((gate_up widths, stages), (down widths, stages))
DeepKTiles = dict[int, tuple[tuple[tuple[int, ...], int], tuple[tuple[int, ...], int]]]
DEEP_K_TILES: dict[str, DeepKTiles] = {
    "h200": {16: (((32, 16), 4), ((64, 32, 16), 3))},
    "h100": {16: (((32, 16), 4), ((64, 32, 16), 3)), 64: (((64, 32), 2), ((64, 32), 3))},
}


@functools.cache
def gpu_kind(device_index: int | None) -> str:
    """``select_config``'s ``gpu`` for a CUDA device: "h100" where the name CUDA reports holds
    "H100" (the 64-row decode tiles were measured on an H100 80GB HBM3; the H100's other forms
    were not measured and take the same), else "h200", also where there is no CUDA device."""
    if device_index is None or not torch.cuda.is_available():
        return "h200"
    return "h100" if "H100" in torch.cuda.get_device_properties(device_index).name else "h200"


def _deep_k(block_m: int, n: int, tiles: int, sms: int, fused: bool, gpu: str) -> GemmConfig:
    """A weight-streaming tile of ``block_m`` rows (a key of ``DEEP_K_TILES[gpu]``) with
    ``DEEP_K``-column K steps: the widest of its widths giving at least one program per
    multiprocessor."""
    widths, stages = DEEP_K_TILES[gpu][block_m][0 if fused else 1]
    block_n = next((w for w in widths if tiles * -(-n // w) >= sms), widths[-1])
    return GemmConfig(block_m, block_n, DEEP_K, group_m=1, num_warps=4, num_stages=stages)


def _streaming(block_m: int, n: int, tiles: int, sms: int, fused: bool, mode: int | None) -> GemmConfig:
    """A weight-streaming tile: the widest BLOCK_N giving at least one program per SM, with as
    many pipeline stages as shared memory holds (deeper for narrow tiles)."""
    # 64 x 128 fused tiles spill. The fp8 down GEMM (not fused) reads its weights faster in
    # 64 x 128 tiles: Mixtral at 128 tokens on one H200 (scripts/fp8_study.py, 2026-12-01), down
    # 0.130 ms (fp8_tensor) and 0.134 ms (fp8_block) against 0.146 and 0.178 ms at 64 x 64.
    widths = (64, 32) if block_m == 64 and (fused or mode not in FP8) else (128, 64, 32)
    block_n = 16
    for candidate in widths:
        if tiles * -(-n // candidate) >= sms:
            block_n = candidate
            break
    if mode == NVFP4:
        # Dequantization holds the unpacked tile in registers; loads are not the limit.
        return GemmConfig(block_m, block_n, 128, group_m=1, num_warps=4, num_stages=3)
    elt = 1 if mode in FP8 else 2
    stage = (block_m + (2 if fused else 1) * block_n) * 128 * elt
    fit = PIPELINE_BYTES // stage + (1 if block_m < 64 else 0)
    stages = max(2, min(6 if block_n <= 32 else 4, fit))
    return GemmConfig(block_m, block_n, 128, group_m=1, num_warps=4, num_stages=stages)


def _few_rows_gate_up(tile: GemmConfig) -> GemmConfig:
    """The fp8 gate_up tile of fewer than DEEP_K_MIN_ROWS routed rows (one token's): the streaming
    tile's width, with DEEP_K-column K steps (2 stages at 128 columns, 3 narrower: the shared
    memory of its 128-column pipeline). The same bits as 128-column steps (the decode tile study
    compares them). The decode tile study at one token, these against the 128-column steps, rounds
    alternating: one H100 80GB HBM3 (results/h100/decode_tile_study-2026-12-07-1f8a85e-*-one-token)
    Mixtral 0.974 (fp8_tensor), 0.976 (fp8_token), 0.978 (fp8_block) at 128 columns, DeepSeek-V3
    0.987, 0.987, 0.991 at 64; one H200 (results/h200/one_token-2026-12-07-19a3672) 4.0% off
    Mixtral fp8_tensor, 1.1% off DeepSeek-V3. The bench's experts at one token against the
    128-column steps, one H200, two alternating rounds
    (results/h200/few_rows_gate_up_ab-2026-12-07-4807f79-44ffee9): DeepSeek-V3 0.985 / 0.987 /
    0.980 (fp8_tensor / fp8_token / fp8_block), Mixtral 0.972 / 0.966 / 0.986, faster in every
    round; Qwen3 within 0.3%. The deep-K tiles' 32 columns at 4 stages, which 16 rows and more
    take, were slower at one token (the note above ``DEEP_K``)."""
    return dataclasses.replace(tile, block_k=DEEP_K, num_stages=2 if tile.block_n >= 128 else 3)


# fp8_block's one-token rows as matrix-vector products (``ExpertsConfig.gemv``, ``kernels.gemv``).
# One H100 80GB HBM3, the decode tile study at one token, two alternating rounds, against the
# chosen tile GEMMs (results/h100/one_token_gemv-2026-12-07-ef59bbb): DeepSeek-V3 0.946, Mixtral
# 0.971, Qwen3 0.855 of the time at 16 x 16 x 512 with 4 warps (the fastest at Mixtral and Qwen3;
# 0.937 at 16 x 16 x 256 with 2 warps at DeepSeek-V3); the bench against the tiles, two alternating
# rounds (results/h100/one_token_gemv_select-2026-12-07-6e96125-1f45e87): 0.951, 0.967 and 0.859 of
# the experts' time. The per-row schemes keep the tiles: 0.982-0.996 at DeepSeek-V3 (32 x 32 x 256,
# 4 warps), 1.005-1.058 at Mixtral and Qwen3 at best over two studies. Taken on an H100 only
# (``GPU_KINDS``): on an H200 the GEMVs have not been timed, and its faster memory leaves the
# tiles' fixed costs a larger share, as with the 64-row tiles' K steps above, which won on the
# H100 and lost on the H200.
ONE_TOKEN_BLOCK_GEMV = GemvConfig(16, 16, 512, 4)


def select_config(num_rows: int, num_experts: int, hidden: int, inter: int, scheme: str,
                  sms: int = 132, fp8_gate_up: str = "mma", pdl: bool = False, gluon: bool = False,
                  gpu: str = "h200") -> ExpertsConfig:
    """Tile shapes for M routed rows over E experts, hidden H, intermediate I (per rank),
    on a GPU with ``sms`` multiprocessors; fp8_gate_up as ``TritonExperts`` takes it; pdl:
    whether the GPU takes programmatic dependent launch (``moeshard.kernels.pdl.supported``);
    gluon: whether it runs the Gluon GEMMs (``moeshard.kernels.persistent_down.supported``); gpu
    (``GPU_KINDS``, ``gpu_kind``): whose measured decode tiles to take."""
    if gpu not in GPU_KINDS:
        raise ValueError(f"select_config: gpu={gpu!r} is not one of {list(GPU_KINDS)}")
    cfg = _tiles(num_rows, num_experts, hidden, inter, scheme, sms, fp8_gate_up, gpu)
    per_row = get_scheme(scheme).kernel_mode in (1, 2)
    if gluon and per_row and cfg.gate_up == GemmConfig(128, 128, 128, 8, 8, 4, tma=True, fp8_acc="imprecise",
                                                       half_tiles=cfg.gate_up.half_tiles) \
            and inter >= 128 and hidden % 128 == 0 and GLUON_GATE_UP_MIN_H <= hidden <= GLUON_GATE_UP_MAX_H:
        # The per-row schemes' prefill gate_up tile as the warp-specialized Gluon kernel
        # (``kernels.persistent_gate_up``), whose second MMA warpgroup skips rows of padding
        # instead of half tiles.
        cfg = dataclasses.replace(cfg, gate_up=dataclasses.replace(cfg.gate_up, engine="gluon", half_tiles=False))
    if gluon and cfg.down.fp8_acc == "imprecise" and cfg.down.block_n == 256 and hidden >= 256 \
            and GLUON_DOWN_MIN_K <= inter <= GLUON_DOWN_MAX_K and per_row:
        # The per-row schemes' prefill down tile (128 x 256 x 128, unpromoted), as the persistent
        # Gluon kernel with 4 stages (scripts/gluon_down_study.py: 4 stages and rows stored
        # through shared memory were fastest at K = 768 and 2048).
        cfg = dataclasses.replace(cfg, down=dataclasses.replace(cfg.down, engine="gluon", num_stages=4,
                                                                 half_tiles=False))
    if gluon and get_scheme(scheme).kernel_mode == FP8_BLOCK \
            and cfg.gate_up == GemmConfig(128, 128, 128, 8, 8, 3, tma=True, half_tiles=cfg.gate_up.half_tiles) \
            and inter >= 128 and inter % 128 == 0 and hidden % 128 == 0 \
            and GLUON_BLOCK_GATE_UP_MIN_H <= hidden <= GLUON_BLOCK_GATE_UP_MAX_H:
        # fp8_block's prefill gate_up tile as the Gluon kernel with block scales: it gathers the
        # input's rows (no layout pass) and stores h in the model dtype for quantize_h.
        gate_up = dataclasses.replace(cfg.gate_up, engine="gluon", half_tiles=False, num_stages=4,
                                      fp8_acc="imprecise")
        cfg = dataclasses.replace(cfg, gate_up=gate_up, lay_out_a=False, h_quant="pass")
        if GLUON_BLOCK_DOWN_MIN_H <= hidden <= GLUON_BLOCK_DOWN_MAX_H:
            cfg = dataclasses.replace(cfg, down=GemmConfig(128, 128, 128, 8, 8, 6, tma=True, fp8_acc="imprecise",
                                                           engine="gluon"))
    decode = rows_per_expert(num_rows, num_experts) <= DECODE_ROWS
    if get_scheme(scheme).kernel_mode == FP8_TOKEN and (decode or cfg.gate_up.engine == "gluon"):
        # fp8_token's row maxima from the gate_up epilogue (``ExpertsConfig.h_quant``). One H200,
        # the bench's fp8_token experts against the row-max pass, two alternating rounds
        # (results/h200/row_max_ab-2026-12-04-4a36ae4): Qwen3 at 1, 16 and 128 tokens 0.0303 /
        # 0.1345 / 0.1837-0.1843 against 0.0311 / 0.1362-0.1367 / 0.1852-0.1858 ms, Mixtral at 16
        # and 128 tokens 0.3685-0.3700 / 0.3777-0.3787 against 0.3705-0.3732 / 0.3793-0.3802, one
        # token and DeepSeek-V3's decode within the rounds' spread; with the Gluon gate_up, Qwen3
        # at 16384 tokens 1.404-1.407 against 1.418 and Mixtral at 4096 and 16384 2.455-2.459 /
        # 10.26 against 2.474-2.487 / 10.28-10.38 (Qwen3 at 4096 even). On the Triton 128 x 128 x
        # 128 prefill tile (at the 255-register cap; the epilogue's reduction spills 1-2 registers
        # where the tile spilled none) DeepSeek-V3 lost 10-13%: 4.28-4.33 / 13.68-13.74 against
        # 3.84-3.97 / 12.05-12.16 ms at 4096 / 16384 tokens.
        cfg = dataclasses.replace(cfg, h_quant="row_max")
    if decode and cfg.gate_up.block_m == cfg.down.block_m and not cfg.lay_out_a \
            and cfg.gate_up.engine == cfg.down.engine == "triton":
        # One token's rows on a direct plan (``ExpertsConfig.direct``): the GEMM waits on no
        # plan kernel. One H200, DeepSeek-V3's experts at one token with the plan made before the
        # call (scripts/decode_study.py, the bench's L2 flush): 112 and 110 us against 123 us
        # (fp8_tensor, fp8_block), though the plan kernel itself runs 3 us.
        cfg = dataclasses.replace(cfg, direct=True)
        if per_row and num_rows < DEEP_K_MIN_ROWS and inter % DEEP_K == 0:
            cfg = dataclasses.replace(cfg, quantize_in_down=True,
                                      down=in_down_tile(hidden, min(num_rows, num_experts), sms))
        if gpu == "h100" and get_scheme(scheme).kernel_mode == FP8_BLOCK and num_rows < DEEP_K_MIN_ROWS \
                and inter % 128 == 0 and hidden % 128 == 0:
            cfg = dataclasses.replace(cfg, gemv=ONE_TOKEN_BLOCK_GEMV)
    if not pdl or not decode:
        return cfg
    # Decode only, and quantize_h with the down GEMM only while quantize_h's grid fits in one wave
    # of the multiprocessors. One H200, the experts launched serially and with PDL on some of
    # their kernels, alternating rounds (scripts/pdl_study.py --stages, 2026-12-03): the plan and
    # gate_up under PDL took 0.964-0.999 of the serial time in every decode case measured (1 and 16
    # tokens); all four kernels took 0.932-0.989 at one token where quantize_h has 48 and 128
    # programs (Qwen3, DeepSeek-V3), but quantize_h and down under PDL took 1.34-1.35 at one Mixtral
    # token (224 programs) and 1.02-1.03 at 16 (896); bf16 (no quantize_h) under PDL throughout took
    # 1.04 at one Mixtral token. The whole chain at 4096 tokens took 0.99-1.05.
    quantized = get_scheme(scheme).quantized
    P = max_tiles(num_rows, num_experts, cfg.block_m) * cfg.block_m
    # Where gate_up quantizes h (``h_quant_for``) no quantize_h runs, and only the plan and gate_up
    # chain was measured.
    separate = quantized and cfg.h_quant != "gate_up"
    chain = "all" if separate and quantize_h_programs(P, inter) <= sms else "gate_up"
    return dataclasses.replace(cfg, pdl=chain)


# One token's per-row fp8 h quantized by the down GEMM as it loads its one row
# (``ExpertsConfig.quantize_in_down``), in 16-row down tiles with 256-column K steps: 64 columns
# wide at 3 stages, or 32 at 4 where 64 would give fewer programs than multiprocessors. The row is
# loaded as one element a thread, and only a load of at least 4 bytes a thread goes through the
# pipeline's asynchronous copies (``LDGSTS``): at 128-column steps each step waits on a 2-byte load
# from L2 (``LDG.E.U16``; scripts/kernel_resources.py's SASS), which cost Mixtral's 112 steps
# more than quantize_h does. One H100 80GB HBM3, the bench's experts at one token, this code's
# first form (128-column steps) against the code before, two alternating rounds
# (scripts/bench_ab.py, results/h100/in_down-2026-12-07-3e16258-e315596): DeepSeek-V3 fp8_tensor
# 0.1404-0.1408 against 0.1430-0.1437 ms, fp8_token 0.1412-0.1413 against 0.1437-0.1439, Qwen3
# fp8_tensor 0.0316-0.0317 against 0.0328-0.0330, but Mixtral fp8_tensor 0.1984-0.1986 against
# 0.1479-0.1483; the decode tile study of the same lease with 256-column down steps: Mixtral
# fp8_tensor 0.722 of that time at 32 x 256, 4 stages (0.1435 ms, against the pass's 0.148),
# DeepSeek-V3 0.975 at 64 x 256, 3 stages. These tiles against the code before, the same A/B
# (results/h100/in_down-2026-12-07-3e16258-36a02bc): fp8_tensor / fp8_token 0.962 / 0.968
# (DeepSeek-V3), 0.969 / 0.970 (Mixtral), 0.887 / 0.898 (Qwen3), faster in every round.
# fp8_block's scale groups are 128 columns, so its row stays a 2-byte load a thread: it keeps
# ``h_quant`` (Mixtral's quantized by gate_up; in the first form Mixtral took 1.45x, DeepSeek-V3
# 0.99x, Qwen3 1.00x).
IN_DOWN_TILES = ((64, 3), (32, 4))


def in_down_tile(hidden: int, tiles: int, sms: int) -> GemmConfig:
    """The down tile of one token's rows whose h the down GEMM quantizes (``IN_DOWN_TILES``)."""
    block_n, stages = next(((w, s) for w, s in IN_DOWN_TILES if tiles * -(-hidden // w) >= sms), IN_DOWN_TILES[-1])
    return GemmConfig(16, block_n, DEEP_K, group_m=1, num_warps=4, num_stages=stages)


def h_quant_for(mode: int | None, gate_up: GemmConfig, inter: int, where: bool) -> str:
    """``ExpertsConfig.h_quant``: "gate_up" for fp8_block experts whose gate_up tile is 128 columns
    wide over an intermediate size that is a multiple of 128, where ``where`` says the shape gains
    from it, else "pass".

    One H200, the experts with either h_quant, alternating rounds (scripts/h_quant_study.py,
    2026-12-04; the same bits): at decode, where the tile is 128 wide, quantizing in gate_up saves
    a launch (Qwen3 128 tokens 0.180 against 0.183 ms, DeepSeek-V3 128 tokens 2.010 against 2.037,
    Mixtral one token 0.122 against 0.125, in every round). At prefill the epilogue's correctly
    rounded divisions cost the gate_up tiles more than the pass over h costs where h is narrow:
    Qwen3 4096 and 16384 tokens 0.646 and 2.094 against 0.607 and 2.020 ms, DeepSeek-V3 within its
    rounds' spread (5.47-5.85 against 5.64-5.71 ms at 4096 tokens). Mixtral's 14336-column h is the
    widest pass: 16384 tokens 15.02-15.18 against 15.31-16.16 ms, 4096 tokens even, so prefill
    quantizes in gate_up where the input is laid out (Mixtral from 1024 rows per expert)."""
    wide = mode == FP8_BLOCK and gate_up.block_n == 128 and gate_up.engine == "triton" and inter % 128 == 0
    return "gate_up" if where and wide else "pass"


def _tiles(num_rows: int, num_experts: int, hidden: int, inter: int, scheme: str, sms: int,
           fp8_gate_up: str, gpu: str) -> ExpertsConfig:
    r = rows_per_expert(num_rows, num_experts)
    mode = get_scheme(scheme, "select_config").kernel_mode
    fp8 = mode in FP8
    if r <= DECODE_ROWS:
        # One tile per expert for most experts (loads vary around r): a second tile would read
        # the expert's weights again.
        block_m = 16 if 1.5 * r <= 16 else (32 if 1.5 * r <= 32 else 64)
        tiles = min(num_rows, num_experts)
        deep = block_m in DEEP_K_TILES[gpu] and mode in (1, 2, FP8_BLOCK) and num_rows >= DEEP_K_MIN_ROWS
        if deep and fp8_gate_up == "mma" and hidden % DEEP_K == 0:
            gate_up = _deep_k(block_m, inter, tiles, sms, True, gpu)
        else:
            gate_up = _streaming(block_m, inter, tiles, sms, True, mode)
            if block_m == 16 and mode in (1, 2, FP8_BLOCK) and fp8_gate_up == "mma" and hidden % DEEP_K == 0:
                gate_up = _few_rows_gate_up(gate_up)
        if deep and inter % DEEP_K == 0:
            down = _deep_k(block_m, hidden, tiles, sms, False, gpu)
        else:
            down = _streaming(block_m, hidden, tiles, sms, False, mode)
        return ExpertsConfig(gate_up, down, h_quant=h_quant_for(mode, gate_up, inter, True))
    if r <= 96:
        if mode == NVFP4:
            return ExpertsConfig(GemmConfig(64, 64, 64, 8, 4, 3), GemmConfig(64, 128, 64, 8, 4, 3))
        if fp8:
            return ExpertsConfig(GemmConfig(64, 64, 64, 8, 4, 4), GemmConfig(64, 128, 128, 8, 4, 4))
        return ExpertsConfig(GemmConfig(64, 128, 64, 8, 4, 4), GemmConfig(64, 128, 64, 8, 4, 4))
    tma = r >= TMA_ROWS
    # The input laid out at padded positions (``ExpertsConfig.lay_out_a``), read through TMA by
    # gate_up, against rows gathered per tile. One H200, the bench workloads, alternating rounds
    # (scripts/gather_study.py, 2026-12-03, two runs): the whole experts at Mixtral (1024 and 4096
    # rows per expert) bf16 4.98 -> 4.89 ms at 4096 tokens and 19.54 -> 18.85 at 16384, fp8_block
    # 3.96 -> 3.78 and 16.18 -> 15.29; fp8_tensor 2.68 -> 2.77 and 11.04 -> 10.83, fp8_token 2.72 ->
    # 2.65 and 11.09 -> 11.28 (no gain either way). Qwen3 at 16384 tokens (1024 rows per expert)
    # ties in the study (bf16 2.395 -> 2.391, fp8_block 2.061 -> 2.040), and its bf16 experts took
    # 2.25-2.27 ms in the two benches with the layout against 2.16 in the two before: the layout
    # is a pass over P x H, and what gate_up saves grows with its 2I output columns, 1536 at Qwen3
    # (gate_up alone 1.48 -> 1.39 ms against the layout's 0.22) and 28672 at Mixtral. Below 1024
    # rows per expert the layout costs more than gate_up saves: DeepSeek-V3 at 4096 tokens (128
    # rows per expert) fp8_block 5.51 -> 5.70 ms, Qwen3 (256) 0.633 -> 0.657; DeepSeek-V3 at 16384
    # (512) fp8_tensor 12.6 -> 13.8.
    lay_out = r >= TMA_ROWS and inter >= LAY_OUT_INTER and mode in (0, FP8_BLOCK)
    # An expert's last 128-row tile holds count % 128 rows, about 64 / r of the rows computed.
    # Half tiles (``GemmConfig.half_tiles``) compute 64 of them where the rest is padding. One
    # H200, gate_up / down / whole experts, half against whole tiles in alternating rounds
    # (scripts/half_tiles_study.py, 2026-12-03): Qwen3 at 4096 tokens (256 rows per expert)
    # faster in every round (experts fp8_tensor 0.495 -> 0.480 ms, fp8_block 0.650 -> 0.636, bf16
    # 0.735 -> 0.701); DeepSeek-V3 at 4096 (128) faster in the medians (4.58 -> 4.36, 6.02 -> 5.76,
    # 8.69 -> 8.48; its rounds spread more than that); mixed at 512 (DeepSeek-V3 16384: 0.4% slower
    # to 6% faster); up to 5% slower at 1024 and more (Mixtral: few half tiles, and the second
    # code path costs the whole tiles' schedule).
    half = r < HALF_TILES_BELOW
    if mode == NVFP4:
        # Prefill decodes the activations (x and h) once instead of in every column block's
        # program (see kernels/nvfp4_values). Where an expert holds more than one row tile, every
        # weight tile would be decoded again by each of them, so the weights are decoded once too,
        # a window of experts at a time (``decode_window``), and both GEMMs become fp16 GEMMs on
        # bf16's tiles. At one row tile per expert (DeepSeek-V3 at 4096 tokens) each weight tile
        # is decoded once in the GEMM anyway, and a pass over the weights would only add to it.
        if r > 128:
            fp16 = _tiles(num_rows, num_experts, hidden, inter, "none", sms, fp8_gate_up, gpu)
            return dataclasses.replace(fp16, decode_nvfp4="all",
                                       decode_experts=decode_window(num_experts, hidden, inter))
        return ExpertsConfig(NVFP4_GATE_UP, NVFP4_DOWN, decode_nvfp4="activations")
    if mode == FP8_BLOCK and fp8_gate_up == "mma":
        # Block scales per 128 x 128, one weight scale per tile and K step (moe_gemm's ws_scalar):
        # gate_up in 128 x 128 x 128 tiles with 8 warps, down in 64 x 128 x 128 tiles with 4 warps
        # over the same plan. One H200 (scripts/fp8_study.py, 2026-12-02), 4096 tokens: gate_up
        # Mixtral 2.42, DeepSeek-V3 3.47, Qwen3 0.367 ms against 3.47, 4.39, 0.461 ms at
        # 64 x 128 x 128 with 4 warps; down 1.21-1.31, 1.71-1.87, 0.207-0.217 ms against 1.22,
        # 2.36, 0.259 ms at 128 x 128 x 128. Down's pipeline: 4 stages through TMA where its K (the
        # intermediate size) is short (DeepSeek-V3 2048: 1.68-1.71 against 1.86 ms at 3 stages of
        # pointer loads; 16384 tokens 5.64-5.70 against 5.76-5.91; Qwen3 768: 0.205-0.207 against
        # 0.217, 0.691-0.697 against 0.721-0.735), 3 of pointer loads at Mixtral's 14336 (1.22
        # against 1.27-1.31 ms; 16384 tokens 4.87-4.88 against 4.94-5.08).
        # Where the intermediate size is not a multiple of 128 (gpt-oss's 2880), up's columns start
        # inside a weight block and every tile carries a vector of weight scales
        # (``modes.one_w_scale_per_tile``): the 128 x 128 x 128 tile then spills (242 local loads,
        # 254 stores; scripts/kernel_resources.py), and 64 x 128 x 128 with 8 warps fits in 255
        # registers. One H100, gpt-oss-120b at 4096 / 16384 tokens, Gluon off: the whole experts
        # call 2.35 / 7.73 ms on 128 x 64 x 128 (8 warps, 4 stages) against 3.49 / 12.37 on
        # 128 x 128 x 128 (scripts/epilogue_study.py); gate_up alone 1.49 / 4.40 ms on 64 x 128 x
        # 128 against 1.60 / 5.28 on 128 x 64 x 128 (scripts/fp8_study.py --down-sweep). At the
        # presets whose intermediate size is a multiple of 128 the 128 x 128 x 128 tile stays
        # fastest (whole call, 4096 tokens: Mixtral 3.83 against 4.66 ms on 128 x 64 x 128,
        # DeepSeek-V3 5.81 against 6.19, Qwen3 0.614 against 0.708). No half tiles on it: a 32-row
        # half sums in another order than the 64-row wgmma (gpt-oss's y moved by 8.6e-3 of its
        # largest value) and gained nothing (2.185 against 2.177 ms at 4096 tokens).
        long_k = inter >= 8192
        if one_w_scale_per_tile(FP8_BLOCK, 128, inter, True):
            gate_up = GemmConfig(128, 128, 128, 8, 8, 3, tma=True, half_tiles=half)
        else:
            gate_up = GemmConfig(64, 128, 128, 8, 8, 3, tma=True)
        return ExpertsConfig(gate_up, GemmConfig(64, 128, 128, 8, 4, 3 if long_k else 4, tma=not long_k),
                             lay_out_a=lay_out, h_quant=h_quant_for(mode, gate_up, inter, lay_out))
    if fp8:
        # Per-tensor / per-row scales: gate_up accumulates across K on the tensor cores without
        # promotion. Mixtral at 4096 tokens on one H200 (scripts/fp8_study.py, 2026-12-01): 1.74 ms
        # at 128 x 128 x 64 against 2.74 ms for the 128 x 64 x 128 split-accumulation tile; its
        # error is within the declared ACCUMULATION["fp8_mma"] (scripts/accumulation_contract.py).
        # 128 x 128 x 128 with 4 stages (two runs, 2026-12-02, gate_up alone): Mixtral 4096 tokens
        # 1.62-1.63 ms against 1.77-1.83 at 128 x 128 x 64, 16384 tokens 6.93-7.03 against
        # 7.35-7.40; DeepSeek-V3 2.74-2.79 against 3.01-3.02 and 8.37-8.46 against 7.94-8.31 (the
        # one shape it loses); Qwen3 0.274-0.276 against 0.301-0.302 and 0.86-0.92 against 0.87-0.90.
        if fp8_gate_up != "mma":
            # The exact gate_up: both GEMMs keep split fp32 accumulation (a second fp32 tile per
            # step, so down's 128 x 256 tile would spill); 64-row down tiles below 512 rows per expert.
            down = GemmConfig(64, 128, 128, 8, 4, 3) if r < 512 else GemmConfig(128, 128, 128, 8, 8, 3, tma=True)
            return ExpertsConfig(GemmConfig(128, 64, 64, 8, 8, 4), down)
        gate_up = GemmConfig(128, 128, 128, 8, 8, 4, tma=True, fp8_acc="imprecise", half_tiles=half)
        # The down GEMM accumulates unpromoted too (its error is within the declared fp8_mma
        # contract at K = 14336: scripts/accumulation_contract.py, "prefill-imprecise-both"), in
        # 128 x 256 x 128 tiles: one accumulator of 128 x 256 holds no second fp32 tile, so it fits
        # 8 warps without spilling. One H200, down alone (scripts/fp8_study.py, 2026-12-02), 4096
        # tokens: Mixtral 0.729 ms against 0.980 at 128 x 128 x 128, DeepSeek-V3 (128 rows per
        # expert) 1.45 against 1.54 at 64 x 128 x 128, Qwen3 0.174 against 0.174; 16384 tokens:
        # 2.72 against 3.66, 3.89 against 5.52, 0.541 against 0.729.
        return ExpertsConfig(gate_up, GemmConfig(128, 256, 128, 8, 8, 3, tma=True, fp8_acc="imprecise",
                                                 half_tiles=half))
    # bf16 gate_up reads its weights through TMA at every prefill shape: gate_up alone in both
    # gather studies (ms, run one / run two) DeepSeek-V3 at 4096 tokens (128 rows per expert) 5.46
    # / 5.34 -> 5.41 / 5.25, at 16384 (512) 16.49 / 16.34 -> 15.34 / 15.17; Qwen3 at 4096 (256)
    # 0.433 / 0.430 -> 0.422 / 0.418. Down keeps TMA from 1024 rows per expert (not re-measured).
    return ExpertsConfig(GemmConfig(128, 128, 64, 8, 8, 4, tma=True, half_tiles=half),
                         GemmConfig(128, 256, 64, 8, 8, 3, tma=tma, half_tiles=half), lay_out_a=lay_out)
