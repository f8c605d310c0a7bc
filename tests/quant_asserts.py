"""Shared assertion for kernel tests: a quantization equals ``quantize_activations`` bit for bit."""

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
