"""Save a small random transformers MoE model (config.json + model.safetensors) for ``moeshard generate``, ``train``.

    PYTHONPATH=src python3 scripts/make_tiny_moe.py DIR [--family qwen3_moe] [--hidden 256]
        [--moe-intermediate 256] [--experts 8] [--layers 2] [--vocab 256] [--dtype float32] [--seed 0]
        [--router-aux-loss-coef 0.01]

Families: mixtral, qwen2_moe, qwen3_moe, deepseek_v3 (its first layer dense); the
sigmoid-scored ones built through ``AutoConfig.for_model`` (``SIGMOID_FAMILIES``: glm4_moe,
glm4_moe_lite, dots1, exaone_moe, deepseek_v32, minimax_m2, afmoe, cohere2_moe, solar_open, glm_moe_dsa,
hy_v3, mimo_v2_flash, flint, beam, laguna, axk2, sarvam_moe, sarvam_mla, dots3_note_text,
minimax_m3_vl_text, kolibri1, hy_v4, axk1), whose router weights and selection biases are drawn
at random (transformers starts some at zero, where every expert ties; A.X-K1's block output norm,
ones, is drawn too);
the softmax-routed ones (``SOFTMAX_FAMILIES``; JetMoE's output bias and Gemma 4's router scales
drawn at random, where transformers starts them at zero and one), also from ``AutoConfig.for_model``; gpt_oss
(random expert biases: transformers initialises them to zero), llama4_text (top-1, a shared
expert, MoE on every second layer), lfm2_moe (short-convolution and attention layers, the
first layer dense, its router and expert bias drawn at random as the sigmoid families' are),
dbrx (its experts as three stacked tensors), kimi_linear and bailing_hybrid (Kimi delta attention
and MLA layers in turn, their routers drawn at random too), deepseek_v4 (its first layer routed
by token id; its routers, token table and selection biases drawn at random), zaya (its MLP
router drawn so that some tokens pick the skip class), longcat_flash (half as many
zero-computation experts as routed ones), inkling_text (one shared expert, which its router weighs),
nemotron_h (Mamba-2 and attention layers in turn before MoE layers of ungated relu^2 experts in a
latent space of half the hidden size; ``--layers`` counts the MoE layers). The vision-language ones
(``VISION_LANGUAGE``: aria, minimax_m3_vl) hold a text family's model as their ``text_config``,
beside a one-layer vision tower; qwen3_vl_moe_text, glm4v_moe_text, glm5_next_text, hy_v4_vl_text,
deepseek_ocr2_text and unlimited_ocr_text are built as their whole vision-language models
(transformers builds no causal LM of them).
The defaults keep every size a multiple of 128, so ``--quant fp8_block`` also runs under
``--tp 2`` without EP (the intermediate slice of a TP rank must hold whole 128-wide blocks).
``--router-aux-loss-coef`` turns transformers' load-balancing loss on (``output_router_logits``),
which ``moeshard train`` adds over the global batch; ``make(...)`` does the same from Python (the
tests call it). Weights are float32 unless ``--dtype`` says otherwise: ``--compare`` judges
float32 runs (in bf16, moeshard's fp32 sum of the experts and transformers' per-expert rounding
can pick different ids at a near-tie of a random model; docs/transformers.md, "Known
differences").
"""

from __future__ import annotations

import argparse
import sys

