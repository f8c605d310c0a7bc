"""``torch.compile`` of a model that holds moeshard layers: the layer runs eagerly inside the
compiled model (under a compile ``MoELayer.forward`` calls a ``torch.compiler.disable``d
``_forward``: a graph break at its boundary), so the compiled model's outputs and gradients are the eager model's, bit for bit, at
one rank and under EP on CPU ranks, in float32 (whose grouped GEMM torch cannot trace) and
bfloat16, and a transformers model with moeshard blocks compiles too, as does one whose decoder
layers route for moeshard's experts (Gemma 4; their logits within the float32 table: the compiled
attention rounds its own way).

Why the test exists: traced, the layer failed in two ways on torch 2.13 -- a float32 forward on
the grouped GEMM's bf16-only meta function, and any backward on its custom autograd Functions
around graph breaks (an internal dynamo error).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moeshard.config import MoEConfig
from moeshard.layer import MoELayer
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.spawn import spawn
from moeshard.weights import MoEWeights

H = 64


def _model(dtype: torch.dtype, **layer) -> nn.Module:
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=H, intermediate_size=128, dtype=dtype, router_dtype="model")
    gen = torch.Generator().manual_seed(0)
    weights = MoEWeights.random(cfg, gen)
    first, last = nn.Linear(H, H), nn.Linear(H, H)
    with torch.no_grad():
        for p in (*first.parameters(), *last.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) / H**0.5)
    return nn.Sequential(first, MoELayer(cfg, weights=weights, **layer), last).to(dtype).requires_grad_(True)


def _run(model: nn.Module, run, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(output, dL/dx, {parameter of model: dL/dp}) of L = sum(y^2) in fp32, y = run(x) (the
    model, or the compiled model)."""
    model.zero_grad()
    x = x.clone().requires_grad_()
    y = run(x)
    y.float().pow(2).sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _differences(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """name -> max |compiled - eager| of the output, the input's gradient, every parameter's
    gradient, and the output without autograd."""
    compiled_model = torch.compile(model)
    eager, compiled = _run(model, model, x), _run(model, compiled_model, x)
    out = {"output": (eager[0] - compiled[0]).abs().max().item(), "x.grad": (eager[1] - compiled[1]).abs().max().item()}
    assert set(eager[2]) == set(compiled[2]) and any(n.startswith("1.") for n in eager[2])  # the layer's too
    out.update({n: (eager[2][n] - compiled[2][n]).abs().max().item() for n in eager[2]})
    with torch.no_grad():
        out["no_grad output"] = (model(x) - compiled_model(x)).abs().max().item()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_model_gives_the_eager_models_outputs_and_gradients(dtype):
    torch.compiler.reset()
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    diffs = _differences(_model(dtype), x)
    assert all(d == 0 for d in diffs.values()), diffs


def compiled_ep2_rank() -> dict[str, float]:
    """One rank of dp2-tp1-ep (each DP rank its own tokens): compiled against eager."""
    groups = ParallelGroups.build(ParallelConfig(2, 1, True))
    x = torch.randn(5 + 3 * dist.get_rank(), H, generator=torch.Generator().manual_seed(10 + dist.get_rank()))
    return _differences(_model(torch.float32, groups=groups, backend="all2all"), x)


@pytest.mark.slow  # a spawn of two ranks that each compile; the one-rank case above runs in make test
def test_a_compiled_model_under_ep2_gives_the_eager_models_outputs_and_gradients():
    for rank, diffs in enumerate(spawn(compiled_ep2_rank, 2, timeout_s=180.0)):
        assert all(d == 0 for d in diffs.values()), (rank, diffs)


@pytest.mark.slow
def test_a_compiled_transformers_model_with_moeshard_blocks():
    tf = pytest.importorskip("transformers")
    from moeshard.integrations.transformers import MoEBlock, shard_moe_blocks

    torch.compiler.reset()
    cfg = tf.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    model = shard_moe_blocks(tf.AutoModelForCausalLM.from_config(cfg).eval())
    assert any(isinstance(m, MoEBlock) for m in model.modules())
    ids = torch.tensor([[3, 17, 42, 5, 9], [1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model)(ids).logits
    # The compiled attention and norms round their own way (inductor's fused kernels): the fp32 table.
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


@pytest.mark.slow
def test_a_compiled_model_whose_layers_route_for_moeshards_experts():
    """Gemma 4: the decoder layer routes and calls moeshard's MoEExperts; under torch.compile the
    experts run eagerly on the routing the compiled router gave."""
    tf = pytest.importorskip("transformers")
    from moeshard.integrations.given_routing import MoEExperts
    from moeshard.integrations.transformers import shard_moe_blocks

    torch.compiler.reset()
    try:
        cfg = tf.AutoConfig.for_model("gemma4_text", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                                      moe_intermediate_size=16, num_experts=4, top_k_experts=2, enable_moe_block=True,
                                      hidden_size_per_layer_input=0, layer_types=["sliding_attention",
                                                                                  "full_attention"])
    except ValueError:
        pytest.skip(f"transformers {tf.__version__} has no gemma4_text")
    torch.manual_seed(0)
    model = shard_moe_blocks(tf.AutoModelForCausalLM.from_config(cfg).eval())
    assert all(isinstance(layer.experts, MoEExperts) for layer in model.model.layers)
    ids = torch.tensor([[3, 17, 42, 5, 9], [1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model)(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
