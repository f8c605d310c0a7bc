"""``moeshard train --save``: the trained model as a checkpoint that transformers and moeshard read.

The proof is exact: the saved checkpoint, read back by transformers' ``from_pretrained`` and cut
as each rank holds it (moeshard's names and layout, the rank's experts and slice of I, the same
rule ``--compare`` uses), equals every rank's trained parameters bit for bit. Families chosen for
how they store their blocks: per-expert tensors that transformers fuses on load (Mixtral), a
shared expert with its gate (Qwen2-MoE), a transposed interleaved gate_up (gpt-oss), stored names
apart from the model's (Granite), the experts alone replaced (Gemma 4), a selection bias held
[1, E] (ERNIE 4.5), a fused shared gate_up (MiniMax-M3), a selection bias that transformers
holds as a parameter and moeshard as a buffer (AFMoE); every other family ``make_tiny_moe``
builds in ``make test-slow``; under EP2, SP and TP2 the experts come from two ranks. Then
moeshard itself reads the saved model (``generate --compare``); the library's
``save_sharded_model`` writes what every rank of a 2-rank world holds, selection biases
included; a save that would miss an element is refused with nothing written, and so is every
output path that would overwrite anything.
"""

from __future__ import annotations

import os
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moeshard.checkpoint.hf_config import read_hf_config
from moeshard.checkpoint.writer import RankState, save_checkpoint
from moeshard.cli import main
from moeshard.jobs.train import TrainSpec, plan_train, train_plans, train_rank
from moeshard.parallel.config import ParallelConfig
from moeshard.training.rank_parts import RankParts

tf = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_tiny_moe  # noqa: E402 - a script of this repository
from forked_world import run_forked  # noqa: E402 - a helper of these tests

PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11, 12))
ONE_RANK = ("mixtral", "qwen2_moe", "gpt_oss", "granitemoe", "gemma4_text", "ernie4_5_moe", "minimax_m3_vl_text",
            "afmoe")
TWO_RANKS = {"dp2-tp1-ep": ("mixtral", ParallelConfig(2, 1, True)), "dp1-tp2-ep": ("qwen2_moe", ParallelConfig(1, 2, True)),
             "dp1-tp2-noep": ("deepseek_v3", ParallelConfig(1, 2, False))}