# model_type -> its config class's arguments beyond the common sizes, given (moe_intermediate, experts).
SIGMOID_FAMILIES = {
    "glm4_moe": lambda i, e: dict(n_routed_experts=e, num_experts_per_tok=2, n_group=2, topk_group=1),
    "glm4_moe_lite": lambda i, e: dict(n_routed_experts=e, num_experts_per_tok=2, num_key_value_heads=4,
                                       q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
                                       v_head_dim=32),
    "dots1": lambda i, e: dict(n_routed_experts=e, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1),
    "exaone_moe": lambda i, e: dict(num_experts=e, num_experts_per_tok=2, num_shared_experts=1),
    "deepseek_v32": lambda i, e: dict(n_routed_experts=e, num_experts_per_tok=2, n_group=2, topk_group=1,
                                      n_shared_experts=1, first_k_dense_replace=1, num_key_value_heads=4,
                                      q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
                                      v_head_dim=32, head_dim=32, index_topk=16, index_head_dim=32, index_n_heads=2),
    "minimax_m2": lambda i, e: dict(intermediate_size=i, head_dim=64, num_local_experts=e, num_experts_per_tok=2),
    "afmoe": lambda i, e: dict(head_dim=64, num_experts=e, num_experts_per_tok=2, num_shared_experts=1,
                               route_scale=2.0),
    "cohere2_moe": lambda i, e: dict(intermediate_size=i, head_dim=64, num_experts=e, num_experts_per_tok=2,
                                     num_shared_experts=1, expert_selection_fn="sigmoid", first_k_dense_replace=1),
    "solar_open": lambda i, e: dict(n_routed_experts=e, num_experts_per_tok=2, n_shared_experts=1, head_dim=64),
    "glm_moe_dsa": lambda i, e: dict(n_routed_experts=e, num_experts_per_tok=2, n_shared_experts=1,
                                     first_k_dense_replace=1, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64,
                                     qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, index_topk=16,
                                     index_head_dim=32, index_n_heads=2),
    "hy_v3": lambda i, e: dict(num_experts=e, num_experts_per_tok=2, head_dim=64),
    "mimo_v2_flash": lambda i, e: dict(n_routed_experts=e, num_experts_per_tok=2, head_dim=64, v_head_dim=64,
                                       sliding_window=16),
    "flint": lambda i, e: dict(num_experts=e, num_experts_per_tok=2, shared_expert_intermediate_size=i,
                               mlp_only_layers=[0], sliding_window=16, head_dim=64),
    "beam": lambda i, e: dict(num_experts=e, num_experts_per_tok=2, n_group=2, topk_group=1,
                              mlp_layer_types=["dense", "sparse"], sliding_window=16, head_dim=64),
    "laguna": lambda i, e: dict(num_experts=e, num_experts_per_tok=2, shared_expert_intermediate_size=i, head_dim=64),
    "axk2": lambda i, e: dict(n_routed_experts=e, num_experts_per_tok=2, first_k_dense_replace=1, num_key_value_heads=4,
                              q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                              head_dim=64, index_topk=16, index_head_dim=32, index_n_heads=2, gated_norm_rank=8),
    "sarvam_moe": lambda i, e: dict(n_routed_experts=e, num_experts_per_tok=2, first_k_dense_replace=1, head_dim=64),
    "sarvam_mla": lambda i, e: dict(n_routed_experts=e, num_experts_per_tok=2, num_key_value_heads=4, q_lora_rank=None,
                                    kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32),
    "dots3_note_text": lambda i, e: dict(n_routed_experts=e, num_experts_per_tok=2, shared_experts_intermediate_size=i,
                                         num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32,
                                         qk_nope_head_dim=32, v_head_dim=32, head_dim=64, index_topk=16,
                                         index_head_dim=32, index_n_heads=2, sliding_window=16, pad_token_id=None,
                                         bos_token_id=None, eos_token_id=None),
    "minimax_m3_vl_text": lambda i, e: dict(intermediate_size=i, num_local_experts=e, num_experts_per_tok=2,
                                            shared_intermediate_size=i, dense_intermediate_size=2 * i, head_dim=64,
                                            rotary_dim=32, bos_token_id=None, eos_token_id=None),
    "kolibri1": lambda i, e: dict(num_experts=e, num_experts_per_tok=2, shared_expert_intermediate_size=i, head_dim=64,
                                  sliding_window=16),
    "hy_v4": lambda i, e: dict(intermediate_size=2 * i, n_routed_experts=e, num_experts_per_tok=2, n_shared_experts=1,
                               num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32,
                               qk_nope_head_dim=32, v_head_dim=32, head_dim=64, index_topk=16, index_head_dim=32,
                               index_n_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None),
    "axk1": lambda i, e: dict(n_routed_experts=e, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                              first_k_dense_replace=0, num_key_value_heads=4, q_lora_rank=64,
                              kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                              bos_token_id=None, eos_token_id=None, pad_token_id=None),
}
# The routers' (weight, selection bias) inside a block, where they are not gate.weight and
# gate.e_score_correction_bias.
ROUTER_PARAMS = {"minimax_m2": ("gate.weight", "e_score_correction_bias"), "hy_v3": ("gate.weight", "e_score_correction_bias"),
                 "afmoe": ("router.gate.weight", "expert_bias"),
                 "lfm2_moe": ("gate.weight", "expert_bias")}


