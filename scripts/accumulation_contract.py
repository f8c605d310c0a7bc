"""Does the fp8 gate_up on the tensor cores stay within the accumulation error it declares? (GPU)

    PYTHONPATH=src python3 scripts/accumulation_contract.py [--json PATH]

For every fp8 scheme, eight expert shapes (K up to 7168) and two seeds, ``TritonExperts`` runs with
the gate_up GEMM on the fp8 tensor cores ("mma", the tiles ``select_config`` picks) and widened to
fp16 ("exact"); for the per-row schemes also the prefill tile with each accumulation forced
("prefill-split", "prefill-imprecise": no promotion to fp32 across K). Each result is compared
with ``expert_reference`` under the contracts of ``ACCUMULATION`` (fp32: 2^-18 of sum |a||b|,
fp8_mma: 2^-12) and coarser ones. Printed per case: the worst |out - ref| / (atol + rtol |ref| +
slack), so <= 1 passes. The kernels declare "fp8_mma" for every fp8 scheme (the down GEMM is on
the fp8 tensor cores in every mode but one token's matrix-vector products, whose fp32 sums of exact
products the same declaration covers). The "token-*" shapes run one token's rows on the tiles of
the direct plan ("token-tiles") and as matrix-vector products ("token-gemv").

Recorded on one H200 (2026-12-01, results/h200/accumulation_contract-2026-12-01.json): under
fp8_mma "mma" at most 0.46, "prefill-split" and "prefill-imprecise" 0.52; under fp32 "mma" and
"prefill-imprecise" 5.8 (the tensor cores' accumulation error is real and must be declared);
"exact" at most 0.68 under fp32.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.kernels.configs import ONE_TOKEN_BLOCK_GEMV, ExpertsConfig, GemmConfig, gpu_kind, multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts
from moeshard.numerics import ACCUMULATION
from moeshard.quant import quantize_activations, quantize_weight
from moeshard.reference import expert_reference
from moeshard.tolerances import tolerance

# (rows M, experts E, hidden H, intermediate I): decode (also at DeepSeek-V3's K), small batch, mid,
# prefill tiles, a larger K, and sizes that are multiples of no tile.
SHAPES = {"decode": (24, 64, 512, 256), "decode-deep": (128, 32, 7168, 2048), "batch64": (256, 8, 512, 512),
          "mid": (1600, 16, 512, 384),
          "prefill": (6144, 8, 1024, 1536), "big": (8192, 8, 4096, 1024), "odd": (999, 12, 256, 336),
          "mixtral": (8192, 8, 4096, 2048), "deepseek": (8192, 16, 7168, 512),
          "mixtral-full": (8192, 8, 4096, 14336), "deepseek-full": (8192, 16, 7168, 2048)}
# One token's rows (M = top-k distinct experts of one input row), at the bench models' sizes: the
# tile GEMMs on the direct plan against the matrix-vector products (``ExpertsConfig.gemv``).
TOKEN_SHAPES = {"token-deepseek": (8, 256, 7168, 2048), "token-mixtral": (2, 8, 4096, 14336),
                "token-qwen3": (8, 128, 2048, 768)}
# Accumulation contracts each output is judged under: the declared ones and coarser candidates.
CONTRACTS = {**ACCUMULATION, "2^-10": 2.0**-10, "2^-9": 2.0**-9, "2^-7": 2.0**-7}
DTYPE = torch.bfloat16


def worst_ratio(out: torch.Tensor, ref, scheme: str) -> float:
    atol, rtol = tolerance(DTYPE, scheme)
    bound = atol + rtol * ref.out.abs() + ref.slack
    return float(((out.double() - ref.out).abs() / bound).max())


def _weights(scheme: str, E: int, H: int, I: int, gen: torch.Generator, device: str) -> ExpertWeights:  # noqa: E741
    """E experts' random gate_up [E, 2I, H] and down [E, H, I] weights, quantized as ``scheme``."""
    gate_up = (torch.randn(E, 2 * I, H, device=device, generator=gen) / H**0.5).to(DTYPE)
    down = (torch.randn(E, H, I, device=device, generator=gen) / I**0.5).to(DTYPE)
    return ExpertWeights(quantize_weight(gate_up, scheme), quantize_weight(down, scheme), scheme)


def _record(row: dict, mode: str, kernel: TritonExperts, out: torch.Tensor, refs: dict, scheme: str) -> None:
    """The accumulation ``kernel`` declares and its worst ratio under each contract, into ``row``."""
    row[f"{mode} declares"] = next(n for n, a in ACCUMULATION.items() if a == kernel.accumulation(scheme))
    for name, ref in refs.items():
        row[f"{mode} vs {name}"] = round(worst_ratio(out, ref, scheme), 3)


