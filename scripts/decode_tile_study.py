"""The weight-streaming decode tiles: the experts with other tile widths, K steps and depths (one GPU).

At decode (up to ``configs.DECODE_ROWS`` rows per expert) each GEMM streams its experts' weights
once, and ``select_config`` picks the widest tile that still gives every multiprocessor a program,
with 128-column K steps and as many stages as shared memory holds. This study times the whole
``TritonExperts`` call with the config ``select_config`` picks and with the gate_up or the down
tile replaced by narrower ones, ones with 256-column K steps, or ones with more or fewer stages,
on the bench's workload (``moeshard.bench.workload``, CUDA graphs, an L2 flush before every
repetition, rounds alternating). Every variant keeps the chosen tile height (one tile plan).

Each variant's output is compared with the chosen config's: the same bits where only the tile
width or depth changed (each output element sums the same K steps in the same order), and the
largest difference relative to the output's largest value where the K step changed (the
tensor cores then accumulate 256 products per fp32 step instead of 128, and h's fp8 rounding
can flip; fp8_block's wider steps are 128-column sub-steps, one per scale group, so the same
bits). fp8_block's h is quantized in the gate_up epilogue by 128-column gate_up tiles, as
``select_config`` does where the intermediate size is a multiple of 128, and in its own pass
after narrower ones. Where the chosen config runs one token on the direct plan, one variant moves
h's quantization: to the down GEMM's loads (``ExpertsConfig.quantize_in_down``) or back to where
``h_quant`` puts it (the same bits either way). Where the chosen config launches kernels under
PDL, the variants ``prefetch<k>`` have each down program ask L2 for the first k columns of each
of its weight rows before it waits on the kernel ahead (``ExpertsConfig.down_prefetch``; the same
bits); where it launches only the plan and gate_up so, ``pdl_all`` launches the down GEMM (and
any quantize_h) under PDL too, and the prefetch variants are named ``pdl_all+prefetch<k>``. A
variant that is refused, or fails to compile or launch, is recorded with its error. One token's fp8
rows also run as matrix-vector products (``ExpertsConfig.gemv``), variants ``gemv<gate_up
block_n>x<down block_n>k<block_k>w<warps>``: fp32 sums of exact products, so not the tiles' bits. ``--only``
keeps the variants whose names start with one of its comma-separated prefixes (the chosen config
always runs).

    PYTHONPATH=src python3 scripts/decode_tile_study.py --json results/h200/decode_tile_study.json
    PYTHONPATH=src python3 scripts/decode_tile_study.py --tokens 1 --only prefetch,h_in
"""

from __future__ import annotations

import dataclasses
import time

import torch

from moeshard.bench.study import routed_case, run_on_gpu, study_parser, time_variants
from moeshard.kernels.configs import (
    DEEP_K,
    FP8,
    ExpertsConfig,
    GemmConfig,
    GemvConfig,
    gpu_kind,
    h_quant_for,
    in_down_tile,
    multiprocessors,
    select_config,
)
from moeshard.kernels.experts import TritonExperts, gluon_supported
from moeshard.kernels.pdl import supported as pdl_supported
from moeshard.quant import get_scheme

MODELS = ("deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b")
TOKENS = (16, 128)
SCHEMES = ("fp8_tensor", "fp8_token", "fp8_block")
# (block_n, block_k, num_stages) of 4-warp tiles at the chosen height, per GEMM and height.
GATE_UP = {16: ((32, 256, 4), (32, 256, 3), (64, 256, 3), (128, 256, 2), (32, 128, 6), (64, 128, 6),
                (128, 128, 3)),
           64: ((32, 256, 3), (64, 256, 2), (32, 128, 6), (64, 128, 3))}
DOWN = {16: ((32, 256, 4), (64, 256, 3), (128, 256, 2), (32, 128, 6), (64, 128, 6), (128, 128, 3)),
        64: ((64, 256, 3), (128, 256, 2), (64, 128, 6), (128, 128, 3))}
# Variants replacing both tiles, per height: at 16 rows the narrow deep-K and the narrow
# deep-pipeline pairs, and the widest 128-column pair (the choice before the deep-K tiles; a
# variant equal to the chosen config is left out); at 64 rows the deep-K pair and the best 128-column pair (fp8_block's only
# legal K step) of the single replacements measured at Mixtral's 128 tokens.
PAIRS = {16: (((32, 256, 4), (64, 256, 3)), ((32, 128, 6), (64, 128, 6)), ((128, 128, 4), (128, 128, 4))),
         64: (((64, 256, 2), (64, 256, 3)), ((64, 128, 3), (128, 128, 3)))}
