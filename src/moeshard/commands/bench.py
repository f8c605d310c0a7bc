"""``moeshard bench``: GPU performance of the expert kernels and the whole layer.

Every figure comes with ratios against ceilings and baselines measured in the same run: dense
bf16 matmul (8192^3), device copy bandwidth, ``torch._grouped_mm``, a per-expert loop. With
``--world-size N`` (or under torchrun) the layer runs across N GPUs per layout x backend x quant,
against the raw NCCL all-to-all, DP without EP and one GPU (``moeshard.bench.distributed``).
Refuses to run without CUDA (exit code 2). ``--json`` and ``--plot`` paths are checked before
anything is measured (their directories are created) and written atomically.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from moeshard import validate
from moeshard.bench.device import require_cuda
from moeshard.commands.args import add_allow_nonfinite, ints, names, refuse_unread_flags, seed, timeout
from moeshard.config import shared_schemes
from moeshard.finite import refuse_nonfinite
from moeshard.outputs import check_output_path

DIST_TIMEOUT_S = 3600.0  # the distributed bench's bound on the whole run, unless --timeout says


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="GPU performance of the expert kernels and the layer (needs CUDA)",
                       description="Time the expert kernels and the whole MoE layer on named full-size shapes, "
                                   "at prefill and decode token counts, for each quantization; report TFLOP/s, "
                                   "weight GB/s and ratios against figures measured in the same run.")
    p.add_argument("--models", default=None, help="comma list of presets (default: mixtral-8x7b,qwen3-30b-a3b,deepseek-v3)")
    p.add_argument("--quants", default=None, help="comma list of none, fp8_tensor, fp8_token, fp8_block, nvfp4 (default: all)")
    p.add_argument("--prefill-tokens", default=None, help="comma list of prefill token counts (default 4096,16384; "
                                                          "with --world-size 1024,4096,16384 per rank)")
    p.add_argument("--decode-tokens", default=None, help="comma list of decode token counts (default 1,16,64,128; "
                                                         "with --world-size 1,16,128 per rank)")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="run the layer across N GPUs (one process each) per layout x backend x quant")
    p.add_argument("--runs", default=None, help="with --world-size: comma list of run names (e.g. 'DP,EP2 low_latency')")
    p.add_argument("--no-graphs", action="store_true", help="with --world-size: eager timing only")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"with --world-size: seconds the whole run may take (default {DIST_TIMEOUT_S:.0f})")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="with --world-size or --backward: cpu runs the same plan on gloo ranks or the host "
                        "(checks the plumbing; its times say "
                        "nothing about GPUs)")
    p.add_argument("--size", choices=("full", "medium", "small"), default="full",
                   help="with --world-size or --backward: preset size (default full)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions at prefill (decode: 4x)")
    p.add_argument("--no-layer", action="store_true", help="time the experts only, not the whole layer")
    p.add_argument("--shared-quant", choices=("none", *shared_schemes()), default="none",
                   help="the layer's shared experts quantized with this per-row or per-block scheme beside quantized "
                        "routed experts, where a model has shared experts (default: the model dtype)")
    p.add_argument("--no-baselines", action="store_true", help="skip torch._grouped_mm, portable and loop baselines")
    p.add_argument("--backward", action="store_true",
                   help="time the training cost instead: the experts' and the layer's forward and backward (bf16, "
                        "prefill; --prefill-tokens, default 4096) against torch._grouped_mm autograd on the same rows")
    p.add_argument("--tune", action="store_true", help="also sweep the grouped GEMM's tile shapes on representative shapes")
    p.add_argument("--tune-only", action="store_true", help="only the tile sweep")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of the ratios (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_allow_nonfinite(p, "figures holding NaN/Inf (in --json as null, named under \"nonfinite\")")
    p.set_defaults(func=run)


def run(args) -> int:
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            if path:  # "" is refused by check_output_path, with the flag
                try:
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise ValueError(f"{flag} {path!r}: cannot create its directory: {exc.strerror or exc}") from None
            check_output_path(path, flag)
    if args.json is not None and args.json == args.plot:
        raise ValueError(f"--json and --plot are the same file {args.json!r}; give two paths")
    seed(args.seed)
    # Named as the user gave them: the library sees --reps doubled (or, at decode, quadrupled).
    validate.size("", "--reps", args.reps)
    if args.timeout is not None:
        timeout(args.timeout)
    if args.world_size is not None:
        validate.size("", "--world-size", args.world_size)
    from moeshard.parallel.torchrun import torchrun_environment

    distributed = args.world_size is not None or torchrun_environment()
    refuse_unread_flags(args, "backward" if args.backward else "distributed" if distributed else "single",
                        _MODE_FLAGS, _MODE_NAMES)
    if args.backward:
        if distributed:
            raise ValueError("--backward times one device; it does not take --world-size or torchrun")
        return _run_backward(args)
    if distributed and args.device == "cpu":
        return _run_distributed(args)
    device = require_cuda()  # before any import that needs a GPU: a clear refusal, exit code 2
    if distributed:
        return _run_distributed(args)
    from moeshard.bench import report, runner, targets, tune

    fields = {"prefill_tokens": ints(args.prefill_tokens or "4096,16384", "--prefill-tokens"),
              "decode_tokens": ints(args.decode_tokens or "1,16,64,128", "--decode-tokens"),
              "prefill_reps": args.reps, "decode_reps": 4 * args.reps, "layer": not args.no_layer,
              "baselines": not args.no_baselines, "seed": args.seed, "shared_quant": args.shared_quant}
    if args.models:
        fields["models"] = names(args.models)
    if args.quants:
        fields["quants"] = names(args.quants)
    opts = runner.BenchOptions(**fields)
    opts.validate()
    started = time.time()
    progress = _progress(started, args.quiet)

    result: dict = {"command": "moeshard " + " ".join(sys.argv[1:])}
    if args.tune or args.tune_only:
        result["tune"] = tune.sweep(device, progress)
        result["tune_best"] = tune.best(result["tune"])
    if not args.tune_only:
        result.update(runner.run(opts, progress))
        result["targets"] = targets.evaluate(result["records"], result["device"]["name"])
    else:
        from moeshard.bench.device import describe
        result["device"] = describe(device)
    result["seconds"] = round(time.time() - started, 1)
    written = refuse_nonfinite(result, "the bench figures", args.allow_nonfinite)  # a NaN time or ratio: broken
    report.print_tables(result)
    if args.json:
        report.write_json(written, args.json)
    if args.plot and result.get("records"):
        why = report.plot(result, args.plot)
        if why:
            print(f"moeshard bench: no plot: {why}", file=sys.stderr)
    return 0


# The flags only some of the bench's three modes read: (flag, attribute, its default, the modes
# that read it). A flag given to a mode that would ignore it is refused, so that, say, ``--backward
# --quants fp8_tensor`` cannot pass for an fp8 backward when it times bf16.
_MODE_FLAGS = (
    ("--quants", "quants", None, ("single", "distributed")),
    ("--decode-tokens", "decode_tokens", None, ("single", "distributed")),
    ("--shared-quant", "shared_quant", "none", ("single",)),
    ("--no-baselines", "no_baselines", False, ("single",)),
    ("--tune", "tune", False, ("single",)),
    ("--tune-only", "tune_only", False, ("single",)),
    ("--no-layer", "no_layer", False, ("single", "backward")),
    ("--plot", "plot", None, ("single", "distributed")),
    ("--size", "size", "full", ("distributed", "backward")),
    ("--runs", "runs", None, ("distributed",)),
    ("--no-graphs", "no_graphs", False, ("distributed",)),
    ("--timeout", "timeout", None, ("distributed",)),
    ("--device", "device", "cuda", ("distributed", "backward")),
)
_MODE_NAMES = {"single": "the one-GPU bench", "distributed": "--world-size (or torchrun)", "backward": "--backward"}


def _dist_timeout(args) -> float:
    """The distributed bench's bound on the whole run, in seconds."""
    return timeout(DIST_TIMEOUT_S if args.timeout is None else args.timeout)