class _Models(dict):
    """model_type -> directory of its tiny random float32 model, made when first asked for."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, family: str) -> str:
        if family not in tf.models.auto.configuration_auto.CONFIG_MAPPING:
            pytest.skip(f"transformers {tf.__version__} has no config class for model_type {family!r}")
        try:
            make_tiny_moe.make(str(self.root / family), family, hidden=32, moe_intermediate=16, experts=4, layers=2,
                               vocab=64, dtype="float32", seed=zlib.crc32(family.encode()) % 1000)
        except ValueError as exc:  # transformers 5.17's Qwen4-Exp has no indexed attention layers
            pytest.skip(f"transformers {tf.__version__} cannot build the tiny {family!r} model: {exc}")
        self[family] = str(self.root / family)
        return self[family]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> _Models:
    return _Models(tmp_path_factory.mktemp("tiny-save"))


def _plan(model_dir: str, parallel: ParallelConfig | None = None, save_dir: str | None = None):
    return plan_train(TrainSpec(model_dir, PROMPTS, 2, 0.01, "sgd", parallel or ParallelConfig(), save_dir=save_dir))


def _state(result) -> RankState:
    return RankState(result.rank, result.params, result.shards, result.buffers or {})


def _check_saved_exactly(plan, results, directory: Path, count: int) -> None:
    """Every rank's every trained parameter is its part of the saved tensor, bit for bit; and the
    save put in every parameter transformers has (moeshard trains them all)."""
    from moeshard.checkpoint.hf_model import model_class  # a vision-language model has no causal LM class

    saved = model_class(tf.AutoConfig.from_pretrained(str(directory))).from_pretrained(str(directory),
                                                                                      dtype=torch.float32)
    params = {name: p.detach() for name, p in saved.named_parameters()}
    assert count == len(params), (count, len(params))
    want = RankParts(read_hf_config(plan.spec.model_dir).family, plan.cfg, params)
    compared = 0
    for r in results:
        assert r.params
        for name, got in r.params.items():
            ref = want.of(name, r.shards)
            assert torch.equal(got, ref), (plan.model_type, plan.parallel.name, r.rank, name)
            compared += 1
    assert compared == len(results) * len(results[0].params)


# Every other family make_tiny_moe builds: make test-slow (about a second each).
OTHERS = sorted((set(make_tiny_moe.SIGMOID_FAMILIES) | set(make_tiny_moe.SOFTMAX_FAMILIES) | set(make_tiny_moe.EXTRA)
                 | set(make_tiny_moe.VISION_LANGUAGE) | {"qwen3_moe", "deepseek_v3"}) - set(ONE_RANK))


@pytest.mark.parametrize("family", [*ONE_RANK, *(pytest.param(f, marks=pytest.mark.slow) for f in OTHERS)])
def test_the_saved_model_holds_what_one_rank_trained(models, tmp_path, family):
    plan = _plan(models[family], save_dir=str(tmp_path / "saved"))
    result = train_rank(plan, None)
    count = save_checkpoint(plan.spec.model_dir, plan.cfg, [_state(result)], plan.spec.save_dir)
    _check_saved_exactly(plan, [result], tmp_path / "saved", count)


def test_the_saved_model_holds_what_two_ranks_trained(models, tmp_path):
    plans = [_plan(models[family], parallel, str(tmp_path / layout)) for layout, (family, parallel) in TWO_RANKS.items()]
    ranks = run_forked(2, train_plans, (plans,))
    for i, plan in enumerate(plans):
        results = [ranks[r][i] for r in range(2)]
        assert not any(isinstance(r, dict) for r in results), results
        count = save_checkpoint(plan.spec.model_dir, plan.cfg, [_state(r) for r in results], plan.spec.save_dir)
        _check_saved_exactly(plan, results, Path(plan.spec.save_dir), count)


def test_moeshard_reads_the_saved_model(models, tmp_path, capsys):
    saved = tmp_path / "saved"
    argv = ["train", "--model", models["mixtral"], "--input-ids", "3,17,42;5,6,7", "--steps", "2", "--lr", "0.05",
            "--optimizer", "sgd", "--save", str(saved)]
    assert main(argv) == 0
    assert "saved the trained model (" in capsys.readouterr().out
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                       "optimizer"]
    assert sorted(p.name for p in (saved / "optimizer").iterdir()) == ["meta.json", "state.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left
    umask = os.umask(0)
    os.umask(umask)
    assert saved.stat().st_mode & 0o777 == 0o777 & ~umask  # as mkdir makes it, not mkdtemp's 0700
    assert main(["generate", "--model", str(saved), "--input-ids", "3,17,42;5,6", "--max-new-tokens", "2",
                 "--compare"]) == 0
    assert "same ids for 2 of 2 prompt(s)" in capsys.readouterr().out


def test_an_element_no_rank_holds_is_refused_and_nothing_is_written(models, tmp_path):
    plan = _plan(models["mixtral"], save_dir=str(tmp_path / "saved"))
    result = train_rank(plan, None)
    assert result.params is not None
    expert = next(n for n in result.params if n.endswith("experts.down_proj"))
    lost = replace(result, params={n: v for n, v in result.params.items() if n != expert})
    with pytest.raises(RuntimeError, match=rf"^{expert}: (\d+) of its \1 elements are held by no rank's "
                                           r"parameters; nothing saved$"):
        save_checkpoint(plan.spec.model_dir, plan.cfg, [_state(lost)], plan.spec.save_dir)
    assert os.listdir(tmp_path) == []


def test_save_never_overwrites_and_says_why(models, tmp_path, capsys):
    model = models["mixtral"]
    (tmp_path / "exists").mkdir()
    (tmp_path / "afile").write_text("keep")
    capsys.readouterr()  # what the models fixture printed, if this test built it
    cases = {str(tmp_path / "exists"): "exists; moeshard creates the directory and never writes into or replaces one",
             str(tmp_path / "afile"): "exists; moeshard creates the directory",
             str(Path(model) / "inside"): "lies inside",
             str(tmp_path / "missing" / "saved"): "does not exist"}
    for path, message in cases.items():
        assert main(["train", "--model", model, "--input-ids", "1,2", "--save", path]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("moeshard train: error: --save ") and message in err, err
    assert (tmp_path / "afile").read_text() == "keep" and not any((tmp_path / "exists").iterdir())
    assert not (Path(model) / "inside").exists()


def test_a_sharded_model_saved_by_the_library_is_what_every_rank_holds(models, tmp_path):
    """``save_sharded_model`` in a 2-rank SP world (DeepSeek-V3: experts split over the ranks, a
    selection bias): every parameter moved on every rank, the biases moved too; the checkpoint
    read back holds exactly those values."""
    import save_ranks

    model_dir, saved = models["deepseek_v3"], tmp_path / "saved"
    ranks = run_forked(2, save_ranks.load_move_save, (model_dir, str(saved), 1, 2, True))
    assert [r["written"] is not None for r in ranks] == [True, False]
    plan = _plan(model_dir, ParallelConfig(1, 2, True))
    results = [RankState(r["rank"], r["params"], r["shards"]) for r in ranks]
    _check_saved_exactly(plan, results, saved, ranks[0]["written"])
    reread = tf.AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32)
    buffers = dict(reread.named_buffers())
    assert ranks[0]["biases"] and all(torch.equal(buffers[n], b) for n, b in ranks[0]["biases"].items())
    original = dict(tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    assert all(torch.equal(p, original[n] + 0.25) for n, p in reread.named_parameters())


def test_the_library_refuses_what_it_cannot_write(models, tmp_path):
    from moeshard.integrations.transformers import load_sharded_model, save_sharded_model

    model_dir = models["mixtral"]
    quantized = load_sharded_model(model_dir, None, quant="fp8_token", dtype="float32")
    with pytest.raises(ValueError, match=r"^rank 0: save_sharded_model: the experts are quantized \(fp8_token\); only quant "
                                         r"none is written"):
        save_sharded_model(quantized, None, model_dir, tmp_path / "saved")
    plain = tf.AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"^rank 0: save_sharded_model: MixtralForCausalLM has no moeshard MoE block"):
        save_sharded_model(plain, None, model_dir, tmp_path / "saved")
    model = load_sharded_model(model_dir, None, dtype="float32")
    with pytest.raises(ValueError, match=r"^rank 0: save_sharded_model: the optimizer steps 1 tensor\(s\) that are no "
                                         r"parameters of the model"):
        save_sharded_model(model, None, model_dir, tmp_path / "saved",
                           optimizer=torch.optim.AdamW([*model.parameters(), torch.nn.Parameter(torch.zeros(2))]))
    with pytest.raises(ValueError, match=r"^rank 0: save_sharded_model: steps_done must be an integer >= 0, got -1"):
        save_sharded_model(model, None, model_dir, tmp_path / "saved", optimizer=torch.optim.SGD(model.parameters()),
                           steps_done=-1)
    (tmp_path / "saved").mkdir()
    with pytest.raises(ValueError, match=r"^rank 0: save_sharded_model directory '.*saved': exists"):
        save_sharded_model(load_sharded_model(model_dir, None, dtype="float32"), None, model_dir, tmp_path / "saved")
    assert not any((tmp_path / "saved").iterdir())


def test_a_loop_of_ones_own_saves_its_optimizer_state_whole_for_any_layout(models, tmp_path):
    """``save_sharded_model(..., optimizer=)`` in a 2-rank TP world (Qwen2-MoE: every expert cut in
    halves of I) writes the AdamW state whole; each rank's ``load_sharded_optimizer`` gives back
    its own moments and step bit for bit, and one process reading it at (1,1) and saving it again
    writes the same tensors bit for bit."""
    import save_ranks
    from safetensors.torch import load_file

    from moeshard.integrations.transformers import load_sharded_model, save_sharded_model
    from moeshard.training.optimizer_state import load_sharded_optimizer

    model_dir, saved = models["qwen2_moe"], tmp_path / "saved"
    ranks = run_forked(2, save_ranks.step_and_save, (model_dir, str(saved), 1, 2, False))
    assert [(r["same"], r["steps_done"], r["layout"]) for r in ranks] == [(True, 1, "dp1-tp2-noep")] * 2
    assert ranks[0]["fields"] == ["exp_avg", "exp_avg_sq", "step"]
    model = load_sharded_model(saved, None, dtype="float32")
    model.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    assert load_sharded_optimizer(optimizer, model, saved).optimizer == "adamw"
    save_sharded_model(model, None, saved, tmp_path / "again", optimizer=optimizer, steps_done=1)
    want, got = (load_file(str(d / "optimizer" / "state.safetensors")) for d in (saved, tmp_path / "again"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(ValueError, match="load_sharded_optimizer: .* holds no whole optimizer state"):
        load_sharded_optimizer(optimizer, model, model_dir)
