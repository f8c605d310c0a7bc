"""The layer with its input's quantization on a side stream while it routes, against the same
layer making it at dispatch (``MoELayer.overlap_payload`` on and off), at the bench's shapes.

    PYTHONPATH=src python3 scripts/payload_overlap_study.py [--models ...] [--quants ...]
        [--tokens 1,128,4096,16384] [--json FILE]

Both layers are built as ``moeshard bench`` builds its layer (the preset's full-size block, the
bench's seeds, the same quantized experts), each forward captured in a CUDA graph and timed after
the bench's L2 flush (median of --reps), the two alternating over --rounds
(``bench.timing.alternating_medians``). The experts' own time (the kernel on the routed rows, as
the bench's "experts") is timed beside them, so each line also gives experts / layer. Each case
checks that the two layers' outputs are the same bits.
"""

from __future__ import annotations

import argparse
import gc

import torch

from moeshard.bench.study import write_study
from moeshard.bench.timing import L2Flush, alternating_medians
from moeshard.bench.workload import experts_for, hidden_states, make_model, routed_input
from moeshard.config import QuantConfig
from moeshard.kernel_choice import select_kernel
from moeshard.layer import MoELayer


def scheme_cases(model, scheme: str, tokens: list[int], args, flush: L2Flush) -> list[dict]:
    """Both layers and the experts at every token count, for one scheme of one model."""
    dev = model.gate_up.device
    experts = experts_for(model, scheme)
    kernel = select_kernel(model.cfg.activation, model.cfg.dtype, dev, scheme)
    layers = {}
    for overlap in (True, False):
        layer = MoELayer(model.cfg, QuantConfig(scheme), weights=model.shell, local_experts=experts, device=dev)
        layer.overlap_payload = overlap
        layers[overlap] = layer
    rows = []
    for T in tokens:
        x = hidden_states(model, T, args.seed + T)  # the bench's tokens for this count
        inp, _ = routed_input(model, x, QuantConfig(scheme))
        same = torch.equal(layers[True](x), layers[False](x))
        calls = {"overlap": lambda x=x: layers[True](x), "serial": lambda x=x: layers[False](x),
                 "experts": lambda inp=inp: kernel(inp, experts)}
        times, med = alternating_medians(calls, rounds=args.rounds, reps=args.reps, flush=flush)
        rows.append({"model": model.name, "quant": scheme, "tokens": T, "same_bits": same,
                     **{f"{k}_ms": v for k, v in med.items()}, "rounds_ms": times})
        print(f"{model.name:14} {scheme:10} T={T:6d} layer overlap {1000 * med['overlap']:9.1f} us, serial "
              f"{1000 * med['serial']:9.1f} us ({100 * (med['overlap'] / med['serial'] - 1):+.1f}%); experts "
              f"{1000 * med['experts']:9.1f} us: experts / layer {100 * med['experts'] / med['overlap']:.1f}% "
              f"against {100 * med['experts'] / med['serial']:.1f}%{'' if same else '  DIFFERENT BITS'}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    ap.add_argument("--quants", default="fp8_tensor,fp8_token,fp8_block")
    ap.add_argument("--tokens", default="1,128,4096,16384")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = L2Flush(dev)
    tokens = [int(t) for t in args.tokens.split(",")]
    results = []
    for name in args.models.split(","):
        model = make_model(name, dev, args.seed)
        for scheme in args.quants.split(","):
            results += scheme_cases(model, scheme, tokens, args, flush)
            gc.collect()
            torch.cuda.empty_cache()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        write_study(args.json, "scripts/payload_overlap_study.py", args, results)


if __name__ == "__main__":
    main()
