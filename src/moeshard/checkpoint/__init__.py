"""Real checkpoints: one layer's MoE block of a Hugging Face model, read per rank (and written back).

Modules, one concern each:

* ``families``: ``FAMILIES``, one ``ModelFamily`` per supported model type (defaults, config.json
  -> ``MoEConfig``, dense layers, block prefixes, expert spellings); a new family is one entry.
* ``hf_config``: config.json -> ``HFMoEModel`` (model type, ``MoEConfig``, dense layers, FP8).
* ``reader``: ``SafetensorsCheckpoint``, slice reads from single or sharded safetensors files.
* ``names``: ``BlockNames``, where a block's tensors are stored (hub per-expert or fused names).
* ``experts``: ``ExpertReader``, this rank's routed experts, one expert at a time.
* ``loader``: ``load_moe_block`` -> ``LoadedBlock`` and ``build_layer`` -> ``MoELayer``.
* ``writer``: the other way, every rank's tensors of a sharded model back to a checkpoint that
  transformers and this package read (``save_checkpoint``).
* ``block_state``: a transformers block's tensors under moeshard's names and layout.
* ``hf_model``: transformers' own model of a checkpoint (``load_transformers_model``), and why
  transformers cannot load one here (``transformers_refusal``).

``moeshard run``'s job (plan, load, split tokens, forward, gather) uses these and lives in
``moeshard.jobs.run``.

Example (one rank)::

    block = load_moe_block("Qwen3-30B-A3B", layer=0, dtype="bfloat16")
    layer = build_layer(block)
    y = layer(x)           # x: [T, H] bfloat16
"""

# ``models``: the families beyond the built-in ones register themselves from their own modules;
# importing any ``moeshard.checkpoint`` module runs this first, so every family is known
# wherever ``families.FAMILIES`` is read.
from moeshard.checkpoint import models  # noqa: F401
from moeshard.checkpoint.hf_config import SUPPORTED_MODEL_TYPES, HFMoEModel, parse_hf_config, read_hf_config
from moeshard.checkpoint.loader import LoadedBlock, build_layer, load_moe_block, resolve_quant
from moeshard.checkpoint.names import BlockNames, resolve_block_names
from moeshard.checkpoint.reader import SafetensorsCheckpoint
from moeshard.sharding import shard_spec

__all__ = [
    "SUPPORTED_MODEL_TYPES", "BlockNames", "HFMoEModel", "LoadedBlock", "SafetensorsCheckpoint", "build_layer",
    "load_moe_block", "parse_hf_config", "read_hf_config", "resolve_block_names", "resolve_quant", "shard_spec",
]