# Columns of K of each down weight row prefetched before the down GEMM's wait (a whole row
# where K is shorter).
DOWN_PREFETCH = (512, 2048, 16384)
# One token's fp8 rows as matrix-vector products (``ExpertsConfig.gemv``): (gate_up block_n, down
# block_n, block_k, num_warps). Each thread loads block_n * block_k / (32 * warps) bytes of each
# weight matrix a K step (gate_up: two), in 16-byte loads.
# Wider down programs quantize each row of h fewer times (every down program quantizes the whole row).
# The last three against 16 x 16 x 512 with 4 warps in their sm_90a gate_up builds
# (scripts/gemv_resources.py, fp8_tensor; it: 96 registers, 5 programs a multiprocessor, 80 KB of
# weights a K step in flight): 2 warps over 16 rows (123 registers, 8 programs, 128 KB), over 8
# rows (96 registers, 10 programs, 80 KB in programs half as long), and 1024-column steps (124
# registers, 4 programs, 128 KB).
GEMV = ((16, 16, 256, 4), (32, 32, 256, 4), (32, 16, 512, 4), (64, 32, 256, 4), (16, 16, 512, 4),
        (8, 8, 256, 4), (16, 16, 256, 2), (32, 32, 256, 8), (64, 64, 256, 8), (16, 32, 256, 4),
        (16, 32, 512, 4), (32, 32, 512, 8), (16, 64, 512, 8), (16, 16, 512, 2), (8, 8, 512, 2),
        (16, 16, 1024, 4))
START = time.monotonic()


def _tile(chosen: GemmConfig, shape: tuple[int, int, int]) -> GemmConfig:
    block_n, block_k, stages = shape
    return dataclasses.replace(chosen, block_n=block_n, block_k=block_k, num_stages=stages, num_warps=4)


def _config(chosen: ExpertsConfig, scheme: str, inter: int, gate_up: GemmConfig | None,
            down: GemmConfig | None) -> ExpertsConfig:
    """``chosen`` (for ``scheme`` over intermediate size ``inter``) with either tile replaced.
    Where h is quantized in gate_up or in its own pass, the replaced gate_up tile decides it as
    ``select_config`` does at decode (``h_quant_for``): fp8_block's 128-column tiles quantize it,
    narrower ones leave it to the pass. fp8_token's row maxima stay where the chosen config has them."""
    g, d = gate_up or chosen.gate_up, down or chosen.down
    h_quant = chosen.h_quant
    if h_quant in ("gate_up", "pass"):
        h_quant = h_quant_for(get_scheme(scheme).kernel_mode, g, inter, where=True)
    return dataclasses.replace(chosen, gate_up=g, down=d, h_quant=h_quant, gemv=None)


def variants(chosen: ExpertsConfig, scheme: str, inter: int, one_token: bool = False,
             down_tile: GemmConfig | None = None) -> dict[str, ExpertsConfig]:
    """The chosen config (first) and its variants, named by what they replace (``_config``);
    one_token: the case's calls take the direct plan (one token's rows), where h may be quantized
    by the down GEMM, and where the chosen config does not, also on ``down_tile``
    (``configs.in_down_tile``: the tile select_config gives that down GEMM)."""
    bm = chosen.block_m
    out = {"chosen": chosen}
    named = [(f"g{n}x{k}s{s}", (n, k, s), None) for n, k, s in GATE_UP.get(bm, ())]
    named += [(f"d{n}x{k}s{s}", None, (n, k, s)) for n, k, s in DOWN.get(bm, ())]
    named += [(f"g{g[0]}x{g[1]}s{g[2]}+d{d[0]}x{d[1]}s{d[2]}", g, d) for g, d in PAIRS.get(bm, ())]
    for name, g, d in named:
        cfg = _config(chosen, scheme, inter, _tile(chosen.gate_up, g) if g else None,
                      _tile(chosen.down, d) if d else None)
        if cfg != chosen:
            out[name] = cfg
    if one_token and chosen.direct and get_scheme(scheme).kernel_mode in FP8:
        # Where one token's h is quantized: by the down GEMM as it loads it, or as h_quant says.
        other = not chosen.quantize_in_down
        out["h_in_down" if other else "h_by_h_quant"] = dataclasses.replace(chosen, quantize_in_down=other, gemv=None)
        if other and down_tile is not None and down_tile != chosen.down:
            name = f"h_in_down+d{down_tile.block_n}x{down_tile.block_k}s{down_tile.num_stages}"
            out[name] = dataclasses.replace(chosen, quantize_in_down=True, down=down_tile, gemv=None)
    if chosen.gemv is not None:
        out["tiles"] = dataclasses.replace(chosen, gemv=None)  # the tile GEMMs on the direct plan
    if one_token and chosen.direct and get_scheme(scheme).kernel_mode in FP8:
        # Both GEMMs as matrix-vector products; under the chosen PDL chain and with the down GEMV
        # under PDL too.
        for gu, dn, bk, warps in GEMV:
            gemv = GemvConfig(gu, dn, bk, warps)
            name = f"gemv{gu}x{dn}k{bk}w{warps}"
            if gemv != chosen.gemv:
                out[name] = dataclasses.replace(chosen, gemv=gemv, quantize_in_down=False, down_prefetch=0)
            if chosen.pdl == "gate_up" and (gu, dn, bk, warps) == GEMV[0]:
                out[f"{name}+pdl_all"] = dataclasses.replace(
                    chosen, gemv=gemv, quantize_in_down=False, down_prefetch=0, pdl="all")
    if chosen.pdl != "off" and chosen.down.engine == "triton" and chosen.gemv is None:
        # The down GEMM under PDL (where the chosen config launches only the plan and gate_up so),
        # and with its weights asked for before its wait.
        under, prefix = (chosen, "") if chosen.pdl == "all" else (dataclasses.replace(chosen, pdl="all"), "pdl_all+")
        if under is not chosen:
            out["pdl_all"] = under
        for k in DOWN_PREFETCH:
            if k != chosen.down_prefetch:
                out[f"{prefix}prefetch{k}"] = dataclasses.replace(under, down_prefetch=k)
    return out


