"""Deterministic per-case inputs: the same weights on every rank, different tokens per DP rank.

Every rank regenerates every DP rank's tokens from the case seed, so each rank can build the
single-device reference for its quantization domain without any communication.
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.config import MoEConfig
from moeshard.eplb.skew import skew_bias, skew_gate, skew_tokens
from moeshard.weights import MoEWeights


def _skew(cfg: MoEConfig, seed: int, skew: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(u fp32 [H], bias fp32 [E]) of a case's skew (``moeshard.eplb.skew``), from its seed."""
    g = torch.Generator().manual_seed(seed * 7919 + 3)
    u = torch.randn(cfg.hidden_size, generator=g)
    return u, skew_bias(cfg.num_experts, skew, g)


def case_weights(cfg: MoEConfig, seed: int, skew: str = "") -> MoEWeights:
    """Full weights of the case (CPU, ``cfg.dtype``). skew: "" (a random router), or one of
    ``moeshard.eplb.skew.SKEWS`` with ``case_tokens`` of the same skew: "one" sends every token
    to one hot expert (its top choice), "zipf" makes expert popularity fall off as a Zipf law."""
    weights = MoEWeights.random(cfg, torch.Generator().manual_seed(seed))
    if not skew:
        return weights
    u, bias = _skew(cfg, seed, skew)
    return dataclasses.replace(weights, gate=skew_gate(weights.gate, u, bias))


def case_tokens(cfg: MoEConfig, seed: int, tokens: tuple[int, ...], skew: str = "") -> list[torch.Tensor]:
    """One [T_d, H] tensor per DP rank d (CPU, ``cfg.dtype``); rank d's values come from its
    own stream and are offset by d, so rows from different ranks can never be mistaken. skew:
    as ``case_weights`` (every token then carries the skew's common component)."""
    u = _skew(cfg, seed, skew)[0] if skew else None
    out = []
    for d, count in enumerate(tokens):
        g = torch.Generator().manual_seed(seed * 1009 + 17 * d + 1)
        x = torch.randn(count, cfg.hidden_size, generator=g)
        if u is not None:
            x = skew_tokens(x, u)
        x = x + 0.05 * d
        out.append(x.to(cfg.dtype))
    return out
