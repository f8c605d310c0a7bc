"""The layer's input passes against the copy rate: ``quant_rows.input_amax`` and
``quant_rows.quantize_rows`` (fp8_tensor, fp8_token) at the bench models' hidden sizes, each with
its package launch and with other tile shapes, every variant's bits checked against the package's.

    PYTHONPATH=src python3 scripts/input_quant_study.py [--tokens 4096,16384] [--json FILE]

Each call is captured in a CUDA graph and timed after the bench's L2 flush (``bench.timing``,
median of --reps), the variants alternating over --rounds. GB/s counts the bytes each pass must
move: the amax reads x; the quantization reads x and writes the fp8 values (and fp8_token's
scales); the ceiling is a device copy of x, reading and writing its bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from moeshard.bench.timing import L2Flush, alternating_medians
from moeshard.kernels import quant_rows
from moeshard.quant import AMAX_FLOOR, FP8_DTYPE, FP8_MAX

HIDDEN = {"qwen3-30b-a3b": 2048, "mixtral-8x7b": 4096, "deepseek-v3": 7168}
# (rows, columns, warps) per program; the first is the package's.
AMAX_TILES = ((quant_rows.ROWS, quant_rows._AMAX_COLS, 4), (32, 2048, 8), (64, 2048, 8), (16, 4096, 8),
              (128, 512, 8))
# (rows, columns per step, warps); fp8_token steps over the whole row.
TENSOR_TILES = ((quant_rows.ROWS, quant_rows.CHUNK, 4), (32, 128, 4), (16, 256, 4), (32, 256, 8), (64, 256, 8))
# fp8_token in two passes of column steps (the package's first, whole rows: ``token_tile``).
TOKEN_TILES = ((quant_rows.ROWS, quant_rows.CHUNK, 4), (8, 256, 4), (32, 128, 8), (16, 256, 8))


def amax_call(x: torch.Tensor, rows: int, cols: int, warps: int):
    T, K = x.shape
    out = torch.zeros(1, dtype=torch.float32, device=x.device)

    def run():
        out.zero_()
        quant_rows._amax_kernel[(triton.cdiv(T, rows), triton.cdiv(K, cols))](
            x, out, T, K, x.stride(0), ROWS=rows, COLS=cols, num_warps=warps)
        return out
    return run


def quantize_call(x: torch.Tensor, mode: int, amax: torch.Tensor, rows: int, chunk: int, warps: int,
                  whole: bool = False):
    T, K = x.shape
    q = torch.empty(T, K, dtype=FP8_DTYPE, device=x.device)
    if mode == 1:
        s = torch.empty(1, dtype=torch.float32, device=x.device)
        g, stride_s, grid = amax.reshape(1), 0, (triton.cdiv(T, rows), triton.cdiv(K, chunk))
    else:
        s = torch.empty(T, 1, dtype=torch.float32, device=x.device)
        g, stride_s, grid = s, s.stride(0), (triton.cdiv(T, rows), 1)

    def run():
        quant_rows._quantize_rows_kernel[grid](x, q, s, g, T, K, x.stride(0), q.stride(0), stride_s, MODE=mode,
                                               ROWS=rows, CHUNK=chunk, AMAX_FLOOR=AMAX_FLOOR, FP8_MAX=FP8_MAX,
                                               WHOLE=whole, num_warps=warps)
        return q, s
    return run


def same_bits(a, b) -> bool:
    return all(torch.equal(u.view(torch.uint8) if u.dtype == FP8_DTYPE else u,
                           v.view(torch.uint8) if v.dtype == FP8_DTYPE else v) for u, v in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--models", default=",".join(HIDDEN))
    args = ap.parse_args()
    flush = L2Flush(torch.device("cuda"))
    results = []
    for model in args.models.split(","):
        H = HIDDEN[model]
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
            nbytes = x.numel() * x.element_size()
            amax = quant_rows.input_amax(x)
            dst = torch.empty_like(x)
            calls = {"copy": lambda dst=dst, x=x: dst.copy_(x)}
            moved = {"copy": 2 * nbytes}
            bits_ok = {}
            for tile in AMAX_TILES:
                name = f"amax {tile[0]}x{tile[1]} w{tile[2]}"
                calls[name], moved[name] = amax_call(x, *tile), nbytes
                bits_ok[name] = torch.equal(calls[name]().reshape(()), amax)
            rows, chunk, whole = quant_rows.token_tile(T, H)
            token_tiles = ((rows, chunk, 8 if whole else 4, whole),) + tuple(t + (False,) for t in TOKEN_TILES)
            for mode, scheme, tiles in ((1, "fp8_tensor", TENSOR_TILES), (2, "fp8_token", token_tiles)):
                want = quant_rows.quantize_rows(x, scheme, amax if mode == 1 else None)
                want_bits = (want.data, want.tensor_scale.reshape(1) if mode == 1 else want.row_scale)
                for tile in tiles:
                    name = f"{scheme} {tile[0]}x{tile[1]} w{tile[2]}" + (" whole" if tile[3:] == (True,) else "")
                    calls[name] = quantize_call(x, mode, amax, *tile)
                    moved[name] = nbytes + x.numel() + (4 * T if mode == 2 else 0)
                    bits_ok[name] = same_bits(calls[name](), want_bits)
            times, medians = alternating_medians(calls, rounds=args.rounds, reps=args.reps, flush=flush)
            for name, ms in medians.items():
                row = {"model": model, "tokens": T, "hidden": H, "call": name, "ms": ms,
                       "rounds_ms": times[name], "gbps": moved[name] / ms / 1e6, "same_bits": bits_ok.get(name, True)}
                results.append(row)
                print(f"{model:14} T={T:6d} {name:28} {1000 * ms:8.1f} us  {row['gbps']:7.0f} GB/s"
                      f"  rounds {' '.join(f'{1000 * t:.1f}' for t in times[name])}"
                      f"{'' if row['same_bits'] else '  DIFFERENT BITS'}", flush=True)
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "median_copy_gbps": statistics.median(r["gbps"] for r in results if r["call"] == "copy"),
               "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
