"""The GPU study scripts' variants, built on the CPU for every shape the bench runs.

A study's variants are configs made from ``select_config``'s choice; one that cannot be built
(a Gluon engine asked of a decode tile, a tile that ``GemmConfig`` refuses) only fails on the GPU
machine, after the models are made, and costs device time. ``scripts/chain_profile.py`` once
failed that way at Mixtral's 128-token decode tile. Here every variant of
``scripts/chain_profile.py`` and ``scripts/h_quant_study.py`` is built for the bench's models, token
counts and fp8 schemes, with and without the Gluon GEMMs and PDL, and the variants the recorded
studies rely on are checked by name.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from moeshard.presets import get_preset

pytest.importorskip("triton")

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
MODELS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
TOKENS = (1, 16, 128, 4096, 16384)
SCHEMES = ("fp8_tensor", "fp8_token", "fp8_block")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shape(model: str, tokens: int) -> tuple[int, int, int, int]:
    cfg = get_preset(model).full
    return tokens * cfg.top_k, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size


@pytest.mark.parametrize("model", MODELS)
def test_every_chain_profile_variant_is_built(model):
    variants = _script("chain_profile").variants
    for tokens in TOKENS:
        for scheme in SCHEMES:
            for gluon in (False, True):
                configs = variants(*_shape(model, tokens), scheme, 132, gluon)
                assert "chosen" in configs, (tokens, scheme, gluon)
    # The profiled pairs: Qwen3 and DeepSeek-V3 select the Gluon gate_up (the other is Triton's
    # tile); decode tiles and fp8_block have no other.
    if model != "mixtral-8x7b":
        pair = variants(*_shape(model, 4096), "fp8_tensor", 132, True)
        assert (pair["chosen"].gate_up.engine, pair["other"].gate_up.engine) == ("gluon", "triton")
    assert set(variants(*_shape(model, 128), "fp8_tensor", 132, True)) == {"chosen"}
    assert set(variants(*_shape(model, 4096), "fp8_block", 132, True)) == {"chosen"}


@pytest.mark.parametrize("model", MODELS)
def test_every_h_quant_study_variant_is_built(model):
    variants = _script("h_quant_study").variants
    for tokens in TOKENS:
        for pdl in (False, True):
            configs = variants(*_shape(model, tokens), "fp8_block", 132, pdl, True)
            assert configs and all(c.h_quant in ("pass", "gate_up") for c in configs.values())
    expected = {("qwen3-30b-a3b", 1): {"h_pass"}, ("qwen3-30b-a3b", 128): {"h_gate_up", "h_pass"},
                ("qwen3-30b-a3b", 4096): {"h_pass"}, ("deepseek-v3", 16): {"h_gate_up", "h_pass"},
                ("mixtral-8x7b", 1): {"h_gate_up", "h_pass"},
                ("mixtral-8x7b", 128): {"h_pass", "h_gate_up_w8_s3", "h_gate_up_w8_s4"},
                ("mixtral-8x7b", 16384): {"h_pass"}}
    # At prefill on a GPU that runs it, fp8_block's gate_up is the Gluon kernel, which stores h
    # for the pass: no gate_up variant quantizing h.
    for (name, tokens), keys in expected.items():
        if name == model:
            got = variants(*_shape(model, tokens), "fp8_block", 132, True, True)
            assert set(got) == keys, (tokens, sorted(got))
            assert next(iter(got)) == f"h_{got[next(iter(got))].h_quant}"  # the selected config first
