"""Which layers are dense, for families whose ``config.json`` may list it per layer.

GLM-4-MoE-Lite, EXAONE-MoE and Cohere2-MoE write ``mlp_layer_types``: one ``"dense"`` or
``"sparse"`` per layer (transformers builds an MoE block exactly for ``"sparse"``). Without it,
the first ``k`` layers are dense, ``k`` read from a field (``first_k_dense_replace``) or fixed
by the family (GLM-4-MoE-Lite: 1), as the transformers config class fills the list in. The hub
configs of dots.note 3 and MiniMax-M3 write the same as a ``moe_layer_freq`` list of 0 (dense)
and 1 (MoE) per layer, which their config classes turn into ``mlp_layer_types``.
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


def moe_layer_list(f: ConfigFields, num_layers: int) -> tuple[bool, ...]:
    """``moe_layer_freq`` as a per-layer list, checked: ``num_layers`` entries, each the integer 0
    (dense) or 1 (MoE); True where layer L has an MoE block."""
    value = f.get("moe_layer_freq")
    if not isinstance(value, list) or len(value) != num_layers or \
            not all(type(v) is int and v in (0, 1) for v in value):
        raise ValueError(f"{f.source}: moe_layer_freq must be a list of num_hidden_layers={num_layers} entries, "
                         f"each 0 (dense) or 1 (MoE), got {value!r}")
    return tuple(v == 1 for v in value)


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
