"""Training with ``MoELayer``s under any layout: what a training loop calls after the backward.

    loss_d = (per-token losses of DP rank d).sum() / N_global    # the same on d's TP ranks
    loss_d.backward()                                              # through moeshard.autograd
    reduce_gradients(model, groups)                                # sum each gradient over its group
    clip_grad_norm_(model, groups, 1.0)                            # norm counts each parameter once
    optimizer.step()
    update_correction_bias(model, groups, speed=1e-3)              # DeepSeek-V3: no auxiliary loss

``gradients`` documents the loss convention and the reductions; ``moeshard.autograd.roles``
which parameter is reduced over which group; ``router_losses`` the load-balancing loss and the
router z-loss over the global batch; ``correction_bias`` DeepSeek-V3's auxiliary-loss-free
update of the correction biases after a step (``update_correction_bias``); ``reference`` the
fp64 single-device gradients that ``moeshard check --backward`` compares with.
"""

from moeshard.training.correction_bias import update_correction_bias
from moeshard.training.gradients import clip_grad_norm_, grad_norm, gradient_roles, reduce_gradients

__all__ = ["clip_grad_norm_", "grad_norm", "gradient_roles", "reduce_gradients", "update_correction_bias"]
