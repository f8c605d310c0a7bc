"""Skewed routing on purpose: router weights and tokens that send most tokens to a few experts.

Every token becomes ``(noise + u) / sqrt(2)`` for a common direction u (tokens keep the scale of
unskewed ones), and router row e has its component along u replaced so that u adds exactly
``bias[e]`` to expert e's logit. The rest of the router is untouched, so routing stays random
around the bias. Two shapes of bias:

* ``one``: +8 for one hot expert, -8 for every other: every token's top choice is the hot expert
  (softmax and sigmoid scoring alike: after a sigmoid the two sides stay far apart, above
  DeepSeek's correction bias);
* ``zipf``: the expert of popularity rank j gets ``-slope * ln(1 + j)``: popularity falls off
  roughly as a power law, as real routers' loads do.

Used by the verification matrix's load-balancing cases (``moeshard.harness.inputs``) and by
``moeshard eplb --layer`` (``moeshard.bench.eplb_layer``).
"""

from __future__ import annotations

import torch

SKEWS = ("one", "zipf")
ONE_BIAS = 8.0
ZIPF_SLOPE = 2.0


def skew_bias(num_experts: int, skew: str, generator: torch.Generator, slope: float = ZIPF_SLOPE) -> torch.Tensor:
    """fp32 [E] logit offsets of ``skew``; the hot expert / popularity order from ``generator``."""
    if skew not in SKEWS:
        raise ValueError(f"skew: {skew!r} is not one of {list(SKEWS)}")
    order = torch.randperm(num_experts, generator=generator)  # order[j]: the expert of popularity rank j
    if skew == "one":
        bias = torch.full((num_experts,), -ONE_BIAS)
        bias[order[0]] = ONE_BIAS
    else:
        bias = torch.zeros(num_experts)
        bias[order] = -slope * torch.log1p(torch.arange(num_experts, dtype=torch.float32))
    return bias


def skew_gate(gate: torch.Tensor, u: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gate [E, H] (any float dtype) -> the same dtype: row e's component along u (fp32 [H])
    set so that ``gate[e] . u / sqrt(2) == bias[e]`` (computed in fp32)."""
    g = gate.float()
    along = (u / u.dot(u)).to(g.device)
    g = g + (2**0.5 * bias.to(g.device) - g @ u.to(g.device)).unsqueeze(1) * along.unsqueeze(0)
    return g.to(gate.dtype)


def skew_tokens(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> (x + u) / sqrt(2) in x's dtype (computed in fp32)."""
    return ((x.float() + u.to(x.device)) / 2**0.5).to(x.dtype)
