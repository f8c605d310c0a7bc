"""Activation kinds: how an expert turns its gate and up products into h, one descriptor each.

A gated kind (a GLU) computes ``h = act(gate, up)`` on its gate rows' products ``[M, I]`` and up
rows' products ``[M, I]`` (``gate_up[:, :I]`` and ``gate_up[:, I:]`` in moeshard's layout,
whatever layout the checkpoint stored them in): the experts' first weight is ``[E, 2I, H]``. An
ungated kind (``gated=False``: a plain MLP, Nemotron-H's ``relu2``) computes ``h = act(up)`` on
``[M, I]`` products of an up weight alone: the experts' first weight is ``[E, I, H]``, still
called gate_up, and ``ActivationKind.products`` (2 or 1) says how many rows it holds per column of
h. Every stage reads the kind from this registry: ``MoEConfig.activation``
validates against it, ``experts.base.activate`` (the portable experts and the reference), the
shared experts, the harness's explanation and the Triton kernels (``kernel_mode``) look it up.

==============  ==========  ==========================================================  =========
name            kernel      h                                                           params
==============  ==========  ==========================================================  =========
silu            0           silu(gate) * up (SwiGLU: Mixtral, Qwen, DeepSeek)
gelu            1           gelu(gate) * up (exact erf GELU-GLU)
gelu_tanh       2           gelu_tanh(gate) * up, GELU's tanh approximation (Gemma 4's
                            ``gelu_pytorch_tanh``)
swiglu_clamped  3           g = min(gate, limit); u = clamp(up, -limit, limit);        alpha 1.702
                            (u + 1) * g * sigmoid(alpha * g)  (gpt-oss)                 limit 7.0
silu_clamped    4           silu(min(gate, limit)) * clamp(up, -limit, limit)           limit 10.0
                            (HY-V4's routed experts)
swiglu_         5           c_g tanh(gate / c_g) * sigmoid(gate) * c_u tanh(up / c_u)  gate_cap 4
softcapped                  (Inkling 2)                                                 up_cap 25
relu2           32          relu(up)^2, ungated (Nemotron-H)
==============  ==========  ==========================================================  =========

A kind without a ``kernel_mode`` runs on the portable experts; the Triton kernels refuse it
with the reason (``kernel_refusal``). A new kind is one ``register_activation`` entry (its
function and parameters as data); a Triton epilogue for it is a change to
``kernels/grouped_gemm.py``'s ``_act_mul`` (an ungated kind's: ``_act_one``, a mode from
``FIRST_UNGATED_MODE`` on) plus its ``kernel_mode`` and parameter names here (``KERNEL_PARAMS``:
the kernels take those parameters as compile-time constants, ``ACT_P0`` and ``ACT_P1`` in that
order), and for a gated kind the same
mode's forward and derivative in ``kernels/glu.py`` (the training forward on CUDA; an ungated
kind's runs as torch ops). The Gluon
gate_up (``kernels/persistent_gate_up.py``) computes modes ``GLUON_ACT_MODES`` of
``kernels/modes.py``; the experts run the others on the Triton gate_up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.nn.functional as F

from moeshard.registry import Registry

# Modes of the Triton gate_up epilogue (``ACT`` of ``kernels.grouped_gemm._act_mul``, and for an
# ungated kind ``_act_one``), each with the parameter names its formula takes, in the order the
# kernels receive them (``ACT_P0``, ``ACT_P1``: ``kernels.modes.act_constants``).
KERNEL_PARAMS: Mapping[int, tuple[str, ...]] = MappingProxyType({
    0: (), 1: (), 2: (), 3: ("alpha", "limit"), 4: ("limit",), 5: ("gate_cap", "up_cap"), 32: ()})
KERNEL_MODES = tuple(KERNEL_PARAMS)
# The modes of ungated kinds (h = act(up) from one product; the kernels then load no up tile):
# from this mode on, every mode is ungated, so that a new gated mode takes the next free number
# below it and no mode is ever renumbered.
FIRST_UNGATED_MODE = 32
UNGATED_KERNEL_MODES = tuple(m for m in KERNEL_MODES if m >= FIRST_UNGATED_MODE)


@dataclass(frozen=True)
class ActivationKind:
    """One activation kind.

    name: the ``MoEConfig.activation`` value.
    act: gated, ``act(gate, up, **params) -> h``: gate and up are tensors of one shape
      ``[..., I]`` and one float dtype, h has that shape and dtype; ungated,
      ``act(up, **params) -> h``. The experts call it on fp32 values (then
      round h to the model dtype); the shared experts on model-dtype values, the reference on
      fp64. It must be elementwise, so that TP slices of I compute the same h as the whole.
    kernel_mode: the Triton epilogue's mode for it (``KERNEL_MODES``), or None: portable only.
    summary: one line for listings.
    params: the constants ``act`` takes as keyword arguments (e.g. ``alpha``, ``limit``).
    gated: True for a GLU (gate and up rows), False for a plain MLP (up rows alone).
    """

    name: str
    act: Callable[..., torch.Tensor]
    kernel_mode: int | None
    summary: str
    params: Mapping[str, float] = field(default_factory=dict)
    gated: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @property
    def products(self) -> int:
        """Rows of the experts' first weight per column of h: 2 (gate and up) gated, 1 ungated."""
        return 2 if self.gated else 1

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """h = act(gate, up) of a gated kind with its parameters; shapes and dtype as ``act``."""
        if not self.gated:
            raise TypeError(f"activation {self.name!r} is ungated: call apply(up) with the up products alone")
        return self.act(gate, up, **self.params)

    def gate_up_rows(self, lo: int, hi: int, I: int) -> tuple[slice, ...]:
        """The rows of an expert's gate_up [products * I, H] (and its bias) that produce columns
        [lo, hi) of h: its gate rows, then its up rows (I later); an ungated kind's up rows alone.
        A TP slice of I keeps these rows, in this order."""
        return (slice(lo, hi), slice(I + lo, I + hi))[:self.products]

    def apply(self, products: torch.Tensor) -> torch.Tensor:
        """products [..., products * I] (gated: gate's columns [0, I), up's [I, 2I); ungated: up's)
        -> h [..., I] in their dtype."""
        if not self.gated:
            return self.act(products, **self.params)
        gate, up = products.chunk(2, dim=-1)
        return self.act(gate, up, **self.params)

    def kernel_refusal(self) -> str | None:
        """None when the Triton kernels compute this kind, else why they do not."""
        if self.kernel_mode is None:
            return (f"activation {self.name!r} ({self.summary}) has no Triton epilogue (kernel_mode None); "
                    f"it runs on the portable experts")
        return None


