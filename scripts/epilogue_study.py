"""What the expert biases and the clamped activations cost the Triton experts at prefill, and
which gate_up tile suits them (one GPU).

For each model with such experts (gpt-oss-120b: biases and ``swiglu_clamped``; hy-v4:
``silu_clamped``), each scheme and token count: ``TritonExperts`` on the tiles it chooses for them
(``select_config`` with the Gluon gate_up off, as it runs experts the Gluon kernel does not
compute), then with the gate_up tile replaced by each of a few variants (its half tiles switched,
and tiles of 128 or 64 rows). Any other preset runs too: its Triton tiles are what a GPU without
the Gluon GEMMs runs. Every variant is timed twice on the same weights and rows: as the model
computes (its activation, its biases) and with the plain epilogue (``silu``, no biases), the
variant that removes the epilogue's extra work and so measures it. Each model-epilogue variant's
output is checked against the chosen tiles' (largest difference relative to the output's largest
value), so that a fast wrong variant cannot pass unseen. Times are CUDA-graph medians with an L2
flush before every repetition (``moeshard.bench.timing``), on the bench's workload
(``moeshard.bench.workload``).

    PYTHONPATH=src python3 scripts/epilogue_study.py --json OUT.json [--models gpt-oss-120b,hy-v4]
        [--schemes none,fp8_tensor,fp8_token,fp8_block] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from moeshard.bench.timing import L2Flush
from moeshard.bench.workload import experts_for, hidden_states, make_model, routed_input
from moeshard.config import QuantConfig
from moeshard.experts.base import ExpertWeights
from moeshard.kernels import pdl
from moeshard.kernels.configs import GemmConfig, gpu_kind, multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts

# fp8_study's timing (a variant that fails is recorded, not fatal) and output check; this
# script's folder is on sys.path when it runs as a script.
from fp8_study import _ms, _rel  # isort: skip

# gate_up tiles of 128 rows (the plan's height, which the chosen down tile divides), each run at
# the chosen tile's accumulation mode and half-tile setting.
# 128 x 64 tiles hold half the accumulator, where the clamped and biased epilogue spills at
# 128 x 128 x 128 (scripts/kernel_resources.py).
TILES = (GemmConfig(128, 128, 128, 8, 8, 3, tma=True), GemmConfig(128, 128, 64, 8, 8, 4, tma=True),
         GemmConfig(128, 64, 128, 8, 8, 4, tma=True), GemmConfig(128, 64, 128, 8, 4, 3, tma=True),
         GemmConfig(64, 128, 128, 8, 8, 3, tma=True))


def _name(c: GemmConfig) -> str:
    return (f"{c.block_m}x{c.block_n}x{c.block_k} g{c.group_m} w{c.num_warps} s{c.num_stages} tma={c.tma} "
            f"half={c.half_tiles}")


def study(model, scheme: str, tokens: int, flush: L2Flush, reps: int, log) -> dict:
    cfg = model.cfg
    device = model.gate_up.device
    experts = experts_for(model, scheme)
    plain = ExpertWeights(experts.gate_up, experts.down, scheme)  # the same weights without biases
    inp, _ = routed_input(model, hidden_states(model, tokens, tokens), QuantConfig(scheme))
    M, E, H, I = inp.num_rows, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    chosen = select_config(M, E, H, I, scheme, multiprocessors(device.index), pdl=pdl.supported(device),
                           gluon=False, gpu=gpu_kind(device.index))
    rec: dict = {"tokens": tokens, "scheme": scheme, "rows": M, "activation": cfg.activation,
                 "biases": experts.has_bias, "chosen": chosen.gate_up.as_dict(), "variants": []}
    reference = None
    # Every variant's rows are a multiple of the chosen down tile's (which then runs on the
    # variant's plan); the chosen tile runs with its half tiles switched too.
    tiles = [chosen.gate_up, dataclasses.replace(chosen.gate_up, half_tiles=not chosen.gate_up.half_tiles)] + \
        [dataclasses.replace(t, fp8_acc=chosen.gate_up.fp8_acc, half_tiles=chosen.gate_up.half_tiles)
         for t in TILES if t.block_m % chosen.down.block_m == 0]
    for tile in dict.fromkeys(tiles):  # the chosen tile first, each once
        # A tile narrower than the 128-column block scale cannot quantize h in its epilogue.
        config = dataclasses.replace(chosen, gate_up=tile,
                                     h_quant="pass" if chosen.h_quant == "gate_up" and tile.block_n != 128
                                     else chosen.h_quant)
        as_model = TritonExperts(cfg.activation, cfg.dtype, config=config)
        bare = TritonExperts("silu", cfg.dtype, config=config)
        try:
            y = as_model(inp, experts)
        except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
            torch.cuda.synchronize()
            rec["variants"].append({"gate_up": tile.as_dict(), "error": f"{type(exc).__name__}: {exc}"[:200]})
            log(f"  {_name(tile)}: {type(exc).__name__}")
            continue
        if reference is None:
            reference = y.clone()
        v = {"gate_up": tile.as_dict(), "h_quant": config.h_quant,
             "model_ms": _ms(lambda m=as_model: m(inp, experts), flush, reps),
             "plain_ms": _ms(lambda b=bare: b(inp, plain), flush, reps), "rel_diff": _rel(y, reference)}
        rec["variants"].append(v)
        log(f"  {_name(tile)}{' (chosen)' if tile == chosen.gate_up else ''}: model {v['model_ms']} plain "
            f"{v['plain_ms']} rel {v['rel_diff']:.2e}")
    return rec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--models", default="gpt-oss-120b,hy-v4")
    ap.add_argument("--schemes", default="none,fp8_tensor,fp8_token,fp8_block")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("epilogue_study: needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    flush = L2Flush(device)
    out = {"gpu": torch.cuda.get_device_name(device), "cases": []}

    def log(line: str) -> None:
        print(line, flush=True)

    for name in args.models.split(","):
        model = make_model(name, device)
        for scheme in args.schemes.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                log(f"{name} {scheme} T={tokens}")
                out["cases"].append({"model": name, **study(model, scheme, tokens, flush, args.reps, log)})
        del model
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
