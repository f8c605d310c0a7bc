"""Save a small random transformers MoE model (config.json + model.safetensors) for ``moeshard generate``.

    PYTHONPATH=src python3 scripts/make_tiny_moe.py DIR [--family qwen3_moe] [--hidden 256]
        [--moe-intermediate 256] [--experts 8] [--layers 2] [--vocab 256] [--dtype bfloat16] [--seed 0]

Families: mixtral, qwen2_moe, qwen3_moe, deepseek_v3 (its first layer dense), gpt_oss (random
expert biases: transformers initialises them to zero), llama4_text (top-1, a shared expert, MoE on
every second layer). The defaults keep
every size a multiple of 128, so ``--quant fp8_block`` also runs under ``--tp 2`` without EP
(the intermediate slice of a TP rank must hold whole 128-wide blocks).
"""

from __future__ import annotations

import argparse
import sys


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
    if family in EXTRA:
        return EXTRA[family](hidden, moe_intermediate, experts, layers, vocab)
    raise SystemExit(f"unknown family {family!r}; choose mixtral, qwen2_moe, qwen3_moe, deepseek_v3, "
                     f"{', '.join(EXTRA)}")


def _gpt_oss(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    return tf.AutoConfig.for_model("gpt_oss", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                                   intermediate_size=moe_intermediate, num_local_experts=experts,
                                   num_experts_per_tok=2, initializer_range=0.2, max_position_embeddings=512)


def _llama4_text(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    return tf.AutoConfig.for_model("llama4_text", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                                   intermediate_size=moe_intermediate, intermediate_size_mlp=2 * moe_intermediate,
                                   num_local_experts=experts, num_experts_per_tok=1,
                                   interleave_moe_layer_step=2 if layers > 1 else 1, initializer_range=0.2)


# Families built from transformers' config class by model type (AutoConfig.for_model).
EXTRA = {"gpt_oss": _gpt_oss, "llama4_text": _llama4_text}


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
    with torch.no_grad():  # expert biases (gpt_oss) start at zero in transformers: random, so that they count
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                p.normal_(0.0, 0.5)
    model.save_pretrained(args.dir)
    n = sum(p.numel() for p in model.parameters())
    print(f"saved {args.family} ({n / 1e6:.2f} M parameters, {args.dtype}) to {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
