"""Deterministic per-case inputs: the same weights on every rank, different tokens per DP rank.

Weights depend on the model shape, the dtype and the run's seed only (``Case.weights_key``), so
the cases of one model share them; tokens depend on the case. ``CaseData`` keeps what cases
share for the cases that follow: the weights (every process), the reference's dequantized
experts (where references are computed) and a rank's shard of the quantized experts.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import torch

from moeshard.config import MoEConfig
from moeshard.eplb.skew import skew_bias, skew_gate, skew_tokens
from moeshard.experts.base import ExpertWeights
from moeshard.reference import DequantizedExperts
from moeshard.sharding import ShardSpec, prepare_experts, shard_of
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
    return dataclasses.replace(weights, gate=skew_gate(weights.router_weight, u, bias))


def case_tokens(cfg: MoEConfig, seed: int, tokens: tuple[int, ...], skew: str = "",
                skew_seed: int = 0) -> list[torch.Tensor]:
    """One [T_d, H] tensor per DP rank d (CPU, ``cfg.dtype``); rank d's values come from its
    own stream and are offset by d, so rows from different ranks can never be mistaken. skew:
    as ``case_weights``, whose seed ``skew_seed`` is (every token then carries the skew's common
    component, the one the weights' router favours)."""
    u = _skew(cfg, skew_seed, skew)[0] if skew else None
    out = []
    for d, count in enumerate(tokens):
        g = torch.Generator().manual_seed(seed * 1009 + 17 * d + 1)
        x = torch.randn(count, cfg.hidden_size, generator=g)
        if u is not None:
            x = skew_tokens(x, u)
        x = x + 0.05 * d
        out.append(x.to(cfg.dtype))
    return out


def case_tokens_of(case) -> list[torch.Tensor]:
    """``case_tokens`` of a ``harness.cases.Case`` (its skew matched to its weights)."""
    return case_tokens(case.moe_config(), case.seed, case.tokens, skew=case.skew, skew_seed=case.weight_seed)


class _Recent:
    """The last ``capacity`` values by key (least recently used dropped first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._values: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        value = make()
        self._values[key] = value
        while len(self._values) > self.capacity:
            self._values.popitem(last=False)
        return value


class CaseData:
    """What consecutive cases share, kept per process (run the cases of one model together: see
    ``execution_order``). Small: a few entries of each kind.

    ``weights(case)``: the full weights (``case_weights``); ``dequantized(case, scheme)``: the
    routed experts quantized with ``scheme`` and dequantized, fp64, for the reference;
    ``local_experts(case, spec)``: a rank's shard for ``case.quant``, cut from every expert
    quantized once per weights and scheme (``sharding.prepare_experts`` / ``shard_of``, equal to
    the layer's own ``shard_experts`` bit for bit); a fresh copy each time, since a layer owns
    (and a test double may change) its weights.
    """

    def __init__(self) -> None:
        self._weights = _Recent(2)
        self._dequantized = _Recent(2)
        self._prepared = _Recent(2)

    def weights(self, case) -> MoEWeights:
        return self._weights.get(case.weights_key,
                                 lambda: case_weights(case.moe_config(), case.weight_seed, skew=case.skew))

    def dequantized(self, case, scheme: str) -> DequantizedExperts:
        cfg = case.moe_config()
        return self._dequantized.get((case.weights_key, scheme),
                                     lambda: DequantizedExperts.of(self.weights(case), scheme, cfg.dtype))

    def local_experts(self, case, spec: ShardSpec) -> ExpertWeights:
        cfg, weights = case.moe_config(), self.weights(case)
        gate_up, down = weights.gate_up, weights.down
        assert gate_up is not None and down is not None  # case_weights makes every expert
        prepared = self._prepared.get((case.weights_key, case.quant.scheme),
                                      lambda: prepare_experts(gate_up, down, cfg, case.quant, weights.gate_up_bias,
                                                              weights.down_bias))
        return shard_of(prepared, cfg, case.quant, spec)


def execution_order(cases: list) -> list[int]:
    """Indices of ``cases`` in the order that keeps ``CaseData`` warm: grouped by weights and
    quantization scheme, otherwise in the given order."""
    return sorted(range(len(cases)), key=lambda i: (cases[i].weights_key, cases[i].quant.scheme, i))
