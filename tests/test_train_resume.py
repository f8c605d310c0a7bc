"""``moeshard train --save`` keeps the optimizer state whole; ``--resume`` goes on from it under any layout.

Proof: two AdamW steps saved and one resumed step give the same model, bit for bit, as three
steps in one run (and the same losses at each step), at (1,1) and under EP2 (dp2-tp1-ep: each
rank's moments put back into whole tensors and cut out again), with a warmup whose rate the
resumed run must take from the step reached. Resumed under another layout (TP2 from (1,1); EP2's
state at (1,1)) the third step lands within float32 rounding of the saving layout's. Without the
saved moments the resumed step differs (a fresh AdamW's first step), so the tests see a state
that was not read. Another optimizer, a per-rank state of another layout, a directory without
a state, and --resume with --compare are refused before any rank starts, naming what differs.
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


def _fresh_third_step(tmp_path: Path, layout: list[str]) -> dict[str, torch.Tensor]:
    """The model of one step of a fresh AdamW, at the whole rate, from the two-step model in
    ``tmp_path / "two"`` (its files without the optimizer state)."""
    fresh = tmp_path / "fresh-start"
    fresh.mkdir()
    for path in (tmp_path / "two").iterdir():
        if path.is_file():
            (fresh / path.name).write_bytes(path.read_bytes())
    _train(str(fresh), 1, layout, tmp_path / "fresh", tmp_path / "fresh.json", "--lr-schedule", "constant",
           "--warmup-steps", "0")
    return _weights(tmp_path / "fresh")


# EP2 spawns two ranks four times (about 15 s on two cores): make test-slow.
@pytest.mark.parametrize("layout", [pytest.param([], id="dp1-tp1-noep"),
                                    pytest.param(["--dp", "2", "--ep"], id="dp2-tp1-ep", marks=pytest.mark.slow)])
def test_two_steps_and_a_resumed_one_are_three_steps(model_dir, tmp_path, layout):
    whole = _train(model_dir, 3, layout, tmp_path / "three", tmp_path / "three.json")
    _train(model_dir, 2, layout, tmp_path / "two", tmp_path / "two.json")
    meta = json.loads((tmp_path / "two" / "optimizer" / "meta.json").read_text())
    assert meta["steps_done"] == 2 and meta["optimizer"] == "adamw"
    assert meta["format"] == 2 and meta["stateless"] == []
    # AdamW's step, once for each parameter outside the blocks and once for each block
    assert set(meta["scalars"]) == {"step"} and set(meta["scalars"]["step"].values()) == {2.0}
    assert "model.layers.0.mlp" in meta["scalars"]["step"] and "model.embed_tokens.weight" in meta["scalars"]["step"]
    # whole fp32 moments under the names and shapes of transformers' parameters
    import transformers

    state = load_file(str(tmp_path / "two" / "optimizer" / "state.safetensors"))
    model = dict(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "two").named_parameters())
    assert {k.rpartition("/")[0] for k in state} <= set(model) and len(state) == 2 * len(model)
    assert all(state[k].dtype == torch.float32 and state[k].shape == model[k.rpartition("/")[0]].shape for k in state)
    resumed = _train(str(tmp_path / "two"), 1, layout, tmp_path / "resumed", tmp_path / "resumed.json", "--resume")
    assert json.loads((tmp_path / "resumed" / "optimizer" / "meta.json").read_text())["steps_done"] == 3
    assert resumed["losses"] == whole["losses"][2:]
    assert resumed["learning_rates"] == whole["learning_rates"][2:]
    want, got = _weights(tmp_path / "three"), _weights(tmp_path / "resumed")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]

    # Without the moments (a fresh AdamW from the same two-step model, at the same whole rate) the
    # third step differs.
    other = _fresh_third_step(tmp_path, layout)
    assert not all(torch.equal(want[k], other[k]) for k in want)


def test_resume_refuses_no_state_compare_another_optimizer_and_a_per_rank_state_of_another_layout(
        model_dir, tmp_path, capsys):
    _train(model_dir, 2, [], tmp_path / "one", tmp_path / "one.json")
    capsys.readouterr()
    base = ["train", "--steps", "1", *COMMON, "--resume"]
    assert main([*base, "--model", model_dir]) == 2
    assert "holds no optimizer state" in capsys.readouterr().err
    assert main([*base, "--model", str(tmp_path / "one"), "--compare"]) == 2
    assert "--resume with --compare" in capsys.readouterr().err
    assert main([*base, "--model", str(tmp_path / "one"), "--optimizer", "sgd"]) == 2
    assert "optimizer 'adamw' (this run: 'sgd')" in capsys.readouterr().err
    assert main([*base, "--model", str(tmp_path / "one"), "--warmup-steps", "4"]) == 2
    assert "--warmup-steps: must be an integer in [0, 3] (the 2 step(s) taken plus --steps=1), got 4" in \
        capsys.readouterr().err
    # A per-rank state (a loop of one's own: save_rank_state) is read by its own layout only.
    meta_path = tmp_path / "one" / "optimizer" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "format": 1, "scalars": None}))
    assert main([*base, "--model", str(tmp_path / "one"), "--dp", "2", "--ep"]) == 2
    assert ("was saved by another run: layout 'dp1-tp1-noep' (this run: 'dp2-tp1-ep'); world size 1 (this run: 2); "
            "backend 'local' (this run: 'all2all')") in capsys.readouterr().err
    meta_path.write_text(json.dumps({**meta, "format": 7}))
    assert main([*base, "--model", str(tmp_path / "one")]) == 2
    assert "format 7 (this moeshard reads [1, 2])" in capsys.readouterr().err


# (1,1) -> TP2 in make test; EP2 -> (1,1) spawns two ranks twice more: make test-slow.
@pytest.mark.parametrize("saved, resumed", [
    pytest.param([], ["--tp", "2"], id="dp1-tp1-noep-to-dp1-tp2-noep"),
    pytest.param(["--dp", "2", "--ep"], [], id="dp2-tp1-ep-to-dp1-tp1-noep", marks=pytest.mark.slow)])
def test_a_whole_state_goes_on_under_another_layout(model_dir, tmp_path, saved, resumed):
    """Two steps saved by one layout and a third resumed by another give the saving layout's
    three-step model, up to the third step's float32 sums in another order (the experts' moments
    cut by another rule: TP2's halves of I, EP2's experts); a fresh AdamW's third step (on the
    saving layout) lands a thousand times further off. (Against another layout's three steps the first two differ too,
    and AdamW's first steps magnify rounding: an element whose gradient is nearly zero moves by
    nearly the whole rate.)"""
    _train(model_dir, 3, saved, tmp_path / "three", tmp_path / "three.json")
    _train(model_dir, 2, saved, tmp_path / "two", tmp_path / "two.json")
    report = _train(str(tmp_path / "two"), 1, resumed, tmp_path / "resumed", tmp_path / "resumed.json", "--resume")
    assert (report["resumed_after_step"], report["resumed_from_layout"]) == \
        (2, "dp2-tp1-ep" if saved else "dp1-tp1-noep")
    other = _fresh_third_step(tmp_path, saved)  # the moments' weight, measured on the cheaper layout
    want, got = _weights(tmp_path / "three"), _weights(tmp_path / "resumed")
    off = max(float((want[k] - got[k]).abs().max()) for k in want)
    fresh_off = max(float((want[k] - other[k]).abs().max()) for k in want)
    assert off <= 1e-5 and fresh_off > 1000 * max(off, 1e-7), (off, fresh_off)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v4"])
def test_a_whole_state_of_biased_or_self_routed_experts_goes_on(tmp_path_factory, tmp_path, family):
    """gpt-oss (expert biases, cut by TP like their weights) and DeepSeek-V4 (experts under the block
    that routes them; attention parameters that some steps give no gradient, so their own step
    counts, or no state at all): saved at (1,1), the third step resumed at (1,1) gives three
    steps' model bit for bit, and resumed under TP2 lands within 1e-4 of it (DeepSeek-V4's
    hyper-connections take TP2's rounding, which AdamW's young moments magnify, to 7.6e-5), a
    fresh AdamW's a hundred times further."""
    model = tmp_path_factory.mktemp(family) / "m"
    try:
        make_tiny_moe.make(str(model), family, hidden=64, moe_intermediate=32, experts=4, vocab=64)
    except ValueError as exc:
        pytest.skip(str(exc))
    _train(str(model), 3, [], tmp_path / "three", tmp_path / "three.json")
    _train(str(model), 2, [], tmp_path / "two", tmp_path / "two.json")
    _train(str(tmp_path / "two"), 1, [], tmp_path / "same", tmp_path / "same.json", "--resume")
    _train(str(tmp_path / "two"), 1, ["--tp", "2"], tmp_path / "resumed", tmp_path / "resumed.json", "--resume")
    other = _fresh_third_step(tmp_path, [])
    want, same, got = _weights(tmp_path / "three"), _weights(tmp_path / "same"), _weights(tmp_path / "resumed")
    assert all(torch.equal(want[k], same[k]) for k in want), [k for k in want if not torch.equal(want[k], same[k])]
    off = max(float((want[k] - got[k]).abs().max()) for k in want)
    fresh_off = max(float((want[k] - other[k]).abs().max()) for k in want)
    assert off <= 1e-4 and fresh_off > 100 * max(off, 1e-7), (off, fresh_off)


