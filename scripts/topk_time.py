"""GPU time of the router's selection kernels (``moeshard.kernels.topk``) at the layer's shapes,
each call captured in a CUDA graph (``triton.testing.do_bench_cudagraph``, median).

    PYTHONPATH=src python3 scripts/topk_time.py [TAG]

Shapes: Qwen3-30B-A3B's [T, 128] top-8 and Mixtral's [T, 8] top-2 from bf16 logits (softmax
routing), DeepSeek-V3's [T, 256] top-8 of fp32 scores. Rows: ``softmax_topk`` (one pass from the
logits; absent in code without it), the torch path before it (fp32 copy, softmax,
``topk_with_weights``), ``topk_with_weights`` and ``topk_low_index_first`` alone. Point
PYTHONPATH at another checkout's ``src`` to time its kernels; TAG names the code in the output.
"""

from __future__ import annotations

import sys

import torch
import triton

from moeshard.kernels import topk

SHAPES = ((4096, 128, 8, torch.bfloat16), (16384, 128, 8, torch.bfloat16), (16384, 8, 2, torch.bfloat16),
          (16384, 256, 8, torch.float32))


def calls(logits: torch.Tensor, k: int) -> dict:
    """The timed callables on [T, E] logits, by name."""
    p = logits.float()
    out = {}
    if hasattr(topk, "softmax_topk"):
        out["softmax_topk"] = lambda: topk.softmax_topk(logits, k, True, 1e-20, 1.0)

    def torch_path():
        s = logits.float().softmax(-1)
        return topk.topk_with_weights(s, s, k, True, 1e-20, 1.0)

    out["copy+softmax+topk_with_weights"] = torch_path
    out["topk_with_weights"] = lambda: topk.topk_with_weights(p, p, k, True, 1e-20, 1.0)
    out["topk_low_index_first"] = lambda: topk.topk_low_index_first(p, k)
    return out


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else "src"
    for T, E, k, dtype in SHAPES:
        logits = torch.randn(T, E, device="cuda").to(dtype)
        times = {name: triton.testing.do_bench_cudagraph(fn, rep=200) for name, fn in calls(logits, k).items()}
        print(tag, T, E, k, str(dtype).removeprefix("torch."),
              " ".join(f"{name}={ms * 1000:.1f}us" for name, ms in times.items()), flush=True)


if __name__ == "__main__":
    main()
