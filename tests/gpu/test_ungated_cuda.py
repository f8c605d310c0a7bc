"""Ungated experts (relu2, Nemotron-H) on CUDA: the layer runs them on the Triton kernels (the
gate_up GEMM's ungated epilogue) and matches the fp64 reference within the tolerance table for
every scheme and token count (decode's direct and 16-row tiles, prefill's); the Triton experts
alone match the reference with expert biases too; the layer's gradients on CUDA equal the CPU
layer's on the same weights and rows within bf16's rounding."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from moeshard.config import QuantConfig
from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.kernels.experts import TritonExperts
from moeshard.layer import MoELayer
from moeshard.presets import PRESETS
from moeshard.reference import expert_reference, reference_forward
from moeshard.tolerances import compare
from moeshard.weights import MoEWeights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PRESET = "nemotron-3-nano"


@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 16, 64, 1024, 4096])
def test_ungated_layer_on_cuda_matches_the_reference(scheme, tokens):
    cfg = PRESETS[PRESET].config("small", torch.bfloat16)
    w = MoEWeights.random(cfg, torch.Generator().manual_seed(0))
    layer = MoELayer(cfg, QuantConfig(scheme), weights=w, device="cuda")
    assert type(layer.kernel) is TritonExperts
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        out = layer(x.cuda()).cpu()
    # The reference prices the roundings the kernel's declared accumulation error leaves in doubt
    # (fp8 on the tensor cores at prefill: ``numerics.ACCUMULATION["fp8_mma"]``).
    ref = reference_forward(x, w, cfg, QuantConfig(scheme), accumulation=layer.accumulation)
    err, atol, rtol, ok = compare(out, ref, cfg.dtype, scheme)
    assert ok, f"max error {err} over atol={atol} rtol={rtol}"


def test_ungated_gradients_on_cuda_equal_the_cpu_layers():
    cfg = PRESETS[PRESET].config("small", torch.bfloat16)
    w = MoEWeights.random(cfg, torch.Generator().manual_seed(2))
    x = torch.randn(96, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    grads = []
    for device in ("cpu", "cuda"):
        layer = MoELayer(cfg, weights=w, device=device).requires_grad_(True)
        xg = x.to(device).clone().requires_grad_(True)
        layer(xg).float().pow(2).sum().backward()
        grads.append({"x": xg.grad.float().cpu(), **{n: p.grad.float().cpu() for n, p in layer.named_parameters()
                                                      if p.grad is not None}})
    cpu, cuda = grads
    assert cpu.keys() == cuda.keys() and "experts.gate_up_proj" in cpu
    for name in cpu:
        scale = cpu[name].abs().max().clamp_min(1e-6)
        assert (cuda[name] - cpu[name]).abs().max() <= 0.05 * scale, name


@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"])
@pytest.mark.parametrize("rows", [1, 45, 2048])
def test_ungated_triton_experts_with_biases_match_the_reference(scheme, rows):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_kernel_epilogues import _problem

    E, H, I = 8, 256, 512
    x, ids, w = _problem(rows, E, H, I, scheme, "relu2", True, seed=5)
    wc = ExpertWeights(*(t.cuda() if isinstance(t, torch.Tensor) else t.to("cuda") for t in (w.gate_up, w.down)), scheme,
                       w.gate_up_bias.cuda(), w.down_bias.cuda())
    if isinstance(x, torch.Tensor):
        xc = x.cuda()
    else:  # the same quantized rows, moved
        xc = dataclasses.replace(x, **{f.name: getattr(x, f.name).cuda() for f in dataclasses.fields(x)
                                       if isinstance(getattr(x, f.name), torch.Tensor)})
    experts = TritonExperts("relu2", torch.bfloat16)
    y = experts(ExpertInput(xc, ids.cuda()), wc)
    ref = expert_reference(x, ids, w, "relu2", torch.bfloat16, accumulation=experts.accumulation(scheme))
    err, atol, rtol, ok = compare(y.cpu(), ref, torch.bfloat16, scheme)
    assert ok, f"max |err| {err:.3g} > atol {atol} + rtol {rtol} |ref|"
