"""Save a small random transformers MoE model (config.json + model.safetensors) for ``moeshard generate``.

    PYTHONPATH=src python3 scripts/make_tiny_moe.py DIR [--family qwen3_moe] [--hidden 256]
        [--moe-intermediate 256] [--experts 8] [--layers 2] [--vocab 256] [--dtype bfloat16] [--seed 0]

Families: mixtral, qwen2_moe, qwen3_moe, deepseek_v3 (its first layer dense), and the softmax-routed
ones built from ``transformers.AutoConfig.for_model`` (``SOFTMAX_FAMILIES``). The defaults keep
every size a multiple of 128, so ``--quant fp8_block`` also runs under ``--tp 2`` without EP
(the intermediate slice of a TP rank must hold whole 128-wide blocks).
"""

from __future__ import annotations

import argparse
import sys


def _alternating(first: str, second: str, layers: int) -> list[str]:
    """Per-layer types ``first, second, first, ...`` ending with ``second`` (the attention layer)."""
    return [second if (layers - 1 - i) % 2 == 0 else first for i in range(layers)]


def _softmax_family(family: str, common: dict, moe_intermediate: int, experts: int):
    """transformers' config of one of ``SOFTMAX_FAMILIES``: its MoE arguments at these sizes."""
    import transformers as tf

    I, L, head = moe_intermediate, common["num_hidden_layers"], common["hidden_size"] // common["num_attention_heads"]
    linear = dict(layer_types=_alternating("linear_attention", "full_attention", L), linear_num_value_heads=4,
                  linear_num_key_heads=2, linear_key_head_dim=head, linear_value_head_dim=head, head_dim=head)
    granite = dict(intermediate_size=I, num_local_experts=experts)
    extra = {
        "olmoe": dict(intermediate_size=I, num_experts=experts),
        "flex_olmo": dict(intermediate_size=I, num_experts=experts),
        "mellum": dict(intermediate_size=2 * I, moe_intermediate_size=I, num_experts=experts, head_dim=head,
                       mlp_layer_types=["dense"] + ["sparse"] * (L - 1)),
        "minimax": dict(intermediate_size=I, num_local_experts=experts, head_dim=head,
                        layer_types=_alternating("linear_attention", "full_attention", L)),
        "jamba": dict(intermediate_size=I, num_experts=experts, attn_layer_period=2, attn_layer_offset=1,
                      expert_layer_period=2, expert_layer_offset=1),
        "qwen3_next": dict(intermediate_size=2 * I, moe_intermediate_size=I, shared_expert_intermediate_size=I,
                           num_experts=experts, **linear),
        "qwen3_5_moe_text": dict(intermediate_size=2 * I, moe_intermediate_size=I, shared_expert_intermediate_size=I,
                                 num_experts=experts, **linear),
        "deepseek_v2": dict(intermediate_size=2 * I, moe_intermediate_size=I, n_routed_experts=experts,
                            first_k_dense_replace=1, n_shared_experts=1, topk_method="group_limited_greedy", n_group=2,
                            topk_group=1, num_key_value_heads=common["num_attention_heads"], q_lora_rank=None,
                            kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32),
        "hunyuan_v1_moe": dict(intermediate_size=I, num_experts=experts, moe_topk=2, head_dim=head,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "ernie4_5_moe": dict(intermediate_size=2 * I, moe_intermediate_size=I, moe_num_experts=experts, moe_k=2,
                             moe_num_shared_experts=1),
        "granitemoe": granite,
        "granitemoeshared": dict(granite, shared_intermediate_size=I),
        "granitemoehybrid": dict(granite, shared_intermediate_size=I, layer_types=_alternating("mamba", "attention", L),
                                 mamba_n_heads=8, mamba_d_head=2 * common["hidden_size"] // 8, mamba_n_groups=1),
        "phimoe": dict(intermediate_size=I, num_local_experts=experts),
        "cohere2_moe": dict(intermediate_size=I, num_experts=experts, head_dim=head, num_shared_experts=1,
                            shared_expert_combination_strategy="sum", mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
                            prefix_dense_intermediate_size=2 * I),
    }[family]
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the small vocabulary
    return tf.AutoConfig.for_model(family, **{**common, "num_experts_per_tok": 2, **ids, **extra})


SOFTMAX_FAMILIES = ("olmoe", "flex_olmo", "mellum", "minimax", "jamba", "qwen3_next", "qwen3_5_moe_text",
                    "deepseek_v2", "hunyuan_v1_moe", "ernie4_5_moe", "granitemoe", "granitemoeshared",
                    "granitemoehybrid", "phimoe", "cohere2_moe")


def build(family: str, hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    sizes = dict(intermediate_size=2 * moe_intermediate, moe_intermediate_size=moe_intermediate)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=512)
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=moe_intermediate, num_local_experts=experts,
                                num_experts_per_tok=2)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, **sizes,
                                 shared_expert_intermediate_size=moe_intermediate, num_experts=experts,
                                 num_experts_per_tok=2)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, **sizes,
                                 num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True)
    if family == "deepseek_v3":
        common["num_key_value_heads"] = 4
        return tf.DeepseekV3Config(**common, **sizes,
                                   first_k_dense_replace=1, n_routed_experts=experts, num_experts_per_tok=2,
                                   n_group=2, topk_group=1, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=64,
                                   qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)
    if family in SOFTMAX_FAMILIES:
        return _softmax_family(family, common, moe_intermediate, experts)
    raise SystemExit(f"unknown family {family!r}; choose mixtral, qwen2_moe, qwen3_moe, deepseek_v3 or one of "
                     f"{', '.join(SOFTMAX_FAMILIES)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    import transformers as tf

    torch.manual_seed(args.seed)
    cfg = build(args.family, args.hidden, args.moe_intermediate, args.experts, args.layers, args.vocab)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype)).eval()
    model.save_pretrained(args.dir)
    n = sum(p.numel() for p in model.parameters())
    print(f"saved {args.family} ({n / 1e6:.2f} M parameters, {args.dtype}) to {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
