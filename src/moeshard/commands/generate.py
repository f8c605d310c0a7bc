"""``moeshard generate``: greedy generation of a whole transformers MoE model under a (dp, tp, ep)
layout, its MoE blocks run by moeshard, each rank holding only its slices of the experts.

    moeshard generate --model DIR --input-ids 3,17,42 --max-new-tokens 8 [--dp D --tp T --ep] \\
                      [--backend B] [--quant Q] [--dtype bf16] [--device cpu|cuda] [--compare] \\
                      [--output OUT.json]
    moeshard generate --model DIR --input-ids "3,17,42;5,6" ...    # several prompts
    moeshard generate --model DIR --input-file prompts.json ...     # [[3,17,42],[5,6]] or one prompt per line

Prompts are split over the DP ranks (contiguous; the TP ranks of a DP rank share its prompts),
each prompt gets exactly ``--max-new-tokens`` new tokens (EOS does not stop generation), and the
new ids are printed per prompt. ``--compare`` also runs the same batches through transformers
alone (every expert, no moeshard) and reports whether the ids are the same and each step's max
|logits difference| against ``moeshard.tolerances``. Ranks: ``dp * tp`` local processes (gloo on
cpu, NCCL on cuda, one GPU each), or, under torchrun, this process is one rank of torchrun's world.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from moeshard.commands.args import add_allow_nonfinite, add_layout_arguments, ints, timeout
from moeshard.errors import NonFiniteOutput
from moeshard.finite import json_text, with_nulls
from moeshard.jobs.generate import (
    GenerateComparison,
    GeneratePlan,
    GenerateRankResult,
    GenerateSpec,
    by_prompt,
    compare_generations,
    describe,
    generate_plans,
    generate_rank,
    nonfinite_logits,
    plan_generate,
    reference_generate,
)
from moeshard.jobs.world import execute
from moeshard.outputs import atomic_write_text, check_input_dir, check_input_file, check_output_path
from moeshard.parallel.config import ParallelConfig


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="greedy generation of a whole transformers MoE model under a layout",
                              description="Greedy generation of a Hugging Face MoE model (Mixtral, Qwen2-MoE, "
                                          "Qwen3-MoE, DeepSeek-V3) with its MoE blocks run by moeshard under a "
                                          "(dp, tp, ep) layout.")
    src = p.add_argument_group("what runs")
    src.add_argument("--model", metavar="DIR", required=True,
                     help="Hugging Face model directory (config.json + *.safetensors)")
    src.add_argument("--input-ids", metavar="IDS", help="prompt token ids, comma-separated; prompts separated by ';'")
    src.add_argument("--input-file", metavar="PATH",
                     help="prompts from a file: JSON (a list of ids, or a list of lists) or one prompt per line")
    src.add_argument("--max-new-tokens", type=int, default=16, metavar="N", help="new tokens per prompt (16)")
    src.add_argument("--output", metavar="OUT", help="write the generated ids (and the comparison) as JSON")
    src.add_argument("--compare", action="store_true",
                     help="also generate with transformers alone and report ids and per-step logit differences")
    add_allow_nonfinite(src, "ids greedy chose from logits holding NaN/Inf (in --output a NaN figure is null, named "
                             "under \"nonfinite\")")
    add_layout_arguments(p, dtype_help="model dtype (default: the checkpoint's)",
                         timeout_help="seconds the ranks may take (default 600)")
    p.set_defaults(func=run)


# -- prompts ----------------------------------------------------------------------------------
def parse_prompts(text: str, flag: str = "--input-ids") -> tuple[tuple[int, ...], ...]:
    """``"3,17,42;5,6"`` -> ((3, 17, 42), (5, 6)); an empty prompt anywhere is refused, naming its
    position (``"3;;5"`` would otherwise number the prompts after it one lower than written)."""
    parts = text.split(";")
    empty = [i + 1 for i, part in enumerate(parts) if not part.strip()]
    if empty:
        raise ValueError(f"{flag}: {text!r} holds an empty prompt (part {', '.join(map(str, empty))} of the "
                         f"{len(parts)} that ';' separates); write ids like 3,17,42 (prompts separated by ';')")
    prompts = tuple(ints(part, flag) for part in parts)
    if any(not p for p in prompts):
        raise ValueError(f"{flag}: {text!r} holds an empty prompt; write ids like 3,17,42 (prompts separated by ';')")
    return prompts


def read_prompts(path: str) -> tuple[tuple[int, ...], ...]:
    """A prompt file: JSON (a list of ints, or a list of lists of ints) or text, one prompt per
    line with ids separated by commas or spaces (blank lines skipped)."""
    file = check_input_file(path, "--input-file")
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--input-file {path!r} cannot be read as text: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        lines = [line.replace(",", " ").split() for line in text.splitlines() if line.strip()]
        try:
            prompts = tuple(tuple(int(t) for t in line) for line in lines)
        except ValueError:
            raise ValueError(f"--input-file {path!r}: neither JSON nor lines of integer token ids") from None
    else:
        if isinstance(data, list) and data and all(isinstance(t, int) and not isinstance(t, bool) for t in data):
            data = [data]
        if (not isinstance(data, list) or not all(isinstance(p, list) for p in data)
                or not all(isinstance(t, int) and not isinstance(t, bool) for p in data for t in p)):
            raise ValueError(f"--input-file {path!r}: the JSON must be a list of token ids or a list of lists of them")
        prompts = tuple(tuple(p) for p in data)
    if not prompts or any(not p for p in prompts):
        raise ValueError(f"--input-file {path!r} holds no prompt, or an empty one")
    return prompts


def spec_from_args(args: argparse.Namespace) -> GenerateSpec:
    """The ``GenerateSpec`` of parsed arguments (ValueError for combinations that make no sense)."""
    if (args.input_ids is None) == (args.input_file is None):
        raise ValueError("give exactly one of --input-ids and --input-file")
    prompts = parse_prompts(args.input_ids) if args.input_ids is not None else read_prompts(args.input_file)
    check_input_dir(args.model, "--model")
    if args.output is not None:
        check_output_path(args.output, "--output", reads=files_read(args.model, args.input_file))
    return GenerateSpec(model_dir=args.model, prompts=prompts, max_new_tokens=args.max_new_tokens,
                        parallel=ParallelConfig(args.dp, args.tp, args.ep), quant=args.quant,
                        defer_input_quant=args.defer_input_quant, shared_quant=args.shared_quant, dtype=args.dtype,
                        backend=args.backend,
                        device=args.device, compare=args.compare,
                        prompts_from="--input-ids" if args.input_ids is not None else "--input-file")


# -- ranks ------------------------------------------------------------------------------------
def _light(result: GenerateRankResult) -> GenerateRankResult:
    """What rank 0 needs of a rank's result: the logits of TP rank 0 only (the others agree or
    are counted as disagreeing on their own rank)."""
    return replace(result, logits=None) if result.tp_rank != 0 else result


# -- output -----------------------------------------------------------------------------------
def files_read(model_dir: str, input_file: str | None) -> list[Path]:
    """Every file the run reads: the prompt file and the model directory's files (an output path
    must be none of them)."""
    files = [Path(input_file)] if input_file is not None else []
    directory = Path(model_dir)
    with contextlib.suppress(OSError):  # an unreadable directory was refused already
        files += sorted(f for f in directory.iterdir() if f.is_file())
    return files


def report(plan: GeneratePlan, results: list[GenerateRankResult], comparison: GenerateComparison | None,
           wall_s: float) -> dict:
    """The run as JSON-able data: the plan, every prompt and its new ids, per-rank figures, the comparison."""
    generated = by_prompt(plan, results)
    dp_of = {i: d for d, mine in enumerate(plan.dp_prompts) for i in mine}
    return {
        "run": describe(plan),
        "prompts": [{"input_ids": list(p), "generated_ids": list(g), "dp_rank": dp_of[i]}
                    for i, (p, g) in enumerate(zip(plan.spec.prompts, generated, strict=True))],
        "ranks": [{"rank": r.rank, "dp_rank": r.dp_rank, "tp_rank": r.tp_rank, "experts": list(r.experts),
                   "intermediate": list(r.intermediate), "expert_bytes": r.expert_bytes, "load_s": round(r.load_s, 4),
                   "generate_s": round(r.generate_s, 4), "tp_disagreements": r.tp_disagreements} for r in results],
        "comparison": comparison.to_json() if comparison is not None else None,
        "nonfinite_logits": [{"prompt": i, "step": step} for i, step in nonfinite_logits(results)],
        "wall_s": round(wall_s, 3),
    }


def _print(data: dict) -> None:
    run, out = data["run"], sys.stdout
    print(f"moeshard generate: {run['model_type']} {run['model']}", file=out)
    print(f"layout {run['layout']} ({run['world_size']} rank(s), {run['device']}), backend {run['backend']}, "
          f"quant {run['quant']}, dtype {run['dtype']}, {run['max_new_tokens']} new tokens per prompt", file=out)
    for r in data["ranks"]:
        print(f"  rank {r['rank']} (dp {r['dp_rank']}, tp {r['tp_rank']}): experts {r['experts'][0]}-"
              f"{r['experts'][1] - 1}, I {r['intermediate'][0]}:{r['intermediate'][1]}, "
              f"{r['expert_bytes'] / 2**20:.2f} MiB of experts, load {r['load_s']:.2f} s, "
              f"generate {r['generate_s']:.2f} s", file=out)
    for i, p in enumerate(data["prompts"]):
        print(f"prompt {i} (dp rank {p['dp_rank']}): {p['input_ids']} -> {p['generated_ids']}", file=out)
    c = data["comparison"]
    if c is not None:
        same = sum(c["same_ids"])
        print(f"vs transformers alone: same ids for {same} of {len(c['same_ids'])} prompt(s)"
              + ("" if same == len(c["same_ids"]) else f", first differing step per prompt {c['first_difference']}"),
              file=out)
        steps = ", ".join("-" if v is None else f"{v:.3g}" for v in c["step_max_abs_logit_diff"])
        line = f"max |logits - transformers' logits| per step: [{steps}] (max {c['max_abs_logit_diff']:.3g}); "
        if c["within_tolerance"] is None:
            line += (f"quant {c['quant']} against the unquantized model: this is its quantization error, "
                     f"reported, not judged by the tolerance table")
        else:
            line += (f"tolerance {run['dtype']} atol {c['tolerance']['atol']:g} rtol {c['tolerance']['rtol']:g}: "
                     f"{'within' if c['within_tolerance'] else 'EXCEEDED'}")
        print(line, file=out)
        if c["transformers_rounding_step_max_abs"] is not None:
            noise = ", ".join("-" if v is None else f"{v:.3g}" for v in c["transformers_rounding_step_max_abs"])
            print(f"for scale, transformers' own {run['dtype']} logits against its {c['noise_reference_dtype']} "
                  f"logits per step: [{noise}]", file=out)
        if c["within_rounding_noise"] is not None:
            print("every step beyond the table is within twice transformers' own float32 rounding (its largest "
                  "distance from float64 over these steps): "
                  + ("within (the difference is rounding order, not what is computed)" if c["within_rounding_noise"]
                     else "EXCEEDED"), file=out)
    if data["nonfinite_logits"]:
        print(f"warning: the logits held NaN/Inf at {len(data['nonfinite_logits'])} (prompt, step) pair(s) "
              f"(--allow-nonfinite): the ids chosen from them mean nothing", file=out)
    disagreements = sum(r["tp_disagreements"] for r in data["ranks"])
    if disagreements:
        print(f"warning: TP ranks' logits differed at {disagreements} step(s); TP rank 0's were used", file=out)
    print(f"wall time {data['wall_s']:.2f} s", file=out)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    timeout_s = timeout(args.timeout)
    plan = plan_generate(spec_from_args(args))
    results = execute(plan, generate_rank, generate_plans, timeout_s, light=_light)
    if results is None:  # a rank of torchrun's world other than 0
        return 0
    bad = nonfinite_logits(results)
    if bad and not args.allow_nonfinite:
        raise NonFiniteOutput(f"the logits hold NaN/Inf at {len(bad)} (prompt, step) pair(s), the first prompt "
                              f"{bad[0][0]} at step {bad[0][1]}: the ids greedy chose from them mean nothing; nothing written"
                              + (f" to {args.output!r}" if args.output is not None else "")
                              + " (--allow-nonfinite writes them anyway)")
    comparison = None
    if plan.spec.compare:
        fp32 = reference_generate(plan, dtype=torch.float32) if plan.dtype != torch.float32 else None
        reference = reference_generate(plan)
        comparison = compare_generations(plan, results, reference, fp32)
        if plan.dtype == torch.float32 and not plan.quant.quantized and comparison.within_tolerance is False:
            # Beyond the table: measure how far float32 rounding alone moves this model's logits
            # (transformers in float64 on the same contexts), and judge against that.
            comparison = compare_generations(plan, results, reference, reference_generate(plan, dtype=torch.float64))
    data = report(plan, results, comparison, time.perf_counter() - start)
    if args.output is not None:
        atomic_write_text(args.output, json_text(with_nulls(data)))  # a NaN figure: null, named under "nonfinite"
    _print(data)
    sys.stdout.flush()
    return exit_code(plan, results, comparison)


def exit_code(plan: GeneratePlan, results: list[GenerateRankResult], comparison: GenerateComparison | None) -> int:
    """1 when TP ranks disagreed, or when an unquantized float32 run differs from transformers
    (ids, or logits beyond both the table and twice transformers' own float32 rounding, which is
    measured against float64 only when the table is exceeded); else 0. bf16 / fp16 and quantized comparisons are reported,
    not judged: the table bounds one layer, and a whole model's logits in those dtypes move by
    more than that through rounding alone (the report prints transformers' own, for scale)."""
    if any(r.tp_disagreements for r in results):
        return 1
    if comparison is not None and plan.dtype == torch.float32 and not plan.quant.quantized:
        within = comparison.within_tolerance or comparison.within_noise
        return 0 if within and all(comparison.same_ids) else 1
    return 0
