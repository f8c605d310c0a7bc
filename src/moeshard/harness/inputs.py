"""Deterministic per-case inputs: the same weights on every rank, different tokens per DP rank.

Every rank regenerates every DP rank's tokens from the case seed, so each rank can build the
single-device reference for its quantization domain without any communication.
"""

from __future__ import annotations

import torch

from moeshard.config import MoEConfig
from moeshard.weights import MoEWeights


def case_weights(cfg: MoEConfig, seed: int) -> MoEWeights:
    """Full weights of the case (CPU, ``cfg.dtype``)."""
    return MoEWeights.random(cfg, torch.Generator().manual_seed(seed))


def case_tokens(cfg: MoEConfig, seed: int, tokens: tuple[int, ...]) -> list[torch.Tensor]:
    """One [T_d, H] tensor per DP rank d (CPU, ``cfg.dtype``); rank d's values come from its
    own stream and are offset by d, so rows from different ranks can never be mistaken."""
    out = []
    for d, count in enumerate(tokens):
        g = torch.Generator().manual_seed(seed * 1009 + 17 * d + 1)
        x = torch.randn(count, cfg.hidden_size, generator=g) + 0.05 * d
        out.append(x.to(cfg.dtype))
    return out
