"""``moeshard train``'s learning-rate schedules, gradient clipping and micro-batches (gradient
accumulation): each checked by hand where a consequence can be computed, and under layouts
against transformers alone doing the same.

- Micro-batches: SGD on a model without a load-balancing loss, the batch in two micro-batches,
  takes the whole batch's step (the cross entropies are each a share of the global token count,
  so their gradients sum to the whole batch's).
- Clipping: one SGD step clipped to c at learning rate lr moves the parameters by lr x c in
  global norm (every parameter counted once, on one rank).
- Schedules: the linear schedule with one warmup step has a rate of 0 at the first step (the
  Trainer's warmup starts from 0), so the first step leaves the loss where it was.
- Layouts: EP2 and SP (dp1-tp2-ep) with all three and the load-balancing loss on (Mixtral, whose
  step's auxiliary loss is the mean of its micro-batches'), against transformers alone with the
  same micro-batches, schedule and clipping (``torch.nn.utils.clip_grad_norm_``).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from moeshard.jobs.train import TrainSpec, compare_training, plan_train, reference_train, train_plans, train_rank
from moeshard.parallel.config import ParallelConfig
from moeshard.tolerances import TRAIN_LOSS_RTOL

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_tiny_moe  # noqa: E402 - a script of this repository
from forked_world import run_forked  # noqa: E402 - a helper of these tests

PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11, 12))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """qwen3_moe (no load-balancing loss) and mixtral (coefficient 0.5), tiny, fp32."""
    root = tmp_path_factory.mktemp("tiny-schedule")
    out = {}
    for seed, (family, coef) in enumerate((("qwen3_moe", None), ("mixtral", 0.5))):
        make_tiny_moe.make(str(root / family), family, hidden=32, moe_intermediate=16, experts=4, layers=2, vocab=64,
                           dtype="float32", seed=seed, router_aux_loss_coef=coef)
        out[family] = str(root / family)
    return out


def _train(models, family: str, steps: int = 1, **settings):
    spec = TrainSpec(models[family], PROMPTS, steps, settings.pop("lr", 0.05), settings.pop("optimizer", "sgd"),
                     compare=True, **settings)
    plan = plan_train(spec)
    return plan, train_rank(plan, None)


def test_two_micro_batches_take_the_whole_batch_step(models):
    whole_plan, whole = _train(models, "qwen3_moe")
    plan, micro = _train(models, "qwen3_moe", micro_batches=2)
    assert plan.micro(0) == ((0, 1), (2, 3)) and plan.global_micro() == ((0, 1), (2, 3))
    assert micro.losses[0] == pytest.approx(whole.losses[0], rel=1e-6)
    assert micro.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
    assert whole.params is not None and micro.params is not None
    worst = max(float((micro.params[n] - whole.params[n]).abs().max()) for n in whole.params)
    assert worst < 1e-7, worst


def test_a_clipped_sgd_step_moves_the_parameters_by_lr_times_the_bound(models):
    plan0, before = _train(models, "qwen3_moe", lr=1e-30)  # the parameters as loaded, to float rounding
    lr, bound = 0.05, 0.01
    _, after = _train(models, "qwen3_moe", lr=lr, max_grad_norm=bound)
    assert after.grad_norm > 10 * bound  # the bound clips
    assert before.params is not None and after.params is not None
    moved = math.sqrt(sum(float((after.params[n] - before.params[n]).double().pow(2).sum()) for n in before.params))
    assert moved == pytest.approx(lr * bound, rel=1e-3), moved


def test_one_warmup_step_starts_the_rate_at_zero(models):
    _, run = _train(models, "qwen3_moe", steps=3, schedule="linear", warmup_steps=1)
    assert run.losses[1] == run.losses[0] and run.losses[2] < run.losses[1]
    # The Trainer's linear schedule: lr x step / warmup during warmup, then down to 0 at the end.
    assert run.learning_rates == pytest.approx((0.0, 0.05, 0.025), rel=1e-12)
    _, cosine = _train(models, "qwen3_moe", steps=4, schedule="cosine", warmup_steps=1)
    assert cosine.learning_rates == pytest.approx((0.0, 0.05, 0.05 * 0.75, 0.05 * 0.25), rel=1e-12)
    _, constant = _train(models, "qwen3_moe", steps=2)
    assert constant.losses[1] < constant.losses[0]


def test_schedule_clipping_and_micro_batches_equal_transformers_under_ep2_and_sp(models):
    settings = dict(schedule="linear", warmup_steps=1, max_grad_norm=0.05, micro_batches=2)
    layouts = (ParallelConfig(2, 1, True), ParallelConfig(1, 2, True))
    plans = [plan_train(TrainSpec(models["mixtral"], PROMPTS, 3, 0.05, "sgd", layout, compare=True, **settings))
             for layout in layouts]
    assert plans[0].micro(0) == ((0,), (1,)) and plans[0].global_micro() == ((0, 2), (1, 3))
    assert plans[1].micro(0) == plans[1].global_micro() == ((0, 1), (2, 3))
    ranks = run_forked(2, train_plans, (plans,))
    for i, plan in enumerate(plans):
        results = [ranks[r][i] for r in range(2)]
        # The micro-batches, and with them the load-balancing losses, follow the DP split.
        reference = reference_train(plan)
        assert reference.losses[1] == reference.losses[0] and reference.grad_norm > 0.05
        c = compare_training(plan, results, reference)
        tag = plan.parallel.name
        assert c.within_tolerance and c.max_loss_rel_diff <= TRAIN_LOSS_RTOL, (tag, c.loss_rel_diff)
        assert c.grad_norm_rel_diff <= TRAIN_LOSS_RTOL and c.max_abs_param_diff <= 1e-6, (tag, c)
        assert reference.aux_losses is not None
        for r in results:
            assert r.aux_losses is not None
            assert max(abs(a - b) / b for a, b in zip(r.aux_losses, reference.aux_losses, strict=True)) < 1e-5, tag
        # The step's load-balancing loss is the mean of its micro-batches' (each over its global
        # micro-batch): before the first update the loss less coef x that mean is the cross entropy
        # alone, which micro-batches do not change (a sum of the micro-batches' auxiliary losses,
        # transformers' own per forward, would leave coef x one of them in it).
        whole = reference_train(plan_train(TrainSpec(models["mixtral"], PROMPTS, 1, 0.05, "sgd", compare=True)))
        assert whole.aux_losses is not None
        cross_entropy = whole.losses[0] - 0.5 * whole.aux_losses[0]
        assert reference.losses[0] - 0.5 * reference.aux_losses[0] == pytest.approx(cross_entropy, rel=1e-6)
        step0 = sum(r.losses[0] for r in results if r.tp_rank == 0)
        assert step0 - 0.5 * results[0].aux_losses[0] == pytest.approx(cross_entropy, rel=1e-6), tag
