"""One-token experts time before and after a 16384-token prefill of the same experts, and after
``torch.cuda.empty_cache()``: does a large case run just before slow the next decode step?

    PYTHONPATH=src python3 scripts/after_prefill_probe.py [--model deepseek-v3] [--scheme fp8_tensor] [--idle]

Every line starts with the host's wall clock (seconds, to the millisecond) when the line's timing
ended, to set beside a clock and power log such as ``nvidia-smi --query-gpu=timestamp,clocks.sm,
power.draw --format=csv -lms 20``. --idle: also the prefill again, then one token after 0.1, 0.3,
1 and 2 s of idling, without empty_cache between.
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
    ap.add_argument("--idle", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda")
    flush = L2Flush(device)
    model = make_model(args.model, device)
    experts = experts_for(model, args.scheme)
    kernel = select_kernel(model.cfg.activation, model.cfg.dtype, device, args.scheme)

    def timed(tokens: int, reps: int) -> float:
        inp, _ = routed_input(model, hidden_states(model, tokens, tokens), QuantConfig(args.scheme))
        return graph_median_ms(lambda: kernel(inp, experts), reps=reps, flush=flush)

    def say(text: str) -> None:
        print(f"{time.time():.3f}  {text}", flush=True)

    say(f"{args.model} {args.scheme} one token first: {timed(1, 40) * 1e3:.1f} us")
    for _ in range(2):
        prefill = timed(args.prefill, 10)
        say(f"  prefill {args.prefill}: {prefill:.3f} ms; one token after it: {timed(1, 40) * 1e3:.1f} us")
    torch.cuda.empty_cache()
    say(f"  after empty_cache: {timed(1, 40) * 1e3:.1f} us")
    torch.cuda.synchronize()

    time.sleep(2.0)
    say(f"  after 2 s idle: {timed(1, 40) * 1e3:.1f} us")
    if args.idle:
        for pause in (0.1, 0.3, 1.0, 2.0):
            prefill = timed(args.prefill, 10)
            torch.cuda.synchronize()
            time.sleep(pause)
            say(f"  prefill {args.prefill}: {prefill:.3f} ms; one token after {pause} s idle: "
                f"{timed(1, 40) * 1e3:.1f} us")


if __name__ == "__main__":
    main()
