"""One-token experts time before and after a 16384-token prefill of the same experts, and after
``torch.cuda.empty_cache()``: does a large case run just before slow the next decode step?

    PYTHONPATH=src python3 scripts/after_prefill_probe.py [--model deepseek-v3] [--scheme fp8_tensor]
"""

from __future__ import annotations

import argparse
import time

import torch

from moeshard.bench.timing import L2Flush, graph_median_ms
from moeshard.bench.workload import experts_for, hidden_states, make_model, routed_input
from moeshard.config import QuantConfig
from moeshard.kernel_choice import select_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--scheme", default="fp8_tensor")
    ap.add_argument("--prefill", type=int, default=16384)
    args = ap.parse_args()
    device = torch.device("cuda")
    flush = L2Flush(device)
    model = make_model(args.model, device)
    experts = experts_for(model, args.scheme)
    kernel = select_kernel(model.cfg.activation, model.cfg.dtype, device, args.scheme)

    def timed(tokens: int, reps: int) -> float:
        inp, _ = routed_input(model, hidden_states(model, tokens, tokens), QuantConfig(args.scheme))
        return graph_median_ms(lambda: kernel(inp, experts), reps=reps, flush=flush)

    print(f"{args.model} {args.scheme} one token first: {timed(1, 40) * 1e3:.1f} us", flush=True)
    for _ in range(2):
        print(f"  prefill {args.prefill}: {timed(args.prefill, 10):.3f} ms; one token after it: "
              f"{timed(1, 40) * 1e3:.1f} us", flush=True)
    torch.cuda.empty_cache()
    print(f"  after empty_cache: {timed(1, 40) * 1e3:.1f} us", flush=True)
    torch.cuda.synchronize()

    time.sleep(2.0)
    print(f"  after 2 s idle: {timed(1, 40) * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
