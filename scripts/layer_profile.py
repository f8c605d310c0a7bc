"""Where the layer's time goes, kernel by kernel (GPU): the measurements behind the "Whole layer"
section of docs/performance.md.

    PYTHONPATH=src python3 scripts/layer_profile.py [--models deepseek-v3,qwen3-30b-a3b] [--tokens 16384]
                                                 [--quant none]

Prints, per model: the GPU time per forward of every kernel of ``MoELayer`` (one GPU, local
backend; torch.profiler over 5 forwards after 3 warm-up ones), then ``align_rows`` alone, then
the router: what the layer runs for router_dtype fp32, the fp32 GEMM on the CUDA cores, and bf16
tensor cores with fp32 output (in one GEMM, and with K cut into chunks whose fp32 partial logits
are summed, ``router.chunked_logits``), each
with its largest distance from the exact (fp64) logits. ``--ops`` also prints the torch operators
that launched the most GPU time, with their input shapes and dtypes, to attribute copies and casts.
"""

from __future__ import annotations

import argparse
import time

import torch

from moeshard.bench.timing import kernel_times
from moeshard.bench.workload import experts_for, hidden_states, make_model
from moeshard.config import QuantConfig
from moeshard.kernels.align import align_rows
from moeshard.layer import MoELayer
from moeshard.router import chunked_logits, router_logits


def op_times(fn, reps: int = 5, top: int = 15) -> list[tuple[str, str, float]]:
    """(torch operator, its input shapes and dtypes, GPU microseconds per call of ``fn``) of the
    operators whose kernels took the most GPU time, largest first."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, f"{e.input_shapes}", e.device_time_total / reps)
            for e in prof.key_averages(group_by_input_shape=True)
            if e.device_time_total > 0 and e.key.startswith("aten::") and e.key not in ("aten::to", "aten::_to_copy")]
    return sorted(rows, key=lambda r: -r[2])[:top]


def wall_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def profile_model(name: str, tokens: int, quant: str, device: torch.device, ops: bool = False) -> None:
    """Print the measurements of one model."""
    model = make_model(name, device)
    cfg = model.cfg
    layer = MoELayer(cfg, QuantConfig(quant), weights=model.shell,
                     local_experts=experts_for(model, quant), device=device)
    x = hidden_states(model, tokens, seed=tokens)
    print(f"== {name}, {tokens} tokens, {quant}: GPU time per forward")
    for kernel, us in kernel_times(lambda: layer(x))[:20]:
        print(f"  {us:10.1f} us  {kernel[:100]}")
    if ops:
        print("  operators (GPU time of the kernels each launched, input shapes):")
        for op, shapes, us in op_times(lambda: layer(x)):
            print(f"  {us:10.1f} us  {op} {shapes[:150]}")
    ids = torch.randint(0, cfg.num_experts, (tokens * cfg.top_k,), device=device)
    plan_us = sum(us for _, us in kernel_times(lambda: align_rows(ids, cfg.num_experts, 128)))
    print(f"  align_rows alone (M={ids.numel()}, E={cfg.num_experts}): {plan_us:.1f} us")
    gate = model.shell.gate
    exact = x.double() @ gate.double().T
    variants = [("the layer's router_dtype fp32 (chunked_logits on CUDA)", lambda: router_logits(x, gate, "fp32")),
                ("fp32 GEMM on the CUDA cores", lambda: torch.nn.functional.linear(x.float(), gate.float())),
                ("bf16 tensor cores, fp32 out", lambda: torch.mm(x, gate.T, out_dtype=torch.float32))]
    variants += [(f"bf16 tensor cores, K in chunks of {c} summed in fp32", lambda c=c: chunked_logits(x, gate, c))
                 for c in (128, 512) if x.shape[1] % c == 0]
    for label, fn in variants:
        try:
            err = float((fn().double() - exact).abs().max())
        except RuntimeError as e:  # a torch without the operator (bmm with out_dtype)
            print(f"  router {label}: not run ({str(e).splitlines()[0][:120]})")
            continue
        print(f"  router {label}: {wall_ms(fn):.3f} ms, max |logit - exact| {err:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="deepseek-v3,qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--quant", default="none")
    parser.add_argument("--ops", action="store_true", help="also attribute GPU time to torch operators")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("layer_profile: needs a CUDA GPU")
    device = torch.device("cuda")
    for name in args.models.split(","):
        profile_model(name, args.tokens, args.quant, device, args.ops)
        # profile_model's return freed the full-size weights; hand their memory back before the next model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
