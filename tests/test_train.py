"""``moeshard train``: optimizer steps of a whole transformers model under every layout equal
transformers' own training on one device.

Tiny random Mixtral, Qwen2-MoE (both with transformers' load-balancing loss on), Qwen3-MoE and
DeepSeek-V3 (its config asks for router logits, but transformers adds no auxiliary loss for it)
models from ``scripts/make_tiny_moe.py``, fp32; a batch of prompts of different lengths (left
padding) split over the DP ranks. The oracle is transformers alone (``from_pretrained``, every
expert, one device) trained on the whole batch with the same optimizer: its loss before every
step, its gradient norm at the last step, and every parameter after it (each rank's copy, an
expert shard against the same slice of transformers' tensor).

One world per world size runs every case of that size. ``make test``: (1,1) for every family
(the optimizer alternating), DP2, TP2, EP2 and SP (dp1-tp2-ep) each with another family (so
every family and both optimizers meet a two-rank layout, and the EP cases take the three EP
backends), and one dp2-tp2-ep case. ``make test-slow``: the rest of the matrix (every layout x
family x optimizer), and a real two-process torchrun.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moeshard.cli import main
from moeshard.jobs.train import (
    TrainReference,
    TrainSpec,
    against_exact,
    compare_training,
    plan_train,
    reference_train,
    train_plans,
    train_rank,
)
from moeshard.parallel.config import ParallelConfig
from moeshard.tolerances import TRAIN_LOSS_RTOL

tf = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_tiny_moe  # noqa: E402 - a script of this repository, importable once its directory is on the path
from forked_world import run_forked  # noqa: E402 - a helper of these tests

# family -> router_aux_loss_coef it is saved with (None: no load-balancing loss).
FAMILIES = {"mixtral": 0.5, "qwen2_moe": 0.2, "qwen3_moe": None, "deepseek_v3": None}
PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11, 12))  # dp2: DP rank 0 trains on 0-1, rank 1 on 2-3
STEPS = 3
LR = {"sgd": 0.05, "adamw": 0.01}
# The largest |parameter difference| after the last step. SGD moves a parameter by lr x its
# gradient, so the difference is lr x the gradients' (largest seen 1.2e-7); AdamW divides by the
# root of the second moment, so an element whose gradient is near zero may move by up to lr on
# one side and less on the other (largest seen 8.2e-6 at lr 0.01). AdamW is blind to a gradient's
# scale (a doubled gradient takes the same step): the gradient norm's comparison sees that.
PARAM_BOUND = {"sgd": 1e-6, "adamw": 1e-4}
SPAWN_TIMEOUT_S = 300.0

LAYOUTS = {"dp1-tp1-noep": ParallelConfig(), "dp2-tp1-noep": ParallelConfig(2, 1, False),
           "dp1-tp2-noep": ParallelConfig(1, 2, False), "dp2-tp1-ep": ParallelConfig(2, 1, True),
           "dp1-tp2-ep": ParallelConfig(1, 2, True), "dp2-tp2-ep": ParallelConfig(2, 2, True)}


EP_BACKENDS = ("all2all", "allgather_reducescatter", "low_latency")
FAST_BACKEND = {"dp2-tp1-ep": "low_latency", "dp1-tp2-ep": "all2all", "dp2-tp2-ep": "allgather_reducescatter"}


def _matrix() -> list[tuple[str, str, str, str | None, bool]]:
    """(layout, family, optimizer, backend, in make test) of every case. make test: on one rank
    every family, with one optimizer (alternating); under each two-rank layout one family, a
    different one per layout (so every family and both optimizers meet a two-rank layout), and
    one dp2-tp2-ep case; make test-slow: the rest. The EP layouts' backends rotate through the
    cases (None: the layout's default, local)."""
    out = []
    for i, layout in enumerate(LAYOUTS):
        for j, family in enumerate(FAMILIES):
            for k, optimizer in enumerate(("sgd", "adamw")):
                if layout == "dp2-tp2-ep":
                    fast = (family, optimizer) == ("qwen2_moe", "sgd")
                elif LAYOUTS[layout].world_size == 1:
                    fast = (j + k) % 2 == 0
                else:
                    fast = j == (i - 1) % len(FAMILIES) and k == i % 2
                backend = EP_BACKENDS[(j + k) % 3] if LAYOUTS[layout].enable_ep else None
                if fast and layout in FAST_BACKEND:  # make test's EP cases take every backend once
                    backend = FAST_BACKEND[layout]
                out.append((layout, family, optimizer, backend, fast))
    return out


MATRIX = _matrix()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """family -> directory of a tiny random fp32 model saved by make_tiny_moe."""
    root = tmp_path_factory.mktemp("tiny-train")
    out = {}
    for seed, (family, coef) in enumerate(FAMILIES.items()):
        directory = root / family
        make_tiny_moe.make(str(directory), family, hidden=32, moe_intermediate=16, experts=4, layers=2, vocab=64,
                           dtype="float32", seed=seed, router_aux_loss_coef=coef)
        if family == "deepseek_v3":  # asks for router logits; transformers' DeepSeek-V3 adds no auxiliary loss
            config = json.loads((directory / "config.json").read_text())
            config["output_router_logits"] = True
            (directory / "config.json").write_text(json.dumps(config))
        out[family] = str(directory)
    return out


def _plan(models, layout: str, family: str, optimizer: str, backend: str | None = None):
    return plan_train(TrainSpec(models[family], PROMPTS, STEPS, LR[optimizer], optimizer, LAYOUTS[layout],
                                backend=backend, compare=True))


@pytest.fixture(scope="module")
def reference(models):
    """transformers alone for a plan, computed once per (model, optimizer): the layout does not change it."""
    cache = {}

    def get(plan):
        key = (plan.spec.model_dir, plan.spec.optimizer)
        if key not in cache:
            cache[key] = reference_train(plan)
        return cache[key]

    return get


def _run_world(ws: int, plans) -> list[list]:
    """Every plan's per-rank results: in this process for one rank, else one forked world of
    ``ws`` ranks."""
    if ws == 1:
        return [[train_rank(plan, None)] for plan in plans]
    results = run_forked(ws, train_plans, (plans,), SPAWN_TIMEOUT_S)
    return [[results[r][i] for r in range(ws)] for i in range(len(plans))]


@pytest.fixture(scope="module")
def world(models):
    """(world size, make test or slow) -> {(layout, family, optimizer, backend): (plan, per-rank results)}."""
    cache: dict = {}

    def get(ws: int, fast: bool):
        key = (ws, fast)
        if key not in cache:
            cases = [case[:4] for case in MATRIX if LAYOUTS[case[0]].world_size == ws and case[4] == fast]
            plans = [_plan(models, *case) for case in cases]
            try:
                cache[key] = dict(zip(cases, zip(plans, _run_world(ws, plans), strict=True), strict=True))
            except Exception as exc:  # noqa: BLE001 - every case of the world reports it
                cache[key] = exc
        if isinstance(cache[key], Exception):
            pytest.fail(f"the {ws}-rank run failed:\n{cache[key]}")
        return cache[key]

    return get


def _params(layout, family, optimizer, backend, fast):
    marks = () if fast else (pytest.mark.slow,)
    name = f"{layout}-{family}-{optimizer}" + (f"-{backend}" if backend else "")
    return pytest.param(layout, family, optimizer, backend, fast, marks=marks, id=name)


@pytest.mark.parametrize("layout, family, optimizer, backend, fast", [_params(*case) for case in MATRIX])
def test_training_equals_transformers_on_one_device(world, reference, layout, family, optimizer, backend, fast):
    p = LAYOUTS[layout]
    plan, results = world(p.world_size, fast)[(layout, family, optimizer, backend)]
    assert plan.backend == (backend or "local")
    for r in results:
        assert not isinstance(r, dict), f"rank raised: {r}"
    ref = reference(plan)
    c = compare_training(plan, results, ref)
    tag = f"{layout} {family} {optimizer} {plan.backend}"
    assert c.within_tolerance and c.max_loss_rel_diff <= TRAIN_LOSS_RTOL, (tag, c.loss_rel_diff)
    assert c.grad_norm_rel_diff <= TRAIN_LOSS_RTOL, (tag, c.grad_norm_rel_diff)
    assert c.max_abs_param_diff <= PARAM_BOUND[optimizer], (tag, c.max_abs_param_diff, c.param_diff_at)
    assert ref.losses[-1] < ref.losses[0] - 0.01, (tag, ref.losses)  # the steps train
    # Every rank holds (its part of) every parameter transformers trains (a block's under moeshard's
    # names: Qwen2-MoE's shared_expert is shared_experts), and every copy was compared.
    assert all(len(r.params) == len(ref.params) for r in results), tag
    assert c.params_compared == p.world_size * len(ref.params)
    coef = FAMILIES[family]
    assert plan.aux_coef == coef
    if coef is None:
        assert ref.aux_losses is None and all(r.aux_losses is None for r in results), tag
    else:
        assert ref.aux_losses is not None
        for r in results:
            assert r.aux_losses is not None
            assert max(abs(a - b) / b for a, b in zip(r.aux_losses, ref.aux_losses, strict=True)) < 1e-5, tag
    # The TP ranks of a DP rank computed the same loss; each DP rank trained on its own prompts.
    for r in results:
        assert r.losses == results[r.dp_rank * p.tp].losses
        assert r.prompts == plan.dp_prompts[r.dp_rank]
        assert r.grad_norm == results[0].grad_norm
    if p.enable_ep:
        per = plan.cfg.num_experts // p.world_size
        assert [r.experts for r in results] == [(r * per, (r + 1) * per) for r in range(p.world_size)]


# -- the command ------------------------------------------------------------------------------
def _argv(models, *extra: str, family: str = "qwen2_moe") -> list[str]:
    return ["train", "--model", models[family], "--input-ids", "3,17,42,5;1,2,3;7,8", "--steps", "2", *extra]


def test_command_trains_compares_and_writes_json(models, tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(_argv(models, "--lr", "0.05", "--optimizer", "sgd", "--compare", "--output", str(out))) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["layout"] == "dp1-tp1-noep" and data["model"] == models["qwen2_moe"]
    assert data["model_type"] == "qwen2_moe" and data["tokens"] == 3 + 2 + 1
    assert data["optimizer"] == {"name": "sgd", "torch": "torch.optim.SGD", "lr": 0.05, "momentum": 0.0}
    assert len(data["losses"]) == len(data["aux_losses"]) == 2 and data["losses"][1] < data["losses"][0]
    assert data["grad_norm"] > 0 and data["aux_loss_coef"] == 0.2
    c = data["comparison"]
    assert c["within_tolerance"] is True and c["tolerance_rel"] == TRAIN_LOSS_RTOL
    assert [abs(a - b) / b for a, b in zip(data["losses"], c["transformers_losses"], strict=True)] == \
        pytest.approx(c["loss_rel_diff"], abs=1e-12)
    assert c["max_abs_param_diff"] < 1e-5 and c["params_compared"] > 0
    assert "relative loss difference per step" in printed and "tolerance 0.0001: within" in printed


def test_a_loss_off_transformers_exits_1_and_says_so(models, tmp_path, capsys, monkeypatch):
    """The comparison has teeth: transformers trained at another learning rate differs from step 2 on,
    and its float64 run at that rate (the rounding-noise measurement) is as far off."""
    from moeshard.commands import train as train_command

    def other_lr(plan, dtype=torch.float32):
        return reference_train(replace(plan, spec=replace(plan.spec, lr=plan.spec.lr * 1.5)), dtype=dtype)

    monkeypatch.setattr(train_command, "reference_train", other_lr)
    out = tmp_path / "train.json"
    assert main(_argv(models, "--lr", "0.05", "--compare", "--output", str(out))) == 1
    c = json.loads(out.read_text())["comparison"]
    assert c["loss_rel_diff"][0] < 1e-6 < TRAIN_LOSS_RTOL < c["loss_rel_diff"][1] and c["within_tolerance"] is False
    assert c["within_rounding_noise"] is False and max(c["transformers_float32_vs_float64_loss_rel"]) < 1e-6
    assert c["loss_rel_diff_float64"][1] > TRAIN_LOSS_RTOL and len(c["transformers_float64_losses"]) == 2
    printed = capsys.readouterr().out
    assert "tolerance 0.0001: EXCEEDED" in printed and "within 0.0001 + 4 x that: EXCEEDED" in printed


def test_a_loss_within_float32_rounding_exits_0(models, tmp_path, capsys, monkeypatch):
    """Why: float32 rounding alone can move a training (AdamW turns near-zero gradients into steps
    of either sign; on one H200 a tiny Qwen3-MoE's third AdamW loss differed by 0.69). Planted: the
    float32 reference is off (another rate), the float64 one is not: moeshard's losses lie on the
    float64 run's, and the float32 reference's distance from it is allowed for: within noise."""
    from moeshard.commands import train as train_command

    def noisy(plan, dtype=torch.float32):
        lr = plan.spec.lr * (1.5 if dtype == torch.float32 else 1.0)
        return reference_train(replace(plan, spec=replace(plan.spec, lr=lr)), dtype=dtype)

    monkeypatch.setattr(train_command, "reference_train", noisy)
    out = tmp_path / "train.json"
    assert main(_argv(models, "--lr", "0.05", "--compare", "--output", str(out))) == 0
    c = json.loads(out.read_text())["comparison"]
    assert c["within_tolerance"] is False and c["within_rounding_noise"] is True
    assert max(c["loss_rel_diff_float64"]) < 1e-6  # moeshard is on the float64 run's trajectory
    assert "within (the difference is rounding order" in capsys.readouterr().out


def test_reference_dtypes_are_checked(models):
    """transformers runs in float32 (the reference) or float64 (the rounding measure), nothing
    else; compare_training's float64 run must be one, its reference the float32 one."""
    plan = _plan(models, "dp1-tp1-noep", "mixtral", "sgd")
    with pytest.raises(ValueError, match=r"^reference_train: dtype must be torch.float32 or torch.float64, "
                                         r"got torch.bfloat16$"):
        reference_train(plan, dtype=torch.bfloat16)
    fp32 = TrainReference(losses=(1.0,), aux_losses=None, grad_norm=1.0, params={}, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"exact must be transformers' float64 run and reference its float32 run, "
                                         r"got exact.dtype=torch.float32 and reference.dtype=torch.float32"):
        compare_training(plan, [], fp32, exact=fp32)
    with pytest.raises(ValueError, match=r"^against_exact: exact must be transformers' float64 run"):
        against_exact(None, plan, [], fp32, fp32)  # type: ignore[arg-type]


def test_nonfinite_losses_are_exit_7_and_nothing_is_written(models, tmp_path, capsys):
    out = tmp_path / "train.json"
    argv = _argv(models, "--lr", "1e30", "--optimizer", "sgd", "--output", str(out), family="mixtral")
    assert main(argv) == 7
    line = capsys.readouterr().err.strip()
    assert line.startswith("moeshard train: error: training diverged:") and "losses[1] = NaN" in line, line
    assert not out.exists()
    assert main([*argv, "--allow-nonfinite"]) == 0
    data = json.loads(out.read_text())
    assert data["losses"][0] > 0 and data["losses"][1] is None
    assert {"field": "losses[1]", "value": "NaN"} in data["nonfinite"]


BAD = {
    "ids not integers": (["--input-ids", "3,x"], "--input-ids: '3,x' is not a comma-separated list of integers"),
    "id outside the vocabulary": (["--input-ids", "3,64"], "prompt 0 holds token ids [64] outside the vocabulary [0, 64)"),
    "nothing to predict": (["--input-ids", "3;5"], "every prompt is one token long"),
    "fewer prompts than DP ranks": (["--input-ids", "3,4", "--dp", "2"], "only 1 prompt(s) were given"),
    "experts not divisible by EP": (["--input-ids", "1,2;3,4;5,6", "--dp", "3", "--ep"],
                                    "num_experts=4 is not divisible by the EP size 3"),
    "tp not dividing I": (["--input-ids", "1,2", "--tp", "3"], "intermediate_size=16 is not divisible by tp=3"),
    "quantized": (["--input-ids", "1,2", "--quant", "fp8_tensor"], "train: --quant fp8_tensor: quant 'fp8_tensor' "
                                                                     "has no backward"),
    "backend without EP": (["--input-ids", "1,2", "--backend", "all2all"], "all2all needs expert parallelism"),
    "defer input quant": (["--input-ids", "1,2", "--defer-input-quant"], "--defer-input-quant: train runs quant none"),
    "steps 0": (["--input-ids", "1,2", "--steps", "0"], "--steps: must be an integer in [1, 100000], got 0"),
    "lr 0": (["--input-ids", "1,2", "--lr", "0"], "--lr: must be a finite number > 0, got 0.0"),
    "lr nan": (["--input-ids", "1,2", "--lr", "nan"], "--lr: must be a finite number > 0, got nan"),
    "more micro-batches than a DP rank's prompts": (["--input-ids", "1,2;3,4;5,6", "--dp", "2", "--micro-batches", "2"],
                                                    "--micro-batches 2: a DP rank of the 2 has only 1 prompt(s) of the 3"),
    "micro-batches 0": (["--input-ids", "1,2", "--micro-batches", "0"], "--micro-batches: must be an integer >= 1, got 0"),
    "warmup past the steps": (["--input-ids", "1,2", "--steps", "2", "--lr-schedule", "linear", "--warmup-steps", "3"],
                              "--warmup-steps: must be an integer in [0, --steps=2], got 3"),
    "warmup without a schedule": (["--input-ids", "1,2", "--warmup-steps", "1"],
                                  "--warmup-steps 1: the constant schedule has no warmup"),
    "max grad norm 0": (["--input-ids", "1,2", "--max-grad-norm", "0"], "--max-grad-norm: must be a finite number > 0, "
                                                                        "got 0.0"),
    "max grad norm inf": (["--input-ids", "1,2", "--max-grad-norm", "inf"], "--max-grad-norm: must be a finite number"),
    "timeout 0": (["--input-ids", "1,2", "--timeout", "0"], "--timeout: must be a finite number"),
    "timeout inf": (["--input-ids", "1,2", "--timeout", "inf"], "--timeout: must be a finite number"),
    "no prompts": ([], "give exactly one of --input-ids and --input-file"),
    "missing prompt file": (["--input-file", "/nonexistent/batch.json"], "--input-file '/nonexistent/batch.json' does "
                                                                         "not exist"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_input_is_one_line_exit_2_before_any_rank(models, bad, tmp_path, capsys):
    argv, message = BAD[bad]
    out = tmp_path / "train.json"
    start = time.monotonic()
    assert main(["train", "--model", models["mixtral"], *argv, "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("moeshard train: error: ") and message in err, err
    assert not out.exists() and time.monotonic() - start < 10


def test_a_single_rank_timeout_is_exit_5(models, capsys):
    assert main(_argv(models, "--timeout", "1e-9")) == 5
    assert "rank 0 (in this process) did not finish within 1e-09 s (--timeout 1e-09)" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_path_in_this_process(models, tmp_path, monkeypatch):
    """A torchrun world of one rank (this process): init from the environment, the gather of the
    ranks' reports, the comparison on rank 0 (the fast sibling of the two-process run below); the batch from --input-file."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(_free_port()))):
        monkeypatch.setenv(name, value)
    out, batch = tmp_path / "train.json", tmp_path / "batch.json"
    batch.write_text(json.dumps([[3, 17, 42, 5], [1, 2, 3], [7, 8]]))
    argv = ["train", "--model", models["deepseek_v3"], "--input-file", str(batch), "--steps", "2", "--compare",
            "--output", str(out), "--save", str(tmp_path / "saved")]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["comparison"]["within_tolerance"] is True and data["aux_loss_coef"] is None
    assert data["saved_to"] == str(tmp_path / "saved") and (tmp_path / "saved" / "model.safetensors").is_file()
    assert [p["input_ids"] for p in data["prompts"]] == [[3, 17, 42, 5], [1, 2, 3], [7, 8]]
    assert not torch.distributed.is_initialized()


@pytest.mark.slow  # two interpreters importing torch and transformers; the in-process case takes the same path
def test_torchrun_two_ranks_sequence_parallel(models, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    out = tmp_path / "train.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "moeshard",
           *_argv(models, "--tp", "2", "--ep", "--optimizer", "sgd", "--lr", "0.05", "--compare", "--output", str(out))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["layout"] == "dp1-tp2-ep" and [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["comparison"]["within_tolerance"] is True and data["comparison"]["max_abs_param_diff"] < 1e-5


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_generate_runs_models_saved_with_router_logits_on(models, family, capsys):
    """A config with ``output_router_logits`` (as make_tiny_moe saves it with a load-balancing
    loss) made transformers compute its auxiliary loss at every cached decoding step, which fails
    for a batch of several prompts (transformers' own generate too): generate turns it off for
    the call and matches transformers alone."""
    from moeshard import cli

    config = json.loads((Path(models[family]) / "config.json").read_text())
    assert config.get("output_router_logits") is True
    assert cli.main(["generate", "--model", models[family], "--input-ids", "3,17,42;5,6", "--max-new-tokens", "2",
                     "--compare"]) == 0
    assert "same ids for 2 of 2 prompt(s)" in capsys.readouterr().out
