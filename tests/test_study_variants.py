"""The GPU study scripts' variants, built on the CPU for every shape the bench runs.

A study's variants are configs made from ``select_config``'s choice; one that cannot be built
(a Gluon engine asked of a decode tile, a tile that ``GemmConfig`` refuses) only fails on the GPU
machine, after the models are made, and costs device time. ``scripts/chain_profile.py`` once
failed that way at Mixtral's 128-token decode tile. Here every variant of
``scripts/chain_profile.py`` and ``scripts/h_quant_study.py`` is built for the bench's models, token
counts and fp8 schemes, with and without the Gluon GEMMs and PDL, and the variants the recorded
studies rely on are checked by name. The studies' variant of the experts with their tile plan
made ahead (``bench.study.plan_made_ahead``) is checked to give the call's own bits.
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
    # Qwen3's 128 tokens and DeepSeek-V3's 16 take 32-column deep-K gate_up tiles: no h in the epilogue.
    expected = {("qwen3-30b-a3b", 1): {"h_pass"}, ("qwen3-30b-a3b", 128): {"h_pass"},
                ("qwen3-30b-a3b", 4096): {"h_pass"}, ("deepseek-v3", 16): {"h_pass"},
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
            for key in keys - {"h_pass", "h_gate_up"}:  # a widened tile keeps 128-column K steps
                assert got[key].gate_up.block_k == 128, (key, got[key].gate_up)


@pytest.mark.parametrize("model", ["deepseek-v3", "qwen2-57b-a14b", "mixtral-8x7b"])
def test_every_decode_layer_study_variant_is_built(model):
    """``scripts/decode_layer_study.py`` builds its layers on the CPU as on the GPU (small blocks
    here): the shared experts' variants only for a block that has them, the block without them
    a valid layer with none, the payload's variant for per-tensor schemes only (its stream
    priority variant needs CUDA streams, so it is not built here); and each
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


# A study's variant through the interpreter (about 5 s each on two cores): make test-slow.
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token"])
def test_plan_made_ahead_is_the_call_without_its_plan(interpreted_kernels, scheme):
    """``bench.study.plan_made_ahead`` (the studies' variant that times the experts without their
    tile plan) makes the plan once and hands it to every later call, zeroing the buffers the plan
    kernel zeroes (fp8_tensor's amax, fp8_token's row maxima at decode): the same bits as the
    call itself, every time."""
    import torch

    from moeshard.bench.study import plan_made_ahead
    from moeshard.experts.base import ExpertInput, ExpertWeights
    from moeshard.kernels import align
    from moeshard.kernels.experts import TritonExperts
    from moeshard.quant import quantize_weight

    g = torch.Generator().manual_seed(0)
    E, H, I = 4, 64, 128  # noqa: E741
    w = ExpertWeights(quantize_weight(torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16) / 8, scheme),
                      quantize_weight(torch.randn(E, H, I, generator=g).to(torch.bfloat16) / 11, scheme), scheme)
    inp = ExpertInput(torch.randn(3, H, generator=g).to(torch.bfloat16), torch.tensor([0, 2, 2, 1, 3, 0]), repeat=2)
    kernel = TritonExperts("silu", torch.bfloat16)
    want = kernel(inp, w)
    # The same ids with a quarter of the input: a stale amax (or row maximum) would keep the
    # first call's larger scale.
    small = ExpertInput(inp.x / 4, inp.expert_ids, repeat=2)
    want_small = kernel(small, w)
    calls = []
    real = align.align_rows
    current = [inp]
    try:
        align.align_rows = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        ahead = plan_made_ahead(lambda: kernel(current[0], w))
        outs = [ahead(), ahead()]
        current[0] = small
        outs_small = [ahead(), ahead()]
    finally:
        align.align_rows = real
    assert calls == [1]
    assert all(torch.equal(out, want) for out in outs)
    assert all(torch.equal(out, want_small) for out in outs_small)