def _progress(started: float, quiet: bool):
    """The progress printer: one stderr line per step, with seconds since ``started``."""
    def progress(line: str) -> None:
        if not quiet:
            print(f"[{time.time() - started:6.1f}s] {line}", file=sys.stderr, flush=True)
    return progress


def _run_backward(args) -> int:
    import torch

    from moeshard.bench import backward, report
    from moeshard.bench.device import describe

    # CPU runs the same plan (checks the plumbing; its times say nothing about GPUs).
    device = torch.device("cpu") if args.device == "cpu" else require_cuda()
    fields: dict = {"tokens": ints(args.prefill_tokens or "4096", "--prefill-tokens"), "reps": args.reps,
                    "size": args.size, "layer": not args.no_layer, "seed": args.seed}
    if args.models:
        fields["models"] = names(args.models)
    opts = backward.BackwardOptions(**fields)
    opts.validate()
    started = time.time()
    progress = _progress(started, args.quiet)

    machine = describe(device) if device.type == "cuda" else {
        "name": f"CPU, torch {torch.__version__}", "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result = {"command": "moeshard " + " ".join(sys.argv[1:]), "device": machine, **backward.run(opts, device, progress)}
    result["seconds"] = round(time.time() - started, 1)
    written = refuse_nonfinite(result, "the bench figures", args.allow_nonfinite)
    backward.print_tables(result)
    if args.json:
        report.write_json(written, args.json)
    wrong = [r for r in result["records"]
             if r.get("weight_grad_rel_diff") is not None and r["weight_grad_rel_diff"] > backward.WEIGHT_GRAD_BOUND]
    for r in wrong:
        print(f"moeshard bench --backward: {r['model']} at {r['tokens']} tokens: the experts' weight gradients differ "
              f"from torch._grouped_mm autograd's by {r['weight_grad_rel_diff']:.3g} of the largest "
              f"(bound {backward.WEIGHT_GRAD_BOUND})", file=sys.stderr)
    return 1 if wrong else 0


def _dist_options(args, world: int):
    from moeshard.bench.distributed import DistOptions

    fields: dict = {"world_size": world, "reps": args.reps * 2, "graphs": not args.no_graphs, "seed": args.seed,
                    "device": args.device, "size": args.size}
    if args.models:
        fields["models"] = names(args.models)
    if args.quants:
        fields["quants"] = names(args.quants)
    if args.decode_tokens:
        fields["decode_tokens"] = ints(args.decode_tokens, "--decode-tokens")
    if args.prefill_tokens:
        fields["prefill_tokens"] = ints(args.prefill_tokens, "--prefill-tokens")
    if args.runs:
        fields["runs"] = tuple(r.strip() for r in args.runs.split(",") if r.strip())
    opts = DistOptions(**fields)
    opts.validate()
    return opts


def _check_memory(opts) -> None:
    """Refuses, before any rank starts, a plan whose estimate exceeds the memory there is (host
    memory for CPU ranks, one GPU's for CUDA ranks)."""
    import torch

    from moeshard.parallel.capacity import available_memory, check_local_world

    if opts.device == "cpu":
        check_local_world(opts.world_size, "cpu", what="--world-size")
        available = available_memory()
    else:
        available = torch.cuda.get_device_properties(0).total_memory
    need = opts.memory_bytes()
    if available is not None and need > available:
        raise ValueError(f"the largest --prefill-tokens/--decode-tokens count ({max(opts.prefill_tokens + opts.decode_tokens)}) "
                         f"of {', '.join(opts.models)} ({opts.size}) on {opts.world_size} {opts.device} rank(s) needs "
                         f"about {need / 2**30:.1f} GiB of memory but {available / 2**30:.1f} GiB is available; choose "
                         f"fewer tokens or a smaller --size")


def _dist_rank(opts, quiet: bool) -> list[dict]:
    """Entry of one rank (spawned, or under torchrun)."""
    import torch.distributed as dist

    from moeshard.bench.distributed import rank_records

    started = time.time()

    def progress(line: str) -> None:
        if not quiet and dist.get_rank() == 0:
            print(f"[{time.time() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    return rank_records(opts, progress)


def _run_distributed(args) -> int:
    from dataclasses import asdict

    import torch
    import torch.distributed as dist

    from moeshard.bench import dist_report, report
    from moeshard.bench.device import describe
    from moeshard.bench.distributed import derive, merge
    from moeshard.parallel.spawn import spawn
    from moeshard.parallel.torchrun import destroy, init_from_env, torchrun_environment

    started = time.time()
    if torchrun_environment():
        init_from_env(backend="nccl" if args.device == "cuda" else "gloo", timeout_s=_dist_timeout(args))
        try:
            opts = _dist_options(args, dist.get_world_size())
            mine = _dist_rank(opts, args.quiet)
            per_rank: list = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, mine)  # our own records, between our own ranks
            if dist.get_rank() != 0:
                return 0
        finally:
            destroy()
    else:
        opts = _dist_options(args, args.world_size)
        if opts.device == "cuda" and torch.cuda.device_count() < opts.world_size:
            raise ValueError(f"--world-size {opts.world_size} needs {opts.world_size} GPUs, "
                             f"{torch.cuda.device_count()} are visible")
        _check_memory(opts)
        per_rank = spawn(_dist_rank, opts.world_size, args=(opts, args.quiet), device=opts.device,
                         timeout_s=_dist_timeout(args))
    records = merge(per_rank)
    derive(records)
    machine = describe(torch.device("cuda", 0)) if opts.device == "cuda" else {
        "name": f"CPU ranks (gloo), torch {torch.__version__}", "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result = {"command": "moeshard " + " ".join(sys.argv[1:]), "world_size": opts.world_size, "device": machine,
              "options": asdict(opts), "records": records, "seconds": round(time.time() - started, 1)}
    written = refuse_nonfinite(result, "the bench figures", args.allow_nonfinite)  # a NaN time or ratio: broken
    dist_report.print_tables(result)
    if args.json:
        report.write_json(written, args.json)
    if args.plot:
        why = dist_report.plot(result, args.plot)
        if why:
            print(f"moeshard bench: no plot: {why}", file=sys.stderr)
    return 0
