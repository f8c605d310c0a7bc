"""``moeshard train --save`` keeps every rank's optimizer state; ``--resume`` goes on from it.

Proof: two AdamW steps saved and one resumed step give the same model, bit for bit, as three
steps in one run (and the same losses at each step), at (1,1) and under EP2 (dp2-tp1-ep: each
rank's state holds its own experts' moments), with a warmup whose rate the resumed run must take
from the step reached. Without the saved moments the resumed step differs (a fresh
AdamW's first step), so the test sees a state that was not read. A state saved by another
layout, a directory without one, and --resume with --compare are refused before any rank starts,
naming what differs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moeshard.cli import main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_tiny_moe  # noqa: E402 - a script of this repository

PROMPTS = "3,17,42,5,9;1,2,3;7,8,9,10;11,12"
# The rate warms up over two steps (0, then half, then whole): a resumed third step must take the
# whole rate, the schedule advanced past the two steps taken (a fresh schedule would give 0).
COMMON = ["--input-ids", PROMPTS, "--lr", "0.01", "--optimizer", "adamw", "--lr-schedule", "constant_with_warmup",
          "--warmup-steps", "2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("resume") / "m"
    make_tiny_moe.make(str(out), "qwen3_moe", hidden=64, moe_intermediate=32, experts=4, vocab=64)
    return str(out)


def _train(model: str, steps: int, layout: list[str], save: Path, output: Path, *extra: str) -> dict:
    code = main(["train", "--model", model, "--steps", str(steps), *COMMON, *layout, "--save", str(save),
                 "--output", str(output), *extra])
    assert code == 0
    return json.loads(output.read_text())


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


# EP2 spawns two ranks four times (about 15 s on two cores): make test-slow.
@pytest.mark.parametrize("layout", [pytest.param([], id="dp1-tp1-noep"),
                                    pytest.param(["--dp", "2", "--ep"], id="dp2-tp1-ep", marks=pytest.mark.slow)])
def test_two_steps_and_a_resumed_one_are_three_steps(model_dir, tmp_path, layout):
    whole = _train(model_dir, 3, layout, tmp_path / "three", tmp_path / "three.json")
    _train(model_dir, 2, layout, tmp_path / "two", tmp_path / "two.json")
    meta = json.loads((tmp_path / "two" / "optimizer" / "meta.json").read_text())
    assert meta["steps_done"] == 2 and meta["optimizer"] == "adamw"
    ranks = 2 if layout else 1
    assert sorted(p.name for p in (tmp_path / "two" / "optimizer").glob("rank-*.safetensors")) == \
        [f"rank-{r:05d}.safetensors" for r in range(ranks)]
    resumed = _train(str(tmp_path / "two"), 1, layout, tmp_path / "resumed", tmp_path / "resumed.json", "--resume")
    assert json.loads((tmp_path / "resumed" / "optimizer" / "meta.json").read_text())["steps_done"] == 3
    assert resumed["losses"] == whole["losses"][2:]
    assert resumed["learning_rates"] == whole["learning_rates"][2:]
    want, got = _weights(tmp_path / "three"), _weights(tmp_path / "resumed")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]

    # Without the moments (a fresh AdamW from the same two-step model, at the same whole rate) the
    # third step differs.
    fresh = tmp_path / "fresh-start"
    fresh.mkdir()
    for path in (tmp_path / "two").iterdir():
        if path.is_file():
            (fresh / path.name).write_bytes(path.read_bytes())
    _train(str(fresh), 1, layout, tmp_path / "fresh", tmp_path / "fresh.json", "--lr-schedule", "constant",
           "--warmup-steps", "0")
    other = _weights(tmp_path / "fresh")
    assert not all(torch.equal(want[k], other[k]) for k in want)


def test_resume_refuses_another_layout_no_state_and_compare(model_dir, tmp_path, capsys):
    _train(model_dir, 2, [], tmp_path / "one", tmp_path / "one.json")
    capsys.readouterr()
    base = ["train", "--steps", "1", *COMMON, "--resume"]
    assert main([*base, "--model", str(tmp_path / "one"), "--dp", "2", "--ep"]) == 2
    err = capsys.readouterr().err
    assert ("was saved by another run: layout 'dp1-tp1-noep' (this run: 'dp2-tp1-ep'); world size 1 (this run: 2); "
            "backend 'local' (this run: 'all2all')") in err
    assert main([*base, "--model", model_dir]) == 2
    assert "holds no optimizer state" in capsys.readouterr().err
    assert main([*base, "--model", str(tmp_path / "one"), "--compare"]) == 2
    assert "--resume with --compare" in capsys.readouterr().err
    assert main([*base, "--model", str(tmp_path / "one"), "--optimizer", "sgd"]) == 2
    assert "optimizer 'adamw' (this run: 'sgd')" in capsys.readouterr().err
    assert main([*base, "--model", str(tmp_path / "one"), "--warmup-steps", "4"]) == 2
    assert "--warmup-steps: must be an integer in [0, 3] (the 2 step(s) taken plus --steps=1), got 4" in \
        capsys.readouterr().err


def test_a_state_that_does_not_fit_the_model_is_refused_naming_the_rank(model_dir, tmp_path, capsys):
    """A rank's state file missing a parameter's moments, or holding a tensor of another shape, is
    refused before any step, naming the rank and the tensor; the model is not trained on."""
    from safetensors.torch import save_file

    _train(model_dir, 2, [], tmp_path / "one", tmp_path / "one.json")
    path = tmp_path / "one" / "optimizer" / "rank-00000.safetensors"
    state = load_file(str(path))
    base = ["train", "--model", str(tmp_path / "one"), "--steps", "1", *COMMON, "--resume"]
    dropped = sorted(state)[0]
    save_file({k: v for k, v in state.items() if k != dropped}, str(path))
    capsys.readouterr()
    assert main(base) != 0
    assert "rank 0: optimizer state" in capsys.readouterr().err
    name = next(k for k in sorted(state) if k.endswith("/exp_avg"))
    save_file({**state, name: torch.zeros(3, 5)}, str(path))
    assert main(base) != 0
    err = capsys.readouterr().err
    assert f"rank 0: optimizer state {path}: {name} is [3, 5]" in err


def test_each_rank_saves_and_reads_back_its_own_state(tmp_path):
    """``save_rank_state`` for a training loop of one's own: each rank (here two, each with its own
    shard, in one process: the files are all there is to it) writes its state and rank 0 the
    meta; ``load_rank_state`` gives a fresh optimizer the same state, and its next step the same
    parameters; a second save over them is refused."""
    from moeshard.training.optimizer_state import OptimizerMeta, load_rank_state, read_meta, save_rank_state

    meta = OptimizerMeta(layout="dp2-tp1-ep", world_size=2, backend="all2all", optimizer="adamw", steps_done=1,
                         dtype="float32")

    def rank_model(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(rank)
        model = torch.nn.Linear(4, 3 + rank)  # each rank its own shard's shape
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    trained = {}
    for rank in range(2):
        model, opt = rank_model(rank)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        save_rank_state(tmp_path, meta, rank, opt, model)
        trained[rank] = (model, opt)
    assert read_meta(tmp_path) == meta
    for rank in range(2):
        model, opt = trained[rank]
        copy, fresh = rank_model(rank)
        copy.load_state_dict(model.state_dict())
        load_rank_state(fresh, copy, tmp_path, rank)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(9))
        for m, o in ((model, opt), (copy, fresh)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), copy.parameters(), strict=True))
    with pytest.raises(FileExistsError, match="rank 1: optimizer state .* exists; it is never written over"):
        save_rank_state(tmp_path, meta, 1, trained[1][1], trained[1][0])
