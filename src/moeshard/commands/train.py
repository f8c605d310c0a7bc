"""``moeshard train``: a few optimizer steps of a whole transformers MoE model under a (dp, tp, ep)
layout, its MoE blocks run by moeshard, each rank holding only its slices of the experts.

    moeshard train --model DIR --input-ids "3,17,42;5,6,7" --steps 4 --lr 0.05 --optimizer sgd|adamw \\
                   [--lr-schedule linear --warmup-steps 1] [--max-grad-norm 1.0] [--micro-batches 2] \\
                   [--dp D --tp T --ep] [--backend B] [--dtype bf16] [--device cpu|cuda] [--compare] \\
                   [--output OUT.json] [--save DIR] [--resume]

Every step trains on the whole batch (the prompts, split over the DP ranks as ``moeshard
generate`` splits them): transformers' loss of the model and its config (the mean next-token
cross entropy over every predicted token of the global batch, plus the load-balancing loss where
the config turns it on), one backward (one per micro-batch with ``--micro-batches``),
``reduce_gradients``, clipping (``--max-grad-norm``), one optimizer step and one step of the
learning-rate schedule on every rank. ``--compare`` also trains the same model with transformers
alone on one device (fp32, the same micro-batches, optimizer, schedule, clipping and steps) and
reports the losses' relative differences, the gradient norm's, and the largest parameter
difference after the last step. ``--save`` writes the trained model as a Hugging Face checkpoint
(``checkpoint.writer``) with the optimizer state beside it, whole (``DIR/optimizer/``,
``training.optimizer_state``); ``--resume`` trains such a directory on from that state under any
layout (the same optimizer), its learning-rate schedule from the step it reached.
Ranks: ``dp * tp`` local processes (gloo on cpu, NCCL on cuda, one GPU each), or, under
torchrun, this process is one rank of torchrun's world.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch

from moeshard.checkpoint.writer import RankState, save_checkpoint
from moeshard.commands.args import add_allow_nonfinite, add_layout_arguments, timeout
from moeshard.commands.generate import files_read, parse_prompts, read_prompts
from moeshard.config import dtype_name
from moeshard.errors import NonFiniteOutput
from moeshard.finite import json_text, nonfinite_fields, with_nulls
from moeshard.jobs.train import (
    OPTIMIZERS,
    SCHEDULES,
    TrainComparison,
    TrainPlan,
    TrainRankResult,
    TrainSpec,
    against_exact,
    compare_training,
    describe,
    global_losses,
    plan_train,
    reference_train,
    tp_loss_spread,
    train_plans,
    train_rank,
)
from moeshard.jobs.world import execute
from moeshard.outputs import atomic_write_text, check_input_dir, check_output_dir, check_output_path
from moeshard.parallel.config import ParallelConfig
from moeshard.tolerances import TRAIN_ROUNDING_FACTOR
from moeshard.training import optimizer_state
from moeshard.training.optimizer_state import OptimizerMeta


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="a few optimizer steps of a whole transformers MoE model under a layout",
                              description="Optimizer steps of a Hugging Face MoE model (Mixtral, Qwen2-MoE, "
                                          "Qwen3-MoE, DeepSeek-V3, ...) with its MoE blocks run by moeshard under a "
                                          "(dp, tp, ep) layout; --compare trains it with transformers alone too.")
    src = p.add_argument_group("what trains")
    src.add_argument("--model", metavar="DIR", required=True,
                     help="Hugging Face model directory (config.json + *.safetensors)")
    src.add_argument("--input-ids", metavar="IDS",
                     help="the training batch: token ids, comma-separated; prompts separated by ';'")
    src.add_argument("--input-file", metavar="PATH",
                     help="the batch from a file: JSON (a list of ids, or a list of lists) or one prompt per line")
    src.add_argument("--steps", type=int, default=4, metavar="N", help="optimizer steps, each on the whole batch (4)")
    src.add_argument("--lr", type=float, default=5e-5, help="learning rate, the schedule's peak (default 5e-5, the "
                                                                "Trainer's)")
    src.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                     help="sgd: torch.optim.SGD(lr), no momentum; adamw (default): torch.optim.AdamW(lr, "
                          "betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0), transformers' TrainingArguments "
                          "defaults (adam_beta1, adam_beta2, adam_epsilon, weight_decay)")
    src.add_argument("--lr-schedule", choices=SCHEDULES, default="constant",
                     help="the learning rate over the steps, as transformers.get_scheduler builds it: constant "
                          "(default), constant_with_warmup, linear (decayed to 0 at the last step; the Trainer's "
                          "default) or cosine")
    src.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                     help="steps of linear warmup from 0 to --lr (schedules other than constant; default 0)")
    src.add_argument("--max-grad-norm", type=float, default=None, metavar="X",
                     help="clip each step's gradients to this global norm, every parameter counted once (the "
                          "Trainer's max_grad_norm, 1.0 by default there); default: no clipping")
    src.add_argument("--micro-batches", type=int, default=1, metavar="M",
                     help="split each DP rank's prompts into M micro-batches, accumulating their gradients "
                          "before each step (default 1: the whole batch in one forward)")
    src.add_argument("--output", metavar="OUT", help="write the losses, the gradient norm (and the comparison) as JSON")
    src.add_argument("--save", metavar="DIR",
                     help="save the trained model to DIR (created; never an existing path) as a Hugging Face "
                          "checkpoint, by transformers' save_pretrained, with the checkpoint's tokenizer files and "
                          "the optimizer state, whole (DIR/optimizer/)")
    src.add_argument("--resume", action="store_true",
                     help="go on from the optimizer state a --save wrote with --model, under any layout, with the same "
                          "optimizer (the schedule from the step it reached)")
    src.add_argument("--compare", action="store_true",
                     help="also train with transformers alone on one device (fp32) and report the differences")
    add_allow_nonfinite(src, "losses or a gradient norm holding NaN/Inf (in --output a NaN figure is null, named "
                             "under \"nonfinite\")")
    add_layout_arguments(p, dtype_help="model dtype (default: the checkpoint's)",
                         timeout_help="seconds the ranks may take (default 600)")
    p.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace) -> TrainSpec:
    """The ``TrainSpec`` of parsed arguments (ValueError for combinations that make no sense)."""
    if (args.input_ids is None) == (args.input_file is None):
        raise ValueError("give exactly one of --input-ids and --input-file")
    if args.defer_input_quant:
        raise ValueError("--defer-input-quant: train runs quant none (quantized experts have no backward), which "
                         "quantizes no activation to defer")
    if args.shared_quant != "none":
        raise ValueError(f"--shared-quant {args.shared_quant}: train runs quant none (quantized experts have no "
                         f"backward), shared experts included")
    prompts = parse_prompts(args.input_ids) if args.input_ids is not None else read_prompts(args.input_file)
    check_input_dir(args.model, "--model")
    if args.output is not None:
        check_output_path(args.output, "--output", reads=files_read(args.model, args.input_file))
    if args.save is not None:
        check_output_dir(args.save, "--save", reads=[args.model])
    return TrainSpec(model_dir=args.model, prompts=prompts, steps=args.steps, lr=args.lr, optimizer=args.optimizer,
                     schedule=args.lr_schedule, warmup_steps=args.warmup_steps, max_grad_norm=args.max_grad_norm,
                     micro_batches=args.micro_batches, save_dir=args.save, resume=args.resume,
                     parallel=ParallelConfig(args.dp, args.tp, args.ep), quant=args.quant, dtype=args.dtype,
                     backend=args.backend, device=args.device, compare=args.compare,
                     prompts_from="--input-ids" if args.input_ids is not None else "--input-file")


# -- ranks ------------------------------------------------------------------------------------
# -- output -----------------------------------------------------------------------------------
def report(plan: TrainPlan, results: list[TrainRankResult], comparison: TrainComparison | None,
           wall_s: float) -> dict:
    """The run as JSON-able data: the plan, the losses, the last gradient norm, per-rank figures,
    the comparison."""
    return {
        **describe(plan),
        "losses": global_losses(plan, results),
        "aux_losses": list(results[0].aux_losses) if results[0].aux_losses is not None else None,
        "grad_norm": results[0].grad_norm,
        "learning_rates": list(results[0].learning_rates),
        "tp_loss_spread": tp_loss_spread(results),
        "prompts": [{"input_ids": list(p), "dp_rank": d} for d, mine in enumerate(plan.dp_prompts)
                    for p in (plan.spec.prompts[i] for i in mine)],
        "ranks": [{"rank": r.rank, "dp_rank": r.dp_rank, "tp_rank": r.tp_rank, "experts": list(r.experts),
                   "intermediate": list(r.intermediate), "expert_bytes": r.expert_bytes, "load_s": round(r.load_s, 4),
                   "train_s": round(r.train_s, 4), "grad_norm": r.grad_norm} for r in results],
        "comparison": comparison.to_json() if comparison is not None else None,
        "wall_s": round(wall_s, 3),
    }


def _figures(values) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"


def _schedule(data: dict) -> str:
    """The schedule and clipping in a few words: "linear, 2 warmup steps, clipped at 1"."""
    words = [data["lr_schedule"]]
    if data["warmup_steps"]:
        words.append(f"{data['warmup_steps']} warmup step(s)")
    words.append(f"clipped at {data['max_grad_norm']:g}" if data["max_grad_norm"] is not None else "no clipping")
    if data.get("resumed_after_step") is not None:
        words.append(f"resumed after step {data['resumed_after_step']} of a {data['resumed_from_layout']} run")
    return ", ".join(words)


def _print(data: dict, nonfinite: int) -> None:
    """The summary of ``report``'s data (NaN figures print as nan); nonfinite: how many of them."""
    out = sys.stdout
    opt = data["optimizer"]
    print(f"moeshard train: {data['model_type']} {data['model']}", file=out)
    print(f"layout {data['layout']} ({data['world_size']} rank(s), {data['device']}), backend {data['backend']}, "
          f"dtype {data['dtype']}, {opt['name']} lr {opt['lr']:g} ({_schedule(data)}), {data['steps']} step(s) on "
          f"{len(data['prompts'])} prompt(s)"
          + (f" in {data['micro_batches']} micro-batches" if data["micro_batches"] > 1 else "")
          + f", {data['tokens']} predicted tokens"
          + (f", load-balancing loss x {data['aux_loss_coef']:g}" if data["aux_loss_coef"] is not None else ""),
          file=out)
    for r in data["ranks"]:
        print(f"  rank {r['rank']} (dp {r['dp_rank']}, tp {r['tp_rank']}): experts {r['experts'][0]}-"
              f"{r['experts'][1] - 1}, I {r['intermediate'][0]}:{r['intermediate'][1]}, "
              f"{r['expert_bytes'] / 2**20:.2f} MiB of experts, load {r['load_s']:.2f} s, train {r['train_s']:.2f} s",
              file=out)
    if data["lr_schedule"] != "constant":
        print(f"learning rate of each step: {_figures(data['learning_rates'])}", file=out)
    print(f"loss before each step: {_figures(data['losses'])}", file=out)
    if data["aux_losses"] is not None:
        print(f"  of which load-balancing loss (before the coefficient): {_figures(data['aux_losses'])}", file=out)
    print(f"gradient norm at the last step: {data['grad_norm']:.6g}"
          + (" (before clipping)" if data["max_grad_norm"] is not None else ""), file=out)
    c = data["comparison"]
    if c is not None:
        print(f"transformers alone (one device, float32): loss {_figures(c['transformers_losses'])}", file=out)
        verdict = (f"{data['dtype']} against float32: reported, not judged" if c["within_tolerance"] is None
                   else f"tolerance {c['tolerance_rel']:g}: " + ("within" if c["within_tolerance"] else "EXCEEDED"))
        print(f"relative loss difference per step: [{', '.join(f'{v:.2g}' for v in c['loss_rel_diff'])}] "
              f"(max {c['max_loss_rel_diff']:.2g}; {verdict})", file=out)
        if c["loss_rel_diff_float64"] is not None:
            exact = ", ".join(f"{v:.2g}" for v in c["loss_rel_diff_float64"])
            noise = ", ".join(f"{v:.2g}" for v in c["transformers_float32_vs_float64_loss_rel"])
            print(f"transformers alone in float64: loss {_figures(c['transformers_float64_losses'])}", file=out)
            print(f"relative loss difference from float64 per step: [{exact}]; transformers' own float32 run's: "
                  f"[{noise}]; every step within {c['tolerance_rel']:g} + {TRAIN_ROUNDING_FACTOR:g} x that: "
                  + ("within (the difference is rounding order, not what is computed)" if c["within_rounding_noise"]
                     else "EXCEEDED"), file=out)
        print(f"transformers' gradient norm {c['transformers_grad_norm']:.6g} (relative difference "
              f"{c['grad_norm_rel_diff']:.2g})", file=out)
        print(f"largest |parameter - transformers'| after the last step: {c['max_abs_param_diff']:.3g} "
              f"({c['param_diff_at']}; {c['params_compared']} parameter copies compared)", file=out)
    if data["tp_loss_spread"]:
        print(f"warning: the TP ranks of a DP rank computed losses differing by up to {data['tp_loss_spread']:.3g}",
              file=out)
    if nonfinite:
        print(f"warning: {nonfinite} figure(s) are NaN/Inf (--allow-nonfinite): the steps after the "
              f"first of them mean nothing", file=out)
    print(f"wall time {data['wall_s']:.2f} s", file=out)


