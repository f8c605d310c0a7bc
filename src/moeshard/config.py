"""Configuration of one MoE layer: model shape, routing, quantization.

All configuration objects are frozen dataclasses validated in ``__post_init__``; a refusal is a
``ValueError`` that names the field and the offending values. ``ParallelConfig`` lives in
``moeshard.parallel.config`` because it also needs the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.activations import ActivationKind, get_activation
from moeshard.quant.schemes import QuantScheme, get_scheme, scheme_names
from moeshard.routing import RoutingKind, get_routing, routing_names
from moeshard.validate import boolean, finite_float, size

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# routed_scaling_factor: published models use 1 to 16 (DeepSeek-V3 2.5, DeepSeek-V2 16); far beyond
# that the routed outputs overflow the model dtype, so a larger value is refused as absurd.
MAX_ROUTED_SCALING = 1000.0
# The router's precision (``MoEConfig.router_dtype``): the dtype its logits x W^T are computed in.
#   fp32   x and W widened to fp32, the product in fp32 (the DeepSeek-V3-style routers, which
#          transformers keeps in fp32); the default
#   model  the product in the model dtype (x's), rounded to it, as most transformers routers
#          compute F.linear(hidden_states, weight) (Mixtral, Qwen)
# Selection and weights are then computed in fp32 from those logits. In a float32 model the two
# are the same computation.
ROUTER_DTYPES = ("fp32", "model")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; refuses dtypes a layer cannot run in."""
    for name, value in MODEL_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype: {dtype} is not a model dtype; expected one of {sorted(MODEL_DTYPES)}")


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Accepts ``torch.bfloat16``, ``"bfloat16"`` or the short ``"bf16"``/``"fp16"``/``"fp32"``."""
    if isinstance(value, torch.dtype):
        dtype_name(value)
        return value
    short = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    name = short.get(value, value) if isinstance(value, str) else None
    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype: {value!r} is not one of {sorted(MODEL_DTYPES) + sorted(short)}")
    return MODEL_DTYPES[name]


def _renormalize(owner: str, value: object, kind: RoutingKind) -> bool:
    """``MoEConfig.renormalize`` resolved against the routing kind's rule (``RoutingKind.renormalize``):
    omitted (None) it is the kind's (True for an "optional" kind); given, it must be a bool the
    kind allows."""
    if value is None:
        return kind.renormalize != "never"
    boolean(owner, "renormalize", value)
    if kind.renormalize == "always" and not value:
        raise ValueError(f"{owner}.renormalize: routing kind {kind.name!r} always renormalizes its weights, got False")
    if kind.renormalize == "never" and value:
        raise ValueError(f"{owner}.renormalize: routing kind {kind.name!r} never renormalizes its weights "
                         f"({kind.summary}), got True")
    return bool(value)


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of one MoE block.

    Routing (see ``moeshard.router``): ``scoring`` names a routing kind of ``moeshard.routing``,
    which says which of the other routing fields it allows.
      * ``scoring="topk_softmax"``: top-k of the logits, softmax over the selected (gpt-oss).
      * ``scoring="group_limited_greedy"``: softmax, the ``topk_group`` groups with the best
        expert kept (DeepSeek-V2).
      * ``scoring="topk_softmax_bias"``: as topk_softmax, the router has a bias [E] (gpt-oss).
      * ``scoring="topk_sigmoid_input"``: sigmoid of the top-k logits, applied to the expert's
        input (Llama-4).
      * ``scoring="softmax_bias"``: softmax, selection on the scores plus ``e_score_correction_bias``
        (``use_correction_bias``), renormalized (ERNIE 4.5).
      * ``scoring="sparsemixer"``: rounds of top-1 on the logits, each weighted among the logits
        near it (Phi-3.5-MoE).
      * ``scoring="softmax"``: Mixtral (``renormalize=True``) and Qwen2/Qwen3-MoE
        (``renormalize`` = ``norm_topk_prob``).
      * ``scoring="sigmoid"``: DeepSeek-V3; ``use_correction_bias`` adds
        ``e_score_correction_bias`` for selection only; ``n_group``/``topk_group`` restrict the
        choice to the best groups; ``routed_scaling_factor`` multiplies the final weights.
    ``renormalize`` (divide the K weights by their sum) follows the routing kind's rule
    (``RoutingKind.renormalize``): omitted, it is the kind's choice (True where the kind leaves it
    optional); a value the kind does not allow is refused. After construction it is a bool, so
    ``dataclasses.replace(cfg, scoring=...)`` carries it over: pass ``renormalize=None`` with the
    new scoring to take that kind's rule.
    Shared experts: ``num_shared_experts`` experts of ``shared_intermediate_size`` fused into one
    MLP of width ``num_shared_experts * shared_intermediate_size`` (DeepSeek-V3, Qwen2-MoE), optionally
    multiplied by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE), then by ``shared_scale``
    (Cohere2-MoE's "average" combination, (routed + shared) / 2: ``shared_scale=0.5`` with
    ``routed_scaling_factor=0.5``). They run ``shared_activation`` where it is given (HY-V4: the
    routed experts clamp their SwiGLU, the shared ones do not), else ``activation``.
    Router precision: ``router_dtype`` (``ROUTER_DTYPES``) says where the logits are computed:
    ``"fp32"`` (the default) or ``"model"`` (in the model dtype, rounded to it, as the family's
    router does); selection and weights are computed in fp32 from those logits, except for a
    routing kind with ``score_dtype="model"``, which computes them in ``dtype`` and needs
    ``router_dtype="model"``.
    Expert biases: ``expert_bias`` gives every routed expert a gate_up bias [2I] (``gate_up_size``)
    and a down bias [H] (gpt-oss), added to its projections' outputs (``moeshard.weights``).

    Every field is type-checked: sizes and counts are ints (not bools) in ``[1, MAX_DIM]``
    (``num_shared_experts`` and ``shared_intermediate_size`` may be 0), flags are real bools,
    ``routed_scaling_factor`` and ``shared_scale`` finite numbers in ``(0, MAX_ROUTED_SCALING]``
    (stored as floats).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"
    scoring: str = "softmax"
    renormalize: bool | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    use_correction_bias: bool = False
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    shared_scale: float = 1.0
    dtype: torch.dtype = torch.float32
    expert_bias: bool = False
    router_dtype: str = "fp32"
    shared_activation: str | None = None

    def __post_init__(self) -> None:
        owner = "MoEConfig"
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "n_group", "topk_group"):
            size(owner, name, getattr(self, name))
        for name in ("num_shared_experts", "shared_intermediate_size"):
            size(owner, name, getattr(self, name), minimum=0)
        for name in ("use_correction_bias", "shared_expert_gate", "expert_bias"):
            boolean(owner, name, getattr(self, name))
        get_activation(self.activation, f"{owner}.activation")
        if self.shared_activation is not None:
            get_activation(self.shared_activation, f"{owner}.shared_activation")
            if not self.num_shared_experts:
                raise ValueError(f"{owner}.shared_activation: {self.shared_activation!r} needs num_shared_experts > 0")
        if self.num_shared_experts and not get_activation(self.shared_activation or self.activation).gated:
            field = "shared_activation" if self.shared_activation is not None else "activation"
            raise ValueError(f"{owner}.{field}: {self.shared_activation or self.activation!r} is ungated, but the shared "
                             f"experts (num_shared_experts={self.num_shared_experts}) are gated MLPs (gate_proj, "
                             f"up_proj); give shared_activation a gated kind")
        if not isinstance(self.router_dtype, str) or self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"{owner}.router_dtype: {self.router_dtype!r} is not one of {list(ROUTER_DTYPES)}")
        kind = get_routing(self.scoring, f"{owner}.scoring")
        if kind.score_dtype == "model" and self.router_dtype != "model":
            raise ValueError(f"{owner}.router_dtype: scoring={self.scoring!r} scores in the model dtype, from logits "
                             f"computed in it; router_dtype must be 'model', got {self.router_dtype!r}")
        object.__setattr__(self, "renormalize", _renormalize(owner, self.renormalize, kind))
        object.__setattr__(self, "routed_scaling_factor",
                           finite_float(owner, "routed_scaling_factor", self.routed_scaling_factor, 0.0,
                                        MAX_ROUTED_SCALING, low_open=True))
        object.__setattr__(self, "shared_scale",
                           finite_float(owner, "shared_scale", self.shared_scale, 0.0, MAX_ROUTED_SCALING,
                                        low_open=True))
        try:
            object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        except ValueError as exc:
            raise ValueError(f"{owner}.{exc}") from None
        if self.top_k > self.num_experts:
            raise ValueError(f"{owner}.top_k: {self.top_k} is larger than num_experts={self.num_experts}")
        if self.num_experts % self.n_group:
            raise ValueError(f"{owner}.n_group: num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"{owner}.topk_group: {self.topk_group} is larger than n_group={self.n_group}")
        if self.n_group > 1:
            per_group = self.num_experts // self.n_group
            if self.top_k > self.topk_group * per_group:
                raise ValueError(f"{owner}.top_k: {self.top_k} exceeds the experts of the kept groups "
                                 f"(topk_group={self.topk_group} x {per_group} experts per group)")
            if kind.groups is None:
                raise ValueError(f"{owner}.n_group: scoring={self.scoring!r} has no group top-k, got "
                                 f"n_group={self.n_group}")
            if kind.groups == "top2_sum" and per_group < 2:
                raise ValueError(f"{owner}.n_group: {self.scoring} grouped top-k scores a group by its best two "
                                 f"experts, but n_group={self.n_group} leaves {per_group} expert per group")
        if self.use_correction_bias and not kind.correction_bias:
            with_bias = [n for n in routing_names() if get_routing(n).correction_bias]
            raise ValueError(f"{owner}.use_correction_bias: only defined for scoring="
                             f"{' or '.join(repr(n) for n in with_bias)}, got scoring={self.scoring!r}")
        if self.routed_scaling_factor != 1.0 and not kind.scaling:
            raise ValueError(f"{owner}.routed_scaling_factor: scoring={self.scoring!r} has no routed scaling, got "
                             f"{self.routed_scaling_factor}")
        if self.num_shared_experts and self.shared_intermediate_size <= 0:
            raise ValueError(f"{owner}.shared_intermediate_size: must be > 0 with num_shared_experts="
                             f"{self.num_shared_experts}, got {self.shared_intermediate_size}")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ValueError(f"{owner}.shared_expert_gate: True needs num_shared_experts > 0")
        if self.shared_scale != 1.0 and not self.num_shared_experts:
            raise ValueError(f"{owner}.shared_scale: {self.shared_scale} needs num_shared_experts > 0")

    @property
    def routing_kind(self) -> RoutingKind:
        """The descriptor of ``scoring`` (``moeshard.routing``)."""
        return get_routing(self.scoring, "MoEConfig.scoring")

    @property
    def activation_kind(self) -> ActivationKind:
        """The descriptor of ``activation`` (``moeshard.activations``)."""
        return get_activation(self.activation, "MoEConfig.activation")

    @property
    def gate_up_size(self) -> int:
        """Rows of each routed expert's first weight: 2 * intermediate_size (gate and up rows) for a
        gated activation, intermediate_size (up rows) for an ungated one (``ActivationKind.products``)."""
        return self.activation_kind.products * self.intermediate_size

    @property
    def shared_act(self) -> str:
        """The shared experts' activation: ``shared_activation``, else ``activation``."""
        return self.shared_activation or self.activation

    @property
    def shared_activation_kind(self) -> ActivationKind:
        """The descriptor of ``shared_act`` (``moeshard.activations``)."""
        return get_activation(self.shared_act, "MoEConfig.shared_activation")

    @property
    def has_shared_experts(self) -> bool:
        return self.num_shared_experts > 0

    @property
    def shared_width(self) -> int:
        """Intermediate width of the fused shared-expert MLP."""
        return self.num_shared_experts * self.shared_intermediate_size


