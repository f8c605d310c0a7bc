"""Every routing kind's top-k weights carry the family's gradient: ``route`` on the router's
logits against transformers' own router module under autograd, one tiny router per kind.

The loss is <G, D> with D [T, E] the dense routing weights (each token's top-k weights at their
experts, zero elsewhere), so the comparison does not depend on the order of a token's k
choices; the gradients compared are those of the tokens x, the router weight and (gpt-oss) the
router's bias. The correction bias (DeepSeek-V3, ERNIE 4.5, Kolibri-1) steers selection only and is a
buffer: no gradient reaches it on either side.

Phi-3.5-MoE's ``sparsemixer`` is the family's eval-mode function (transformers in training mode
samples the experts and replaces the gradient with Heun's third-order estimate, which moeshard
does not offer): its weights are softmaxes over the logits near the pick, differentiated as
they are; a row whose window holds the pick alone has weight 1 and no gradient, in both.
"""

from __future__ import annotations

import pytest
import torch

from moeshard.config import MoEConfig
from moeshard.router import route_tokens
from moeshard.routing import get_routing, register_routing, unregister_routing

tf = pytest.importorskip("transformers")

E, H, T = 8, 16, 48
SHAPE = dict(hidden_size=H, num_attention_heads=2, num_key_value_heads=2)

# kind -> (transformers module, its router class, config class, config fields, moeshard routing fields)
KINDS = {
    "softmax": ("mixtral", "MixtralTopKRouter", "MixtralConfig",
                dict(num_local_experts=E, num_experts_per_tok=2), dict(top_k=2, renormalize=True)),
    "sigmoid": ("deepseek_v3", "DeepseekV3TopkRouter", "DeepseekV3Config",
                dict(n_routed_experts=E, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     norm_topk_prob=True),
                dict(top_k=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, use_correction_bias=True,
                     renormalize=True)),
    "group_limited_greedy": ("deepseek_v2", "DeepseekV2TopkRouter", "DeepseekV2Config",
                             dict(n_routed_experts=E, num_experts_per_tok=2, topk_method="group_limited_greedy",
                                  n_group=4, topk_group=2, routed_scaling_factor=2.0),
                             dict(top_k=2, n_group=4, topk_group=2, routed_scaling_factor=2.0, renormalize=False)),
    "topk_softmax": ("granitemoe", "GraniteMoeTopKRouter", "GraniteMoeConfig",
                     dict(num_local_experts=E, num_experts_per_tok=2), dict(top_k=2, renormalize=False)),
    "topk_softmax_bias": ("gpt_oss", "GptOssTopKRouter", "GptOssConfig",
                          dict(num_local_experts=E, num_experts_per_tok=2), dict(top_k=2, renormalize=False)),
    "topk_sigmoid_input": ("llama4", "Llama4Router", "Llama4TextConfig",
                           dict(num_local_experts=E, num_experts_per_tok=1), dict(top_k=1, renormalize=False)),
    "topk_sigmoid": ("cohere2_moe", "Cohere2MoeTopKRouter", "Cohere2MoeConfig",
                     dict(num_experts=E, num_experts_per_tok=2, expert_selection_fn="sigmoid", norm_topk_prob=True),
                     dict(top_k=2, renormalize=True)),
    "topk_sigmoid_biased": ("kolibri1", "Kolibri1TopKRouter", "Kolibri1Config",
                            dict(num_experts=E, num_experts_per_tok=2, norm_topk_prob=True),
                            dict(top_k=2, renormalize=True, use_correction_bias=True)),
    "softmax_bias": ("ernie4_5_moe", "Ernie4_5_MoeTopKRouter", "Ernie4_5_MoeConfig",
                     dict(moe_num_experts=E, moe_k=2), dict(top_k=2, use_correction_bias=True)),
    "sparsemixer": ("phimoe", "PhimoeTopKRouter", "PhimoeConfig",
                    dict(num_local_experts=E, num_experts_per_tok=2, router_jitter_noise=0.01),
                    dict(top_k=2, renormalize=False)),
}


def _router(kind: str):
    module, router_class, config_class, fields, _ = KINDS[kind]
    modeling = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    if not hasattr(tf, config_class) or not hasattr(modeling, router_class):
        pytest.skip(f"transformers {tf.__version__} has no {config_class}.{router_class}")
    router = getattr(modeling, router_class)(getattr(tf, config_class)(**SHAPE, **fields)).eval()
    g = torch.Generator().manual_seed(len(kind))
    with torch.no_grad():
        for name, p in _trained(router).items():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name == "bias" else 1.0))
        if kind == "sparsemixer":  # rows near one another, so that many windows hold several experts
            router.weight.copy_(router.weight[:1] + 0.005 * router.weight)
        bias = _correction(router)
        if bias is not None:
            bias.copy_(torch.rand(bias.shape, generator=g) / 4)
    return router


def _trained(router) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in router.named_parameters() if p.requires_grad}


def _correction(router) -> torch.Tensor | None:
    """The router's correction bias: a buffer (DeepSeek-V3) or a frozen parameter (ERNIE 4.5)."""
    tensors = [*router.named_buffers(), *router.named_parameters()]
    return next((t for name, t in tensors if name.endswith("e_score_correction_bias")), None)


