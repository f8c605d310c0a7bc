"""Recording a layer's intermediate values, stage by stage, for ``moeshard check --explain``.

``MoELayer(..., recorder=StageRecorder())`` copies what each stage of one forward produced on
this rank (to the CPU, detached); without a recorder the layer records nothing and pays for
one ``is None`` test per stage. Recording never changes what the layer computes.

Stages, in pipeline order, and what each records (shapes on this rank: R rows it routes, K
top-k, M dispatched rows, H hidden):

    routing    topk_ids int64 [R, K], topk_weights fp32 [R, K], first_token (SP chunk start)
    payload    rows [R, Hp] (model dtype, or the uint8 wire view of quantized data), row_scale
               (wire view [R, S] or None), tensor_scale, input_amax  (by the backend)
    dispatch   rows [M / repeat, Hp] and row_scale as the experts receive them (wire views),
               expert_ids int64 [M] (local; -1 padding), repeat, first_expert (global id of
               local expert 0)
    experts    y [M, H] (model dtype): each dispatched row through its expert, unweighted
    combine    out fp32 [R, H]: the weighted sums over top-k (a TP slice's part under TP)
    tp_reduce  out fp32 [R, H] after the TP all-reduce (TP without EP only)
    shared     out fp32 [R, H]: the shared experts' contribution (models that have them)
    output     out [T, H] (model dtype): what forward returns (after the SP gather)

With gradients (``record_grad``, the layer calls it only when its forward carries them), the
backward's values at two points, kept in ``grads`` as the backward passes them:

    sp_gather     fp32 or model dtype [R, H]: the gradient of this rank's rows of the output,
                  after the SP all-gather's backward (SP only)
    topk_weights  fp32 [R, K]: the gradient of the top-k weights this rank routed (after the TP
                  copy's all-reduce under TP)
"""

from __future__ import annotations

from typing import Any

import torch

STAGES = ("routing", "payload", "dispatch", "experts", "combine", "tp_reduce", "shared", "output")
GRAD_STAGES = ("sp_gather", "topk_weights")


class StageRecorder:
    """Copies of one rank's stage values for one forward: ``stages[name] = {field: value}``
    (tensors on the CPU), and of its backward: ``grads[name]``. A stage recorded again (a second
    forward) replaces the first."""

    def __init__(self) -> None:
        self.stages: dict[str, dict[str, Any]] = {}
        self.grads: dict[str, torch.Tensor] = {}

    def record(self, stage: str, **values: Any) -> None:
        if stage not in STAGES:
            raise ValueError(f"StageRecorder.record: stage {stage!r} is not one of {list(STAGES)}")
        self.stages[stage] = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                              for k, v in values.items()}

    def record_grad(self, stage: str, tensor: torch.Tensor) -> None:
        """Keeps (a CPU copy of) the gradient of ``tensor`` under ``stage`` when the backward
        computes it (a tensor hook; the gradient itself is left as it is). Nothing for a tensor
        that no gradient reaches (it does not require grad)."""
        if stage not in GRAD_STAGES:
            raise ValueError(f"StageRecorder.record_grad: stage {stage!r} is not one of {list(GRAD_STAGES)}")
        if not tensor.requires_grad:
            return

        def keep(grad: torch.Tensor) -> None:
            self.grads[stage] = grad.detach().to("cpu", copy=True)

        tensor.register_hook(keep)
