"""The tile plan in one program against the three-kernel plan, side by side in one process (GPU).

``align_rows`` builds the plan of at most ``ONE_PROGRAM_ROWS`` routed rows in one program. This
times both plans on the same ids (CUDA graphs, an L2 flush before every repetition) at the row
counts decode steps give (top-k times 1 to 16 tokens) and the experts' expert counts, then the
fp8_tensor experts of full-size models at those token counts with either plan, each timed in
alternating rounds (medians reported, every round kept), so that the choice of
``ONE_PROGRAM_ROWS`` rests on a measurement of one run (times of separate runs on separately
lent GPUs differ by a few percent).

    PYTHONPATH=src python3 scripts/plan_study.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from moeshard.bench.timing import L2Flush, graph_median_ms
from moeshard.bench.workload import experts_for, hidden_states, make_model, routed_input
from moeshard.config import QuantConfig
from moeshard.kernels import align
from moeshard.kernels.experts import TritonExperts

ROWS = (2, 8, 32, 64, 128)
EXPERTS = (8, 128, 256)
MODELS = (("mixtral-8x7b", (1, 16)), ("qwen3-30b-a3b", (1, 16)), ("deepseek-v3", (1, 16)))


def _ms(fn, flush: L2Flush, reps: int = 50) -> float:
    return graph_median_ms(fn, reps=reps, flush=flush, warmup=3)


ROUNDS = 3  # each plan timed this many times, alternating, so that drift favours neither


def _both(fn, flush: L2Flush) -> dict:
    """fn timed with the one-program plan (as shipped) and with the three-kernel plan, ROUNDS
    times each in alternation (one, three, three, one, ...): the median of each, and every round."""
    saved = align.ONE_PROGRAM_ROWS
    rounds: dict[str, list[float]] = {"one_program": [], "three_kernels": []}
    try:
        for r in range(ROUNDS):
            for plan in (("one_program", "three_kernels") if r % 2 == 0 else ("three_kernels", "one_program")):
                align.ONE_PROGRAM_ROWS = saved if plan == "one_program" else 0
                rounds[plan].append(_ms(fn, flush))
    finally:
        align.ONE_PROGRAM_ROWS = saved
    return {**{f"{k}_ms": statistics.median(v) for k, v in rounds.items()}, "rounds_ms": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    flush = L2Flush(device)
    out: list[dict] = []
    for E in EXPERTS:
        for M in ROWS:
            ids = torch.randint(0, E, (M,), device=device)
            rec = {"stage": "align_rows", "rows": M, "experts": E, "block_m": 16,
                   **_both(lambda ids=ids, E=E: align.align_rows(ids, E, 16), flush)}
            print(rec, flush=True)
            out.append(rec)
    for name, token_counts in MODELS:
        model = make_model(name, device)
        experts = experts_for(model, "fp8_tensor")
        kernel = TritonExperts(model.cfg.activation, model.cfg.dtype)
        for tokens in token_counts:
            inp, _ = routed_input(model, hidden_states(model, tokens, tokens), QuantConfig("fp8_tensor"))
            rec = {"stage": "experts fp8_tensor", "model": name, "tokens": tokens, "rows": inp.num_rows,
                   **_both(lambda inp=inp, kernel=kernel, experts=experts: kernel(inp, experts), flush)}
            print(rec, flush=True)
            out.append(rec)
        del model, experts, kernel
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
