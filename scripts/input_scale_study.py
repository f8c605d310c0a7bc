"""How the layer's agreement with the reference holds as the inputs grow, on CPU.

    python scripts/input_scale_study.py [--presets mixtral-8x7b,deepseek-v3,gpt-oss-120b,hy-v4]
        [--scales 1,2,4] [--tokens 1,300] [--dtype bfloat16]

Each preset's small block (``MoEWeights.random``, seed 0) runs as ``MoELayer`` on one CPU rank
(the portable experts, quant none) on standard normal inputs times each scale, against
``reference_forward``; printed per case: whether ``compare`` passes, the largest error and the
largest ratio of error to bound. A second line per case ("y rounded") evaluates the reference
with each routed expert's output rounded to the model dtype before the combine, as the layer
rounds it, to show how much of a miss that one rounding explains. Presets with shared experts
run a third time without them ("no shared experts": the same routed weights, the shared MLP
removed from config and weights), the variant that takes that stage away. Nothing is changed in
the package: the rounding variant wraps ``reference.expert_rows_batched`` for this process only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

import torch

import moeshard.reference as reference
from moeshard.config import QuantConfig
from moeshard.layer import MoELayer
from moeshard.presets import PRESETS
from moeshard.tolerances import compare_rows
from moeshard.weights import MoEWeights


@contextlib.contextmanager
def routed_outputs_rounded():
    """``reference_forward`` with every routed expert's output rounded to the model dtype."""
    original = reference.expert_rows_batched

    def rounded(*args, **kwargs):
        dtype = args[4]
        return [(y.to(dtype).double(), s) for y, s in original(*args, **kwargs)]

    reference.expert_rows_batched = rounded
    try:
        yield
    finally:
        reference.expert_rows_batched = original


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="mixtral-8x7b,deepseek-v3,gpt-oss-120b,hy-v4")
    p.add_argument("--scales", default="1,2,4")
    p.add_argument("--tokens", default="1,300")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print("preset, tokens, input scale, reference: passed, max |err|, max err/bound")
    for name in args.presets.split(","):
        cfg = PRESETS[name].config("small", dtype)
        weights = MoEWeights.random(cfg, generator=torch.Generator().manual_seed(0))
        variants = [("as is", cfg, weights, contextlib.nullcontext), ("y rounded", cfg, weights, routed_outputs_rounded)]
        if cfg.has_shared_experts:
            bare = dataclasses.replace(cfg, num_shared_experts=0, shared_intermediate_size=0, shared_activation=None,
                                       shared_expert_gate=False)
            kept = dataclasses.replace(weights, shared_gate=None, shared_up=None, shared_down=None,
                                       shared_expert_gate=None)
            variants.append(("no shared experts", bare, kept, contextlib.nullcontext))
        layers = [MoELayer(c_cfg, QuantConfig("none"), weights=c_weights) for _, c_cfg, c_weights, _ in variants]
        for tokens in (int(t) for t in args.tokens.split(",")):
            for scale in (float(s) for s in args.scales.split(",")):
                x = (torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens)) * scale)
                x = x.to(dtype)
                for (what, c_cfg, c_weights, ctx), layer in zip(variants, layers, strict=True):
                    out = layer(x)
                    with ctx():
                        ref = reference.reference_forward(x, c_weights, c_cfg, QuantConfig("none"),
                                                          accumulation=layer.accumulation)
                    c = compare_rows(out, ref, dtype, "none")
                    print(f"{name}, T={tokens}, x{scale:g}, {what}: {'passed' if c.ok else 'MISSED'}, "
                          f"{c.max_abs_err:.3g}, {c.err_to_bound:.2f}", flush=True)


if __name__ == "__main__":
    main()
