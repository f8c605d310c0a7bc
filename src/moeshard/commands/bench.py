"""``moeshard bench``: GPU performance of the expert kernels and the whole layer.

Every figure comes with ratios against ceilings and baselines measured in the same run: dense
bf16 matmul (8192^3), device copy bandwidth, ``torch._grouped_mm``, a per-expert loop.
Refuses to run without CUDA (exit code 2). ``--json`` and ``--plot`` paths are checked before
anything is measured (their directories are created) and written atomically.
"""

from __future__ import annotations

import sys
import time

from pathlib import Path

from moeshard.bench.device import require_cuda
from moeshard.commands.args import ints, names, seed
from moeshard.outputs import check_output_path


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="GPU performance of the expert kernels and the layer (needs CUDA)",
                       description="Time the expert kernels and the whole MoE layer on named full-size shapes, "
                                   "at prefill and decode token counts, for each quantization; report TFLOP/s, "
                                   "weight GB/s and ratios against figures measured in the same run.")
    p.add_argument("--models", default=None, help="comma list of presets (default: mixtral-8x7b,qwen3-30b-a3b,deepseek-v3)")
    p.add_argument("--quants", default=None, help="comma list of none, fp8_tensor, fp8_token, fp8_block, nvfp4 (default: all)")
    p.add_argument("--prefill-tokens", default="4096,16384", help="comma list of prefill token counts")
    p.add_argument("--decode-tokens", default="1,16,64,128", help="comma list of decode token counts")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions at prefill (decode: 4x)")
    p.add_argument("--no-layer", action="store_true", help="time the experts only, not the whole layer")
    p.add_argument("--no-baselines", action="store_true", help="skip torch._grouped_mm, portable and loop baselines")
    p.add_argument("--tune", action="store_true", help="also sweep the grouped GEMM's tile shapes on representative shapes")
    p.add_argument("--tune-only", action="store_true", help="only the tile sweep")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of the ratios (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run)


def run(args) -> int:
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"{flag} {path!r}: cannot create its directory: {exc.strerror or exc}") from None
            check_output_path(path, flag)
    seed(args.seed)
    device = require_cuda()  # before any import that needs a GPU: a clear refusal, exit code 2
    from moeshard.bench import report, runner, targets, tune

    fields = {"prefill_tokens": ints(args.prefill_tokens, "--prefill-tokens"),
              "decode_tokens": ints(args.decode_tokens, "--decode-tokens"),
              "prefill_reps": args.reps, "decode_reps": 4 * args.reps, "layer": not args.no_layer,
              "baselines": not args.no_baselines, "seed": args.seed}
    if args.models:
        fields["models"] = names(args.models)
    if args.quants:
        fields["quants"] = names(args.quants)
    opts = runner.BenchOptions(**fields)
    opts.validate()
    started = time.time()

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"[{time.time() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    result: dict = {"command": "moeshard " + " ".join(sys.argv[1:])}
    if args.tune or args.tune_only:
        result["tune"] = tune.sweep(device, progress)
        result["tune_best"] = tune.best(result["tune"])
    if not args.tune_only:
        result.update(runner.run(opts, progress))
        result["targets"] = targets.evaluate(result["records"])
    else:
        from moeshard.bench.device import describe
        result["device"] = describe(device)
    result["seconds"] = round(time.time() - started, 1)
    report.print_tables(result)
    if args.json:
        report.write_json(result, args.json)
    if args.plot and result.get("records"):
        why = report.plot(result, args.plot)
        if why:
            print(f"moeshard bench: no plot: {why}", file=sys.stderr)
    return 0