def test_a_state_that_does_not_fit_the_model_is_refused_naming_the_rank(model_dir, tmp_path, capsys):
    """A state missing a parameter's moments, or holding a tensor of another shape (outside the
    blocks or inside one), is refused before any step, naming the rank and the tensor; the model
    is not trained on."""
    from safetensors.torch import save_file

    _train(model_dir, 2, [], tmp_path / "one", tmp_path / "one.json")
    path = tmp_path / "one" / "optimizer" / "state.safetensors"
    state = load_file(str(path))
    base = ["train", "--model", str(tmp_path / "one"), "--steps", "1", *COMMON, "--resume"]
    dropped = "model.embed_tokens.weight/exp_avg"
    save_file({k: v for k, v in state.items() if k != dropped}, str(path))
    capsys.readouterr()
    assert main(base) != 0
    assert f"rank 0: optimizer state {path}: no 'exp_avg' for the trained parameter 'model.embed_tokens.weight'" in \
        capsys.readouterr().err
    save_file({**state, dropped: torch.zeros(3, 5)}, str(path))
    assert main(base) != 0
    assert f"rank 0: optimizer state {path}: model.embed_tokens.weight/exp_avg is [3, 5] of this rank" in \
        capsys.readouterr().err
    expert = next(k for k in sorted(state) if ".experts." in k and k.endswith("/exp_avg_sq"))
    save_file({**state, expert: state[expert][:1]}, str(path))
    assert main(base) != 0
    assert f"rank 0: optimizer state {path}: " in capsys.readouterr().err


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