_REGISTRY: Registry[ActivationKind] = Registry()


def register_activation(kind: ActivationKind) -> ActivationKind:
    """Adds ``kind`` after checking it is complete; returns it. ValueError names what is wrong."""
    where = f"register_activation({kind.name!r})"
    if not isinstance(kind.name, str) or not kind.name.isidentifier():
        raise ValueError(f"{where}: name must be an identifier, got {kind.name!r}")
    if kind.name in _REGISTRY:
        raise ValueError(f"{where}: an activation of that name is registered already")
    if not callable(kind.act):
        raise ValueError(f"{where}: act must be callable, got {kind.act!r}")
    if not isinstance(kind.gated, bool):
        raise ValueError(f"{where}: gated must be True or False, got {kind.gated!r}")
    if kind.kernel_mode is not None and (kind.kernel_mode in UNGATED_KERNEL_MODES) == kind.gated:
        want = "an ungated mode of " + str(list(UNGATED_KERNEL_MODES)) if not kind.gated else \
            "a gated mode (below " + str(FIRST_UNGATED_MODE) + ")"
        raise ValueError(f"{where}: {'a gated' if kind.gated else 'an ungated'} kind needs {want} or None, got "
                         f"kernel_mode {kind.kernel_mode!r}")
    if kind.kernel_mode is not None:
        taken = {k.kernel_mode: k.name for k in _REGISTRY.values() if k.kernel_mode is not None}
        if kind.kernel_mode in KERNEL_MODES and sorted(kind.params) != sorted(KERNEL_PARAMS[kind.kernel_mode]):
            raise ValueError(f"{where}: kernel_mode {kind.kernel_mode} computes with parameters "
                             f"{list(KERNEL_PARAMS[kind.kernel_mode])}, the kind has {sorted(kind.params)}")
        if kind.kernel_mode not in KERNEL_MODES or kind.kernel_mode in taken:
            raise ValueError(f"{where}: kernel_mode {kind.kernel_mode!r} is not a free mode of {KERNEL_MODES} "
                             f"(taken: {taken})")
    for key, value in kind.params.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{where}: parameter {key!r} must be a number, got {value!r}")
    _REGISTRY.add(kind.name, kind)
    return kind


def unregister_activation(name: str) -> None:
    """Removes a kind (tests that register one of their own clean up with this)."""
    _REGISTRY.remove(name)


def activation_names() -> tuple[str, ...]:
    """Every registered kind, in registration order."""
    return _REGISTRY.names()


def get_activation(name: str, where: str = "activation") -> ActivationKind:
    """The descriptor of ``name``; ValueError naming ``where``, the value and the known kinds."""
    return _REGISTRY.get(name, where)


def _silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _gelu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate) * up


def _gelu_tanh_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    # gpt-oss clamps both products so that the large-activation tail stays in range.
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _clamped_silu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    # HY-V4's routed experts: plain SwiGLU on clamped products.
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def _softcapped_swiglu(gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float) -> torch.Tensor:
    # Inkling 2: the sigmoid sees the raw gate; the caps bound the two linear factors.
    return (torch.tanh(gate / gate_cap) * gate_cap) * torch.sigmoid(gate) * (torch.tanh(up / up_cap) * up_cap)


def _relu_squared(up: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(up))


for _kind in (
    ActivationKind("silu", _silu_glu, 0, "SwiGLU: silu(gate) * up"),
    ActivationKind("gelu", _gelu_glu, 1, "GELU-GLU: gelu(gate) * up (exact erf)"),
    ActivationKind("swiglu_clamped", _clamped_swiglu, 3,
                   "gpt-oss SwiGLU: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)",
                   {"alpha": 1.702, "limit": 7.0}),
    ActivationKind("gelu_tanh", _gelu_tanh_glu, 2, "GELU-GLU with GELU's tanh approximation"),
    ActivationKind("silu_clamped", _clamped_silu, 4,
                   "SwiGLU on clamped products: silu(min(gate, limit)) * clamp(up, -limit, limit)", {"limit": 10.0}),
    ActivationKind("relu2", _relu_squared, 32, "relu(up)^2, an ungated MLP (Nemotron-H)", gated=False),
    ActivationKind("swiglu_softcapped", _softcapped_swiglu, 5,
                   "soft-capped SwiGLU: gate_cap tanh(gate / gate_cap) * sigmoid(gate) * up_cap tanh(up / up_cap)",
                   {"gate_cap": 4.0, "up_cap": 25.0}),
):
    register_activation(_kind)
