"""What the benchmark runs: full-size presets, random weights made on the GPU, routed rows.

Legend: T tokens, K top-k, M = T * K routed rows, E experts, H hidden, I intermediate,
S shared-expert width.

Routing is realistic rather than uniform: random hidden states go through the preset's random
router (softmax or DeepSeek's grouped sigmoid), so expert loads carry the natural imbalance of a
random gate. The same routed rows feed every implementation of one case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.config import MoEConfig, QuantConfig
from moeshard.dispatch.base import BackendContext
from moeshard.dispatch.local import LocalBackend
from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.presets import PRESETS, get_preset
from moeshard.quant import QuantizedWeight, quantize_weight, scheme_names
from moeshard.router import Routing, route_tokens
from moeshard.weights import MoEWeights

# Elements quantized or drawn per step: bounds the fp32 temporaries to about 1 GiB each.
CHUNK_ELEMENTS = 2**28


def check_choices(models: tuple[str, ...], quants: tuple[str, ...]) -> None:
    """Refuses a model that is not a preset, or a quantization that is not a registered scheme."""
    for m in models:
        if m not in PRESETS:
            raise ValueError(f"bench: model {m!r} is not one of {sorted(PRESETS)}")
    for q in quants:
        if q not in scheme_names():
            raise ValueError(f"bench: quant {q!r} is not one of {list(scheme_names())}")


@dataclass(frozen=True)
class ModelOnDevice:
    """One preset's block at full size on the GPU, in bf16.

    shell: router (with its bias where the routing kind has one), correction bias and shared
    experts (``gate_up`` / ``down`` are None);
    gate_up: [E, 2I, H]; down: [E, H, I]; gate_up_bias [E, 2I] and down_bias [E, H]: the experts'
    biases where ``cfg.expert_bias`` (gpt-oss), else None.
    """

    name: str
    cfg: MoEConfig
    shell: MoEWeights
    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


def _randn(shape: tuple[int, ...], std: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """bf16 normal(0, std) of ``shape``, drawn in fp32 a slab of leading rows at a time."""
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    per_row = max(1, out[0].numel()) if out.dim() > 1 else 1
    step = max(1, CHUNK_ELEMENTS // per_row)
    for i in range(0, shape[0], step):
        rows = out[i:i + step]
        rows.copy_(torch.randn(rows.shape, generator=gen, device=device) * std)
    return out


def make_model(name: str, device: torch.device, seed: int = 0, size: str = "full") -> ModelOnDevice:
    """The preset's block (full size unless ``size`` says otherwise) with std 1/sqrt(fan_in)
    weights (router 2/sqrt(H), as ``MoEWeights.random``), generated on ``device``."""
    cfg = get_preset(name).config(size, torch.bfloat16)
    E, H, I, S = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.shared_width
    gen = torch.Generator(device=device).manual_seed(seed)
    shared = cfg.has_shared_experts
    shell = MoEWeights(
        gate=_randn((E, H), 2 / H**0.5, gen, device),
        gate_up=None,
        down=None,
        correction_bias=torch.rand(E, generator=gen, device=device) * 0.1 if cfg.use_correction_bias else None,
        shared_gate=_randn((S, H), 1 / H**0.5, gen, device) if shared else None,
        shared_up=_randn((S, H), 1 / H**0.5, gen, device) if shared else None,
        shared_down=_randn((H, S), 1 / S**0.5, gen, device) if shared else None,
        shared_expert_gate=_randn((1, H), 1 / H**0.5, gen, device) if cfg.shared_expert_gate else None,
        gate_bias=_randn((E,), 0.5, gen, device) if cfg.routing_kind.router_bias else None,
    )
    P = cfg.gate_up_size  # 2I gate and up rows, or I up rows for an ungated activation
    gate_up, down = _randn((E, P, H), 1 / H**0.5, gen, device), _randn((E, H, I), 1 / I**0.5, gen, device)
    if not cfg.expert_bias:
        return ModelOnDevice(name, cfg, shell, gate_up, down)
    # Biases of the products' scale (as MoEWeights.random's).
    return ModelOnDevice(name, cfg, shell, gate_up, down, _randn((E, P), 0.5, gen, device),
                         _randn((E, H), 0.5, gen, device))


def _quantize_chunked(w: torch.Tensor, scheme: str) -> QuantizedWeight:
    """``quantize_weight`` a few experts at a time (identical result: every scale is per expert
    or finer), concatenated along E."""
    E, N, K = w.shape
    step = max(1, CHUNK_ELEMENTS // (N * K))
    return QuantizedWeight.cat_experts([quantize_weight(w[i:i + step], scheme) for i in range(0, E, step)])


def experts_for(model: ModelOnDevice, scheme: str) -> ExpertWeights:
    """The routed experts in ``scheme`` (bf16 tensors for "none", shared with ``model``)."""
    biases = (model.gate_up_bias, model.down_bias)  # never quantized
    if scheme == "none":
        return ExpertWeights(model.gate_up, model.down, "none", *biases)
    return ExpertWeights(_quantize_chunked(model.gate_up, scheme), _quantize_chunked(model.down, scheme), scheme,
                         *biases)


def hidden_states(model: ModelOnDevice, tokens: int, seed: int) -> torch.Tensor:
    """bf16 [T, H] standard normal hidden states."""
    gen = torch.Generator(device=model.gate_up.device).manual_seed(seed)
    return torch.randn(tokens, model.cfg.hidden_size, generator=gen, device=model.gate_up.device).to(torch.bfloat16)


def routed_input(model: ModelOnDevice, x: torch.Tensor, quant: QuantConfig) -> tuple[ExpertInput, Routing]:
    """The rows the layer's experts receive for ``x`` under the local backend (quantized before
    dispatch by the backend itself, as in ``MoELayer``), with the routing that produced them. As
    in the layer, the input's x holds T rows with ``repeat = K`` (M = T * K routed rows)."""
    cfg = model.cfg
    routing = route_tokens(x, model.shell.router_weight, cfg, model.shell.correction_bias, model.shell.gate_bias)
    return LocalBackend(BackendContext(cfg, quant)).dispatch(x, routing).input, routing


