"""What the tests of quantized checkpoint formats share (FP8 with a scale per tensor or row, MXFP8,
ModelOpt NVFP4): each writes a quantized checkpoint of a tiny random model beside an oracle, a
full-precision checkpoint of the values the quantized one dequantizes to, which transformers loads
itself; and each checks that training's save of a model read from it is a full-precision
checkpoint."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_tiny_moe  # noqa: E402 - a script of this repository, importable once its directory is on the path


def save_beside(src: Path, directory: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
    """``directory`` made with ``tensors`` as its model.safetensors, ``config`` as its config.json
    and every other file of the tiny model's directory ``src`` copied."""
    directory.mkdir(parents=True)
    save_file(dict(tensors), str(directory / "model.safetensors"), metadata={"format": "pt"})
    for extra in src.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            shutil.copy(extra, directory / extra.name)
    (directory / "config.json").write_text(json.dumps(config))


def tiny_pairs(root: Path, cases: Mapping[str, Any], write: Callable[[Path, Path, Path, Any], None],
               seed: int) -> dict[str, tuple[Path, Path]]:
    """case id -> (its quantized checkpoint, its oracle) under ``root``: for each case (with
    ``family`` and ``sizes`` = hidden, moe intermediate, experts) a tiny model of seed ``seed`` + its
    index, then ``write(tiny model, checkpoint dir, oracle dir, case)``."""
    out = {}
    for i, (cid, case) in enumerate(cases.items()):
        hidden, inter, experts = case.sizes
        src = root / f"{cid}-src"
        make_tiny_moe.make(str(src), case.family, hidden=hidden, moe_intermediate=inter, experts=experts, seed=seed + i)
        write(src, root / cid, root / f"{cid}-oracle", case)
        out[cid] = (root / cid, root / f"{cid}-oracle")
    return out


def assert_saves_as_full_precision(model_dir: Path, saved: Path, prompt: Sequence[int]) -> None:
    """Training's save (``save_sharded_model``) of the model read from the quantized ``model_dir``
    with ``--quant none``: a model-dtype checkpoint without the source's quantization (in its
    config, or an hf_quant_config.json), which reads back to the same logits."""
    from moeshard.checkpoint import read_hf_config
    from moeshard.integrations.transformers import load_sharded_model, save_sharded_model

    model = load_sharded_model(model_dir, quant="none", dtype="float32")
    save_sharded_model(model, None, model_dir, saved)
    assert read_hf_config(saved).checkpoint_format == "bf16"
    assert not (saved / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        before = model(ids).logits
        after = load_sharded_model(saved, dtype="float32")(ids).logits
    assert torch.equal(before, after)


def oracle_generations(plan: Callable[[Path, Any], Any]) -> Callable[[Path, int], list]:
    """(oracle directory, DP size) -> transformers' own generation on that checkpoint
    (``reference_generate`` of ``plan(directory, DP layout)``: each DP rank its share of the
    prompts), each computed once."""
    from moeshard.jobs.generate import reference_generate
    from moeshard.parallel.config import ParallelConfig

    cache: dict[tuple[Path, int], list] = {}

    def get(oracle_dir: Path, dp: int = 1) -> list:
        if (oracle_dir, dp) not in cache:
            cache[oracle_dir, dp] = reference_generate(plan(oracle_dir, ParallelConfig(dp, 1, False)))
        return cache[oracle_dir, dp]

    return get