def shared_schemes() -> tuple[str, ...]:
    """The registered schemes ``QuantConfig.shared`` may name besides ``none``: quantized, with
    per-row or per-block activation scales."""
    return tuple(s for s in scheme_names() if get_scheme(s).quantized and not get_scheme(s).per_tensor_activation)


@dataclass(frozen=True)
class QuantConfig:
    """How the experts are quantized (the router stays in the model dtype).

    ``scheme`` is a registered scheme (``moeshard.quant.schemes``: ``none``, ``fp8_tensor``,
    ``fp8_token``, ``fp8_block``, ``nvfp4`` built in) for the routed experts.
    ``defer_input_quant=True`` dispatches the activations in the model dtype and lets the expert
    kernel quantize them, so the dispatched activation scale is ``None``.

    ``shared`` is the shared experts' scheme: ``none`` (the model dtype, the default) or, with
    quantized routed experts, a scheme whose activation scales are per row or per block
    (``fp8_token``, ``fp8_block``), as fp8 checkpoints such as DeepSeek-V3's ship them. A
    scheme with one activation scale per tensor (``fp8_tensor``, ``nvfp4``) is refused there:
    the shared experts run on each rank's own rows, so that scale, and the output, would depend
    on the layout.
    """

    scheme: str = "none"
    defer_input_quant: bool = False
    shared: str = "none"

    def __post_init__(self) -> None:
        get_scheme(self.scheme, "QuantConfig.scheme")
        boolean("QuantConfig", "defer_input_quant", self.defer_input_quant)
        if self.defer_input_quant and self.scheme == "none":
            raise ValueError("QuantConfig.defer_input_quant: True has no meaning with scheme='none'")
        if self.shared != "none" and self.scheme == "none":
            raise ValueError(f"QuantConfig.shared: {self.shared!r} with scheme='none'; quantized shared experts need "
                             f"quantized routed experts (a layer quantizes its routed experts at least as its shared)")
        if get_scheme(self.shared, "QuantConfig.shared").per_tensor_activation:
            raise ValueError(f"QuantConfig.shared: {self.shared!r} takes one activation scale per tensor; the shared "
                             f"experts run on each rank's own rows, so it would depend on the layout; use a scheme "
                             f"with per-row or per-block activation scales (fp8_token, fp8_block)")

    @property
    def spec(self) -> QuantScheme:
        """The scheme's descriptor."""
        return get_scheme(self.scheme, "QuantConfig.scheme")

    def check_model(self, cfg: MoEConfig, owner: str) -> None:
        """ValueError (naming ``owner``) if a model of ``cfg`` cannot take this quantization:
        quantized shared experts where it has none."""
        if self.shared != "none" and not cfg.has_shared_experts:
            raise ValueError(f"{owner}: QuantConfig.shared={self.shared!r}, but the model has no shared experts "
                             f"(num_shared_experts={cfg.num_shared_experts})")

    @property
    def quantized(self) -> bool:
        """Whether the routed experts are quantized (the shared experts are only with them)."""
        return self.scheme != "none"

    @property
    def name(self) -> str:
        """``scheme``, with ``+defer`` under deferred input quantization and ``+shared-<scheme>``
        with quantized shared experts (as case ids write it)."""
        return (self.scheme + ("+defer" if self.defer_input_quant else "")
                + ("" if self.shared == "none" else f"+shared-{self.shared}"))
