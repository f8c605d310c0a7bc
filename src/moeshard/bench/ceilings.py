"""The two ceilings every figure is compared with, measured in the same run.

* dense bf16 matmul: ``a @ b`` with a, b of 8192 x 8192 random bf16 (cuBLAS), 2 * 8192^3 FLOP;
* device copy: ``dst.copy_(src)`` of 2 GiB, counting bytes read plus bytes written.
"""

from __future__ import annotations

import torch

from moeshard.bench.timing import L2Flush, time_cuda


def matmul_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> dict:
    """Dense bf16 GEMM rate: {"n", "ms", "tflops"}."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    t = time_cuda(lambda: torch.mm(a, b, out=out), warmup=5, reps=reps, flush=None)
    return {"n": n, "ms": t.median_ms, "tflops": 2 * n**3 / (t.median_ms * 1e-3) / 1e12}


def copy_gbps(device: torch.device, nbytes: int = 2 * 2**30, reps: int = 20) -> dict:
    """Device-to-device copy bandwidth, read + write: {"bytes", "ms", "gbps"}."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), warmup=5, reps=reps, flush=L2Flush(device))
    return {"bytes": nbytes, "ms": t.median_ms, "gbps": 2 * nbytes / (t.median_ms * 1e-3) / 1e9}
