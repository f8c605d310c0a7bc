"""How the layer's agreement with the reference holds as the inputs grow, on CPU.

    python scripts/input_scale_study.py [--presets all] [--scales 1,2,4,8] [--tokens 1,300]
        [--dtype bfloat16]

Each preset's small block (``MoEWeights.random``, seed 0) runs as ``MoELayer`` on one CPU rank
(the portable experts, quant none) on standard normal inputs times each scale, against
``reference_forward``; printed per case: whether ``compare`` passes, the largest error and the
largest ratio of error to bound. A second line per case ("unpriced") takes the reference's
pricing of the layer's model-dtype output roundings away (``unit_roundoff`` 0 inside
``moeshard.reference``, for this process only): the variant that shows what those terms carry.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import moeshard.reference as reference
from moeshard.config import QuantConfig
from moeshard.layer import MoELayer
from moeshard.presets import PRESETS
from moeshard.tolerances import compare_rows
from moeshard.weights import MoEWeights


@contextlib.contextmanager
def roundings_unpriced():
    """``reference_forward`` with the output roundings' terms of the slack at zero."""
    original = reference.unit_roundoff
    reference.unit_roundoff = lambda dtype: 0.0
    try:
        yield
    finally:
        reference.unit_roundoff = original


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="all", help="comma-separated preset names, or all")
    p.add_argument("--scales", default="1,2,4,8")
    p.add_argument("--tokens", default="1,300")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    names = list(PRESETS) if args.presets == "all" else args.presets.split(",")
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        p.error(f"--presets: unknown {unknown}; known: {', '.join(PRESETS)}")
    print("preset, tokens, input scale, reference: passed, max |err|, max err/bound")
    for name in names:
        cfg = PRESETS[name].config("small", dtype)
        weights = MoEWeights.random(cfg, generator=torch.Generator().manual_seed(0))
        layer = MoELayer(cfg, QuantConfig("none"), weights=weights)
        for tokens in (int(t) for t in args.tokens.split(",")):
            for scale in (float(s) for s in args.scales.split(",")):
                x = (torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens)) * scale)
                x = x.to(dtype)
                out = layer(x)
                for what, ctx in (("priced", contextlib.nullcontext), ("unpriced", roundings_unpriced)):
                    with ctx():
                        ref = reference.reference_forward(x, weights, cfg, QuantConfig("none"),
                                                          accumulation=layer.accumulation)
                    c = compare_rows(out, ref, dtype, "none")
                    print(f"{name}, T={tokens}, x{scale:g}, {what}: {'passed' if c.ok else 'MISSED'}, "
                          f"{c.max_abs_err:.3g}, {c.err_to_bound:.2f}", flush=True)


if __name__ == "__main__":
    main()
