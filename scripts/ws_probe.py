"""Does Triton's warp-specialized K loop run on this GPU at all? A minimal TMA grouped matmul
(no moeshard code), each variant in its own process with a time limit: the loop's bound taken from
the tile (``tl.where(live, K, 0)``, as the grouped GEMM needs for dead tiles) or the argument K,
with all tiles live or some dead, and the TMA descriptors made on the host (``TensorDescriptor``,
as the grouped GEMM makes them) or in the kernel (``tl.make_tensor_descriptor``).

    PYTHONPATH=src python3 scripts/ws_probe.py           # does each variant run
    PYTHONPATH=src python3 scripts/ws_probe.py --time    # one large product, with and without
"""

from __future__ import annotations

import subprocess
import sys

import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _mm(a_desc, b_desc, a_ptr, b_ptr, c_ptr, te_ptr, M, N, K, E, WS: tl.constexpr, TILE_BOUND: tl.constexpr,
        DEVICE_DESC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(te_ptr + pid_m)
    live = e >= 0
    e = tl.maximum(e, 0)
    if DEVICE_DESC:
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM, BK])
        b_desc = tl.make_tensor_descriptor(b_ptr, [E * N, K], [K, 1], [BN, BK])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_stop = tl.where(live, K, 0) if TILE_BOUND else K
    for k in tl.range(0, k_stop, BK, warp_specialize=WS):
        a = a_desc.load([pid_m * BM, k])
        b = b_desc.load([e * N + pid_n * BN, k])
        acc = tl.dot(a, tl.trans(b), acc)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16), mask=live)


def one(ws: bool, dead: bool, tile_bound: bool, device_desc: bool) -> None:
    M, N, K, E, BM, BN, BK = 1024, 512, 1024, 4, 128, 128, 64
    a = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    b = torch.randn(E * N, K, device="cuda").to(torch.bfloat16)
    te = torch.arange(M // BM, device="cuda", dtype=torch.int32) % E
    if dead:
        te[-2:] = -1
    c = torch.zeros(M, N, device="cuda", dtype=torch.bfloat16)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    a_desc = None if device_desc else TensorDescriptor.from_tensor(a, [BM, BK])
    b_desc = None if device_desc else TensorDescriptor.from_tensor(b, [BN, BK])
    _mm[(M // BM, N // BN)](a_desc, b_desc, a, b, c, te, M, N, K, E, WS=ws, TILE_BOUND=tile_bound,
                            DEVICE_DESC=device_desc, BM=BM, BN=BN, BK=BK, num_warps=4, num_stages=3)
    torch.cuda.synchronize()
    ref = torch.stack([a[i * BM:(i + 1) * BM].float() @ b[int(e) * N:(int(e) + 1) * N].float().T
                       if e >= 0 else torch.zeros(BM, N, device="cuda") for i, e in enumerate(te.tolist())]).reshape(M, N)
    err = (c.float() - ref).abs().max()
    print(f"ws={ws} dead_tiles={dead} tile_bound={tile_bound} device_desc={device_desc}: ran, max |c - ref| {err:.3g}",
          flush=True)


def timed(fp8: bool, BN: int) -> None:
    """One 8192 x 4096 x 4096 product (4 experts' weights, every tile live), bf16 or fp8 (e4m3,
    128-wide K steps), in-kernel descriptors, with and without warp specialization: the median
    ms of ``triton.testing.do_bench``."""
    M, N, K, E, BM, BK = 8192, 4096, 4096, 4, 128, 128 if fp8 else 64
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    a = torch.randn(M, K, device="cuda").to(dtype)
    b = torch.randn(E * N, K, device="cuda").to(dtype)
    te = torch.arange(M // BM, device="cuda", dtype=torch.int32) % E
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for ws in (False, True):
        def call(ws=ws):
            _mm[(M // BM, N // BN)](None, None, a, b, c, te, M, N, K, E, WS=ws, TILE_BOUND=True, DEVICE_DESC=True,
                                    BM=BM, BN=BN, BK=BK, num_warps=4 if ws else 8, num_stages=3 if BN == 256 else 4)
        ms = triton.testing.do_bench(call, rep=200, return_mode="median")
        print(f"timed fp8={fp8} BN={BN} ws={ws}: {ms:.3f} ms, {2 * M * N * K / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--time"]:
        for fp8, bn in ((True, 128), (True, 256), (False, 256)):
            try:
                timed(fp8, bn)
            except Exception as e:  # a tile that does not fit: say so, time the next
                print(f"timed fp8={fp8} BN={bn}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    elif len(sys.argv) == 5:
        one(*(v == "1" for v in sys.argv[1:]))
    else:
        print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
        # A dead tile under K as the bound computes (its store stays masked), so the difference
        # from the reference shows only where tiles are dead and the bound is the tile's.
        for ws, dead, bound, device in ((0, 1, 1, 1), (1, 0, 0, 0), (1, 1, 0, 0), (1, 0, 1, 0), (1, 0, 0, 1),
                                        (1, 1, 1, 1)):
            args = [sys.executable, __file__, str(ws), str(dead), str(bound), str(device)]
            try:
                r = subprocess.run(args, timeout=20, capture_output=True, text=True)
                print(r.stdout.strip() or f"{args[2:]}: exit {r.returncode}: {r.stderr.strip()[-300:]}", flush=True)
            except subprocess.TimeoutExpired:
                print(f"ws={bool(ws)} dead_tiles={bool(dead)} tile_bound={bool(bound)} device_desc={bool(device)}: "
                      "no result within 20 s (hung)", flush=True)
