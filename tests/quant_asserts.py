"""Shared assertions for kernel tests: a quantization equals ``quantize_activations`` bit for bit,
and the positions of h that ``quantize_h`` writes."""

import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_same_quantization(q, ref, live: torch.Tensor) -> None:
    """q: padded ``QuantizedActivations`` from a kernel; ref: the reference quantization of the
    rows ``live`` (bool mask over q's rows) marks as real."""
    assert torch.equal(_bits(q.data[live]), _bits(ref.data))
    if ref.row_scale is not None:
        assert torch.equal(_bits(q.row_scale[live]), _bits(ref.row_scale))
    if ref.tensor_scale is not None:
        assert torch.equal(q.tensor_scale[live], ref.tensor_scale)


def quantized_positions(plan, rows: int = 16) -> torch.Tensor:
    """bool [P]: the padded positions ``kernels.quant.quantize_h`` writes for ``plan`` (a
    ``RowAlignment``): the blocks of ``rows`` positions (its ROWS) in live tiles that begin before
    their expert's last row. Written here from the plan's definition, not from the kernel."""
    tile_of = plan.tile_expert.repeat_interleave(plan.block_m).long()
    expert = tile_of.clamp(min=0)
    block_start = torch.arange(tile_of.shape[0], device=tile_of.device) // rows * rows
    return (tile_of >= 0) & (block_start - plan.start.long()[expert] < plan.count.long()[expert])
