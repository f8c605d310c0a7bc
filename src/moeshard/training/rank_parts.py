"""What one rank holds of a model's whole tensors: the map from transformers' parameters (or
anything shaped like them, such as an optimizer's moments) to the sharded model's parameters.

Outside the MoE blocks a parameter has transformers' name and every rank holds it whole. Inside a
block moeshard's names and layout are its own (``checkpoint.block_state``: the family's tensors
under ``MoEWeights``' canonical names, the router's own) and a rank holds, of the routed experts,
the part its ``ShardSpec`` gives it (``training.reference.shard_of_grad``: its experts; under TP
its slice of I). ``checkpoint.writer.placed_tensors`` is the inverse: the ranks' parts put back
into whole tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from moeshard.checkpoint.families import ModelFamily
from moeshard.config import MoEConfig
from moeshard.sharding import ShardSpec


def block_of(name: str, blocks: Iterable[str]) -> str | None:
    """The MoE block (its module name, one of ``blocks``) that holds the rank's parameter ``name``,
    None for a parameter outside every block."""
    return next((b for b in blocks if name.startswith(b + ".")), None)


class RankParts:
    """Whole tensors by transformers' parameter name (``whole``: name -> tensor of that
    parameter's shape, any dtype) seen as a rank's parameters. Each block's tensors are mapped
    once, on first use."""

    def __init__(self, family: ModelFamily, cfg: MoEConfig, whole: dict[str, torch.Tensor]) -> None:
        self.family, self.cfg, self.whole = family, cfg, whole
        self.blocks: dict[str, dict[str, torch.Tensor]] = {}

    def _block(self, prefix: str) -> dict[str, torch.Tensor]:
        from moeshard.checkpoint.block_state import block_state

        if prefix not in self.blocks:
            raw = {k[len(prefix) + 1:]: v for k, v in self.whole.items() if k.startswith(prefix + ".")}
            self.blocks[prefix] = block_state(raw, self.family, self.cfg.num_experts)
        return self.blocks[prefix]

    def of(self, name: str, shards: dict[str, ShardSpec]) -> torch.Tensor:
        """The rank's parameter ``name`` (its name in the sharded model) from the whole tensors;
        shards: the rank's MoE blocks' module names -> their ``ShardSpec``. KeyError for a name
        the whole tensors do not give."""
        from moeshard.training.reference import shard_of_grad

        prefix = block_of(name, shards)
        if prefix is None:
            return self.whole[name]
        local = name[len(prefix) + 1:]
        return shard_of_grad(local, self._block(prefix)[local], shards[prefix], self.cfg)