def _ids_and_weights(out) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's (logits, weights, ids) as transformers 5.24 orders it, or (ids, weights, logits)
    as 5.17's Granite router does -> (ids [T, K], weights [T, K])."""
    ids = next(t for t in out if not t.is_floating_point())
    weights = next(t for t in out if t.is_floating_point() and t.shape == ids.shape)
    return ids, weights


def _dense(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.zeros(ids.shape[0], E, dtype=weights.dtype).scatter(1, ids, weights)


@pytest.mark.parametrize("kind", list(KINDS))
def test_route_weights_have_the_gradient_of_transformers_router(kind):
    router = _router(kind)
    cfg = MoEConfig(num_experts=E, hidden_size=H, intermediate_size=8, scoring=kind, **KINDS[kind][4])
    g = torch.Generator().manual_seed(100 + len(kind))
    x = torch.randn(T, H, generator=g)
    upstream = torch.randn(T, E, generator=g)

    x_tf = x.clone().requires_grad_()
    out = router(x_tf)
    dense_tf = out[0] if kind == "topk_sigmoid_input" else _dense(*_ids_and_weights(out))  # Llama-4's scores are dense
    (dense_tf * upstream).sum().backward()

    x_ms = x.clone().requires_grad_()
    params = {name: p.detach().clone().requires_grad_() for name, p in _trained(router).items()}
    correction = _correction(router)
    if correction is not None:
        correction = correction.detach().reshape(-1)
    r = route_tokens(x_ms, params["weight"], cfg, correction, params.get("bias"))
    dense = _dense(r.topk_ids, r.topk_weights)
    assert torch.allclose(dense, dense_tf.detach().float(), rtol=1e-5, atol=1e-6), kind  # the same routes
    (dense * upstream).sum().backward()

    assert x_tf.grad is not None and x_ms.grad is not None
    scale = float(x_tf.grad.abs().max())
    assert scale > 0, kind  # the weights do carry a gradient
    bias = _correction(router)
    assert bias is None or bias.grad is None  # selection only: nothing reaches it
    assert torch.allclose(x_ms.grad, x_tf.grad, rtol=0, atol=1e-5 * scale), kind
    for name, p in _trained(router).items():
        assert p.grad is not None and params[name].grad is not None, (kind, name)
        assert torch.allclose(params[name].grad, p.grad, rtol=0, atol=1e-5 * float(p.grad.abs().max())), (kind, name)
    if kind == "topk_softmax_bias":
        assert float(params["bias"].grad.abs().max()) > 0  # the router's bias is trained
    if kind == "sparsemixer":
        # rows whose windows hold several experts have a gradient; a lone pick's weight 1 has none
        lone = (r.topk_weights == 1).all(dim=1)
        assert lone.any() and (~lone).any()
        assert float(x_ms.grad[lone].abs().max()) == 0 and float(x_ms.grad[~lone].abs().amax(dim=1).min()) > 0


# Kinds that score in the model dtype, whose transformers routing is not one router module's
# output: LFM2-MoE's router takes the block's expert bias as an argument; DBRX's router returns
# logits and its FFN routes them (``route_tokens_to_experts``).
# kind -> (module, config class, config fields, moeshard routing fields)
MODEL_DTYPE_KINDS = {
    "sigmoid_bias_model": ("lfm2_moe", "Lfm2MoeConfig",
                           dict(num_experts=E, num_experts_per_tok=2, routed_scaling_factor=1.5),
                           dict(top_k=2, use_correction_bias=True, routed_scaling_factor=1.5)),
    "softmax_model": ("dbrx", "DbrxConfig", dict(d_model=H, ffn_config=dict(moe_num_experts=E, moe_top_k=2)),
                      dict(top_k=2, renormalize=True)),
    "softmax_group_model": ("mistral4", "Mistral4Config",
                            dict(n_routed_experts=E, num_experts_per_tok=2, n_group=4, topk_group=2,
                                 routed_scaling_factor=1.5, norm_topk_prob=True),
                            dict(top_k=2, n_group=4, topk_group=2, routed_scaling_factor=1.5, renormalize=True)),
    "sqrtsoftplus_bias_model": ("deepseek_v4", "DeepseekV4Config",
                                dict(n_routed_experts=E, num_experts_per_tok=2, routed_scaling_factor=1.5),
                                dict(top_k=2, use_correction_bias=True, routed_scaling_factor=1.5)),
}
# Each model-dtype kind's fp32 counterpart (the same steps with the scores in fp32), for the bf16
# test; None where no registered kind is one (a probe kind is registered for the test's duration).
WIDE = {"softmax_model": "softmax", "sigmoid_bias_model": "sigmoid", "sqrtsoftplus_bias_model": None,
        "softmax_group_model": None}


def _model_dtype_routing(kind: str, g: torch.Generator, dtype: torch.dtype = torch.float32):
    """(router weight, selection bias or None, x -> (ids, weights)) of the family's own routing
    code in ``dtype``, its router weight drawn from ``g`` (the LFM2-MoE bias stays fp32, as the
    block holds it)."""
    module, config_class, fields, _ = MODEL_DTYPE_KINDS[kind]
    modeling = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    if not hasattr(tf, config_class):
        pytest.skip(f"transformers {tf.__version__} has no {config_class}")
    config = getattr(tf, config_class)(**SHAPE, **fields)
    if module == "lfm2_moe":
        router = modeling.Lfm2MoeTopKRouter(config).eval().to(dtype)
        bias = torch.rand(E, generator=g) / 4
        weight = router.weight

        def run(x):
            _, w, ids = router(x, bias)
            return ids, w
    elif module == "mistral4":
        router = modeling.Mistral4TopkRouter(config).eval().to(dtype)
        bias, weight = None, router.weight

        def run(x):
            _, w, ids = router(x)
            return ids, w
    elif module == "deepseek_v4":
        router = modeling.DeepseekV4TopKRouter(config).eval()
        router.weight.data = router.weight.data.to(dtype)  # the selection bias stays fp32, as loaded
        with torch.no_grad():
            router.e_score_correction_bias.copy_(torch.rand(E, generator=g) / 4)
        bias, weight = router.e_score_correction_bias, router.weight

        def run(x):
            _, w, ids = router(x)
            return ids, w
    else:
        ffn = modeling.DbrxFFN(config).eval().to(dtype)
        bias, weight = None, ffn.router.layer.weight

        def run(x):
            w, ids = ffn.route_tokens_to_experts(ffn.router(x))
            return ids, w
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=g))
    return weight, bias, run


