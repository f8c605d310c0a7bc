"""Programmatic dependent launch for the experts' kernels: what it saves, with and without the
weight prefetch, against the same tiles launched one after another.

At decode the experts are four short kernels in a row (tile plan, gate_up, quantize_h, down), and
each launch waits for the one before to finish. With PDL (``moeshard.kernels.pdl``) a kernel's
programs become resident while the kernel ahead finishes, and a weight-streaming GEMM may ask L2
for the first ``prefetch_bytes`` of each of its weight rows before it waits. For each model,
token count and scheme this times the whole ``TritonExperts`` call on the bench's workload
(``moeshard.bench.workload``, CUDA graphs, an L2 flush before every repetition) with the tiles
``select_config`` picks: launched serially, under PDL without the prefetch, and under PDL with
each prefetch size asked for, in alternating rounds so that drift is not read as a difference.
Every variant's output must equal the serial one bit for bit.

    PYTHONPATH=src python3 scripts/pdl_study.py --json results/h200/pdl_study.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from moeshard.bench.timing import L2Flush, graphed, time_cuda
from moeshard.bench.workload import experts_for, hidden_states, make_model, routed_input
from moeshard.config import QuantConfig
from moeshard.kernels.configs import ExpertsConfig, multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts

MODELS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")
TOKENS = (1, 16, 128, 4096)
SCHEMES = ("none", "fp8_tensor", "fp8_token", "fp8_block")
PREFETCH = (256, 512, 1024, 2048)


def _ms(fn, flush, reps: int) -> float:
    g = graphed(fn)
    try:
        return time_cuda(g, warmup=2, reps=reps, flush=flush).median_ms
    finally:
        g.release()


def variants(sel: ExpertsConfig, prefetch: tuple[int, ...]) -> dict[str, ExpertsConfig]:
    """serial, pdl, and pdl with each prefetch size where the tiles stream weights through pointers."""
    plain = ExpertsConfig(dataclasses.replace(sel.gate_up, prefetch_bytes=0),
                          dataclasses.replace(sel.down, prefetch_bytes=0))
    out = {"serial": plain, "pdl": dataclasses.replace(plain, pdl=True)}
    if not (sel.gate_up.tma or sel.down.tma) and sel.gate_up.block_m <= 64:
        for b in prefetch:
            out[f"pdl_pf{b}"] = ExpertsConfig(dataclasses.replace(sel.gate_up, prefetch_bytes=b),
                                              dataclasses.replace(sel.down, prefetch_bytes=b), pdl=True)
    return out


def study(name: str, tokens: int, scheme: str, model, experts, flush, rounds: int, reps: int,
          prefetch: tuple[int, ...]) -> dict:
    cfg = model.cfg
    device = model.gate_up.device
    x = hidden_states(model, tokens, tokens)
    inp, _ = routed_input(model, x, QuantConfig(scheme))
    M, E, H, I = inp.num_rows, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    sel = select_config(M, E, H, I, scheme, multiprocessors(device.index), pdl=True)
    kernels = {k: TritonExperts(cfg.activation, cfg.dtype, ec) for k, ec in variants(sel, prefetch).items()}
    want = kernels["serial"](inp, experts)
    same = {k: bool(torch.equal(kern(inp, experts), want)) for k, kern in kernels.items()}
    rec = {"model": name, "tokens": tokens, "scheme": scheme, "rows": M,
           "config": {"gate_up": sel.gate_up.as_dict(), "down": sel.down.as_dict(), "pdl": sel.pdl},
           "same_bits": same, "rounds": {k: [] for k in kernels}}
    for _ in range(rounds):
        for key, kern in kernels.items():
            rec["rounds"][key].append(_ms(lambda kern=kern: kern(inp, experts), flush, reps))
    rec["median_ms"] = {k: statistics.median(v) for k, v in rec["rounds"].items()}
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--prefetch", default=",".join(map(str, PREFETCH)), help="prefetch sizes (bytes per weight row)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    flush = L2Flush(device)
    prefetch = tuple(int(b) for b in args.prefetch.split(",") if b)
    records = []
    for name in args.models.split(","):
        model = make_model(name, device)
        for scheme in args.schemes.split(","):
            experts = experts_for(model, scheme)
            for tokens in map(int, args.tokens.split(",")):
                rec = study(name, tokens, scheme, model, experts, flush, args.rounds, args.reps, prefetch)
                records.append(rec)
                m = rec["median_ms"]
                base = m["serial"]
                print(f"{name:14s} T={tokens:<5d} {scheme:10s} serial {base * 1e3:8.1f} us | "
                      + " ".join(f"{k} {v * 1e3:.1f} ({v / base:.3f})" for k, v in m.items() if k != "serial")
                      + ("" if all(rec["same_bits"].values()) else f" | DIFFERENT BITS {rec['same_bits']}"),
                      flush=True)
            del experts
        del model
        torch.cuda.empty_cache()
    if args.json:
        out = {"command": "python3 scripts/pdl_study.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if v not in (None, False) and k != "json"),
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "records": records}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
