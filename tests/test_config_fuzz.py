"""Property: any input to a configuration either builds a valid object or raises ValueError naming
a field -- never another exception (TypeError, OverflowError, KeyError, ...), never a value that
is silently read another way (``"false"`` as True, ``Infinity`` as a scale).

Over ``MoEConfig``, ``QuantConfig``, ``ParallelConfig`` (and ``ParallelConfig.parse``) and the
checkpoint config reader ``parse_hf_config`` (config.json -> ``HFMoEModel``).
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeshard.checkpoint.hf_config import parse_hf_config
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig, QuantConfig
from moeshard.parallel.config import ParallelConfig
from moeshard.quant import scheme_names
from moeshard.validate import MAX_DIM

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Hostile values of every JSON / Python kind: huge and negative ints, NaN/Inf/1e39, bools, strings
# that look like numbers or booleans, containers, None.
HOSTILE = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from([0, 1, 2, 3, 4, 8, 16, 128, 2**31 - 1, 2**31, 10**10, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e39, 1e-300, 0.5, 2.5, 1.5]),
    st.sampled_from(["false", "true", "8", "1.5", "", "silu", "gelu", "sigmoid", "softmax", "bf16", "bfloat16",
                     "fp8_block", "none", "[/x/pair.cc:553]"]),
    st.text(max_size=6),
    st.lists(st.integers(min_value=-3, max_value=300), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _named_field(message: str, owner: str, fields: set[str]) -> bool:
    return any(f"{owner}.{name}" in message for name in fields)


# -- MoEConfig ----------------------------------------------------------------------------------
MOE_VALID = dict(num_experts=8, top_k=2, hidden_size=16, intermediate_size=32, activation="silu", scoring="softmax",
                 renormalize=True, n_group=1, topk_group=1, routed_scaling_factor=1.0, use_correction_bias=False,
                 num_shared_experts=0, shared_intermediate_size=0, shared_expert_gate=False, dtype=torch.float32)
MOE_FIELDS = {f.name for f in dataclasses.fields(MoEConfig)}


@st.composite
def moe_kwargs(draw):
    extra = st.sampled_from([torch.bfloat16, torch.float16, torch.int8, "float32", "fp16", "sigmoid", "gelu"])
    return {name: draw(st.one_of(st.just(valid), HOSTILE, extra)) for name, valid in MOE_VALID.items()}


@SETTINGS
@given(moe_kwargs())
def test_moe_config_builds_or_names_a_field(kwargs):
    try:
        cfg = MoEConfig(**kwargs)
    except ValueError as exc:
        assert _named_field(str(exc), "MoEConfig", MOE_FIELDS), str(exc)
        return
    for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "n_group", "topk_group",
                 "num_shared_experts", "shared_intermediate_size"):
        value = getattr(cfg, name)
        assert type(value) is int and 0 <= value <= MAX_DIM, (name, value)
    for name in ("renormalize", "use_correction_bias", "shared_expert_gate"):
        assert type(getattr(cfg, name)) is bool, name
    assert type(cfg.routed_scaling_factor) is float
    assert math.isfinite(cfg.routed_scaling_factor) and 0 < cfg.routed_scaling_factor <= MAX_ROUTED_SCALING
    assert cfg.dtype in (torch.float32, torch.bfloat16, torch.float16)


# -- QuantConfig --------------------------------------------------------------------------------
@SETTINGS
@given(st.one_of(st.sampled_from(scheme_names()), HOSTILE), st.one_of(st.booleans(), HOSTILE))
def test_quant_config_builds_or_names_a_field(scheme, defer):
    try:
        q = QuantConfig(scheme, defer)
    except ValueError as exc:
        assert _named_field(str(exc), "QuantConfig", {"scheme", "defer_input_quant"}), str(exc)
        return
    assert q.scheme in scheme_names() and type(q.defer_input_quant) is bool


# -- ParallelConfig -----------------------------------------------------------------------------
@SETTINGS
@given(st.one_of(st.integers(1, 4), HOSTILE), st.one_of(st.integers(1, 4), HOSTILE), st.one_of(st.booleans(), HOSTILE))
def test_parallel_config_builds_or_names_a_field(dp, tp, ep):
    try:
        p = ParallelConfig(dp, tp, ep)
    except ValueError as exc:
        assert _named_field(str(exc), "ParallelConfig", {"dp", "tp", "enable_ep"}), str(exc)
        return
    assert type(p.dp) is int and type(p.tp) is int and type(p.enable_ep) is bool
    assert ParallelConfig.parse(p.name) == p


LAYOUT_TEXT = st.one_of(
    st.text(max_size=16),
    st.builds(lambda d, t, e: f"dp{d}-tp{t}-{e}", st.integers(0, 10**25), st.integers(0, 10**25),
              st.sampled_from(["ep", "noep", "bogus", ""])),
    st.builds(lambda d, t, e: f"{d},{t},{e}", st.integers(0, 10**25), st.integers(0, 10**25),
              st.sampled_from(["on", "off", "x"])),
)


@SETTINGS
@given(st.one_of(LAYOUT_TEXT, HOSTILE))
def test_layout_parse_builds_or_names_the_text(text):
    try:
        p = ParallelConfig.parse(text)
    except ValueError as exc:
        assert repr(text) in str(exc), str(exc)
        return
    assert ParallelConfig.parse(p.name) == p


# -- the checkpoint config reader ---------------------------------------------------------------
BASES = {
    "mixtral": {"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 32,
                "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_hidden_layers": 4, "hidden_size": 16, "moe_intermediate_size": 32,
                  "num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 16,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [0]},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 16, "moe_intermediate_size": 32,
                  "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 2},
    "deepseek_v3": {"model_type": "deepseek_v3", "num_hidden_layers": 3, "hidden_size": 16,
                    "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                    "topk_group": 1, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "norm_topk_prob": True},
}
OTHER_KEYS = ["hidden_act", "scoring_func", "topk_method", "dtype", "torch_dtype", "quantization_config",
              "moe_layer_freq", "num_experts", "num_local_experts", "n_routed_experts", "mlp_only_layers",
              "decoder_sparse_step", "norm_topk_prob", "routed_scaling_factor", "model_type"]
ALL_KEYS = sorted({k for base in BASES.values() for k in base} | set(OTHER_KEYS))
FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
CONFIG_VALUE = st.one_of(HOSTILE, st.just(FP8), st.fixed_dictionaries({
    "quant_method": st.one_of(st.just("fp8"), HOSTILE), "weight_block_size": st.one_of(st.just([128, 128]), HOSTILE),
    "activation_scheme": st.one_of(st.just("dynamic"), HOSTILE)}))


@st.composite
def hf_configs(draw):
    raw = dict(BASES[draw(st.sampled_from(sorted(BASES)))])
    changed = set()
    for key in draw(st.lists(st.sampled_from(ALL_KEYS), max_size=4, unique=True)):
        changed.add(key)
        if draw(st.booleans()) and key in raw:
            del raw[key]
        else:
            raw[key] = draw(CONFIG_VALUE)
    return raw, changed


def _names_a_config_field(message: str, changed: set[str]) -> bool:
    if "MoEConfig." in message:  # a value of the right type that the block refuses (e.g. top_k > experts)
        return True
    return any(re.search(rf"\b{re.escape(key)}\b", message) for key in changed | {"model_type"})


@SETTINGS
@given(hf_configs(), st.integers(min_value=-2, max_value=10**12))
def test_hf_config_reader_builds_or_names_a_field(raw_changed, layer):
    raw, changed = raw_changed
    try:
        model = parse_hf_config(raw)
    except ValueError as exc:
        assert _names_a_config_field(str(exc), changed), (str(exc), changed)
        return
    cfg = model.moe_config()
    assert isinstance(cfg, MoEConfig) and type(model.num_layers) is int and 1 <= model.num_layers <= MAX_DIM
    try:  # a lookup of any layer answers at once, whatever num_hidden_layers claims
        model.check_layer(layer)
    except ValueError as exc:
        assert "layer" in str(exc)


def test_hf_config_reader_refuses_each_reported_value():
    """The values of the hostile-user report, each refused with the field named."""
    ds = BASES["deepseek_v3"]
    for key, value, words in [
        ("routed_scaling_factor", float("inf"), "routed_scaling_factor must be a finite number"),
        ("routed_scaling_factor", 1e39, "routed_scaling_factor must be a finite number"),
        ("norm_topk_prob", "false", "norm_topk_prob must be true or false"),
        ("n_shared_experts", 1.5, "n_shared_experts must be an integer"),
        ("moe_intermediate_size", "8", "moe_intermediate_size must be an integer"),
        ("num_hidden_layers", 10**10, f"num_hidden_layers must be at most {MAX_DIM}"),
        ("n_routed_experts", 10**9 * 8, f"n_routed_experts must be at most {MAX_DIM}"),
    ]:
        try:
            parse_hf_config({**ds, key: value})
        except ValueError as exc:
            assert words in str(exc), str(exc)
        else:
            raise AssertionError(f"{key}={value!r} was accepted")
    qwen = BASES["qwen2_moe"]
    for key, value, words in [("shared_expert_intermediate_size", "8", "shared_expert_intermediate_size must be"),
                              ("mlp_only_layers", "0", "mlp_only_layers must be a list"),
                              ("norm_topk_prob", 0, "norm_topk_prob must be true or false")]:
        try:
            parse_hf_config({**qwen, key: value})
        except ValueError as exc:
            assert words in str(exc), str(exc)
        else:
            raise AssertionError(f"{key}={value!r} was accepted")


def test_a_huge_layer_count_costs_nothing():
    """num_hidden_layers near the bound: reading the config and looking up layers is instant."""
    import time
    start = time.monotonic()
    model = parse_hf_config({**BASES["deepseek_v3"], "num_hidden_layers": MAX_DIM, "moe_layer_freq": 10**6})
    model.check_layer(MAX_DIM - 1 - (MAX_DIM - 1) % 10**6)
    try:
        model.check_layer(5)
    except ValueError as exc:
        assert "MoE layers: none among the first 100000" in str(exc)  # the listing scans a bounded prefix
    else:
        raise AssertionError("layer 5 is dense")
    # The families reading first_k_dense_replace and an integer moe_layer_freq decide per layer too.
    shape = {"hidden_size": 32, "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
             "num_hidden_layers": MAX_DIM, "moe_layer_freq": 3, "first_k_dense_replace": 1}
    for model_type in ("axk2", "dots3_note_text"):
        dense = parse_hf_config({"model_type": model_type, **shape}).dense_layers
        assert (0 in dense, 3 in dense, 4 in dense, MAX_DIM - 1 in dense) == (True, False, True, MAX_DIM % 3 != 1)
    assert time.monotonic() - start < 5
