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
}
for _model_type, _reason in REFUSALS.items():
    refuse_family(_model_type, _reason)