def randomize_routers(model, family: str, std: float) -> None:
    """Router weights ~ N(0, std^2) and selection biases in [0, 0.3) in every MoE block."""
    import torch

    weight_name, bias_name = ROUTER_PARAMS.get(family, ("gate.weight", "gate.e_score_correction_bias"))
    with torch.no_grad():
        text = getattr(model.model, "language_model", model.model)  # a vision-language model's text model
        for layer in text.layers:
            block = getattr(layer, "mlp", None) or layer.feed_forward  # LFM2-MoE's is feed_forward
            if not hasattr(block, "experts"):
                continue
            block.get_parameter(weight_name).normal_(0.0, std)
            owner, _, leaf = bias_name.rpartition(".")
            bias = getattr(block.get_submodule(owner) if owner else block, leaf, None)
            if bias is not None:
                bias.uniform_(0.0, 0.3)


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
        "granitemoe_swa": dict(granite, shared_intermediate_size=0),
        "jetmoe": dict(intermediate_size=I, num_local_experts=experts, kv_channels=head),
        "gemma4_text": dict(intermediate_size=2 * I, moe_intermediate_size=I, num_experts=experts, top_k_experts=2,
                            enable_moe_block=True, head_dim=head, hidden_size_per_layer_input=0),
        "lara_mini": dict(moe_intermediate_size=I, shared_expert_intermediate_size=I, num_experts=experts, **linear),
        "aria_text": dict(intermediate_size=I, moe_num_experts=experts, moe_topk=2, moe_num_shared_experts=1,
                          head_dim=head),
        "qwen4_exp_text": dict(intermediate_size=2 * I, moe_intermediate_size=I, shared_expert_intermediate_size=I,
                               num_experts=experts, hc_count=2, hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1,
                               indexer_head_dim=head, indexer_budget=16, indexer_compress_ratio=4,
                               **dict(linear, layer_types=_alternating("linear_attention", "indexed_attention", L))),
    }[family]
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the small vocabulary
    return tf.AutoConfig.for_model(family, **{**common, "num_experts_per_tok": 2, **ids, **extra})


SOFTMAX_FAMILIES = ("olmoe", "flex_olmo", "mellum", "minimax", "jamba", "qwen3_next", "qwen3_5_moe_text",
                    "deepseek_v2", "hunyuan_v1_moe", "ernie4_5_moe", "granitemoe", "granitemoeshared",
                    "granitemoehybrid", "phimoe", "lara_mini", "jetmoe", "gemma4_text",
                    "granitemoe_swa", "aria_text", "qwen4_exp_text")


def build(family: str, hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int,
          text_config: dict | None = None):
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
    if family in SIGMOID_FAMILIES:
        return tf.AutoConfig.for_model(family, **{**common, **sizes, **SIGMOID_FAMILIES[family](moe_intermediate,
                                                                                                 experts)})
    if family in SOFTMAX_FAMILIES:
        return _softmax_family(family, common, moe_intermediate, experts)
    if family in EXTRA:
        return EXTRA[family](hidden, moe_intermediate, experts, layers, vocab)
    if text_config and family not in VISION_LANGUAGE:
        raise ValueError(f"text_config is for the vision-language families {list(VISION_LANGUAGE)}, not {family!r}")
    if family in VISION_LANGUAGE:
        text_family, text_extra, extra = VISION_LANGUAGE[family]
        text = {**build(text_family, hidden, moe_intermediate, experts, layers, vocab).to_dict(), **text_extra(layers),
                **(text_config or {})}
        return tf.AutoConfig.for_model(family, text_config=text, **extra(hidden))
    raise SystemExit(f"unknown family {family!r}; choose mixtral, qwen2_moe, qwen3_moe, deepseek_v3, "
                     f"{', '.join([*SIGMOID_FAMILIES, *SOFTMAX_FAMILIES, *EXTRA, *VISION_LANGUAGE])}")


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


