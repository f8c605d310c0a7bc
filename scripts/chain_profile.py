"""The experts' kernels timed inside the whole call: each stage's GPU time where it runs after the
stages before it, with the gate_up GEMM ``select_config`` picks and with the other engine's.

``gluon_gate_up_study.py`` times the gate_up GEMM alone and the experts' whole call. Where the
two disagree (a gate_up faster alone but experts no faster), this says which kernel of the chain
took the time: for each model, token count and scheme it runs ``TritonExperts`` on the bench's
workload with the selected config and with its gate_up on the other kernel (the Gluon kernel at 4
stages where the Triton kernel is selected, the Triton kernel's tile where the Gluon kernel is;
the selected config alone for the schemes and tiles the Gluon gate_up does not take),
an L2 flush before every call as the bench does, under the CUDA profiler (eager launches: at
prefill a kernel runs for milliseconds, so launch gaps do not matter), in ``--rounds`` alternating
rounds. Records each kernel's GPU microseconds per call (the flush's own kernel included, so that
a slower flush after one variant shows too) and whether both variants gave the same bits.

    PYTHONPATH=src python3 scripts/chain_profile.py --models deepseek-v3 --tokens 4096,16384 --json F
"""

from __future__ import annotations

import dataclasses
import statistics

from moeshard.bench.study import experts_variants, routed_case, run_on_gpu, study_parser
from moeshard.bench.timing import kernel_times
from moeshard.kernels.configs import ExpertsConfig, multiprocessors, select_config
from moeshard.kernels.experts import gluon_supported
from moeshard.quant import get_scheme

MODELS = ("deepseek-v3", "qwen3-30b-a3b")
TOKENS = (4096, 16384)
SCHEMES = ("fp8_tensor", "fp8_token")


def variants(M: int, E: int, H: int, I: int, scheme: str, sms: int, gluon: bool) -> dict[str, ExpertsConfig]:  # noqa: E741
    """The configs profiled for M routed rows over E experts of hidden size H and intermediate
    size I: "chosen", as ``select_config`` picks it, and, at the per-row schemes' prefill tile
    (the one the Gluon gate_up computes), "other" with the gate_up on the other engine: the Gluon
    kernel (4 stages, whole tiles) on the Triton tile, or that Triton tile where the Gluon kernel
    was picked."""
    chosen = select_config(M, E, H, I, scheme, sms, gluon=gluon)
    configs = {"chosen": chosen}
    triton_tile = select_config(M, E, H, I, scheme, sms, gluon=False).gate_up
    gluon_tile = (triton_tile.block_m, triton_tile.block_n, triton_tile.block_k, triton_tile.num_warps,
                  triton_tile.fp8_acc) == (128, 128, 128, 8, "imprecise")
    if get_scheme(scheme).kernel_mode in (1, 2) and gluon_tile:
        other = triton_tile if chosen.gate_up.engine == "gluon" else \
            dataclasses.replace(triton_tile, engine="gluon", half_tiles=False, num_stages=4)
        configs["other"] = dataclasses.replace(chosen, gate_up=other)
    return configs


def study(name: str, model, tokens: int, scheme: str, flush, args) -> dict:
    case = routed_case(model, tokens, scheme)
    configs = variants(case.M, case.E, case.H, case.I, scheme, multiprocessors(case.device.index),
                       gluon_supported(case.device))
    rec: dict = {"model": name, "tokens": tokens, "scheme": scheme, "rows": case.M,
                 "gate_up": {key: config.gate_up.engine for key, config in configs.items()}}
    calls: dict = {}
    experts_variants(case, configs, calls, rec)
    rounds: dict[str, list[dict[str, float]]] = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, call in calls.items():
            def step(call=call) -> None:
                flush()
                call()
            rounds[key].append(dict(kernel_times(step, reps=args.reps)))
    rec["kernels_us"] = {}
    for key, per_round in rounds.items():
        names = sorted({k for r in per_round for k in r})
        rec["kernels_us"][key] = {k: [round(r.get(k, 0.0), 2) for r in per_round] for k in names}
    return rec


def line(rec: dict) -> str:
    out = [f"{rec['model']} T={rec['tokens']} {rec['scheme']} bits:{'same' if rec['same_bits']['experts'] else 'DIFFERENT'}"]
    for key, kernels in rec["kernels_us"].items():
        out.append(f"  {key} (gate_up {rec['gate_up'][key]}):")
        for k, v in sorted(kernels.items(), key=lambda kv: -statistics.median(kv[1])):
            out.append(f"    {statistics.median(v):10.1f} us  {v}  {k[:100]}")
    return "\n".join(out)


def main() -> None:
    ap = study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=5)
    run_on_gpu(ap.parse_args(), "scripts/chain_profile.py", study, line)


if __name__ == "__main__":
    main()
