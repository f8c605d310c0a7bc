"""What the tile plan costs a decode step's experts inside their chain of kernels (one GPU).

    PYTHONPATH=src python3 scripts/plan_chain_study.py [--models ...] [--tokens 1,2,4,16]
        [--schemes fp8_tensor,fp8_block] [--rounds 3] [--reps 40] [--json FILE]

The plan's own kernel runs a few microseconds, but the launches after it wait on it. This times
``TritonExperts`` on the bench's routed rows (CUDA graphs, the bench's L2 flush before every
repetition, alternating rounds: ``bench.study.time_variants``) with ``select_config``'s config
(``shipped``: one token's rows on the direct plan, ``ExpertsConfig.direct``) and with one thing
changed:

* ``sorted``: the sorted plan of ``align_rows`` whatever the token count (``direct`` off);
* ``sorted_plan_ahead``: that plan handed in, made before the timed call; the buffers the plan
  kernel zeroes (the per-expert amax, the row maxima) are zeroed by memsets instead;
* ``pdl_off``: no kernel of the chain under programmatic dependent launch.

Every variant's output is checked to be the shipped call's bits.
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.bench.study import bits_line, plan_made_ahead, routed_case, run_on_gpu, study_parser, time_variants
from moeshard.kernels.configs import gpu_kind, multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts, gluon_supported
from moeshard.kernels.pdl import supported as pdl_supported

SCRIPT = "scripts/plan_chain_study.py"


def study(name: str, model, tokens: int, scheme: str, flush, args) -> dict:
    case = routed_case(model, tokens, scheme)
    device = case.device
    shipped = select_config(case.M, case.E, case.H, case.I, scheme, multiprocessors(device.index),
                            pdl=pdl_supported(device), gluon=gluon_supported(device), gpu=gpu_kind(device.index))
    configs = {"shipped": shipped, "sorted": dataclasses.replace(shipped, direct=False, quantize_in_down=False, gemv=None),
               "pdl_off": dataclasses.replace(shipped, pdl="off")}
    kernels = {k: TritonExperts(case.cfg.activation, case.cfg.dtype, c) for k, c in configs.items()}
    calls = {k: (lambda kernel=kernel: kernel(case.inp, case.experts)) for k, kernel in kernels.items()}
    calls["sorted_plan_ahead"] = plan_made_ahead(calls["sorted"])
    want = calls["shipped"]()
    rec = {"model": name, "tokens": tokens, "scheme": scheme, "rows": case.M, "pdl": shipped.pdl,
           "direct": shipped.direct and case.inp.repeat == case.M,
           "same_bits": {k: torch.equal(fn(), want) for k, fn in calls.items() if k != "shipped"}}
    return time_variants(rec, calls, flush, args)


def main() -> None:
    args = study_parser(__doc__, ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b"), (1, 2, 4, 16),
                        ("fp8_tensor", "fp8_block"), reps=40).parse_args()
    run_on_gpu(args, SCRIPT, study, bits_line)


if __name__ == "__main__":
    main()