def _lfm2_moe(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    return tf.AutoConfig.for_model("lfm2_moe", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * moe_intermediate,
                                   moe_intermediate_size=moe_intermediate, num_experts=experts, num_experts_per_tok=2,
                                   num_dense_layers=1 if layers > 1 else 0,
                                   layer_types=_alternating("conv", "full_attention", layers), initializer_range=0.2,
                                   max_position_embeddings=512)


# Kimi delta attention and MLA layers in turn (the first with a dense MLP), saved as the hub stores
# them; the default special token ids of these configs lie beyond a tiny vocabulary.
_KDA_MLA = dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=32,
                qk_nope_head_dim=32, v_head_dim=32, linear_head_dim=64, linear_num_heads=4, initializer_range=0.2,
                pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _kda_mla(model_type: str, hidden: int, moe_intermediate: int, layers: int, vocab: int, **routing):
    import transformers as tf

    return tf.AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   intermediate_size=2 * moe_intermediate, moe_intermediate_size=moe_intermediate,
                                   layer_types=_alternating("linear_attention", "full_attention", layers),
                                   **_KDA_MLA, **routing)


def _kimi_linear(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    return _kda_mla("kimi_linear", hidden, moe_intermediate, layers, vocab, num_local_experts=experts,
                    num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1)


def _bailing_hybrid(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    # Ling's own names for the routing fields; no multi-token-prediction layer.
    return _kda_mla("bailing_hybrid", hidden, moe_intermediate, layers, vocab, num_experts=experts,
                    num_experts_per_token=2, num_expert_group=2, topk_group=1, num_shared_experts=1, head_dim=64,
                    mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), num_nextn_predict_layers=0)


def _dbrx(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # DBRX's own names for the sizes; its attention reads rope_theta from attn_config and clamps q,
    # k, v by clip_qkv (transformers 5.24 refuses clip_qkv=None).
    return tf.AutoConfig.for_model("dbrx", vocab_size=vocab, d_model=hidden, n_layers=layers, n_heads=4,
                                   max_seq_len=512, initializer_range=0.2,
                                   attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                   ffn_config=dict(ffn_hidden_size=moe_intermediate, moe_num_experts=experts,
                                                   moe_top_k=2))


def _deepseek_v4(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # The first layer routes by token id, the rest on their scores; compressed sparse (with its
    # indexer) and heavily compressed attention in turn.
    kinds = ("compressed_sparse_attention", "heavily_compressed_attention")
    return tf.AutoConfig.for_model("deepseek_v4", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=64, q_lora_rank=64,
                                   qk_rope_head_dim=16, moe_intermediate_size=moe_intermediate,
                                   n_routed_experts=experts, num_experts_per_tok=2, o_groups=2, o_lora_rank=32,
                                   index_n_heads=2, index_head_dim=32, index_topk=4, sliding_window=8, hc_mult=2,
                                   max_position_embeddings=512, mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1),
                                   layer_types=[kinds[i % 2] for i in range(layers)])


def _randomize_deepseek_v4(model, generator) -> None:
    """DeepSeek-V4's routers: weights at std 2/sqrt(H), each token's table row K distinct experts,
    selection biases in [0, 0.3) (transformers starts the tables and biases at zero)."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=generator) * 2 / gate.weight.shape[1] ** 0.5)
            if hasattr(gate, "tid2eid"):
                rows, k = gate.tid2eid.shape
                gate.tid2eid.copy_(torch.stack([torch.randperm(gate.num_experts, generator=generator)[:k]
                                                for _ in range(rows)]))
            else:
                gate.e_score_correction_bias.copy_(torch.rand(gate.num_experts, generator=generator) * 0.3)


def _zaya(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # top-1: the only choice ZAYA's config takes (each token one expert, or the skip class).
    return tf.AutoConfig.for_model("zaya", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                                   moe_intermediate_size=moe_intermediate, num_experts=experts, num_experts_per_tok=1,
                                   router_hidden_size=hidden // 2, initializer_range=0.2, max_position_embeddings=512,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _longcat_flash(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # Half as many zero-computation experts as routed ones; MLA attention with a key and value per
    # head; num_layers counts decoder layers (two attention sublayers each).
    return tf.AutoConfig.for_model("longcat_flash", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                                   num_attention_heads=4, n_routed_experts=experts, zero_expert_num=experts // 2,
                                   moe_topk=2, expert_ffn_hidden_size=moe_intermediate, ffn_hidden_size=2 * moe_intermediate,
                                   q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                                   v_head_dim=32, head_dim=32, initializer_range=0.2, max_position_embeddings=512,
                                   routed_scaling_factor=2.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _inkling_text(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # Full and sliding attention with relative logits; one shared expert, weighed by the router.
    head = hidden // 4
    return tf.AutoConfig.for_model("inkling_text", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=head,
                                   swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=head,
                                   sliding_window_size=8, d_rel=4, rel_extent=16, intermediate_size=2 * moe_intermediate,
                                   moe_intermediate_size=moe_intermediate, n_routed_experts=experts,
                                   num_experts_per_tok=2, n_shared_experts=1, initializer_range=0.2,
                                   max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _randomize_zaya(model, generator) -> None:
    """ZAYA's router: its output projection at std 10 / sqrt(fan-in), so that its probabilities vary
    by token (init leaves them about uniform); the experts' balancing biases in [-1.01, -0.99), as
    the skip class's -1 (transformers starts the experts' at zero, so that no token of a random
    router would skip; its loading sets the skip class's to -1 whatever the checkpoint holds);
    the router state's scales in [0.5, 1.5) (ones)."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate
            out = gate.router_mlp.out_proj.weight
            out.copy_(torch.randn(out.shape, generator=generator) * 10 / out.shape[1] ** 0.5)
            experts = gate.balancing_biases.shape[0] - 1
            gate.balancing_biases[:experts] = torch.rand(experts, generator=generator) * 0.02 - 1.01
            if hasattr(gate, "router_states_scale"):
                gate.router_states_scale.copy_(torch.rand(gate.router_states_scale.shape, generator=generator) + 0.5)


def _inkling2(loop: bool):
    def config(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
        import transformers as tf

        # Sliding-window and hybrid attention layers in turn, the block residuals over two layers
        # (one in the loop model, whose middle layers run twice); the unembedding padded by 8 rows.
        head = hidden // 4
        common = dict(vocab_size=vocab, unpadded_vocab_size=vocab - 8, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head, swa_num_attention_heads=4,
                      swa_num_key_value_heads=2, swa_head_dim=head, sliding_window_size=8, d_rel=4, rel_extent=16,
                      moe_intermediate_size=moe_intermediate, n_routed_experts=experts, num_experts_per_tok=2,
                      max_position_embeddings=512, initializer_range=0.2, eos_token_id=None, pad_token_id=None,
                      bos_token_id=None, layer_types=_alternating("hybrid_sliding", "hybrid", layers)[::-1])
        if not loop:
            return tf.AutoConfig.for_model("inkling2_text", n_layers_per_attn_res_block=2, **common)
        return tf.AutoConfig.for_model("inkling2_loop_text", n_layers_per_attn_res_block=1, loop_layer_index_start=1,
                                       loop_layer_index_end=max(2, layers - 1), loop_num_passes=2, loop_gate_rank=8,
                                       **common)

    return config


def _randomize_inkling2(model, generator) -> None:
    """Inkling 2: the block residuals' queries and the short convolutions' static weights drawn at
    std 0.02 (transformers starts them at zero), the experts' gate_up at std 0.5 and down at 0.02, so
    that the soft caps (4 on the gate, 25 on up) bite."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("query" in name or "static" in name) and not p.any():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
            elif name.endswith("experts.gate_up_proj"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
            elif name.endswith("experts.down_proj"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)


def _nemotron_h(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # ``layers`` MoE layers, each after a Mamba-2 or an attention layer in turn; ungated relu^2
    # experts in a latent space of half the hidden size; DeepSeek-V3's sigmoid routing.
    types = [t for i in range(layers) for t in (("linear_attention", "full_attention")[i % 2], "moe")]
    head = hidden // 4
    return tf.AutoConfig.for_model("nemotron_h", vocab_size=vocab, hidden_size=hidden, layers_block_type=types,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=head,
                                   intermediate_size=2 * moe_intermediate, mamba_num_heads=4, mamba_head_dim=head,
                                   ssm_state_size=16, n_groups=2, chunk_size=16, n_routed_experts=experts,
                                   num_experts_per_tok=2, moe_intermediate_size=moe_intermediate,
                                   moe_shared_expert_intermediate_size=moe_intermediate, moe_latent_size=hidden // 2,
                                   routed_scaling_factor=2.0, initializer_range=0.2, max_position_embeddings=512,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _qwen3_vl_moe_text(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # The whole vision-language model (transformers builds no causal LM of its text model), with a
    # one-block vision tower; the text model's second layer dense (``mlp_only_layers``).
    head = hidden // 4
    half = head // 2  # the rotary sections (temporal, height, width) cover half the head, as Qwen3-VL's 24/20/20
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * moe_intermediate, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=head, moe_intermediate_size=moe_intermediate,
                num_experts=experts, num_experts_per_tok=2, mlp_only_layers=[1] if layers > 2 else [],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [half - 2 * (half // 4), half // 4, half // 4]},
                max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
    return tf.AutoConfig.for_model("qwen3_vl_moe", text_config=text, vision_config=vision, tie_word_embeddings=False)


def _glm4v_moe_text(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # The whole vision-language model (no causal LM of its text model), a one-block vision tower;
    # the first text layer dense (``first_k_dense_replace``), DeepSeek-style sigmoid routing.
    head = hidden // 4
    half = head // 4  # the rotary half of a head rotating half its dims: its sections sum to it
    sections = [half // 4, half // 4, half - 2 * (half // 4)]
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * moe_intermediate, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=head, moe_intermediate_size=moe_intermediate,
                n_routed_experts=experts, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                first_k_dense_replace=1, routed_scaling_factor=1.5, max_position_embeddings=512,
                initializer_range=0.2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": sections,
                                                        "partial_rotary_factor": 0.5})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden, patch_size=4,
                  image_size=16, spatial_merge_size=2, temporal_patch_size=2)
    return tf.AutoConfig.for_model("glm4v_moe", text_config=text, vision_config=vision)


def _ocr_text(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int) -> dict:
    """The OCR models' text config: the first layer dense (``mlp_layer_types``), DeepSeek-V2's
    group-limited greedy routing over an fp32 softmax, scaled, one shared expert."""
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * moe_intermediate, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=moe_intermediate,
                n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1, topk_method="group_limited_greedy",
                n_group=2, topk_group=1, routed_scaling_factor=1.5, max_position_embeddings=512,
                mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), initializer_range=0.2)


# A one-block SAM encoder, as both OCR models' vision towers start.
_TINY_SAM = dict(hidden_size=32, output_channels=16, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                 patch_size=16, window_size=2, global_attn_indexes=[0], downsample_channels=[16, 32], mlp_dim=64)


def _deepseek_ocr2_text(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # The whole vision-language model (no causal LM of its text model): the SAM encoder and a
    # one-layer Qwen2 encoder.
    vision = dict(sam_config=_TINY_SAM, encoder_config=dict(vocab_size=16, hidden_size=32, intermediate_size=64,
                                                            num_hidden_layers=1, num_attention_heads=2,
                                                            num_key_value_heads=2))
    return tf.AutoConfig.for_model("deepseek_ocr2", text_config=_ocr_text(hidden, moe_intermediate, experts, layers, vocab),
                                   vision_config=vision, image_token_id=vocab - 1)


def _unlimited_ocr_text(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # As deepseek_ocr2_text, with Unlimited OCR's one-layer CLIP-style encoder (its attention stores
    # q, k and v as one qkv_proj) and its text attention over a sliding window of 8 tokens plus the
    # prompt's.
    text = {**_ocr_text(hidden, moe_intermediate, experts, layers, vocab), "sliding_window": 8}
    vision = dict(sam_config=_TINY_SAM, encoder_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                            num_attention_heads=2, image_size=28, patch_size=14))
    return tf.AutoConfig.for_model("unlimited_ocr", text_config=text, vision_config=vision, image_token_id=vocab - 1)


def _glm5_next_text(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # The whole vision-language model (no causal LM of its text model), a one-block vision tower;
    # the first text layer dense, linear attention (its convolution stored as three) then the
    # indexed attention in the last layer (its indexer keeping every position: index_topk covers the
    # prompts), hyper-connections, DeepSeek-style sigmoid routing.
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * moe_intermediate, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=moe_intermediate,
                n_routed_experts=experts, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=0, qk_nope_head_dim=16,
                v_head_dim=16, index_topk=32, index_head_dim=16, index_n_heads=2, index_kpool=4, linear_head_dim=16,
                linear_num_heads=4, hc_mult=2, mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
                layer_types=["linear_attention"] * (layers - 1) + ["full_attention"], pad_token_id=0,
                max_position_embeddings=512, initializer_range=0.2)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=hidden,
                  projection_intermediate_size=64, patch_size=14, image_size=28)
    return tf.AutoConfig.for_model("glm5_next", text_config=text, vision_config=vision, image_token_id=vocab - 6,
                                   video_token_id=vocab - 5, image_start_token_id=vocab - 4,
                                   image_end_token_id=vocab - 3, video_start_token_id=vocab - 2,
                                   video_end_token_id=vocab - 1)


def _hy_v4_vl_text(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # The whole vision-language model (no causal LM of its text model), a one-block vision tower;
    # HY-V4's text model (its first layer dense) with multimodal rotary sections.
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * moe_intermediate, num_hidden_layers=layers,
                num_attention_heads=4, moe_intermediate_size=moe_intermediate, n_shared_experts=1,
                n_routed_experts=experts, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32,
                kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_topk=32,
                index_head_dim=16, index_n_heads=2, hc_mult=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                max_position_embeddings=512, initializer_range=0.2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1,
                  out_hidden_size=hidden, patch_size=16, max_image_size=64)
    return tf.AutoConfig.for_model("hy_v4_vl", text_config=text, vision_config=vision, image_token_id=vocab - 2,
                                   video_token_id=vocab - 1)


def _mistral4(hidden: int, moe_intermediate: int, experts: int, layers: int, vocab: int):
    import transformers as tf

    # DeepSeek-V3's MLA and block (its first layer dense), the softmax router's groups: up to 4 of
    # two or more experts each, the best half kept.
    groups = max(1, min(4, experts // 2))
    return tf.AutoConfig.for_model("mistral4", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * moe_intermediate,
                                   moe_intermediate_size=moe_intermediate, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=4, n_routed_experts=experts,
                                   n_shared_experts=1, num_experts_per_tok=2, n_group=groups,
                                   topk_group=max(1, groups // 2),
                                   first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                   qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=1.5,
                                   max_position_embeddings=512, pad_token_id=0, initializer_range=0.2)


# Families built from transformers' config class by model type (AutoConfig.for_model).
EXTRA = {"gpt_oss": _gpt_oss, "llama4_text": _llama4_text, "lfm2_moe": _lfm2_moe, "dbrx": _dbrx,
         "kimi_linear": _kimi_linear, "bailing_hybrid": _bailing_hybrid, "deepseek_v4": _deepseek_v4,
         "zaya": _zaya, "longcat_flash": _longcat_flash, "inkling_text": _inkling_text, "nemotron_h": _nemotron_h,
         "qwen3_vl_moe_text": _qwen3_vl_moe_text, "glm4v_moe_text": _glm4v_moe_text, "glm5_next_text": _glm5_next_text,
         "hy_v4_vl_text": _hy_v4_vl_text, "mistral4": _mistral4, "inkling2_text": _inkling2(False),
         "deepseek_ocr2_text": _deepseek_ocr2_text, "unlimited_ocr_text": _unlimited_ocr_text,
         "inkling2_loop_text": _inkling2(True)}
# Vision-language families whose config.json holds a text family's config as ``text_config``:
# model_type -> (that text family, its config's further arguments given the layer count, the whole
# model's other arguments given the hidden size: a one-layer vision tower and its projector).
_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                    patch_size=14)
VISION_LANGUAGE = {
    "aria": ("aria_text", lambda layers: {},
             lambda hidden: dict(vision_config=_TINY_VISION, projector_patch_to_query_dict={4: 4})),
    # MiniMax-M3: the first layer dense. Its attention is full: the block-sparse layers'
    # ("minimax_m3_sparse") blocks count from the padded row's start, so a prompt's output depends on
    # the padding in front of it, and DP ranks pad their own prompts (text_config can ask for them).
    "minimax_m3_vl": ("minimax_m3_vl_text",
                      lambda layers: dict(mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
                                          layer_types=["full_attention"] * layers,
                                          index_n_heads=2, index_head_dim=16, index_block_size=2, index_topk_blocks=2),
                      lambda hidden: dict(vision_config=_TINY_VISION, projector_hidden_size=hidden)),
}
# Families whose router weights and selection biases are drawn at random (see the module docstring).
RANDOM_ROUTERS = (*SIGMOID_FAMILIES, "lfm2_moe", "kimi_linear", "bailing_hybrid", "glm4v_moe_text", "glm5_next_text",
                  "hy_v4_vl_text", "inkling2_text", "inkling2_loop_text", "deepseek_ocr2_text",
                  "unlimited_ocr_text")


def make(directory: str, family: str = "qwen3_moe", hidden: int = 256, moe_intermediate: int = 256, experts: int = 8,
         layers: int = 2, vocab: int = 256, dtype: str = "float32", seed: int = 0,
         router_aux_loss_coef: float | None = None, text_config: dict | None = None) -> int:
    """Saves the model to ``directory``; returns its parameter count. text_config: further fields
    of a vision-language family's text config (``VISION_LANGUAGE``). router_aux_loss_coef: also
    turn transformers' load-balancing loss on (``output_router_logits``) with this coefficient,
    for families whose config has one (what ``moeshard train`` then adds to the loss). ValueError
    where the installed transformers cannot build the family's config."""
    import torch
    import transformers as tf

    try:
        from huggingface_hub.errors import StrictDataclassError as ConfigError
    except ImportError:  # a huggingface_hub before strict config classes
        ConfigError = ValueError

    torch.manual_seed(seed)
    try:
        cfg = build(family, hidden, moe_intermediate, experts, layers, vocab, text_config or {})
    except ConfigError as exc:  # a config class's validation (not a ValueError): a field this transformers lacks
        raise ValueError(f"transformers {tf.__version__} cannot build the tiny {family} config: {exc}") from exc
    if router_aux_loss_coef is not None:
        if not hasattr(cfg, "router_aux_loss_coef"):
            raise SystemExit(f"--router-aux-loss-coef: the {family} config has no router_aux_loss_coef (transformers "
                             f"computes no load-balancing loss for it)")
        cfg.output_router_logits, cfg.router_aux_loss_coef = True, router_aux_loss_coef
    from moeshard.checkpoint.hf_model import model_class  # a vision-language model has no causal LM class

    model = model_class(cfg).from_config(cfg, dtype=getattr(torch, dtype)).eval()
    text_family = VISION_LANGUAGE[family][0] if family in VISION_LANGUAGE else family
    if text_family in RANDOM_ROUTERS:
        randomize_routers(model, text_family, 2 / hidden**0.5)
    with torch.no_grad():  # a router left at zero (ERNIE 4.5's by transformers 5.17) routes every token on ties
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2 and not p.any():
                p.normal_(0.0, cfg.initializer_range)
    with torch.no_grad():  # expert biases (gpt_oss) start at zero in transformers: random, so that they count
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                p.normal_(0.0, 0.5)
        if family == "jetmoe":  # and so does JetMoE's bias on the block's output
            for layer in model.model.layers:
                layer.mlp.bias.normal_(0.0, 0.5)
        if family == "axk1":  # and A.X-K1's norm of the block's output (ones)
            for layer in model.model.layers:
                if hasattr(layer.mlp, "post_mlp_layernorm"):
                    layer.mlp.post_mlp_layernorm.weight.uniform_(0.5, 1.5)
        if family == "deepseek_v4":  # and DeepSeek-V4's token tables and selection biases (zeros)
            _randomize_deepseek_v4(model, torch.Generator().manual_seed(seed + 1))
        if family == "zaya":  # and ZAYA's balancing biases and router state scales
            _randomize_zaya(model, torch.Generator().manual_seed(seed + 1))
        if family in ("inkling2_text", "inkling2_loop_text"):  # and Inkling 2's residual queries and experts
            _randomize_inkling2(model, torch.Generator().manual_seed(seed + 1))
        if family == "gemma4_text":  # and Gemma 4's router scales (ones)
            for layer in model.model.layers:
                layer.router.scale.normal_(1.0, 0.3)
                layer.router.per_expert_scale.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="float32 by default: the dtype whose comparison `moeshard generate/train --compare` "
                             "judges (a bf16 tiny random model has near-ties that rounding order decides)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--router-aux-loss-coef", type=float, default=None,
                        help="turn the load-balancing loss on (output_router_logits) with this coefficient")
    args = parser.parse_args()
    n = make(args.dir, args.family, args.hidden, args.moe_intermediate, args.experts, args.layers, args.vocab,
             args.dtype, args.seed, args.router_aux_loss_coef)
    print(f"saved {args.family} ({n / 1e6:.2f} M parameters, {args.dtype}) to {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