def token_case(scheme: str, shape: str, seed: int, device: str = "cuda") -> dict:
    """One token's rows: the tiles ``select_config`` picks on this GPU, without and with the
    GEMVs (``configs.ONE_TOKEN_BLOCK_GEMV``'s shape, for every scheme),
    each against the reference of the token's row repeated once per routed row. (``device`` "cpu"
    runs the kernels under Triton's interpreter, where ``TRITON_INTERPRET=1`` was set before
    moeshard's kernels were imported.)"""
    M, E, H, I = TOKEN_SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = _weights(scheme, E, H, I, gen, device)
    x = torch.randn(1, H, device=device, generator=gen).to(DTYPE)
    ids = torch.randperm(E, device=device, generator=gen)[:M]
    index = 0 if device == "cuda" else None
    # Per-tensor, per-row and per-group scales of copies of one row are that row's.
    xs = quantize_activations(x.expand(M, H).contiguous(), scheme)
    row = {"scheme": scheme, "shape": shape, "seed": seed}
    refs = {name: expert_reference(xs, ids, weights, "silu", DTYPE, accumulation=acc) for name, acc in CONTRACTS.items()}
    tiles = replace(select_config(M, E, H, I, scheme, multiprocessors(index), gpu=gpu_kind(index)), gemv=None)
    modes = {"token-tiles": tiles, "token-gemv": replace(tiles, gemv=ONE_TOKEN_BLOCK_GEMV,
                                                         quantize_in_down=False, down_prefetch=0)}
    for mode, config in modes.items():
        kernel = TritonExperts("silu", DTYPE, config)
        _record(row, mode, kernel, kernel(ExpertInput(quantize_activations(x, scheme), ids, repeat=M), weights), refs,
                scheme)
    return row


def case(scheme: str, shape: str, seed: int) -> dict:
    if shape in TOKEN_SHAPES:
        return token_case(scheme, shape, seed)
    M, E, H, I = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weights = _weights(scheme, E, H, I, gen, "cuda")
    x = quantize_activations(torch.randn(M, H, device="cuda", generator=gen).to(DTYPE), scheme)
    ids = torch.randint(0, E, (M,), device="cuda", generator=gen)
    ids[: M // 3] = 1  # one expert with many tiles, some experts with none
    row = {"scheme": scheme, "shape": shape, "seed": seed}
    refs = {name: expert_reference(x, ids, weights, "silu", DTYPE, accumulation=acc) for name, acc in CONTRACTS.items()}
    modes = {"mma": TritonExperts("silu", DTYPE), "exact": TritonExperts("silu", DTYPE, fp8_gate_up="exact")}
    if scheme != "fp8_block":  # the prefill tile of the per-row schemes, each accumulation forced
        tile, down = GemmConfig(128, 128, 128, 8, 8, 4, tma=True), GemmConfig(128, 128, 128, 8, 8, 4, tma=True)
        for acc in ("split", "imprecise"):
            modes[f"prefill-{acc}"] = TritonExperts("silu", DTYPE, ExpertsConfig(replace(tile, fp8_acc=acc), down))
        # Both GEMMs unpromoted, the down GEMM at its 128 x 256 prefill tile (K = I, 14336 at Mixtral).
        both = ExpertsConfig(replace(tile, fp8_acc="imprecise"), GemmConfig(128, 256, 128, 8, 8, 3, tma=True,
                                                                            fp8_acc="imprecise"))
        modes["prefill-imprecise-both"] = TritonExperts("silu", DTYPE, both)
    for mode, kernel in modes.items():
        _record(row, mode, kernel, kernel(ExpertInput(x, ids), weights), refs, scheme)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--shapes", default=",".join({**SHAPES, **TOKEN_SHAPES}),
                        help="comma list of: " + ", ".join({**SHAPES, **TOKEN_SHAPES}))
    parser.add_argument("--schemes", default="fp8_tensor,fp8_token,fp8_block")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("accumulation_contract: needs a CUDA GPU with fp8 tensor cores")
    rows = []
    for scheme in args.schemes.split(","):
        for shape in args.shapes.split(","):
            for seed in (0, 1):
                rows.append(case(scheme, shape, seed))
                print(rows[-1], flush=True)
    for key in sorted({k for r in rows for k in r if " vs " in k}):
        print(f"worst {key}: {max(r[key] for r in rows if key in r):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