def kept(names: list[str], only: str | None) -> list[str]:
    """The variant names ``--only`` keeps: all for None, else "chosen" and those starting with one
    of its comma-separated prefixes."""
    if only is None:
        return names
    prefixes = tuple(p for p in only.split(",") if p)
    return [n for n in names if n == "chosen" or n.startswith(prefixes)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def study(name: str, model, tokens: int, scheme: str, flush, args) -> dict:
    rec: dict = {"model": name, "tokens": tokens, "scheme": scheme}
    if time.monotonic() - START > args.budget_s:
        rec["skipped"] = f"past --budget-s {args.budget_s}"
        return rec
    case = routed_case(model, tokens, scheme)
    device = case.device
    chosen = select_config(case.M, case.E, case.H, case.I, scheme, multiprocessors(device.index),
                           pdl=pdl_supported(device), gluon=gluon_supported(device), gpu=gpu_kind(device.index))
    rec.update(rows=case.M, config=dataclasses.asdict(chosen), variants={}, errors={})
    calls: dict = {}
    reference = None
    sms = multiprocessors(device.index)
    tile = in_down_tile(case.H, min(case.M, case.E), sms) if case.I % DEEP_K == 0 else None
    every = variants(chosen, scheme, case.I, one_token=case.inp.repeat == case.M, down_tile=tile)
    for key in kept(list(every), args.only):
        cfg = every[key]
        kernel = TritonExperts(case.cfg.activation, case.cfg.dtype, cfg)
        try:
            out = kernel(case.inp, case.experts)
            torch.cuda.synchronize()
        except Exception as exc:  # a tile that does not compile or launch is a finding, not the end
            rec["errors"][key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        if reference is None:
            reference = out
        rec["variants"][key] = {"gate_up": list(dataclasses.astuple(cfg.gate_up)[:6]),
                                "down": list(dataclasses.astuple(cfg.down)[:6]), "h_quant": cfg.h_quant,
                                "quantize_in_down": cfg.quantize_in_down, "down_prefetch": cfg.down_prefetch,
                                "gemv": cfg.gemv.as_dict() if cfg.gemv is not None else None, "pdl": cfg.pdl,
                                "same_bits": bool(torch.equal(out, reference)), "rel_diff": _rel(out, reference)}
        calls[key] = lambda kernel=kernel: kernel(case.inp, case.experts)
    time_variants(rec, calls, flush, args)
    base = rec["median_ms"]["chosen_ms"]
    for key, v in rec["variants"].items():
        v["vs_chosen"] = rec["median_ms"][f"{key}_ms"] / base
    return rec


def line(rec: dict) -> str:
    head = f"{rec['model']:14s} T={rec['tokens']:<4d} {rec['scheme']:10s}"
    if "skipped" in rec:
        return f"{head} skipped ({rec['skipped']})"
    base = rec["median_ms"]["chosen_ms"]
    best = sorted(rec["variants"].items(), key=lambda kv: kv[1]["vs_chosen"])[:4]
    parts = []
    for key, v in best:
        bits = "" if v["same_bits"] else f" (rel {v['rel_diff']:.3g})"
        parts.append(f"{key} {v['vs_chosen']:.3f}{bits}")
    errors = f" errors: {sorted(rec['errors'])}" if rec["errors"] else ""
    return f"{head} chosen {base:.4f} ms | best: " + ", ".join(parts) + errors


def main() -> None:
    ap = study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=20)
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="cases starting later than this many seconds after the start are skipped")
    ap.add_argument("--only", default=None,
                    help="comma-separated prefixes of the variant names to run (the chosen config always runs)")
    args = ap.parse_args()
    run_on_gpu(args, "scripts/decode_tile_study.py", study, line)


if __name__ == "__main__":
    main()
