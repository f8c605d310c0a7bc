"""Which layers are dense, for families whose ``config.json`` may list it per layer.

GLM-4-MoE-Lite, EXAONE-MoE and Cohere2-MoE write ``mlp_layer_types``: one ``"dense"`` or
``"sparse"`` per layer (transformers builds an MoE block exactly for ``"sparse"``). Without it,
the first ``k`` layers are dense, ``k`` read from a field (``first_k_dense_replace``) or fixed
by the family (GLM-4-MoE-Lite: 1), as the transformers config class fills the list in.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers

LAYER_TYPES = ("dense", "sparse")


def mlp_layer_types(f: ConfigFields, num_layers: int) -> tuple[str, ...] | None:
    """``mlp_layer_types`` checked (a list of ``num_layers`` entries of ``LAYER_TYPES``), or None
    when config.json has none."""
    value = f.get("mlp_layer_types")
    if value is None:
        return None
    if not isinstance(value, list) or not all(v in LAYER_TYPES for v in value):
        raise ValueError(f"{f.source}: mlp_layer_types must be a list of {list(LAYER_TYPES)}, got {value!r}")
    if len(value) != num_layers:
        raise ValueError(f"{f.source}: mlp_layer_types has {len(value)} entries, but num_hidden_layers={num_layers}")
    return tuple(value)


def listed_or_first_dense(f: ConfigFields, num_layers: int, first: int | str) -> DenseLayers:
    """Dense layers from ``mlp_layer_types`` when given, else the first ``first`` layers (an int,
    or the name of the field that holds it)."""
    types = mlp_layer_types(f, num_layers)
    if types is not None:
        return DenseLayers(num_layers, lambda layer: "mlp_layer_types[layer] is 'dense'"
                           if types[layer] == "dense" else None)
    if isinstance(first, str):
        k, why = f.int(first, minimum=0), f"layer < {first}={f.get(first)} (no mlp_layer_types)"
    else:
        k, why = first, f"one of the first {first} layers (no mlp_layer_types)"
    return DenseLayers(num_layers, lambda layer: why if layer < k else None)
