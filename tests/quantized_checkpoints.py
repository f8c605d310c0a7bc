"""What the tests of quantized checkpoint formats share (FP8 with a scale per tensor or row, MXFP8,
ModelOpt NVFP4, DeepSeek-V4's FP8 release): each writes a quantized checkpoint of a tiny random
model beside an oracle, a full-precision checkpoint of the values the quantized one dequantizes to,
which transformers loads itself; each judges moeshard's generation on the quantized checkpoint,
at one rank and under the two-rank ``LAYOUTS``, against transformers' on the oracle; and each
checks that training's save of a model read from it is a full-precision checkpoint."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from moeshard.parallel.config import ParallelConfig

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


# The layouts each format is judged under besides (1,1): the experts split between two ranks, and
# every expert's intermediate size cut in two.
LAYOUTS = {"dp2-tp1-ep": ParallelConfig(2, 1, True), "dp1-tp2-noep": ParallelConfig(1, 2, False)}


class AgainstTransformers:
    """The whole tiny model read from a quantized checkpoint against transformers on its oracle: at
    (1,1), where moeshard's own ``--compare`` model must also be transformers on the oracle's
    values bit for bit, and under each of ``LAYOUTS``. A test module subclasses it as a ``Test``
    class, giving ``plan(model_dir, layout)`` (its ``GeneratePlan``); its module provides the
    fixtures ``ckpts`` ((checkpoint, oracle)) and ``oracles`` (DP size -> transformers' generation on
    the oracle)."""

    spawn_timeout_s = 300.0

    @staticmethod
    def plan(model_dir: Path, layout: ParallelConfig | None = None) -> Any:
        raise NotImplementedError("a test class of AgainstTransformers gives plan(model_dir, layout)")

    @pytest.fixture(scope="class")
    @classmethod
    def world(cls, ckpts):
        return layouts_world(lambda layout: cls.plan(ckpts[0], layout), cls.spawn_timeout_s)

    def test_one_rank_equals_transformers_on_the_dequantized_weights(self, ckpts, oracles):
        from moeshard.jobs.generate import generate_rank

        plan = self.plan(ckpts[0])
        judge(plan, [generate_rank(plan, None)], oracles(), "(1,1)")
        assert_compare_model_is_the_oracle(plan, oracles())

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_layout_equals_transformers_on_the_dequantized_weights(self, world, oracles, layout):
        judge(*world(layout), oracles(LAYOUTS[layout].dp), layout)


def layouts_world(plan_of: Callable[[ParallelConfig], Any], timeout_s: float) -> Callable[[str], tuple[Any, list]]:
    """layout name -> (its plan, the ranks' results): the plans ``plan_of(layout)`` of every
    ``LAYOUTS`` entry, run together in one spawned world (each rank runs both), the first time one
    is asked for."""
    from generate_worlds import GenerateWorlds

    world = GenerateWorlds(lambda _: (list(LAYOUTS), [plan_of(layout) for layout in LAYOUTS.values()]), timeout_s)
    return lambda layout: world("layouts")[layout]


def judge(plan, results: Sequence, oracle: list, tag: str) -> None:
    """The ranks' ``results`` of ``plan`` give transformers' greedy ids on ``oracle`` (its
    generation) and logits within the plan's tolerance; ``tag`` names the case in the failure."""
    from moeshard.jobs.generate import compare_generations

    for r in results:
        assert not isinstance(r, dict), f"{tag}: rank raised: {r}"
    c = compare_generations(plan, list(results), oracle)
    assert all(c.same_ids), f"{tag}: ids differ at steps {c.first_difference}"
    assert c.within_tolerance, f"{tag}: logits off by {c.step_max_abs}"


def assert_compare_model_is_the_oracle(plan, oracle: list) -> None:
    """moeshard's own ``--compare`` model of ``plan``'s quantized checkpoint (``reference_generate``)
    is transformers on the oracle's values: the same ids and logits, bit for bit."""
    from moeshard.jobs.generate import reference_generate

    for (ids, logits), (want_ids, want_logits) in zip(reference_generate(plan), oracle, strict=True):
        assert ids == want_ids and all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))


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
