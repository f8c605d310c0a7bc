"""``moeshard eplb``: what expert-parallel load balancing does to a skewed load.

Default: a synthetic skewed routing trace (``moeshard.eplb.trace``), balancedness and all-to-all
bytes per rank before and after each balancing policy; pure CPU, runs anywhere. ``--layer``: the
EP layer's time under skew with and without replicas, across ``--world-size`` ranks (GPUs, or
CPU ranks with ``--device cpu``), in one run (``moeshard.bench.eplb_layer``).
"""

from __future__ import annotations

import sys
import time

from moeshard import validate
from moeshard.commands.args import add_allow_nonfinite, ints, names, refuse_unread_flags
from moeshard.finite import json_text, refuse_nonfinite
from moeshard.outputs import atomic_write_text, check_output_path


def add_parser(sub) -> None:
    p = sub.add_parser("eplb", help="expert-parallel load balancing on a skewed load: balancedness, bytes, layer time",
                       description="Balance a synthetic skewed routing trace with each policy and report "
                                   "balancedness (mean / max rank load) and all-to-all bytes per rank, before and "
                                   "after; with --layer, time the EP layer under skew with and without replicas.")
    p.add_argument("--preset", default=None, help="take experts, top-k, hidden and intermediate sizes from a preset's "
                                                  "full size (trace default: deepseek-v3's; --layer default deepseek-v3)")
    p.add_argument("--experts", type=int, default=None, help="trace: logical experts (default 256)")
    p.add_argument("--top-k", type=int, default=None, help="trace: experts per token (default 8)")
    p.add_argument("--ranks", type=int, default=8, help="trace: EP ranks (default 8)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (and step, for the trace)")
    p.add_argument("--steps", type=int, default=8, help="trace: steps, the first half observed (default 8)")
    p.add_argument("--zipf", type=float, default=0.8, help="trace: Zipf exponent of expert popularity (default 0.8)")
    p.add_argument("--redundant-per-rank", default=None,
                   help="comma list of redundant slots per rank (trace default 0,1,2,4; --layer 0,2,8,32)")
    p.add_argument("--policies", default="greedy,hierarchical", help="trace: comma list of balancing policies")
    p.add_argument("--layer", action="store_true", help="time the EP layer under skew with and without replicas")
    p.add_argument("--world-size", type=int, default=2, metavar="N", help="--layer: ranks (default 2)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="--layer: GPUs (NCCL) or CPU ranks (gloo)")
    p.add_argument("--size", choices=("full", "medium", "small"), default=None,
                   help="--layer: preset size (default full on cuda, small on cpu)")
    p.add_argument("--skew", choices=("zipf", "one"), default="zipf", help="--layer: routing skew (default zipf)")
    p.add_argument("--policy", default="hierarchical", help="--layer: balancing policy (default hierarchical)")
    p.add_argument("--backend", default="all2all", help="--layer: EP backend (default all2all)")
    p.add_argument("--quant", default="none", help="--layer: expert quantization (default none)")
    p.add_argument("--reps", type=int, default=10, help="--layer: timed repetitions (median)")
    p.add_argument("--timeout", type=float, default=1800.0, help="--layer: seconds the whole run may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    add_allow_nonfinite(p, "figures holding NaN/Inf (in --json as null, named under \"nonfinite\")")
    p.set_defaults(func=run)


def _check_memory(need: int, what: str) -> None:
    """Refuses, before anything is allocated, a run whose estimate exceeds the available memory."""
    from moeshard.parallel.capacity import available_memory

    available = available_memory()
    if available is not None and need > available:
        raise ValueError(f"{what} needs about {need / 2**30:.1f} GiB of memory but {available / 2**30:.1f} GiB is "
                         f"available; choose fewer --tokens (or --steps, --ranks)")


def _check_counts(args) -> None:
    """The numeric options, named as the user gave them, before any library object sees them."""
    for flag, value in (("--tokens", args.tokens), ("--ranks", args.ranks), ("--reps", args.reps),
                        ("--world-size", args.world_size)):
        validate.size("", flag, value)
    if args.experts is not None:
        validate.size("", "--experts", args.experts)
    if args.top_k is not None:
        validate.size("", "--top-k", args.top_k)
    validate.int_in_range("", "--steps", args.steps, 2, validate.MAX_DIM)
    validate.finite_float("", "--zipf", args.zipf, 0.0, 10.0)
    validate.seed("", "--seed", args.seed)
    validate.timeout("", "--timeout", args.timeout)


def _trace(args) -> tuple[dict, str]:
    """The trace's figures and their report."""
    from moeshard.eplb.trace import TraceOptions, format_report, run_trace
    from moeshard.presets import get_preset

    fields: dict = {"ranks": args.ranks, "tokens_per_rank": args.tokens, "steps": args.steps, "zipf": args.zipf,
                    "policies": names(args.policies), "seed": args.seed}
    if args.preset:
        full = get_preset(args.preset).full
        fields.update(num_experts=full.num_experts, top_k=full.top_k, hidden_size=full.hidden_size,
                      intermediate_size=full.intermediate_size)
    if args.experts is not None:
        fields["num_experts"] = args.experts
    if args.top_k is not None:
        fields["top_k"] = args.top_k
    if args.redundant_per_rank:
        fields["redundant_per_rank"] = ints(args.redundant_per_rank, "--redundant-per-rank")
    opts = TraceOptions(**fields)
    _check_memory(opts.memory_bytes, f"the trace of {opts.steps} steps x {opts.ranks} ranks x "
                                     f"{opts.tokens_per_rank} tokens (--tokens)")
    result = run_trace(opts)
    return result, format_report(result)


def _layer_rank(opts, quiet: bool) -> list[dict]:
    import torch.distributed as dist

    from moeshard.bench.eplb_layer import rank_records

    started = time.time()

    def progress(line: str) -> None:
        if not quiet and dist.get_rank() == 0:
            print(f"[{time.time() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    return rank_records(opts, progress)


def _layer(args) -> tuple[dict, str]:
    """The layer's figures and their report."""
    import torch

    from moeshard.bench.eplb_layer import (
        LayerOptions,
        format_report,
        memory_bytes,
        merge,
        options_dict,
    )
    from moeshard.parallel.capacity import check_local_world
    from moeshard.parallel.spawn import spawn

    fields: dict = {"world_size": args.world_size, "device": args.device, "tokens": args.tokens, "skew": args.skew,
                    "policy": args.policy, "backend": args.backend, "quant": args.quant, "reps": args.reps,
                    "seed": args.seed, "size": args.size or ("full" if args.device == "cuda" else "small")}
    if args.preset:
        fields["preset"] = args.preset
    if args.redundant_per_rank:
        fields["redundant_per_rank"] = ints(args.redundant_per_rank, "--redundant-per-rank")
    opts = LayerOptions(**fields)
    if opts.device == "cuda" and torch.cuda.device_count() < opts.world_size:
        raise ValueError(f"--world-size {opts.world_size} needs {opts.world_size} GPUs, {torch.cuda.device_count()} "
                         f"are visible (use --device cpu for CPU ranks)")
    if opts.device == "cpu":
        check_local_world(opts.world_size, "cpu", what="--world-size")
    _check_memory(memory_bytes(opts), f"--layer with {opts.tokens} --tokens per rank on {opts.world_size} ranks "
                                      f"({opts.preset}, {opts.size})")
    started = time.time()
    per_rank = spawn(_layer_rank, opts.world_size, args=(opts, False), device=opts.device, timeout_s=args.timeout)
    result = {"command": "moeshard " + " ".join(sys.argv[1:]), "options": options_dict(opts),
              "records": merge(per_rank), "seconds": round(time.time() - started, 1)}
    if opts.device == "cuda":
        from moeshard.bench.device import describe
        result["device"] = describe(torch.device("cuda", 0))
    return result, format_report(result)


# The flags only one of the two modes reads: (flag, attribute, default, modes). A trace flag given
# with --layer (or the other way round) is refused rather than ignored: ``--layer --policies
# greedy`` would otherwise report the hierarchical policy under a command line naming greedy.
_MODE_FLAGS = (
    ("--experts", "experts", None, ("trace",)),
    ("--top-k", "top_k", None, ("trace",)),
    ("--ranks", "ranks", 8, ("trace",)),
    ("--steps", "steps", 8, ("trace",)),
    ("--zipf", "zipf", 0.8, ("trace",)),
    ("--policies", "policies", "greedy,hierarchical", ("trace",)),
    ("--world-size", "world_size", 2, ("layer",)),
    ("--device", "device", "cuda", ("layer",)),
    ("--size", "size", None, ("layer",)),
    ("--skew", "skew", "zipf", ("layer",)),
    ("--policy", "policy", "hierarchical", ("layer",)),
    ("--backend", "backend", "all2all", ("layer",)),
    ("--quant", "quant", "none", ("layer",)),
    ("--reps", "reps", 10, ("layer",)),
    ("--timeout", "timeout", 1800.0, ("layer",)),
)
_MODE_NAMES = {"trace": "the trace (without --layer)", "layer": "--layer"}


def run(args) -> int:
    refuse_unread_flags(args, "layer" if args.layer else "trace", _MODE_FLAGS, _MODE_NAMES)
    _check_counts(args)
    if args.json is not None:  # checked before any work; the command reads no file of its own
        check_output_path(args.json, "--json")
    result, report = _layer(args) if args.layer else _trace(args)
    # A NaN balancedness, byte count or time is a broken result: refused, exit code 7, unless
    # --allow-nonfinite (then it is printed as nan and written as null, named under "nonfinite").
    written = refuse_nonfinite(result, "the eplb figures", args.allow_nonfinite)
    print(report)
    if args.json is not None:
        atomic_write_text(args.json, json_text(written, indent=2))
        print(f"wrote {args.json}")
    return 0
