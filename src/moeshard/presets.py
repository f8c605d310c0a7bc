"""Named model shapes, shared by ``moeshard check``, ``run --random`` and ``bench``.

Each preset has its real size (``full``), a scaled-down CPU size with the same routing features
(scoring, grouping, shared experts) small enough for the CPU verification matrix (``small``),
and ``medium``: 4x the hidden size, 2x the intermediate sizes and up to 2x the experts of
``small``, for the longer CPU runs (``moeshard check --full``). Each computes its router logits
as its family does (``MoEConfig.router_dtype``): in the model dtype, except the DeepSeek-V3,
DeepSeek-V2 and ERNIE 4.5 presets, whose routers transformers runs in fp32; the matrix's bfloat16
cases therefore cover both. DBRX, LFM2-MoE and DeepSeek-V4 also score in the model dtype (their
routing kinds' ``score_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moeshard.config import MoEConfig

SIZES = ("small", "medium", "full")


@dataclass(frozen=True)
class Preset:
    """A named shape. router_dtype: the family's router precision (``MoEConfig.router_dtype``),
    put into ``full`` and ``small`` (and so ``medium``)."""

    name: str
    full: MoEConfig
    small: MoEConfig
    summary: str
    router_dtype: str = "fp32"

    def __post_init__(self) -> None:
        for size in ("full", "small"):
            object.__setattr__(self, size, replace(getattr(self, size), router_dtype=self.router_dtype))

    @property
    def medium(self) -> MoEConfig:
        s = self.small
        return replace(s, hidden_size=4 * s.hidden_size, intermediate_size=2 * s.intermediate_size,
                       num_experts=min(2 * s.num_experts, self.full.num_experts),
                       shared_intermediate_size=2 * s.shared_intermediate_size)

    def config(self, size: str = "small", dtype: torch.dtype | None = None) -> MoEConfig:
        if size not in SIZES:
            raise ValueError(f"preset size: {size!r} is not one of {list(SIZES)}")
        cfg = {"small": self.small, "medium": self.medium, "full": self.full}[size]
        return replace(cfg, dtype=dtype) if dtype is not None else cfg


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("mixtral-8x7b",
           MoEConfig(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512),
           "softmax top-2 of 8, renormalized", router_dtype="model"),
    Preset("qwen3-30b-a3b",
           MoEConfig(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768, renormalize=True),
           MoEConfig(num_experts=16, top_k=4, hidden_size=128, intermediate_size=512, renormalize=True),
           "softmax top-8 of 128, norm_topk_prob", router_dtype="model"),
    Preset("qwen2-57b-a14b",
           MoEConfig(num_experts=64, top_k=8, hidden_size=3584, intermediate_size=2560, renormalize=False,
                     num_shared_experts=1, shared_intermediate_size=20480, shared_expert_gate=True),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512, renormalize=False,
                     num_shared_experts=1, shared_intermediate_size=64, shared_expert_gate=True),
           "softmax top-k without renormalization, gated shared expert", router_dtype="model"),
    Preset("deepseek-v3",
           MoEConfig(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, scoring="sigmoid",
                     n_group=8, topk_group=4, routed_scaling_factor=2.5, use_correction_bias=True,
                     num_shared_experts=1, shared_intermediate_size=2048),
           MoEConfig(num_experts=16, top_k=4, hidden_size=128, intermediate_size=512, scoring="sigmoid",
                     n_group=4, topk_group=2, routed_scaling_factor=2.5, use_correction_bias=True,
                     num_shared_experts=1, shared_intermediate_size=64),
           "sigmoid, correction bias, grouped top-k, routed scaling, shared expert", router_dtype="fp32"),
    # The full size is the transformers Cohere2MoeConfig default shape.
    Preset("cohere2-moe",
           MoEConfig(num_experts=8, top_k=2, hidden_size=8192, intermediate_size=22528, scoring="topk_sigmoid",
                     renormalize=True, routed_scaling_factor=0.5, num_shared_experts=1,
                     shared_intermediate_size=22528, shared_scale=0.5),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512, scoring="topk_sigmoid",
                     renormalize=True, routed_scaling_factor=0.5, num_shared_experts=1, shared_intermediate_size=64,
                     shared_scale=0.5),
           "top-k of the logits, sigmoid of the selected, renormalized; shared expert averaged with the routed",
           router_dtype="model"),
    Preset("gpt-oss-120b",
           MoEConfig(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880, scoring="topk_softmax_bias",
                     activation="swiglu_clamped", renormalize=False, expert_bias=True),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512, scoring="topk_softmax_bias",
                     activation="swiglu_clamped", renormalize=False, expert_bias=True),
           "router bias, softmax over the top-k logits, expert biases, clamped SwiGLU", router_dtype="model"),
    Preset("llama4-scout",
           MoEConfig(num_experts=16, top_k=1, hidden_size=5120, intermediate_size=8192, scoring="topk_sigmoid_input",
                     renormalize=False, num_shared_experts=1, shared_intermediate_size=8192),
           MoEConfig(num_experts=8, top_k=1, hidden_size=128, intermediate_size=512, scoring="topk_sigmoid_input",
                     renormalize=False, num_shared_experts=1, shared_intermediate_size=64),
           "sigmoid of the top-1 logit applied to the expert's input, shared expert", router_dtype="model"),
    Preset("ernie-4.5-21b-a3b",
           MoEConfig(num_experts=64, top_k=6, hidden_size=2560, intermediate_size=1536, scoring="softmax_bias",
                     use_correction_bias=True, num_shared_experts=2, shared_intermediate_size=1536),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512, scoring="softmax_bias",
                     use_correction_bias=True, num_shared_experts=2, shared_intermediate_size=64),
           "softmax, selection bias, renormalized with a floor, ungated shared experts", router_dtype="fp32"),
    Preset("phi-3.5-moe",
           MoEConfig(num_experts=16, top_k=2, hidden_size=4096, intermediate_size=6400, scoring="sparsemixer",
                     renormalize=False),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512, scoring="sparsemixer",
                     renormalize=False),
           "sparsemixer: two rounds of top-1, each weighted by a softmax among the logits near it", router_dtype="model"),
    Preset("deepseek-v2",
           MoEConfig(num_experts=160, top_k=6, hidden_size=5120, intermediate_size=1536,
                     scoring="group_limited_greedy", renormalize=False, n_group=8, topk_group=3,
                     routed_scaling_factor=16.0, num_shared_experts=2, shared_intermediate_size=1536),
           MoEConfig(num_experts=16, top_k=4, hidden_size=128, intermediate_size=512,
                     scoring="group_limited_greedy", renormalize=False, n_group=4, topk_group=2,
                     routed_scaling_factor=2.0, num_shared_experts=2, shared_intermediate_size=64),
           "softmax, groups scored by their best expert, top-k in the kept groups, routed scaling, shared experts",
           router_dtype="fp32"),
    Preset("granite-3b-moe",
           MoEConfig(num_experts=40, top_k=8, hidden_size=1536, intermediate_size=512, scoring="topk_softmax",
                     renormalize=False),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512, scoring="topk_softmax",
                     renormalize=False),
           "top-k of the logits, softmax over the selected", router_dtype="model"),
    Preset("dbrx",
           MoEConfig(num_experts=16, top_k=4, hidden_size=6144, intermediate_size=10752, scoring="softmax_model",
                     router_dtype="model"),
           MoEConfig(num_experts=16, top_k=4, hidden_size=128, intermediate_size=512, scoring="softmax_model",
                     router_dtype="model"),
           "softmax in the model dtype, top-4 of 16, divided by their sum", router_dtype="model"),
    Preset("lfm2-8b-a1b",
           MoEConfig(num_experts=32, top_k=4, hidden_size=2048, intermediate_size=1792, scoring="sigmoid_bias_model",
                     use_correction_bias=True, router_dtype="model"),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512, scoring="sigmoid_bias_model",
                     use_correction_bias=True, router_dtype="model"),
           "sigmoid in the model dtype, selection bias, divided by the sum plus 1e-6", router_dtype="model"),
    # The full size is the transformers Kolibri1Config default shape.
    Preset("kolibri1",
           MoEConfig(num_experts=384, top_k=6, hidden_size=2560, intermediate_size=512, scoring="topk_sigmoid_biased",
                     use_correction_bias=True, renormalize=False, num_shared_experts=1, shared_intermediate_size=512),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512, scoring="topk_sigmoid_biased",
                     use_correction_bias=True, renormalize=False, num_shared_experts=1, shared_intermediate_size=64),
           "top-k of the logits plus a selection bias, sigmoid of the unbiased selected logits, shared expert",
           router_dtype="fp32"),
    # The full size is the transformers HYV4Config default shape.
    Preset("hy-v4",
           MoEConfig(num_experts=256, top_k=8, hidden_size=2816, intermediate_size=768, activation="silu_clamped",
                     scoring="sigmoid", routed_scaling_factor=2.827, use_correction_bias=True, num_shared_experts=1,
                     shared_intermediate_size=768, shared_activation="silu"),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512, activation="silu_clamped",
                     scoring="sigmoid", routed_scaling_factor=2.827, use_correction_bias=True, num_shared_experts=1,
                     shared_intermediate_size=64, shared_activation="silu"),
           "sigmoid, selection bias, routed experts' SwiGLU clamped at 10, a shared expert's not", router_dtype="fp32"),
    # The full size is the transformers DeepseekV4Config default shape; its learned layers' routing
    # (the first layers' token-id routing is transformers', given to the experts).
    Preset("deepseek-v4",
           MoEConfig(num_experts=256, top_k=6, hidden_size=4096, intermediate_size=2048, activation="silu_clamped",
                     scoring="sqrtsoftplus_bias_model", routed_scaling_factor=1.5, use_correction_bias=True,
                     num_shared_experts=1, shared_intermediate_size=2048, shared_activation="silu_clamped",
                     router_dtype="model"),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512, activation="silu_clamped",
                     scoring="sqrtsoftplus_bias_model", routed_scaling_factor=1.5, use_correction_bias=True,
                     num_shared_experts=1, shared_intermediate_size=64, shared_activation="silu_clamped",
                     router_dtype="model"),
           "sqrt(softplus) in the model dtype, selection bias, renormalized, clamped SwiGLU in every expert",
           router_dtype="model"),
    # The full size is the published Nemotron-3-Nano-30B-A3B's routed experts; its shared expert,
    # ungated too, stays transformers' in the model (``MoEExperts``), so the preset has none.
    Preset("nemotron-3-nano",
           MoEConfig(num_experts=128, top_k=6, hidden_size=2688, intermediate_size=1856, activation="relu2",
                     scoring="sigmoid", routed_scaling_factor=2.5, use_correction_bias=True),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512, activation="relu2",
                     scoring="sigmoid", routed_scaling_factor=2.5, use_correction_bias=True),
           "sigmoid, selection bias, renormalized, routed scaling, ungated relu^2 experts", router_dtype="fp32"),
    # The full size is the transformers Inkling2TextConfig default shape (no shared experts).
    Preset("inkling-2",
           MoEConfig(num_experts=384, top_k=8, hidden_size=4608, intermediate_size=2304, activation="swiglu_softcapped",
                     scoring="sigmoid", routed_scaling_factor=8.0, use_correction_bias=True),
           MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=512, activation="swiglu_softcapped",
                     scoring="sigmoid", routed_scaling_factor=8.0, use_correction_bias=True),
           "sigmoid, selection bias, renormalized, routed scaling 8, soft-capped SwiGLU", router_dtype="fp32"),
)}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"preset: {name!r} is not one of {sorted(PRESETS)}")
    return PRESETS[name]
