"""Empty picks on the Triton kernels: a routing given with zero-computation picks (id -1 in the
layer, ``Routing.empty_picks``) leaves their output rows unwritten by the kernels, and the local
backend's Triton combine skips them (the layer no longer zeroes them). The memory the kernels'
output takes is filled with NaN first, so a row read would show; the output is the definition of tests/test_empty_picks.py within
bfloat16's rounding (the CPU proof in float32 is that file)."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_empty_picks import E, K, Z, _definition, _inputs  # noqa: E402 - the CPU test's definition


@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"])
def test_empty_picks_on_the_triton_kernels_give_the_definition(scheme):
    """Every scheme: a per-tensor scheme's h amax must not see the unwritten rows either. none
    within a few bf16 steps of the output's scale; a quantized scheme within its scheme's bound on
    the relative RMS error (``QuantScheme.quant_error``, as ``moeshard check`` bounds it)."""
    from moeshard.config import QuantConfig
    from moeshard.experts import GroupedExperts
    from moeshard.integrations.given_routing import MoEExperts
    from moeshard.presets import PRESETS
    from moeshard.weights import MoEWeights

    cfg = dataclasses.replace(PRESETS["mixtral-8x7b"].config("small", torch.bfloat16), top_k=K)
    full = MoEWeights.random(cfg, generator=torch.Generator().manual_seed(0))
    layer = MoEExperts(cfg, quant=QuantConfig(scheme), weights=full, identity_experts=Z, device="cuda")
    assert type(layer.kernel) is not GroupedExperts  # the Triton kernels
    x, ids, weights = _inputs(0, cfg.hidden_size)
    x = x.to(torch.bfloat16)
    poison = torch.full((64 << 20,), float("nan"), device="cuda")  # the allocator hands this memory on
    del poison
    with torch.no_grad():
        got = layer(x.cuda(), ids.cuda(), weights.cuda()).float().cpu()
    want = _definition(x.float(), ids, weights, full.gate_up.to(torch.bfloat16).float(),
                       full.down.to(torch.bfloat16).float())
    assert got.isfinite().all()
    assert E == cfg.num_experts
    if scheme == "none":
        torch.testing.assert_close(got, want, rtol=0, atol=2**-6 * float(want.abs().max()))
    else:
        rms = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
        assert rms <= QuantConfig(scheme).spec.quant_error, (scheme, rms)


def test_the_gathering_combine_skips_empty_picks_on_cuda():
    """The EP backends' combine (``combine_rows``, the Triton kernel with gathered rows) adds
    nothing for a pair of id -1: its row holds NaN here, its weight is nonzero, and the sum equals
    the CPU path's, which zeroes such rows."""
    from moeshard.dispatch.base import combine_rows

    g = torch.Generator().manual_seed(2)
    T, Kp, H = 9, 4, 300
    ids = torch.randint(-1, 6, (T, Kp), generator=g)
    ids[0] = -1
    rows = torch.randperm(T * Kp + 5, generator=g)[:T * Kp].view(T, Kp)
    y = torch.randn(T * Kp + 5, H, generator=g).to(torch.bfloat16)
    y[rows[ids < 0]] = float("nan")
    w = torch.rand(T, Kp, generator=g) + 0.5
    want = combine_rows(y, rows, w, ids)
    got = combine_rows(y.cuda(), rows.cuda(), w.cuda(), ids.cuda()).cpu()
    assert want.isfinite().all() and got[0].eq(0).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
