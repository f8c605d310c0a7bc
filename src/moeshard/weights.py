"""Full (unsharded, unquantized) weights of one MoE block under their canonical names.

The names and shapes are those of a transformers-5 sparse MoE block, so ``block.state_dict()``
of Mixtral, Qwen2-MoE, Qwen3-MoE or DeepSeek-V3 maps onto ``MoEWeights`` without renaming:

==================================  ===============  ==========================================
name                                shape            meaning
==================================  ===============  ==========================================
gate.weight                         [E, H]           router
gate.e_score_correction_bias        [E]              DeepSeek-V3 selection bias (optional)
gate.bias                           [E]              router bias (a kind with ``router_bias``: gpt-oss)
experts.gate_up_proj                [E, 2I, H]       rows [0, I) gate, rows [I, 2I) up; an ungated
                                                     activation's up rows alone, [E, I, H]
experts.down_proj                   [E, H, I]
experts.gate_up_proj_bias           [E, 2I]          expert biases (``expert_bias``: gpt-oss), added
experts.down_proj_bias              [E, H]           to gate_up's and down's outputs; [0, I) gate
shared_experts.gate_proj.weight     [S, H]           S = num_shared_experts * shared size
shared_experts.up_proj.weight       [S, H]
shared_experts.down_proj.weight     [H, S]
shared_expert_gate.weight           [1, H]           Qwen2-MoE sigmoid gate (optional)
==================================  ===============  ==========================================

Qwen2-MoE spells the shared MLP ``shared_expert.`` (singular); both spellings are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from moeshard.config import MoEConfig

SHARED_ALIASES = ("shared_experts.", "shared_expert.")
# The routed experts' tensors: sharded per rank, so a layer given its shard elsewhere has none here.
ROUTED = ("gate_up", "down", "gate_up_bias", "down_bias")
# The router's tensors: a layer that takes its routing as given (``MoEExperts``) reads none of them.
ROUTER = ("gate", "correction_bias", "gate_bias")


@dataclass(frozen=True)
class MoEWeights:
    """Every tensor of one MoE block, unsharded, in one dtype (see the module table for shapes).
    ``gate`` is None only for a layer that does not route (``validate(router=False)``)."""

    gate: torch.Tensor | None
    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    correction_bias: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    shared_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_expert_gate: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def expected_shapes(self, cfg: MoEConfig) -> dict[str, tuple[int, ...] | None]:
        E, H, I, S = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.shared_width
        shared = cfg.has_shared_experts
        return {
            "gate": (E, H),
            "gate_up": (E, cfg.gate_up_size, H),
            "down": (E, H, I),
            "correction_bias": (E,) if cfg.use_correction_bias else None,
            "shared_gate": (S, H) if shared else None,
            "shared_up": (S, H) if shared else None,
            "shared_down": (H, S) if shared else None,
            "shared_expert_gate": (1, H) if cfg.shared_expert_gate else None,
            "gate_bias": (E,) if cfg.routing_kind.router_bias else None,
            "gate_up_bias": (E, cfg.gate_up_size) if cfg.expert_bias else None,
            "down_bias": (E, H) if cfg.expert_bias else None,
        }

    @property
    def router_weight(self) -> torch.Tensor:
        """``gate`` [E, H], for a computation that routes; ValueError where these weights hold none
        (a given-routing layer's: ``validate(router=False)``)."""
        if self.gate is None:
            raise ValueError("MoEWeights.gate: missing; these weights take their routing as given (no router "
                             "weight), and routing needs the router [E, H]")
        return self.gate

    def validate(self, cfg: MoEConfig, routed: bool = True, router: bool = True) -> None:
        """Raises ValueError naming the tensor, the expected and the actual shape.

        routed=False: the routed experts (``gate_up``, ``down`` and their biases) are supplied
        elsewhere, already sharded, and may be None here. router=False: the routing is given
        (``MoEExperts``), so the router's tensors (``ROUTER``) may be None; any given is checked."""
        for name, shape in self.expected_shapes(cfg).items():
            value = getattr(self, name)
            if value is None and ((not routed and name in ROUTED) or (not router and name in ROUTER)):
                continue
            if shape is None:
                if value is not None:
                    raise ValueError(f"MoEWeights.{name}: given, but the config has no use for it ({cfg})")
                continue
            if value is None:
                raise ValueError(f"MoEWeights.{name}: missing; expected shape {shape}")
            if tuple(value.shape) != shape:
                raise ValueError(f"MoEWeights.{name}: expected shape {shape}, got {tuple(value.shape)}")
            if not value.is_floating_point():
                raise ValueError(f"MoEWeights.{name}: expected a floating tensor, got {value.dtype}")
            if value.is_meta:
                raise ValueError(f"MoEWeights.{name}: a meta tensor (a shape without data); materialise the weights "
                                 f"first (moeshard.integrations.transformers.load_sharded_model reads a checkpoint's, "
                                 f"or module.to_empty(device=...) and load_state_dict)")

    def to(self, device=None, dtype: torch.dtype | None = None) -> MoEWeights:
        """Moves every tensor; the router (``gate``, ``correction_bias``, ``gate_bias``) keeps its
        stored precision, since it decides routing (DeepSeek-V3 checkpoints keep it in fp32)."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                keep = f.name in ROUTER
                value = value.to(device=device, dtype=None if keep else dtype)
            moved[f.name] = value
        return MoEWeights(**moved)

    @staticmethod
    def random(cfg: MoEConfig, generator: torch.Generator | None = None, dtype=None) -> MoEWeights:
        """Random weights at a scale where outputs stay O(1): std 1/sqrt(fan_in).

        The router weights get a larger scale (std 2/sqrt(H)) so that top-k choices are well
        separated and ties between near-equal logits are rare in tests.
        """
        E, H, I, S = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.shared_width
        dtype = dtype or cfg.dtype

        def rnd(*shape, fan_in):
            t = torch.randn(*shape, generator=generator, dtype=torch.float32) / fan_in**0.5
            return t.to(dtype)

        shared = cfg.has_shared_experts
        # Biases of the scale of the products they are added to, so that a dropped one shows.
        bias = (lambda *shape: (torch.randn(*shape, generator=generator) * 0.5).to(dtype)) if cfg.expert_bias else None
        return MoEWeights(
            gate=(rnd(E, H, fan_in=H).float() * 2).to(dtype),
            gate_up=rnd(E, cfg.gate_up_size, H, fan_in=H),
            down=rnd(E, H, I, fan_in=I),
            correction_bias=(torch.rand(E, generator=generator) * 0.1) if cfg.use_correction_bias else None,
            shared_gate=rnd(S, H, fan_in=H) if shared else None,
            shared_up=rnd(S, H, fan_in=H) if shared else None,
            shared_down=rnd(H, S, fan_in=S) if shared else None,
            shared_expert_gate=rnd(1, H, fan_in=H) if cfg.shared_expert_gate else None,
            gate_bias=(torch.randn(E, generator=generator) * 0.5).to(dtype) if cfg.routing_kind.router_bias else None,
            gate_up_bias=bias(E, cfg.gate_up_size) if bias else None,
            down_bias=bias(E, H) if bias else None,
        )

    @staticmethod
    def from_state_dict(state: dict[str, torch.Tensor], cfg: MoEConfig, prefix: str = "",
                        strict: bool = True, router: bool = True) -> MoEWeights:
        """Reads the canonical names (module table) under ``prefix``; validates shapes. strict: a
        tensor under ``prefix`` that ``cfg`` reads no use for (a shared expert with
        ``num_shared_experts=0``, a router bias its routing kind has none of, a misspelt name) is
        refused, naming it, rather than dropped (``load_state_dict`` refuses it as well).
        router=False: the routing is given, the router's tensors are neither required nor read."""
        read: set[str] = set()

        def get(name: str, required: bool) -> torch.Tensor | None:
            key = prefix + name
            if key in state:
                read.add(key)
                return state[key]
            if required:
                raise ValueError(f"state dict: missing tensor {key!r}")
            return None

        def shared(name: str) -> torch.Tensor | None:
            if not cfg.has_shared_experts:
                return None
            for alias in SHARED_ALIASES:
                if prefix + alias + name in state:
                    read.add(prefix + alias + name)
                    return state[prefix + alias + name]
            raise ValueError(f"state dict: missing tensor {prefix + SHARED_ALIASES[0] + name!r} "
                             f"(or {prefix + SHARED_ALIASES[1] + name!r})")

        weights = MoEWeights(
            gate=get("gate.weight", True) if router else None,
            gate_up=get("experts.gate_up_proj", True),
            down=get("experts.down_proj", True),
            correction_bias=get("gate.e_score_correction_bias", True) if router and cfg.use_correction_bias else None,
            shared_gate=shared("gate_proj.weight"),
            shared_up=shared("up_proj.weight"),
            shared_down=shared("down_proj.weight"),
            shared_expert_gate=get("shared_expert_gate.weight", True) if cfg.shared_expert_gate else None,
            gate_bias=get("gate.bias", True) if router and cfg.routing_kind.router_bias else None,
            gate_up_bias=get("experts.gate_up_proj_bias", True) if cfg.expert_bias else None,
            down_bias=get("experts.down_proj_bias", True) if cfg.expert_bias else None,
        )
        unread = sorted(k for k in state if k.startswith(prefix) and k not in read)
        if strict and unread:
            raise ValueError(f"state dict: unexpected tensor(s) {unread[:6]}{' ...' if len(unread) > 6 else ''}: the "
                             f"config reads none of them (num_shared_experts={cfg.num_shared_experts}, "
                             f"shared_expert_gate={cfg.shared_expert_gate}, use_correction_bias="
                             f"{cfg.use_correction_bias}, scoring={cfg.scoring!r}, expert_bias={cfg.expert_bias})")
        weights.validate(cfg, router=router)
        return weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The canonical names (inverse of ``from_state_dict``)."""
        names = {
            "gate": "gate.weight", "gate_up": "experts.gate_up_proj", "down": "experts.down_proj",
            "correction_bias": "gate.e_score_correction_bias",
            "shared_gate": "shared_experts.gate_proj.weight", "shared_up": "shared_experts.up_proj.weight",
            "shared_down": "shared_experts.down_proj.weight", "shared_expert_gate": "shared_expert_gate.weight",
            "gate_bias": "gate.bias", "gate_up_bias": "experts.gate_up_proj_bias",
            "down_bias": "experts.down_proj_bias",
        }
        return {key: getattr(self, f) for f, key in names.items() if getattr(self, f) is not None}
