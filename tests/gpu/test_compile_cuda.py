"""``torch.compile`` of a model holding a CUDA ``MoELayer`` (its Triton experts and one-pass
routing): the layer runs eagerly inside the compiled model, so the compiled model's output and
gradients are the eager model's (the CPU proof, bit for bit, is tests/test_compile.py; here the
compiled residual add may round its own way, so bf16's tolerance)."""

import pytest
import torch
from torch import nn

from moeshard.layer import MoELayer
from moeshard.presets import PRESETS
from moeshard.weights import MoEWeights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class _Residual(nn.Module):
    def __init__(self, layer: MoELayer) -> None:
        super().__init__()
        self.moe = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x)


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "deepseek-v3"])
def test_a_compiled_model_on_cuda_gives_the_eager_models_outputs_and_gradients(preset):
    torch.compiler.reset()
    cfg = PRESETS[preset].config("small", torch.bfloat16)
    layer = MoELayer(cfg, weights=MoEWeights.random(cfg, torch.Generator().manual_seed(0)), device="cuda")
    model = _Residual(layer).requires_grad_(True)
    compiled = torch.compile(model)
    x = torch.randn(48, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    grads = []
    for run in (model, compiled):
        model.zero_grad()
        xg = x.clone().requires_grad_()
        run(xg).float().pow(2).sum().backward()
        grads.append((xg.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (gx_eager, gp_eager), (gx_compiled, gp_compiled) = grads
    torch.testing.assert_close(gx_compiled, gx_eager)
    assert gp_eager.keys() == gp_compiled.keys() and gp_eager
    for name in gp_eager:
        torch.testing.assert_close(gp_compiled[name], gp_eager[name], msg=name)
