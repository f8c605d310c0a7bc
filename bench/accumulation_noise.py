"""How much accumulation error in the gate_up GEMM the tolerance table absorbs (CPU, fp64).

    PYTHONPATH=src python3 bench/accumulation_noise.py

The fp8 schemes quantize h = act(gate) * up again before the down GEMM, after rounding the
gate_up product to the model dtype. A relative error eps in the gate_up sums moves some products
across a bf16 rounding boundary, and some of those across an e4m3 boundary of h; each such flip
changes y by one e4m3 step of h times a down weight. This script multiplies the exact gate_up
product by (1 + eps * N(0, 1)), runs the rest exactly as the reference does, and compares with
the noise-free result under the tolerance table: fp32 accumulation (eps ~ 1e-7) passes; the
~14-bit accumulation of Hopper's fp8 tensor cores (eps ~ 1e-5 .. 1e-4) does not. It is why the
Triton kernels widen fp8 to fp16 for gate_up (``moeshard.kernels.grouped_gemm``, FP8_EXACT).
"""

from __future__ import annotations

import torch

from moeshard.experts.grouped import PER_TENSOR_SCHEMES, activate
from moeshard.quant import fake_quantize_activations, quantize_activations, quantize_weight
from moeshard.tolerances import compare

M, E, H, I = 1600, 16, 512, 384
DTYPE = torch.bfloat16


def max_error(scheme: str, eps: float, seed: int = 0) -> tuple[float, bool]:
    g = torch.Generator().manual_seed(seed)
    w13 = quantize_weight((torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DTYPE), scheme).dequantize().double()
    w2 = quantize_weight((torch.randn(E, H, I, generator=g) / I**0.5).to(DTYPE), scheme).dequantize().double()
    x = quantize_activations(torch.randn(M, H, generator=g).to(DTYPE), scheme).dequantize().double()
    ids = torch.randint(0, E, (M,), generator=g)
    ids[: M // 3] = 1
    exact, noisy = torch.zeros(M, H, dtype=torch.float64), torch.zeros(M, H, dtype=torch.float64)
    for e in range(E):
        rows = (ids == e).nonzero().flatten()
        gate_up = x[rows] @ w13[e].T
        for out, noise in ((exact, 0.0), (noisy, eps)):
            h = activate((gate_up * (1 + noise * torch.randn(gate_up.shape, generator=g, dtype=torch.float64))).to(DTYPE),
                         "silu", DTYPE)
            amax = h.abs().amax().float() if scheme in PER_TENSOR_SCHEMES else None
            y = fake_quantize_activations(h, scheme, amax=amax).double() @ w2[e].T
            out[rows] = y.to(DTYPE).double() if noise else y
    err, _, _, ok = compare(noisy, exact, DTYPE, scheme)
    return err, ok


if __name__ == "__main__":
    print("scheme      eps      max |err|  within the table")
    for scheme in ("fp8_tensor", "fp8_token", "fp8_block"):
        for eps in (1e-7, 1e-5, 1e-4):
            err, ok = max_error(scheme, eps)
            print(f"{scheme:10s}  {eps:7.0e}  {err:9.4f}  {ok}")
