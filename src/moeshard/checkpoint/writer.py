"""A sharded model back to a Hugging Face checkpoint: what every rank holds, put where transformers
holds it, saved by transformers' own ``save_pretrained`` so that ``from_pretrained`` (and
moeshard's loader) read it.

    RankState(rank, params, shards, buffers)   one rank's tensors (CPU, by moeshard's names)
    placed_tensors(model_dir, cfg, ranks, model)
                                          every tensor of transformers' ``model`` that the ranks
                                          hold, whole, under transformers' name and layout
    save_checkpoint(model_dir, cfg, ranks, directory)
                                          the checkpoint read, in transformers, with those
                                          tensors put in; saved to a new directory

Outside the MoE blocks a tensor has transformers' name and every rank holds the same copy (a
replicated parameter, kept equal by the gradient reduction), so the lowest rank's is taken.
Inside a block moeshard's names and layout differ from the family's
(``checkpoint.block_state``) and a rank holds its experts and its slice of I
(``training.reference.shard_of_grad``). Rather than a second, inverse, rule per family and layout,
each element is placed by the forward rules themselves: they are applied to a transformers block
whose every element holds its own index (float64, exact below 2^53), which gives, for every
element of a rank's shard, the index of transformers' element it is. Every element of every block
parameter must be given by some rank, else the save is refused naming the tensor; a buffer (the
selection bias) is taken where a rank holds it and kept as read otherwise.

The writing process holds the whole model once (transformers' ``from_pretrained`` of the
checkpoint, in ``cfg.dtype``). Tokenizer and other files of the checkpoint that
``save_pretrained`` does not write are copied. The directory appears whole or not at all
(``outputs.atomic_write_dir``). An MXFP4 checkpoint is written dequantized.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from moeshard.checkpoint.block_state import block_state, unused_rows
from moeshard.checkpoint.families import ModelFamily
from moeshard.checkpoint.hf_config import read_hf_config
from moeshard.config import MoEConfig
from moeshard.outputs import atomic_write_dir
from moeshard.sharding import ShardSpec

# Files of a checkpoint that hold its weights: never copied, ``save_pretrained`` writes the new ones.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# What describes the source's weights rather than the written ones: an older ModelOpt export's
# quantization (the writer saves the model dtype, without a quantization_config).
WEIGHT_DESCRIPTIONS = ("hf_quant_config.json",)


@dataclass(frozen=True)
class RankState:
    """One rank's tensors. params: every parameter (CPU; a routed expert tensor is the rank's
    shard) by its name in the sharded model; shards: each MoE block's module name -> the rank's
    ``ShardSpec``; buffers: floating-point buffers by name (the selection bias), or none."""

    rank: int
    params: dict[str, torch.Tensor]
    shards: dict[str, ShardSpec]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def _index_probe(raw: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """The block's tensors as float64 tensors of the same shapes whose elements are their own
    indices into one flat vector of them all (in ``raw``'s order), and that vector's length."""
    probe, start = {}, 0
    for name, t in raw.items():
        probe[name] = torch.arange(start, start + t.numel(), dtype=torch.float64).reshape(t.shape)
        start += t.numel()
    if start >= 2**53:
        raise ValueError(f"a MoE block of {start} elements cannot be indexed exactly in float64")
    return probe, start


def _block_tensors(family: ModelFamily, cfg: MoEConfig, ranks: list[RankState], prefix: str,
                   raw: dict[str, torch.Tensor], parameters: set[str], absent_ok: bool = False,
                   unused: float | None = None) -> dict[str, torch.Tensor]:
    """transformers' block tensors (``raw``: name inside the block -> its tensor as loaded;
    ``parameters``: which of them are parameters), each with the values the ranks hold of it;
    absent_ok: a parameter no rank gives any element of is left out instead of refused; unused:
    the value of the elements transformers holds but never uses (``block_state.unused_rows``),
    None: as loaded."""
    from moeshard.training.reference import shard_of_grad

    probe, total = _index_probe(raw)
    where = block_state(probe, family, cfg.num_experts)
    flat = torch.cat([t.detach().reshape(-1).float() for t in raw.values()]) if raw else torch.zeros(0)
    given = torch.zeros(total, dtype=torch.bool)
    for rows in unused_rows(probe, family, cfg.num_experts):
        index = rows.reshape(-1).long()
        given[index] = True
        if unused is not None:
            flat[index] = unused
    for r in ranks:
        spec = r.shards[prefix]
        held = [(name, value, True) for name, value in r.params.items()]
        held += [(name, value, False) for name, value in r.buffers.items()]
        for name, value, is_param in held:
            if not name.startswith(prefix + "."):
                continue
            local = name[len(prefix) + 1:]
            if local not in where:
                if not is_param:
                    continue  # a buffer of moeshard's own (load counts), not transformers'
                raise RuntimeError(f"rank {r.rank}: {name} is no tensor of transformers' block {prefix} "
                                   f"(it has {sorted(raw)})")
            index = shard_of_grad(local, where[local], spec, cfg)
            if tuple(index.shape) != tuple(value.shape):
                raise RuntimeError(f"rank {r.rank}: {name} is {tuple(value.shape)}, its part of transformers' "
                                   f"tensor {tuple(index.shape)}")
            index = index.reshape(-1).long()
            flat[index] = value.reshape(-1).float()
            given[index] = True
    out, start = {}, 0
    for name, t in raw.items():
        part = slice(start, start + t.numel())
        start += t.numel()
        if absent_ok and name in parameters and not bool(given[part].any()):
            continue
        if name in parameters and not bool(given[part].all()):
            missing = int((~given[part]).sum())
            raise RuntimeError(f"{prefix}.{name}: {missing} of its {t.numel()} elements are held by no rank's "
                               f"parameters; nothing saved")
        out[name] = flat[part].reshape(t.shape)
    return out


def placed_tensors(model_dir: str | Path, cfg: MoEConfig, ranks: list[RankState],
                   model: torch.nn.Module, absent_ok: bool = False, unused: float | None = None) -> dict[str, torch.Tensor]:
    """transformers' tensor name -> its value (CPU fp32, whole) for every parameter and
    floating-point buffer of ``model`` (transformers' model of ``model_dir``) that the ranks hold.
    A block parameter the ranks give part of is refused (RuntimeError); one they give nothing of
    too, unless ``absent_ok`` (an optimizer's state, which a parameter without gradients lacks).
    Elements transformers holds but never uses (LongCat-Flash's gate_up rows of its
    zero-computation experts) keep ``model``'s values, or take ``unused``."""
    if not ranks:
        raise ValueError("placed_tensors: no rank's tensors given")
    first = min(ranks, key=lambda r: r.rank)
    params = dict(model.named_parameters())
    buffers = {n: b for n, b in model.named_buffers() if b.is_floating_point()}
    blocks = sorted(first.shards, key=len, reverse=True)
    family = read_hf_config(model_dir).family
    held = {**first.buffers, **first.params}
    out: dict[str, torch.Tensor] = {}
    for name in {**buffers, **params}:
        if not any(name.startswith(b + ".") for b in blocks) and name in held:
            out[name] = held[name]
    for prefix in blocks:
        raw = {k[len(prefix) + 1:]: v for k, v in {**buffers, **params}.items() if k.startswith(prefix + ".")}
        inside = {k[len(prefix) + 1:] for k in params if k.startswith(prefix + ".")}
        out.update({f"{prefix}.{k}": v
                    for k, v in _block_tensors(family, cfg, ranks, prefix, raw, inside, absent_ok, unused).items()})
    return out


def _copy_other_files(source: Path, target: Path) -> None:
    """Files of the checkpoint (tokenizer, chat template, ...) that are no weights and that
    ``save_pretrained`` did not write."""
    for path in sorted(source.iterdir()):
        if (not path.is_file() or path.name in WEIGHT_INDEXES + WEIGHT_DESCRIPTIONS
                or path.name.endswith(WEIGHT_SUFFIXES)):
            continue
        if not (target / path.name).exists():
            shutil.copy2(path, target / path.name)


def save_checkpoint(model_dir: str | Path, cfg: MoEConfig, ranks: list[RankState], directory: str | Path,
                    also: Callable[[str, torch.nn.Module], None] | None = None) -> int:
    """Writes the model the ranks hold to the new ``directory`` as transformers' ``save_pretrained``
    does (safetensors, config.json in ``cfg.dtype``, generation config), with ``model_dir``'s other
    files, and whatever ``also(tmp, model)`` writes into the directory before it appears (the
    optimizer state; ``model``: transformers' model the ranks' tensors were put into); returns how
    many of transformers' parameters were put in from the ranks. ``OutputError`` if it cannot be
    written; ``RuntimeError`` (nothing written) if an element of a block parameter has no rank."""
    from moeshard.checkpoint.hf_model import load_transformers_model

    model = load_transformers_model(str(model_dir), cfg.dtype)
    placed = placed_tensors(model_dir, cfg, ranks, model)
    with torch.no_grad():
        targets = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        for name, value in placed.items():
            targets[name].copy_(value.to(targets[name].dtype))

    def write(tmp: str) -> None:
        cast(Any, model).save_pretrained(tmp)  # a transformers PreTrainedModel, typed as the nn.Module it is
        _copy_other_files(Path(model_dir), Path(tmp))
        if also is not None:
            also(tmp, model)

    atomic_write_dir(directory, write)
    params = dict(model.named_parameters())
    return sum(1 for name in placed if name in params)
