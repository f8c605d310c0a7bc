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
    (dict(routed_scaling_factor=0.0), r"routed_scaling_factor: must be > 0"),
    (dict(use_correction_bias=True), r"use_correction_bias: only defined for scoring='sigmoid'"),
    (dict(num_shared_experts=1), r"shared_intermediate_size: must be > 0"),
    (dict(shared_expert_gate=True), r"shared_expert_gate: True needs num_shared_experts > 0"),
    (dict(dtype="int8"), r"dtype: 'int8' is not one of"),
    (dict(n_group=4, topk_group=1, top_k=3), r"top_k: 3 exceeds the experts of the kept groups"),
])
def test_moe_config_refusals(change, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**BASE, **change})


def test_moe_config_accepts_and_normalises():
    c = MoEConfig(**BASE, dtype="bf16", num_shared_experts=2, shared_intermediate_size=8)
    assert c.dtype == torch.bfloat16 and c.shared_width == 16 and c.has_shared_experts
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.top_k = 3


def test_quant_config():
    assert QuantConfig("fp8_block", defer_input_quant=True).quantized
    with pytest.raises(ValueError, match=r"scheme: 'int4' is not one of"):
        QuantConfig("int4")
    with pytest.raises(ValueError, match="defer_input_quant"):
        QuantConfig("none", defer_input_quant=True)


def test_parse_dtype():
    assert parse_dtype("fp16") == torch.float16 and parse_dtype(torch.float32) == torch.float32
