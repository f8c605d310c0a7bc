"""moeshard: a Mixture-of-Experts layer for PyTorch, correct under every DP/TP/EP/SP layout.

Public names are imported on first use, so ``import moeshard.config`` stays light.
"""

import importlib

_EXPORTS = {
    "MoEConfig": "moeshard.config", "QuantConfig": "moeshard.config", "MoELayer": "moeshard.layer",
    "MoEWeights": "moeshard.weights", "ParallelConfig": "moeshard.parallel.config",
    "ParallelGroups": "moeshard.parallel.groups", "reference_forward": "moeshard.reference",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moeshard' has no attribute {name!r}")
