"""Model types transformers ships whose MoE block (or checkpoint) moeshard cannot express, each
refused with the part it lacks (``families.refuse_family``) instead of as an unknown model type.
"""

from __future__ import annotations

from moeshard.checkpoint.families import refuse_family

REFUSALS = {
    "nemotron_h": "its experts are not gated (up_proj, relu squared, down_proj) and may project into a latent space "
                  "around them (moe_latent_size); moeshard's experts are gated MLPs",
    "doge": "its experts are rows of two embedding tables [num_experts, hidden_size] chosen by two sub-key top-ks "
            "(DogeCDMoE), not gated MLP experts",
    "inkling_text": "its router scores the shared experts too (a [n_routed_experts + n_shared_experts, hidden_size] "
                    "weight): the chosen experts' sigmoid scores are normalized together with the shared ones', "
                    "which weigh each shared expert per token, times a learned per-layer scale (gate.global_scale); "
                    "moeshard's shared experts are ungated or gated by one sigmoid gate, and its scaling is one "
                    "constant",
}
for _model_type, _reason in REFUSALS.items():
    refuse_family(_model_type, _reason)
