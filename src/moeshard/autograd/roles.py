"""Which ranks' gradients of a parameter must be summed, and which rank counts it in the norm.

After the backward of the replicated loss (``moeshard.autograd``) a rank holds, for each
parameter, its own contribution: the gradient of its part of the loss through the rows it
computed. ``GradRole`` says which group's contributions together make the whole gradient
(``reduce``) and which one rank counts the parameter in the global gradient norm (``counted``),
for a ``MoELayer``'s parameter under its layout, and for a parameter every rank holds whole:

=======================  ===============  ==========================  ============================
parameter                layout           reduce over (sum)           why
=======================  ===============  ==========================  ============================
routed experts and       EP on (EP, SP)   nothing                     one rank owns the expert (its
their biases                                                          biases travel with it); the
                                                                      backward all-to-all brought
                                                                      every token's gradient to it
routed experts, their    EP off           the DP group                a slice of I (TP) or whole,
gate_up bias                                                          held by every DP rank, each
                                                                      for its own tokens
down bias of the         EP off           the DP group (of TP rank    added once, to TP rank 0's
routed experts                            0: no other TP rank holds   partial sum: its gradient is
                                          it)                         there whole (the TP
                                                                      all-reduce's backward is the
                                                                      identity)
router (weight, bias),   SP               every rank of the layout    each TP rank routed a chunk
shared experts,                           (the EP group)              of the rows, each DP rank its
shared-expert gate                                                    own tokens
router (weight, bias),   otherwise        the DP group                the TP ranks of a DP rank
shared experts,                                                       computed the same gradient
shared-expert gate
anything outside the     every layout     the DP group                attention, norms, embeddings
MoE layers                                                            run on all of a DP rank's
                                                                      rows on each of its TP ranks
=======================  ===============  ==========================  ============================

Counted: a gradient that several ranks hold identical after the reduction is counted on the
first of them only (global rank 0 for a replicated parameter, DP rank 0 for an expert slice
under EP off), an owned expert on its rank; so the norm counts every parameter exactly once.
The down bias under TP is counted on DP rank 0 of TP rank 0, the only TP rank holding it.
A correction bias (DeepSeek-V3's ``e_score_correction_bias``) is a buffer: no gradient reaches
it; ``moeshard.training.correction_bias`` updates it by its own rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeshard.parallel.config import ParallelConfig

REDUCE_GROUPS = ("", "dp", "ep")


@dataclass(frozen=True)
class GradRole:
    """reduce: "" (the gradient is whole on this rank), "dp" or "ep" (the group of
    ``ParallelGroups`` over whose ranks it is summed); counted: this rank counts it in the
    gradient norm; kind: "expert" | "expert_slice" | "replicated", for messages."""

    reduce: str
    counted: bool
    kind: str

    def __post_init__(self) -> None:
        if self.reduce not in REDUCE_GROUPS:
            raise ValueError(f"GradRole.reduce: {self.reduce!r} is not one of {list(REDUCE_GROUPS)}")


def replicated_role(rank: int) -> GradRole:
    """A parameter outside the MoE layers, held whole by every rank (global rank ``rank``)."""
    return GradRole("dp", rank == 0, "replicated")


def layer_role(name: str, parallel: ParallelConfig, rank: int) -> GradRole:
    """The role of a ``MoELayer`` parameter ``name`` (relative to the layer: ``experts.*`` are
    the routed experts and their biases, anything else is held whole by every rank) on global
    rank ``rank``. Under TP without EP ``experts.down_proj_bias`` exists on TP rank 0 alone (the
    layer adds it once): asked there, its role is an expert slice's."""
    if name.startswith("experts."):
        if parallel.enable_ep:
            return GradRole("", True, "expert")
        return GradRole("dp", parallel.dp_rank(rank) == 0, "expert_slice")
    return GradRole("ep" if parallel.is_sequence_parallel else "dp", rank == 0, "replicated")