def _nonfinite(plan: TrainPlan, results: list[TrainRankResult]) -> list[tuple[str, str]]:
    """Where the losses, the load-balancing losses or the gradient norm hold NaN/Inf."""
    figures = {"losses": global_losses(plan, results), "grad_norm": results[0].grad_norm,
               "aux_losses": list(results[0].aux_losses or [])}
    return nonfinite_fields(figures)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    timeout_s = timeout(args.timeout)
    plan = plan_train(spec_from_args(args))
    results = execute(plan, train_rank, train_plans, timeout_s)
    if results is None:  # a rank of torchrun's world other than 0
        return 0
    bad = _nonfinite(plan, results)
    if bad and not args.allow_nonfinite:
        shown = ", ".join(f"{name} = {value}" for name, value in bad[:3])
        raise NonFiniteOutput(f"training diverged: {len(bad)} figure(s) are NaN/Inf ({shown}); nothing written"
                              + (f" to {args.output!r}" if args.output is not None else "")
                              + " (a smaller --lr; --allow-nonfinite writes them anyway)")
    comparison = None
    if plan.spec.compare:
        reference = reference_train(plan)
        comparison = compare_training(plan, results, reference)
        if plan.dtype == torch.float32 and comparison.within_tolerance is False:
            # Beyond the tolerance: measure how far float32 rounding alone moves this training
            # (transformers in float64, the same steps), and judge against float64 allowing for it.
            # (Within the tolerance of the float32 run is within that bound too: train_bound.)
            exact = reference_train(plan, dtype=torch.float64)
            comparison = against_exact(comparison, plan, results, reference, exact)
    saved = None
    if plan.spec.save_dir is not None:
        ranks = [RankState(r.rank, r.params or {}, r.shards, r.buffers or {}) for r in results]
        p = plan.parallel
        states = {r.rank: r.optimizer_state or {} for r in results}
        meta = OptimizerMeta(layout=p.name, world_size=p.world_size, backend=plan.backend, optimizer=plan.spec.optimizer,
                             steps_done=plan.steps_before + plan.spec.steps, dtype=dtype_name(plan.dtype))
        saved = save_checkpoint(plan.spec.model_dir, plan.cfg, ranks, plan.spec.save_dir,
                                also=optimizer_state.whole_writer(plan.spec.model_dir, plan.cfg, ranks, states, meta))
    light = [replace(r, params=None, buffers=None, optimizer_state=None) for r in results]  # not reported
    data = report(plan, light, comparison, time.perf_counter() - start)
    written = with_nulls(data)  # a NaN figure: null, named under "nonfinite"
    if args.output is not None:
        atomic_write_text(args.output, json_text(written))
    _print(data, len(written.get("nonfinite", [])))
    if saved is not None:
        print(f"saved the trained model ({saved} trained parameters) to {plan.spec.save_dir}")
    sys.stdout.flush()
    return exit_code(plan, comparison)


def exit_code(plan: TrainPlan, comparison: TrainComparison | None) -> int:
    """1 when a float32 run's loss differs from transformers' by more than the tolerance
    (``tolerances.TRAIN_LOSS_RTOL``, relative) at some step, and from transformers' float64 run
    (measured only then) by more than ``tolerances.train_bound`` of transformers' own float32
    distance from it at some step; else 0. Other dtypes are compared with an fp32 reference:
    reported, not judged."""
    if comparison is not None and plan.dtype == torch.float32:
        return 0 if comparison.within_tolerance or comparison.within_noise else 1
    return 0
