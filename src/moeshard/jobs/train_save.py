"""``moeshard train --save DIR``: the trained model as a Hugging Face checkpoint, written by
transformers' own ``save_pretrained`` so that ``from_pretrained`` (and moeshard's loader) read it.

    trained_parameters(plan, results)   parent: every parameter moeshard trained, whole, under
                                        transformers' name and layout, from the ranks' copies
    save_trained(plan, results, DIR)    parent: the checkpoint the run read, in transformers, with
                                        those parameters put in; saved to a new directory

The ranks send their trained parameters back as ``--compare`` has them (``TrainRankResult.params``,
CPU fp32, by moeshard's names; a routed expert tensor as its rank's shard). Outside the MoE blocks
a parameter has transformers' name and every rank holds the same copy (the gradient reduction
keeps them equal), so rank 0's is taken. Inside a block moeshard's names and layout differ from
the family's (``integrations.transformers.block_state``) and a rank holds its experts and its
slice of I (``training.reference.shard_of_grad``). Rather than a second, inverse, rule per family
and layout, each element is placed by the forward rules themselves: they are applied to a
transformers block whose every element holds its own index (float64, exact below 2^53), which
gives, for every element of a rank's shard, the index of transformers' element it is. Every
element of every block tensor must be given by some rank, else the save is refused naming the
tensor.

The parent holds the whole model once (transformers' ``from_pretrained`` of the checkpoint, in
the run's dtype), as ``--compare`` does. Tokenizer and other files of the checkpoint that
``save_pretrained`` does not write are copied. The directory appears whole or not at all
(``outputs.atomic_write_dir``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, cast

import torch

from moeshard.checkpoint.hf_config import read_hf_config
from moeshard.jobs.generate import load_transformers_model
from moeshard.jobs.train import TrainPlan, TrainRankResult
from moeshard.outputs import atomic_write_dir

# Files of a checkpoint that hold its weights: never copied, ``save_pretrained`` writes the trained ones.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


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


def _block_parameters(plan: TrainPlan, results: list[TrainRankResult], prefix: str,
                      raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' block tensors (``raw``: name inside the block -> its tensor as loaded), each
    replaced by the trained values the ranks hold of it."""
    from moeshard.integrations.transformers import block_state
    from moeshard.training.reference import shard_of_grad

    family = read_hf_config(plan.spec.model_dir).family
    probe, total = _index_probe(raw)
    where = block_state(probe, family, plan.cfg.num_experts)
    flat = torch.zeros(total, dtype=torch.float32)
    given = torch.zeros(total, dtype=torch.bool)
    for r in results:
        assert r.params is not None  # save_trained checks
        spec = r.shards[prefix]
        for name, value in r.params.items():
            if not name.startswith(prefix + "."):
                continue
            local = name[len(prefix) + 1:]
            if local not in where:
                raise RuntimeError(f"rank {r.rank}: {name} is no tensor of transformers' block {prefix} "
                                   f"(it has {sorted(raw)})")
            index = shard_of_grad(local, where[local], spec, plan.cfg)
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
        if not bool(given[part].all()):
            missing = int((~given[part]).sum())
            raise RuntimeError(f"{prefix}.{name}: {missing} of its {t.numel()} elements are held by no rank's "
                               f"trained parameters; nothing saved")
        out[name] = flat[part].reshape(t.shape)
    return out


def trained_parameters(plan: TrainPlan, results: list[TrainRankResult],
                       model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' parameter name -> its trained value (CPU fp32, whole) for every parameter of
    ``model`` (transformers' model of the run's checkpoint) that moeshard trained."""
    if any(r.params is None for r in results):
        raise ValueError("trained_parameters: the ranks sent no parameters (TrainSpec.save_dir and compare unset)")
    first = min(results, key=lambda r: r.rank)
    assert first.params is not None
    params = dict(model.named_parameters())
    blocks = sorted(first.shards, key=len, reverse=True)
    out: dict[str, torch.Tensor] = {}
    for name in params:
        if any(name.startswith(b + ".") for b in blocks):
            continue
        if name in first.params:
            out[name] = first.params[name]
    for prefix in blocks:
        raw = {k[len(prefix) + 1:]: v.detach() for k, v in params.items() if k.startswith(prefix + ".")}
        out.update({f"{prefix}.{k}": v for k, v in _block_parameters(plan, results, prefix, raw).items()})
    return out


def _copy_other_files(source: Path, target: Path) -> None:
    """Files of the checkpoint (tokenizer, chat template, ...) that are no weights and that
    ``save_pretrained`` did not write."""
    for path in sorted(source.iterdir()):
        if not path.is_file() or path.name in WEIGHT_INDEXES or path.name.endswith(WEIGHT_SUFFIXES):
            continue
        if not (target / path.name).exists():
            shutil.copy2(path, target / path.name)


def save_trained(plan: TrainPlan, results: list[TrainRankResult], directory: str | Path) -> int:
    """Writes the trained model to the new ``directory`` as transformers' ``save_pretrained`` does
    (safetensors, config.json in the run's dtype, generation config), with the checkpoint's other
    files; returns how many parameters moeshard trained and put in. ``OutputError`` if it cannot be
    written; ``RuntimeError`` (nothing written) if some trained element has no rank."""
    model = load_transformers_model(plan.spec.model_dir, plan.dtype)
    trained = trained_parameters(plan, results, model)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in trained.items():
            params[name].copy_(value.to(params[name].dtype))

    def write(tmp: str) -> None:
        cast(Any, model).save_pretrained(tmp)  # a transformers PreTrainedModel, typed as the nn.Module it is
        _copy_other_files(Path(plan.spec.model_dir), Path(tmp))

    atomic_write_dir(directory, write)
    return len(trained)
