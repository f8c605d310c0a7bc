"""Gradients through the collectives, proved on CPU ranks (one world of 2 for everything):

* ``torch.autograd.gradcheck`` (fp64, central differences) of every custom Function: the SP
  row shard and gather (uneven, empty ranks), the TP copy and reduce, every backend's dispatch
  and combine (uneven ranks; SP's chunks of one token: an empty rank), the local backend under TP;
* whole-model training steps (a replicated linear, the MoE layer, a replicated linear) under
  EP, SP, TP and DP: after ``reduce_gradients`` every gradient, each rank's shard of the
  experts included, and ``grad_norm`` equal one device's on all tokens, for the sum and the
  mean loss conventions; ``clip_grad_norm_`` leaves the norm it was asked for; gpt-oss's router
  and expert biases under TP (the down bias on TP rank 0 alone);
* the load-balancing loss and the router z-loss (``moeshard.training.router_losses``) of two
  stacked layers under EP, SP (padding rows masked, and one token on two ranks), TP and DP (an
  empty rank): their values equal transformers' own functions on one device's logits, and the
  gradients of a loss that adds them equal one device's;
* DeepSeek-V3's correction-bias update (``moeshard.training.update_correction_bias``) over a
  few steps under EP, SP, TP and DP: loads and biases equal one device's, bit for bit.
"""

import pytest
import torch
from forked_world import run_forked


@pytest.fixture(scope="module")
def world():
    """Every rank's results: ``spawn``'s loop, with the ranks forked from the fork server that the
    harness uses (torch and moeshard imported once per test session, not once per rank)."""
    import backward_ranks

    return run_forked(2, backward_ranks.all_checks)


def test_gradcheck_of_every_custom_function(world):
    for rank, (checks, _, _, _) in enumerate(world):
        assert len(checks) == 2 + 2 + 3 * 2
        failed = {name: why for name, why in checks.items() if why is not True}
        assert not failed, f"rank {rank}: {failed}"


def test_a_whole_model_trains_as_on_one_device_under_every_layout(world):
    for rank, (_, errors, _, _) in enumerate(world):
        assert any("dp1-tp2-ep" in k and "embed.weight" in k for k in errors)  # SP: a replicated weight
        assert any("moe.experts.gate_up_proj" in k for k in errors)
        biased = "gpt-oss-120b/dp1-tp2-noep/local/sum moe."
        assert f"{biased}gate.bias" in errors and f"{biased}experts.gate_up_proj_bias" in errors
        # the down bias is added once, to TP rank 0's partial sum: only that rank holds it
        assert (f"{biased}experts.down_proj_bias" in errors) == (rank == 0)
        bad = {k: v for k, v in errors.items() if not v < 2e-5}
        assert not bad, f"rank {rank}: {bad}"


def test_router_losses_under_every_layout_equal_transformers_on_one_device(world):
    """transformers' own load_balancing_loss_func and router_z_loss_func on one device's logits
    (two stacked layers, every DP rank's tokens) are the oracle of the values; one device's
    autograd of the same loss that of the gradients."""
    import backward_ranks
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    from moeshard.layer import MoELayer
    from moeshard.training.reference import shard_of_grad
    from moeshard.training.router_losses import keep_router_logits

    for i, (layout, backend, tokens, masked) in enumerate(backward_ranks.ROUTER_LOSS_CASES):
        cfg, weights, xs, gs, masks = backward_ranks.router_loss_inputs(tokens, masked)
        one = torch.nn.Sequential(*(MoELayer(cfg, weights=w) for w in weights)).requires_grad_(True)
        keep_router_logits(one)
        x = torch.cat(xs).requires_grad_()
        y = one(x)
        logits = tuple(layer.router_logits[0] for layer in one)
        aux = load_balancing_loss_func(logits, cfg.num_experts, cfg.top_k,
                                       torch.cat(masks).reshape(1, -1) if masked else None)
        z = None if masked else router_z_loss_func(torch.cat(logits)[None])
        ((y * torch.cat(gs)).sum() / sum(tokens) + 0.1 * aux + (0.01 * z if z is not None else 0)).backward()
        for rank, (_, _, results, _) in enumerate(world):
            got, tag = results[i], f"{layout}/{backend}/t{tokens}{'/masked' if masked else ''} rank {rank}"
            assert abs(got["aux"] - float(aux.detach())) <= 2e-6 * float(aux.detach()), tag
            assert got["z"] is None if z is None else abs(got["z"] - float(z.detach())) <= 2e-6 * float(z.detach()), tag
            for name, q in one.named_parameters():
                want = shard_of_grad(name.split(".", 1)[1], q.grad, got["shards"][int(name[0])], cfg)
                assert (got["grads"][name] - want).abs().max() <= 2e-5 * want.abs().max(), (tag, name)
            d = got["dp_rank"]
            want_x = x.grad[sum(tokens[:d]):sum(tokens[:d + 1])]
            assert torch.allclose(got["x"], want_x, rtol=0, atol=2e-5 * float(x.grad.abs().max())), tag


def test_correction_bias_updates_under_every_layout_equal_one_device(world):
    """DeepSeek-V3's auxiliary-loss-free update (``update_correction_bias``) of two layers
    (sigmoid with groups, ERNIE's softmax_bias) over a few steps of two micro-batches: every
    rank's loads and biases after every step equal one device's on all tokens, bit for bit."""
    import backward_ranks

    from moeshard.training import update_correction_bias

    for i, (layout, _, tokens) in enumerate(backward_ranks.BIAS_UPDATE_CASES):
        one = backward_ranks.bias_model()
        start = [layer.gate.e_score_correction_bias.clone() for layer in (one.sigmoid, one.softmax)]
        for step in range(backward_ranks.BIAS_STEPS):
            with torch.no_grad():
                for micro in backward_ranks.bias_update_inputs(tokens, step):
                    one(torch.cat(micro))
            loads = update_correction_bias(one, None, backward_ranks.BIAS_SPEED)
            assert [int(t.sum()) for t in loads] == [sum(map(sum, tokens)) * k for k in (4, 2)]  # every (token, k)
            biases = [layer.gate.e_score_correction_bias for layer in (one.sigmoid, one.softmax)]
            for rank, (_, _, _, results) in enumerate(world):
                got, tag = results[i][step], f"{layout} step {step} rank {rank}"
                assert all(torch.equal(a, b) for a, b in zip(got["loads"], loads, strict=True)), tag
                assert all(torch.equal(a, b) for a, b in zip(got["biases"], biases, strict=True)), tag
        moved = [b - s for b, s in zip(biases, start, strict=True)]
        assert all(bool((m != 0).any()) for m in moved), layout  # the update did something
