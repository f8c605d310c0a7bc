"""Model types transformers ships whose MoE block (or checkpoint) moeshard cannot express, each
refused with the part it lacks (``families.refuse_family``) instead of as an unknown model type.
"""

from __future__ import annotations

from moeshard.checkpoint.families import refuse_family

REFUSALS = {
    "doge": "its experts are rows of two embedding tables [num_experts, hidden_size] chosen by two sub-key top-ks "
            "(DogeCDMoE), not gated MLP experts",
}
for _model_type, _reason in REFUSALS.items():
    refuse_family(_model_type, _reason)
