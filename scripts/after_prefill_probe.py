"""One-token experts time before and after a 16384-token prefill of the same experts, and after
``torch.cuda.empty_cache()``: does a large case run just before slow the next decode step?

    PYTHONPATH=src python3 scripts/after_prefill_probe.py [--model deepseek-v3] [--scheme fp8_tensor] [--idle]

Every line starts with the host's wall clock (seconds, to the millisecond) when the line's timing
ended, to set beside a clock and power log such as ``nvidia-smi --query-gpu=timestamp,clocks.sm,
power.draw --format=csv -lms 20``. --idle: also the prefill again, then one token after 0.1, 0.3,
1 and 2 s of idling, without empty_cache between. --states: instead, one token in each of a list
of device-memory states (fresh; after a large tensor was allocated and freed, so that the caching
allocator holds it; while it is held; after ``empty_cache``; after a prefill), each timed three
ways: a graph captured in that state, one graph captured at the start and replayed, and a read
of a buffer of the one-token weight bytes (``torch.sum``) as a control that has no plan, no
scales and no graph pool of its own. --settle: the read alone, in windows after a large tensor
was freed and handed back to the driver (``torch.cuda.empty_cache()``, as ``torch.cuda.graph``
does when a capture begins), for several sizes and pauses: how long, and how much, the release
slows reads.
"""

from __future__ import annotations

import argparse
import time

import torch

from moeshard.bench.timing import L2Flush, graph_median_ms, graphed, time_cuda
from moeshard.bench.workload import experts_for, hidden_states, make_model, routed_input
from moeshard.config import QuantConfig
from moeshard.kernel_choice import select_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--scheme", default="fp8_tensor")
    ap.add_argument("--prefill", type=int, default=16384)
    ap.add_argument("--idle", action="store_true")
    ap.add_argument("--states", action="store_true")
    ap.add_argument("--settle", action="store_true")
    ap.add_argument("--big-gib", type=float, default=16.0, help="--states: size of the large tensor")
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

    if args.settle:
        settle(model, flush, say)
        return
    if args.states:
        states(model, experts, timed, flush, args, say)
        return
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


def settle(model, flush, say) -> None:
    """The read control after a release of each size, after each pause (--settle)."""
    device = torch.device("cuda")
    nbytes = 3 * model.cfg.hidden_size * model.cfg.intermediate_size * model.cfg.top_k
    control = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=device)
    read = graphed(lambda: control.sum(dtype=torch.float32))
    say(f"read of {nbytes / 1e6:.0f} MB, median of 20 after each L2 flush; columns: freed GiB, host ms in "
        f"empty_cache, pause s, read us")
    for _ in range(2):
        base = time_cuda(read, warmup=2, reps=20, flush=flush).median_ms * 1e3
        say(f"  nothing freed            read {base:6.1f} us")
        for gib in (0.25, 1.0, 4.0, 16.0):
            for pause in (0.0, 0.005, 0.02, 0.05, 0.1, 0.3):
                big = torch.empty(int(gib * 2**30) // 4, dtype=torch.int32, device=device)
                big.zero_()
                torch.cuda.synchronize()
                del big
                start = time.perf_counter()
                torch.cuda.empty_cache()
                host_ms = (time.perf_counter() - start) * 1e3
                time.sleep(pause)
                r = time_cuda(read, warmup=0, reps=20, flush=flush).median_ms * 1e3
                say(f"  {gib:5.2f} GiB  {host_ms:7.2f} ms  pause {pause:5.3f} s  read {r:6.1f} us")


def states(model, experts, timed, flush, args, say) -> None:
    """One token in each memory state; see the module's docstring (--states)."""
    device = torch.device("cuda")
    inp, _ = routed_input(model, hidden_states(model, 1, 1), QuantConfig(args.scheme))
    kernel = select_kernel(model.cfg.activation, model.cfg.dtype, device, args.scheme)
    held = graphed(lambda: kernel(inp, experts))
    ids = inp.expert_ids[inp.expert_ids >= 0].unique()
    per_expert = 3 * model.cfg.hidden_size * model.cfg.intermediate_size
    weight_bytes = ids.numel() * per_expert * (2 if args.scheme == "none" else 1)
    control = torch.zeros(weight_bytes // 2, dtype=torch.bfloat16, device=device)
    read = graphed(lambda: control.sum(dtype=torch.float32))
    say(f"{args.model} {args.scheme}: one token's weights ~{weight_bytes / 1e6:.0f} MB "
        f"(experts {ids.numel()}); columns: captured now / held graph / read")
    big_elems = int(args.big_gib * 2**30) // 4

    def line(state: str) -> None:
        now = timed(1, 40) * 1e3
        h = time_cuda(held, warmup=2, reps=40, flush=flush).median_ms * 1e3
        r = time_cuda(read, warmup=2, reps=40, flush=flush).median_ms * 1e3
        say(f"  {state:34s} {now:7.1f} {h:7.1f} {r:7.1f} us;  reserved "
            f"{torch.cuda.memory_reserved() / 2**30:6.2f} GiB")

    for round_ in range(2):
        say(f" round {round_ + 1}")
        line("as it is")
        torch.cuda.empty_cache()
        line("after empty_cache")
        big = torch.empty(big_elems, dtype=torch.int32, device=device)
        big.zero_()
        line(f"holding {args.big_gib:g} GiB")
        del big
        line(f"{args.big_gib:g} GiB freed, cached")
        torch.cuda.empty_cache()
        line("after empty_cache")
        prefill = timed(args.prefill, 10)
        line(f"after prefill ({prefill:.2f} ms)")
        torch.cuda.empty_cache()
        line("prefill, then empty_cache")


if __name__ == "__main__":
    main()
