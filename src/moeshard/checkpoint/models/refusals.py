"""Model types transformers ships whose MoE block (or checkpoint) moeshard cannot express, each
refused with the part it lacks (``families.refuse_family``) instead of as an unknown model type.
"""

from __future__ import annotations

from moeshard.checkpoint.families import refuse_family

REFUSALS = {
    "longcat_flash": "its router also picks zero-computation (identity) experts (zero_expert_num), which pass the "
                     "row through scaled by its weight; moeshard's experts are gated MLPs only",
    "zaya": "its router is an MLP over a projection of the hidden states that carries state from the previous "
            "layer and routes to an extra skip class (ZayaRouter), not a linear router",
    "doge": "its experts are rows of two embedding tables [num_experts, hidden_size] chosen by two sub-key top-ks "
            "(DogeCDMoE), not gated MLP experts",
}
for _model_type, _reason in REFUSALS.items():
    refuse_family(_model_type, _reason)
