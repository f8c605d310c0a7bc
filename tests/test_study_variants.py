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


@pytest.mark.parametrize("model", ["deepseek-v3", "qwen2-57b-a14b", "mixtral-8x7b"])
def test_every_decode_layer_study_variant_is_built(model):
    """``scripts/decode_layer_study.py`` builds its layers on the CPU as on the GPU (small blocks
    here): the shared experts' variants only for a block that has them, the block without them
    a valid layer with none, the payload's variant for per-tensor schemes only; and each
    variant's forward runs, the inline ones giving the layer's bits."""
    import torch

    from moeshard.bench.workload import experts_for, hidden_states, make_model

    study = _script("decode_layer_study")
    m = make_model(model, torch.device("cpu"), size="small")
    for scheme in ("fp8_tensor", "fp8_block"):
        layers = study.layers(m, scheme, experts_for(m, scheme))
        want = {"layer"} | ({"shared_inline", "no_shared"} if m.cfg.has_shared_experts else set()) | (
            {"payload_inline"} if scheme == "fp8_tensor" else set())
        assert set(layers) == want, (model, scheme)
        if "no_shared" in layers:
            assert layers["no_shared"].shared_experts is None and layers["layer"].shared_experts is not None
        x = hidden_states(m, 3, 3)
        out = layers["layer"](x)
        for name, layer in layers.items():
            y = layer(x)
            assert y.shape == out.shape, name
            if name.endswith("_inline"):
                assert torch.equal(y, out), name
