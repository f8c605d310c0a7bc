"""Nemotron-H (nemotron_h: NVIDIA's Nemotron-3 hybrids): Mamba-2, attention, MLP and MoE layers,
whose routed experts are ungated (``up_proj``, relu squared, ``down_proj``).

Each layer's type comes from ``layers_block_type`` (a list; transformers 5 writes it) or the
hub's ``hybrid_override_pattern`` (one character a layer: ``M`` Mamba, ``E`` MoE, ``*``
attention, ``-`` MLP); a ``"moe"`` layer holds a ``NemotronHMoE`` at ``mixer``. Its router
``gate`` (``weight`` [E, H] in fp32) takes the sigmoid scores plus ``e_score_correction_bias``,
the top ``num_experts_per_tok`` of the best ``topk_group`` of ``n_group`` groups, the unbiased
scores of those renormalized when ``norm_topk_prob``, times ``routed_scaling_factor`` (DeepSeek-V3's
routing). The block may project its rows into a latent space of ``moe_latent_size`` columns
around the routed experts (``fc1_latent_proj``, ``fc2_latent_proj``): the experts then map
latent rows to latent rows, and moeshard's experts are that wide. Its shared expert, ungated too,
reads the block's input.

moeshard replaces only ``mixer.experts`` (``ModelFamily.experts_only``) with ungated experts of
activation ``relu2``: the router, the latent projections, the shared expert, the Mamba and
attention layers stay transformers'. transformers holds the experts fused (``up_proj`` [E, I, H],
``down_proj`` [E, H, I]; the ``up_rows`` layout) under ``model.layers``; the hub and
transformers' own saves store them per expert (``experts.{e}.up_proj.weight``, ``down_proj``)
under ``backbone.layers``, and every other tensor under ``backbone.`` where the model has
``model.`` (``dense_renames``).

Checkpoints: full precision, and the FP8 ones NVIDIA publishes (ModelOpt: e4m3 experts, shared
expert and Mamba projections with one scale per tensor, attention left in bf16), whose experts
load as fp8_tensor or fp8_token as stored and whose other e4m3 weights are dequantized for
transformers' modules (``checkpoint.formats``), and ModelOpt's NVFP4 ones, every NVFP4 weight
dequantized to the model dtype as it is read.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig

# Layer types: transformers 5's names, and the older ones (and the hub pattern's) it renames.
LAYER_TYPES = ("mamba", "linear_attention", "attention", "full_attention", "mlp", "moe")
PATTERN_CODES = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}


def _types(f: ConfigFields) -> tuple[str, ...]:
    return f.layer_types(listed="layers_block_type", pattern="hybrid_override_pattern", codes=PATTERN_CODES,
                         known=LAYER_TYPES)


def _moe(f: ConfigFields) -> MoEConfig:
    latent = f.get("moe_latent_size")
    hidden = f.int("moe_latent_size") if latent is not None else f.int("hidden_size")
    return MoEConfig(num_experts=f.int("n_routed_experts"), top_k=f.int("num_experts_per_tok"), hidden_size=hidden,
                     intermediate_size=f.int("moe_intermediate_size"), activation=f.activation("mlp_hidden_act"),
                     scoring=f.family.routing, renormalize=f.bool("norm_topk_prob"), n_group=f.int("n_group"),
                     topk_group=f.int("topk_group"),
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     use_correction_bias=True)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    types = _types(f)
    return DenseLayers(num_layers, lambda layer: None if types[layer] == "moe" else f"its layer type is {types[layer]!r}")


register_family(ModelFamily(
    "nemotron_h", {"mlp_hidden_act": "relu2", "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                   "routed_scaling_factor": 1.0, "moe_latent_size": None},
    _moe, _dense_layers, routing="sigmoid", layers="backbone.layers", model_layers="model.layers",
    block_prefixes=("mixer.",), fused_names=("up_proj", "down_proj"), fused_layout="up_rows",
    hidden_acts={"relu2": "relu2"}, linear_router=False, experts_only=True,
    formats=("bf16", "modelopt_fp8", "compressed_fp8", "modelopt_nvfp4"), router_dtype="fp32",
    layer_count=lambda f: len(_types(f)), dense_renames=(("model.", "backbone."),)))
