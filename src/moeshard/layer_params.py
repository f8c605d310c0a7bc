"""The layer's parameter modules, under transformers' names: the router ``Gate``, this rank's
``RoutedExperts`` (model-dtype parameters or quantized buffers) and the fused ``SharedExperts``.
They hold weights only; ``moeshard.layer.MoELayer`` computes with them."""

from __future__ import annotations

import torch
from torch import nn

from moeshard.activations import get_activation
from moeshard.experts.base import ExpertWeights
from moeshard.experts.shared import QuantizedSharedMLP
from moeshard.quant import QuantizedWeight
from moeshard.weights import MoEWeights


class Gate(nn.Module):
    """weight: [E, H] router; e_score_correction_bias: fp32 [E] (DeepSeek-V3) when configured;
    bias: [E] the router linear's bias (a routing kind with ``router_bias``: gpt-oss), else None."""

    def __init__(self, weights: MoEWeights) -> None:
        super().__init__()
        self.weight = nn.Parameter(weights.router_weight.clone(), requires_grad=False)
        if weights.correction_bias is not None:
            self.register_buffer("e_score_correction_bias", weights.correction_bias.float().clone())
        else:
            self.e_score_correction_bias = None
        self.bias = None if weights.gate_bias is None else nn.Parameter(weights.gate_bias.clone(), requires_grad=False)


class RoutedExperts(nn.Module):
    """This rank's routed experts under the canonical names ``gate_up_proj`` [E_l, 2 I_l, H] and
    ``down_proj`` [E_l, H, I_l]; quantized weights add ``<name>_scale`` (and ``_global_scale``);
    expert biases are ``gate_up_proj_bias`` [E_l, 2 I_l] and ``down_proj_bias`` [E_l, H] (the
    latter on TP rank 0 only), model-dtype parameters.

    ``weights`` is the kernels' view of the module's tensors. Building it validates every layout,
    so it is kept, and made again whenever a tensor it holds is no longer the module's: after
    ``.to``, ``load_state_dict(..., assign=True)``, an assignment, or inside
    ``torch.func.functional_call`` (which puts the tensors it is given in place of the module's).
    Writes into the same tensors (``load_state_dict``'s copy, an in-place op) need no new view.
    The view is dropped at ``.to`` and after ``load_state_dict``, so it never keeps replaced
    tensors alive; the tensors a ``functional_call`` gave stay referenced by it until the next
    forward (or ``.to`` / ``load_state_dict``) of the layer."""

    gate_up_proj_bias: nn.Parameter | None
    down_proj_bias: nn.Parameter | None

    def __init__(self, weights: ExpertWeights) -> None:
        super().__init__()
        self.scheme = weights.scheme
        self._shapes = {}
        for name, w in (("gate_up_proj", weights.gate_up), ("down_proj", weights.down)):
            if isinstance(w, QuantizedWeight):
                self.register_buffer(name, w.data)
                self.register_buffer(name + "_scale", w.scale)
                self.register_buffer(name + "_global_scale", w.global_scale)
                self._shapes[name] = w.shape
            else:
                setattr(self, name, nn.Parameter(w, requires_grad=False))
        for name, b in (("gate_up_proj_bias", weights.gate_up_bias), ("down_proj_bias", weights.down_bias)):
            setattr(self, name, None if b is None else nn.Parameter(b, requires_grad=False))
        self._made_from: tuple = ()
        self._made: ExpertWeights | None = None
        # load_state_dict(assign=True) puts new tensors in: let the view of the old ones go then,
        # not at the next forward (a model loading many layers would hold every old set at once).
        self.register_load_state_dict_post_hook(lambda module, _keys: module._forget_view())

    def _weight(self, name: str):
        if self.scheme == "none":
            return getattr(self, name)
        return QuantizedWeight(self.scheme, getattr(self, name), getattr(self, name + "_scale"),
                               getattr(self, name + "_global_scale"), self._shapes[name])

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every per-slot tensor, each [E_l, ...]: weights, then scales, global scales and biases, of
        gate_up then down (what a rebalance moves slot by slot: a bias travels with its expert)."""
        names = [n + suffix for n in ("gate_up_proj", "down_proj") for suffix in ("", "_scale", "_global_scale", "_bias")]
        return [t for t in (getattr(self, n, None) for n in names) if t is not None]

    @property
    def weights(self) -> ExpertWeights:
        """The kernels' ``ExpertWeights`` of the module's current tensors (see the class)."""
        # A tensor's identity, and its storage: ``.to`` may swap a parameter's ``.data`` in place.
        held = tuple((t, t.data_ptr()) for t in self.slot_tensors())
        if self._made is None or len(held) != len(self._made_from) or any(
                a is not b or pa != pb for (a, pa), (b, pb) in zip(held, self._made_from, strict=True)):
            self._made = ExpertWeights(self._weight("gate_up_proj"), self._weight("down_proj"), self.scheme,
                                       self.gate_up_proj_bias, self.down_proj_bias)
            self._made_from = held
        return self._made

    def _forget_view(self) -> None:
        self._made, self._made_from = None, ()

    def _apply(self, fn, *args, **kwargs):
        # The view made before holds the old tensors: let them go now, not at the next forward.
        self._forget_view()
        return super()._apply(fn, *args, **kwargs)


def _frozen_linear(weight: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` without bias holding ``weight`` [out, in] (a copy), built without
    initialising a random weight first."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return layer


class SharedExperts(nn.Module):
    """The fused shared-expert MLP: down(act(gate(x)) * up(x)); width S; never sharded.

    ``gate_proj`` / ``up_proj`` [S, H] and ``down_proj`` [H, S] hold the model-dtype weights
    (the state dict's). ``quantized``: None (the MLP runs in the model dtype), or the
    ``QuantizedSharedMLP`` that runs it quantized (``QuantConfig.shared``) from those weights."""

    def __init__(self, weights: MoEWeights, activation: str, quantized: QuantizedSharedMLP | None = None) -> None:
        super().__init__()
        self.activation = activation
        gate, up, down = weights.shared_gate, weights.shared_up, weights.shared_down
        if gate is None or up is None or down is None:
            missing = [name for name, w in (("shared_gate", gate), ("shared_up", up), ("shared_down", down)) if w is None]
            raise ValueError(f"SharedExperts: MoEWeights.{', '.join(missing)} missing; the shared MLP needs all three")
        self.gate_proj = _frozen_linear(gate)
        self.up_proj = _frozen_linear(up)
        self.down_proj = _frozen_linear(down)
        self.quantized = quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        return self.down_proj(get_activation(self.activation)(self.gate_proj(x), self.up_proj(x)))