@pytest.mark.parametrize("kind", list(MODEL_DTYPE_KINDS))
def test_model_dtype_kinds_have_the_gradient_of_transformers_routing(kind):
    """fp32 (the model dtype here): the same routes, weights and gradients of x and the router
    weight as the family's own routing, with its +1e-6 (LFM2-MoE), its 1-norm (DBRX) and its groups
    (Mistral Small 4)."""
    g = torch.Generator().manual_seed(200 + len(kind))
    weight, bias, run = _model_dtype_routing(kind, g)
    cfg = MoEConfig(num_experts=E, hidden_size=H, intermediate_size=8, scoring=kind, router_dtype="model",
                    **MODEL_DTYPE_KINDS[kind][3])
    x = torch.randn(T, H, generator=g)
    upstream = torch.randn(T, E, generator=g)

    x_tf = x.clone().requires_grad_()
    dense_tf = _dense(*run(x_tf))
    (dense_tf * upstream).sum().backward()

    x_ms = x.clone().requires_grad_()
    w_ms = weight.detach().clone().requires_grad_()
    r = route_tokens(x_ms, w_ms, cfg, bias)
    dense = _dense(r.topk_ids, r.topk_weights)
    assert torch.equal(dense, dense_tf.detach()), kind  # the same routes and weights, bit for bit
    (dense * upstream).sum().backward()
    assert x_tf.grad is not None and x_ms.grad is not None and weight.grad is not None and w_ms.grad is not None
    assert float(x_tf.grad.abs().max()) > 0, kind
    assert torch.allclose(x_ms.grad, x_tf.grad, rtol=0, atol=1e-5 * float(x_tf.grad.abs().max())), kind
    assert torch.allclose(w_ms.grad, weight.grad, rtol=0, atol=1e-5 * float(weight.grad.abs().max())), kind


@pytest.mark.parametrize("kind", list(MODEL_DTYPE_KINDS))
def test_model_dtype_kinds_in_bf16_are_the_familys_routing_bit_for_bit(kind):
    """bf16: the same experts and the same bf16 weights as the family's routing (each step
    rounded to bf16); the same kind's steps in fp32 give other weights for some tokens."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(300 + len(kind))
    weight, bias, run = _model_dtype_routing(kind, g, torch.bfloat16)
    cfg = MoEConfig(num_experts=E, hidden_size=H, intermediate_size=8, scoring=kind, router_dtype="model",
                    dtype=torch.bfloat16, **MODEL_DTYPE_KINDS[kind][3])
    x = torch.randn(4 * T, H, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        ids, w = run(x)
        r = route_tokens(x, weight, cfg, bias)
    assert w.dtype == torch.bfloat16
    assert torch.equal(_dense(r.topk_ids, r.topk_weights), _dense(ids, w.float())), kind
    probe = WIDE[kind] is None
    if probe:
        register_routing(replace(get_routing(kind), name="fp32_probe", score_dtype="fp32"))
    try:
        wide = replace(cfg, scoring="fp32_probe" if probe else WIDE[kind])
        with torch.no_grad():
            fp32 = route_tokens(x, weight, wide, bias)
    finally:
        if probe:
            unregister_routing("fp32_probe")
    assert not torch.equal(_dense(fp32.topk_ids, fp32.topk_weights), _dense(ids, w.float())), kind


def test_every_registered_routing_kind_is_compared():
    from moeshard.routing import routing_names

    assert set(KINDS) | set(MODEL_DTYPE_KINDS) == set(routing_names())
