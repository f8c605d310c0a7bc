"""Routed-expert computation: the interface (``base``) and the portable grouped path
(``grouped``). The Triton kernels live in ``moeshard.kernels``; which of the two runs is
``moeshard.kernel_choice``'s decision (above both)."""

from __future__ import annotations

from moeshard.experts.base import ExpertInput, ExpertKernel, ExpertWeights
from moeshard.experts.grouped import GroupedExperts

__all__ = ["ExpertInput", "ExpertKernel", "ExpertWeights", "GroupedExperts"]