def expert_flops(rows: int, cfg: MoEConfig) -> int:
    """Multiply-adds x 2 of the routed experts: gate_up [M, H] x [H, 2I] ([H, I] ungated) and down
    [M, I] x [I, H]."""
    return 2 * (cfg.activation_kind.products + 1) * rows * cfg.hidden_size * cfg.intermediate_size


def layer_flops(tokens: int, cfg: MoEConfig) -> int:
    """Routed experts + router + shared experts (+ the shared-expert gate) of one forward."""
    H = cfg.hidden_size
    flops = expert_flops(tokens * cfg.top_k, cfg) + 2 * tokens * H * cfg.num_experts
    flops += 6 * tokens * H * cfg.shared_width + (2 * tokens * H if cfg.shared_expert_gate else 0)
    return flops


def projection_bytes(w: torch.Tensor | QuantizedWeight) -> int:
    """Bytes of one projection of every expert (gate_up or down): its data, scales and global
    scales."""
    tensors = (w.data, w.scale, w.global_scale) if isinstance(w, QuantizedWeight) else (w,)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def bytes_per_expert(experts: ExpertWeights) -> float:
    """Weight bytes one expert's GEMMs read: data, scales and global scales of both projections."""
    return (projection_bytes(experts.gate_up) + projection_bytes(experts.down)) / experts.num_experts


def active_experts(expert_ids: torch.Tensor, num_experts: int) -> int:
    """How many experts receive at least one row (read back once, outside any timed region)."""
    return int((torch.bincount(expert_ids, minlength=num_experts) > 0).sum())
