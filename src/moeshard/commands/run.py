"""``moeshard run``: apply one MoE block of a real checkpoint (or random weights) to hidden states
under a (dp, tp, ep) layout, and write the output.

    moeshard run --model DIR --layer L --input IN.safetensors --output OUT.safetensors \\
                 [--dp D --tp T --ep] [--backend B] [--quant Q] [--defer-input-quant] \\
                 [--device cpu|cuda] [--tokens-per-rank 5,3] [--dtype bfloat16]
    moeshard run --random deepseek-v3 --seed 0 --tokens 64 --dp 2 --ep --output OUT.safetensors

IN holds ``hidden_states [T, H]``, all tokens; OUT gets ``hidden_states [T, H]``, the block's
output for every token in input order (plus ``input_hidden_states`` when the input was
generated from the seed). Ranks: ``dp * tp`` local processes (gloo on cpu, NCCL on cuda, one
GPU each), or, started under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT`` all set; some of them without the others is refused), this process is one
rank of torchrun's world, which must have ``dp * tp`` ranks; ``--timeout`` bounds its process
group's rendezvous and collectives.

Before any rank starts: the output path is checked (writable, not a directory, not a file the
run reads), the world size against the machine, the memory the run will need against what is
available. The output is written atomically. Exit codes as ``moeshard.errors``: a refusal 2, a
rank that fails or dies 4, one that times out 5, an output that cannot be written 6.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import cast

import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moeshard.commands.args import add_allow_nonfinite, add_layout_arguments, ints, seed, timeout
from moeshard.dispatch.registry import build_groups
from moeshard.errors import MoeshardError, NonFiniteOutput, OutputError, RankFailed
from moeshard.jobs.failures import as_value_error, rank_errors
from moeshard.jobs.run import RunPlan, RunRankResult, RunSpec, check_memory, describe, files_read, plan_run, run_plans, run_rank
from moeshard.jobs.world import check_same_spec
from moeshard.outputs import atomic_write, check_input_dir, check_input_file, check_output_path
from moeshard.parallel.capacity import available_memory, check_local_world
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.signals import in_process_deadline
from moeshard.parallel.spawn import RankFailure, spawn
from moeshard.parallel.torchrun import destroy, init_from_env, torchrun_environment
from moeshard.parallel.trace import TRACE_CAPACITY, CollectiveTrace, error_headline, last_collectives
from moeshard.presets import PRESETS

DEFAULT_TOKENS = 16  # tokens generated without --input, --tokens or --tokens-per-rank


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("run", help="apply a checkpoint's MoE block to hidden states under a layout",
                              description="Apply one MoE block of a Hugging Face checkpoint (or random weights) to "
                                          "hidden states under a (dp, tp, ep) layout and write the output.")
    src = p.add_argument_group("what runs")
    src.add_argument("--model", metavar="DIR", help="Hugging Face model directory (config.json + *.safetensors)")
    src.add_argument("--layer", type=int, metavar="L", help="decoder layer whose MoE block runs (with --model)")
    src.add_argument("--random", metavar="PRESET", choices=sorted(PRESETS),
                     help=f"random weights of a preset instead of a checkpoint: {', '.join(sorted(PRESETS))}")
    src.add_argument("--full", action="store_true", help="with --random: the preset's real size (default: small)")
    src.add_argument("--seed", type=int, default=0, help="seed of random weights and generated input (default 0)")
    io = p.add_argument_group("tokens")
    io.add_argument("--input", metavar="IN", help="safetensors file with hidden_states [T, H] (default: generated)")
    io.add_argument("--tokens", type=int, default=None, metavar="T",
                    help="tokens to generate without --input (default: the sum of --tokens-per-rank, else 16)")
    io.add_argument("--tokens-per-rank", metavar="N0,N1,...", help="tokens per DP rank (default: even split)")
    io.add_argument("--output", metavar="OUT", help="safetensors file to write hidden_states [T, H] to")
    add_allow_nonfinite(io, "an output holding NaN/Inf")
    add_layout_arguments(p, dtype_help="model dtype (default: the input's, else the checkpoint's)",
                         timeout_help="seconds the whole run may take (default 600; finite); under torchrun, the bound "
                                      "on the rendezvous and on every collective")
    p.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    """The ``RunSpec`` of parsed arguments (ValueError for combinations that make no sense, and
    for an ``--output`` that cannot be written or is a file the run reads)."""
    if args.full and args.random is None:
        raise ValueError("--full only applies to --random")
    if args.random is not None and args.model is not None:
        raise ValueError(f"give either --model or --random, not both (got --model {args.model!r}, --random {args.random!r})")
    split = None if args.tokens_per_rank is None else ints(args.tokens_per_rank, "--tokens-per-rank")
    if args.input is not None and args.tokens is not None:
        raise ValueError(f"--tokens {args.tokens} conflicts with --input {args.input!r}, which gives the tokens "
                         f"(all of its rows); give one of the two")
    num_tokens = args.tokens if args.tokens is not None else (sum(split) if split else DEFAULT_TOKENS)
    spec = RunSpec(parallel=ParallelConfig(args.dp, args.tp, args.ep), model_dir=args.model, layer=args.layer,
                   preset=args.random, preset_size="full" if args.full else "small", seed=seed(args.seed),
                   input_path=args.input, num_tokens=num_tokens, tokens_per_rank=split,
                   quant=args.quant, defer_input_quant=args.defer_input_quant, shared_quant=args.shared_quant,
                   dtype=args.dtype, backend=args.backend,
                   device=args.device)
    # After the options' own checks (RunSpec), before anything reads the files.
    if args.model is not None:
        check_input_dir(args.model, "--model")
    if args.input is not None:
        check_input_file(args.input, "--input")
    if args.output is not None:
        check_output_path(args.output, "--output", reads=files_read(spec))
    return spec


def _execute_local(plan: RunPlan, timeout_s: float) -> list[RunRankResult]:
    world = plan.parallel.world_size
    if world == 1:
        with in_process_deadline(timeout_s, "rank 0 (in this process)"):
            return [run_rank(plan, None)]
    # Each rank records the collectives it enters (a few microseconds each); read only on failure.
    traces = [CollectiveTrace.shared(TRACE_CAPACITY) for _ in range(world)]
    try:
        per_rank = spawn(run_plans, world, args=([plan], traces), device=plan.spec.device, timeout_s=timeout_s)
    except RankFailure as failure:
        raise as_value_error(failure, traces, plan.parallel) from None
    results = [r[0] for r in per_rank]
    rank_errors(results, traces, plan.parallel)
    return results


def _execute_torchrun(plan: RunPlan, timeout_s: float) -> list[RunRankResult] | None:
    """Runs as one rank of torchrun's world; returns every rank's result on rank 0, None elsewhere.
    ``timeout_s`` bounds the rendezvous and every collective. A rank that fails otherwise than
    by refusing its input says which collectives it entered last (no parent is there to diff
    the ranks' traces: each rank's line is in torchrun's output)."""
    init_from_env(backend="nccl" if plan.spec.device == "cuda" else "gloo", timeout_s=timeout_s)
    trace = CollectiveTrace(TRACE_CAPACITY)
    try:
        check_same_spec(plan.spec)
        plan.parallel.validate_world_size(dist.get_world_size(), rank=dist.get_rank())
        result = run_rank(plan, build_groups(plan.parallel, plan.spec.device, [plan.backend], trace=trace))
        reports: list[RunRankResult | None] = [None] * dist.get_world_size()
        light = replace(result, output=None)
        dist.all_gather_object(reports, light)  # our own small dataclasses, between our own ranks
        if dist.get_rank() != 0:
            return None
        # all_gather_object filled every entry with a rank's report
        return [result] + cast("list[RunRankResult]", reports[1:])
    except (ValueError, MoeshardError):
        raise
    except Exception as exc:
        raise RankFailed(f"rank {dist.get_rank()} raised {type(exc).__name__}: {error_headline(str(exc))}; "
                         f"its last collectives: {last_collectives(trace)}") from exc
    finally:
        destroy()


def _write(path: str, plan: RunPlan, output: torch.Tensor) -> None:
    """Writes the output file atomically, then reads its header back (a writer that fails
    silently, on a full disk say, leaves a file whose header does not cover it)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    from moeshard.jobs.run import random_hidden_states

    tensors = {"hidden_states": output.contiguous()}
    if plan.generated_input:
        tensors["input_hidden_states"] = random_hidden_states(plan.total_tokens, plan.cfg.hidden_size,
                                                              plan.spec.seed, plan.cfg.dtype)

    def write(tmp: str) -> None:
        try:
            save_file(tensors, tmp, metadata={"moeshard_run": json.dumps(describe(plan))})
        except SafetensorError as exc:  # safetensors' own I/O errors (a full disk) are not OSErrors
            raise OutputError(f"cannot write {path!r}: {exc}") from None
        try:
            with safe_open(tmp, "pt") as f:
                complete = set(f.keys()) == set(tensors)
        except SafetensorError as exc:
            raise OutputError(f"cannot write {path!r}: the file written is incomplete ({exc})") from None
        if not complete:
            raise OutputError(f"cannot write {path!r}: the file written is incomplete")

    atomic_write(path, write)


def _summary(plan: RunPlan, results: list[RunRankResult], output_path: str | None, wall_s: float) -> None:
    console = Console(highlight=False)
    info = describe(plan)
    console.print(f"[bold]moeshard run[/bold]: {escape(info['source'])}")
    console.print(f"layout {info['layout']} ({plan.parallel.world_size} rank(s), {info['device']}), backend "
                  f"{info['backend']}, quant {info['quant']}, dtype {info['dtype']}")
    console.print(f"tokens {plan.total_tokens}" + (" (generated from the seed)" if plan.generated_input else "")
                  + f", per DP rank [{info['tokens_per_dp_rank']}]")
    table = Table(show_header=True, header_style="bold")
    for col in ("rank", "dp", "tp", "tokens", "experts", "I slice", "load s", "forward s"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r.rank), str(r.dp_rank), str(r.tp_rank), str(r.tokens), f"{r.experts[0]}-{r.experts[1] - 1}",
                      f"{r.intermediate[0]}:{r.intermediate[1]}", f"{r.load_s:.3f}", f"{r.forward_s:.4f}")
    console.print(table)
    out = results[0].output
    assert out is not None  # rank 0's result holds the output of all T tokens
    where = output_path if output_path is not None else "not written (no --output)"
    console.print(f"output {escape(where)}: hidden_states {list(out.shape)} {str(out.dtype).removeprefix('torch.')}")
    console.print(f"wall time {wall_s:.2f} s")


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    timeout_s = timeout(args.timeout)
    torchrun = torchrun_environment()
    spec = spec_from_args(args)
    if not torchrun:  # before plan_run: a world the machine cannot hold is refused at once
        check_local_world(spec.parallel.world_size, spec.device, what="--dp x --tp")
    plan = plan_run(spec)
    if torchrun:
        results = _execute_torchrun(plan, timeout_s)
        if results is None:
            return 0
    else:
        check_memory(plan, available_memory())
        results = _execute_local(plan, timeout_s)
    output = results[0].output
    assert output is not None  # rank 0's result holds the output of all T tokens
    bad = output.numel() - int(torch.isfinite(output).sum())
    if bad and not args.allow_nonfinite:
        raise NonFiniteOutput(f"the output holds {bad} NaN/Inf value(s) of {output.numel()} (first at row "
                              f"{int((~torch.isfinite(output)).any(dim=1).nonzero()[0])}); nothing written"
                              + (f" to {args.output!r}" if args.output is not None else "")
                              + " (--allow-nonfinite writes it anyway)")
    if args.output is not None:
        _write(args.output, plan, output)
    _summary(plan, results, args.output, time.perf_counter() - start)
    sys.stdout.flush()
    return 0
