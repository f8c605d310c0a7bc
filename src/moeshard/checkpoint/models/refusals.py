"""Model types transformers ships whose MoE block (or checkpoint) moeshard cannot express, each
refused with the part it lacks (``families.refuse_family``) instead of as an unknown model type.
"""

from __future__ import annotations

from moeshard.checkpoint.families import refuse_family

REFUSALS = {
    "doge": "its experts are rows of two embedding tables [num_experts, hidden_size] chosen by two sub-key top-ks "
            "(DogeCDMoE), not gated MLP experts",
    "glm5_next": "this config.json holds GLM-5.3-Flash's text fields at its top level, with no text_config: a "
                 "text-only checkpoint, without the vision tower of the model transformers builds from it; a "
                 "config.json with a text_config (model_type glm5_next_text) is read",
    "ernie4_5_vl_moe": "each block holds two sets of experts, for text and for vision tokens, with their own routers "
                       "and widths, chosen per token by its modality, where moeshard's block has one",
    "mistral_large4": "its checkpoints, transformers' own saves too, keep Mistral's tensor names (layers.N.experts.E.w1, "
                      "attention.wq, tok_embeddings), the block's tensors directly under the decoder layer, which "
                      "moeshard's reader does not map onto the model's",
    "muse_spark": "each expert's output passes through its own RMS norm (post_expert_norm) before it is weighted, a "
                  "stage moeshard's experts do not have",
    "qwen3_omni_moe": "transformers' whole Qwen3-Omni model has no forward of its own (its thinker and talker, two "
                      "MoE stacks, run through generate), and its text model sits two configs deep "
                      "(thinker_config.text_config)",
    "step3p7": "its layers clamp their SwiGLU each at their own limits (swiglu_limits, swiglu_limits_shared: "
               "min(silu(gate), limit)) while moeshard's block runs one activation in every layer, and its "
               "checkpoints keep the routed experts as separate gate, up and down tensors [E, I, H] under moe.",
    "nllb-moe": "an encoder-decoder translation model whose top-2 routers send tokens to their experts only up to "
                "each expert's capacity (expert_capacity, second_expert_policy), dropping the rest; moeshard's "
                "block computes every pick, in decoder-only causal LMs and image-text-to-text models",
    "switch_transformers": "an encoder-decoder model whose top-1 routers send tokens to their experts only up to "
                           "each expert's capacity (expert_capacity), dropping the rest; moeshard's block computes "
                           "every pick, in decoder-only causal LMs and image-text-to-text models",
    "openai_privacy_filter": "a bidirectional token classifier (OpenAIPrivacyFilterForTokenClassification), not a "
                             "causal LM or an image-text-to-text model, which are what moeshard loads and generates "
                             "with",
}
# Model types transformers builds with another's config class, or parts of another's model: refused
# for that one's reason.
for _alias, (_of, _how) in {
    "step3p5": ("step3p7", "transformers builds it as Step-3.7 (Step3p7TextConfig)"),
    "qwen3_omni_moe_thinker": ("qwen3_omni_moe", "a part of Qwen3-Omni"),
    "qwen3_omni_moe_text": ("qwen3_omni_moe", "a part of Qwen3-Omni"),
    "qwen3_omni_moe_talker_text": ("qwen3_omni_moe", "a part of Qwen3-Omni"),
}.items():
    REFUSALS[_alias] = f"{_how}: {REFUSALS[_of]}"
for _model_type, _reason in REFUSALS.items():
    refuse_family(_model_type, _reason)
