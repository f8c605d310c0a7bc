"""Configuration validation: every refusal names the field and the values."""

import dataclasses

import pytest
import torch

from moeshard.config import MoEConfig, QuantConfig, parse_dtype

BASE = dict(num_experts=8, top_k=2, hidden_size=16, intermediate_size=32)


@pytest.mark.parametrize("change,match", [
    (dict(top_k=9), r"top_k: 9 is larger than num_experts=8"),
    (dict(n_group=3), r"n_group: num_experts=8 is not divisible by n_group=3"),
    (dict(n_group=2, topk_group=3), r"topk_group: 3 is larger than n_group=2"),
    (dict(hidden_size=0), r"hidden_size: must be a positive integer, got 0"),
    (dict(intermediate_size=-4), r"intermediate_size: must be a positive integer, got -4"),
    (dict(num_experts=2.5), r"num_experts: must be a positive integer, got 2.5"),
    (dict(activation="relu"), r"activation: 'relu' is not one of"),
    (dict(scoring="tanh"), r"scoring: 'tanh' is not one of"),
    (dict(routed_scaling_factor=0.0), r"routed_scaling_factor: must be a finite number in \(0, 1000\], got 0.0"),
    (dict(routed_scaling_factor=float("inf")), r"routed_scaling_factor: must be a finite number .* got inf"),
    (dict(routed_scaling_factor=1e39), r"routed_scaling_factor: must be a finite number .* got 1e\+39"),
    (dict(routed_scaling_factor=float("nan")), r"routed_scaling_factor: must be a finite number .* got nan"),
    (dict(routed_scaling_factor="2.5"), r"routed_scaling_factor: must be a finite number .* got '2.5'"),
    (dict(routed_scaling_factor=True), r"routed_scaling_factor: must be a finite number .* got True"),
    (dict(renormalize="false"), r"MoEConfig.renormalize: must be a bool, got 'false'"),
    (dict(use_correction_bias=1), r"MoEConfig.use_correction_bias: must be a bool, got 1"),
    (dict(num_shared_experts=1.5, shared_intermediate_size=8), r"num_shared_experts: must be an integer >= 0, got 1.5"),
    (dict(num_shared_experts=1, shared_intermediate_size="8"), r"shared_intermediate_size: must be an integer >= 0, got '8'"),
    (dict(num_experts=10**10), r"MoEConfig.num_experts: must be at most 2147483647, got 10000000000"),
    (dict(activation=["silu"]), r"MoEConfig.activation: \['silu'\] is not one of"),
    (dict(dtype=["bf16"]), r"MoEConfig.dtype: \['bf16'\] is not one of"),
    (dict(use_correction_bias=True), r"use_correction_bias: only defined for scoring='sigmoid'"),
    (dict(num_shared_experts=1), r"shared_intermediate_size: must be > 0"),
    (dict(shared_expert_gate=True), r"shared_expert_gate: True needs num_shared_experts > 0"),
    (dict(dtype="int8"), r"dtype: 'int8' is not one of"),
    (dict(n_group=4, topk_group=1, top_k=3), r"top_k: 3 exceeds the experts of the kept groups"),
    (dict(router_dtype="bf16"), r"MoEConfig.router_dtype: 'bf16' is not one of \['fp32', 'model'\]"),
    (dict(router_dtype=None), r"MoEConfig.router_dtype: None is not one of \['fp32', 'model'\]"),
])
def test_moe_config_refusals(change, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**BASE, **change})


def test_moe_config_accepts_and_normalises():
    c = MoEConfig(**BASE, dtype="bf16", num_shared_experts=2, shared_intermediate_size=8)
    assert c.dtype == torch.bfloat16 and c.shared_width == 16 and c.has_shared_experts
    assert type(MoEConfig(**BASE, routed_scaling_factor=2).routed_scaling_factor) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.top_k = 3


def test_quant_config():
    assert QuantConfig("fp8_block", defer_input_quant=True).quantized
    with pytest.raises(ValueError, match=r"scheme: 'int4' is not one of"):
        QuantConfig("int4")
    with pytest.raises(ValueError, match="defer_input_quant"):
        QuantConfig("none", defer_input_quant=True)
    with pytest.raises(ValueError, match=r"QuantConfig.defer_input_quant: must be a bool, got 'false'"):
        QuantConfig("fp8_block", defer_input_quant="false")
    with pytest.raises(ValueError, match=r"QuantConfig.scheme: \['none'\] is not one of"):
        QuantConfig(["none"])


def test_parse_dtype():
    assert parse_dtype("fp16") == torch.float16 and parse_dtype(torch.float32) == torch.float32
