"""The softmax-routed families beyond the built-in four, each a whole tiny random transformers
model built from transformers' own config class and saved with ``save_pretrained``.

Per family: at (1,1) the logits of every greedy step equal transformers' (fp32, 1e-5) and so do
the ids; under EP2 (dp2-tp1-ep), SP (dp1-tp2-ep), TP2 (dp1-tp2-noep) and dp2-tp2-ep on CPU ranks
the greedy ids equal transformers' alone. One spawn per world size (2 and 4) runs every family's
cases of that size; the layout cases of a family whose block takes the path of another family's
(``SAME_PATH_AS``) run in a spawn of their own in make test-slow. A family whose config class the
installed transformers lacks is skipped.

In bfloat16 every block routes transformers' own router inputs to its experts from logits equal to
its router's bit for bit (each family's ``router_dtype``: fp32 for DeepSeek-V2, Hunyuan and ERNIE
4.5, the model dtype for the others), and the greedy ids of ``BF16_FAMILIES`` equal transformers'
at (1,1) and under EP2 (in the 2-rank spawn; with fp32 logits Phi-3.5-MoE's did not).

The random models are nudged where an untouched random init would hide the family's routing:
ERNIE 4.5's selection bias is random (transformers initialises it to zeros), Phi-3.5-MoE's
router rows are close to each other, so that sparsemixer's window often holds more than the
picked expert and its masked softmax matters, JetMoE's bias on the block's output is random
(zeros) and so are Gemma 4's router scales (ones).

Gemma 4's decoder layer routes itself, and so do the blocks of ZAYA (an MLP router with a skip
class), LongCat-Flash (zero-computation experts) and Inkling's text model (sigmoid-routed, its
router weighing the shared experts too); their routers are transformers' own, so instead of
router parity their test follows the ids and weights from that router into moeshard's experts,
and ``moeshard run``, which routes one block alone, refuses Gemma 4.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from generate_worlds import GenerateWorlds
from router_parity import bf16_router_parity, swapped_logits

from moeshard.checkpoint.families import FAMILIES as DESCRIPTORS
from moeshard.checkpoint.hf_config import parse_hf_config
from moeshard.jobs.generate import (
    GenerateSpec,
    compare_generations,
    generate_rank,
    plan_generate,
    reference_generate,
)
from moeshard.parallel.config import ParallelConfig

tf = pytest.importorskip("transformers")
from huggingface_hub.errors import StrictDataclassError  # noqa: E402 - a config class's own validation

SPAWN_TIMEOUT_S = 300.0
NEW_TOKENS = 6
PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11,))
FP32_ATOL = 1e-5
SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# Gated-delta-net (linear attention) layers of the Qwen3-Next kind, sized for SMALL.
LINEAR_ATTENTION = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, head_dim=8)
# model_type -> the config class's arguments beyond SMALL (4 or 8 experts: EP over 2 and 4 ranks).
CONFIGS = {
    "olmoe": dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    "flex_olmo": dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "mellum": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8,
                   mlp_layer_types=["dense", "sparse"]),
    "minimax": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8, block_size=4,
                    layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_dt_rank=4),
    "qwen3_next": dict(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       num_experts=4, num_experts_per_tok=2, **LINEAR_ATTENTION),
    "qwen3_5_moe_text": dict(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                             num_experts=4, num_experts_per_tok=2, **LINEAR_ATTENTION),
    "deepseek_v2": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                        first_k_dense_replace=1, n_shared_experts=1, topk_method="group_limited_greedy", n_group=4,
                        topk_group=2, routed_scaling_factor=2.0, q_lora_rank=None, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4),
    "hunyuan_v1_moe": dict(intermediate_size=16, num_experts=4, moe_topk=2, head_dim=8,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "ernie4_5_moe": dict(intermediate_size=48, moe_intermediate_size=16, moe_num_experts=4, moe_k=2,
                         moe_num_shared_experts=1),
    "granitemoe": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "granitemoeshared": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=24),
    "granitemoehybrid": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=24, layer_types=["mamba", "attention"], mamba_n_heads=4,
                             mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1),
    "phimoe": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    # The decoder layer routes (its router on its own norm and scales) and calls its experts.
    "gemma4_text": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, top_k_experts=2,
                        enable_moe_block=True, head_dim=8, hidden_size_per_layer_input=0),
    # A learned bias on the block's output; attention as a mixture of heads (kv_channels: head_dim).
    "jetmoe": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, kv_channels=8),
    # Gated delta net and attention layers; the checkpoint fuses the delta net's input projections.
    "lara_mini": dict(moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
                      num_experts_per_tok=2, **LINEAR_ATTENTION),
    # DBRX's own names for SMALL's sizes (given as hidden_size, transformers 5.24 sizes the experts
    # by the default d_model); its attention reads rope_theta from attn_config and clamps by clip_qkv.
    "dbrx": dict(d_model=32, n_layers=2, n_heads=4, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2)),
    # Granite with sliding-window attention and sinks; its checkpoint keeps the model's names.
    # (Appended last: a family's seed is its place here, so the others keep their random models.)
    "granitemoe_swa": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=0),
    # Aria's text model: Granite's routing, experts stored transposed as fc1 / fc2, a shared MLP.
    "aria_text": dict(intermediate_size=16, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1, head_dim=8),
    # Qwen4-Exp: Qwen3.5's block without renormalization here, inside hyper-connections, beside a
    # gated-delta-net layer and an indexed-attention layer (no per-layer n-gram embeddings).
    "qwen4_exp_text": dict(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                           num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, hc_count=2, hc_lowrank=8,
                           layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2,
                           indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4,
                           **{k: v for k, v in LINEAR_ATTENTION.items() if k != "layer_types"}),
    # ZAYA: the block routes itself with an MLP router that carries state from layer to layer and
    # has a skip class; top-1, the only choice its config takes.
    "zaya": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=1, head_dim=8, router_hidden_size=16),
    # LongCat-Flash: two zero-computation experts beside the four routed ones, picked by the block's
    # own router; MLA attention, two sublayers per decoder layer (num_layers counts decoder layers).
    "longcat_flash": dict(num_layers=2, n_routed_experts=4, zero_expert_num=2, moe_topk=2, expert_ffn_hidden_size=16,
                          ffn_hidden_size=32, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                          v_head_dim=8, head_dim=8, routed_scaling_factor=2.0),
    # Inkling's text model: its router weighs the shared expert per token too (the block routes
    # itself); full and sliding attention with relative logits, short convolutions, a dense layer 0.
    "inkling_text": dict(head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
                         sliding_window_size=8, d_rel=4, rel_extent=16, intermediate_size=48, moe_intermediate_size=16,
                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                         mlp_layer_types=["dense", "sparse"]),
    # Nemotron-H: Mamba-2, attention and two MoE layers, whose ungated relu^2 experts work in a latent
    # space of 16 columns (the block projects its rows in and out); DeepSeek-V3's sigmoid routing.
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"], intermediate_size=48,
                       head_dim=8, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=8,
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=24, moe_latent_size=16, routed_scaling_factor=2.0),
}
# SMALL's fields a config class takes under names of its own (in CONFIGS).
OWN_NAMES = {"dbrx": ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"),
             "longcat_flash": ("num_hidden_layers", "num_key_value_heads")}  # MLA: a key and value per head
FAMILIES = tuple(CONFIGS)
# Families whose bf16 greedy ids are compared with transformers' at (1,1) and under EP2 (routers in
# the model dtype; the others' bf16 ids differ where two next-token logits tie or are one bf16 step
# apart, or an exact tie of router logits is broken another way: docs/transformers.md).
BF16_FAMILIES = ("granitemoe", "qwen3_5_moe_text", "phimoe", "dbrx", "gemma4_text")
BF16_EP2 = ParallelConfig(2, 1, True)
# Families whose MoE block takes the path of a family make test runs under layouts and in memory
# (the same reader output, names, routing kind and shared-expert kind; a layout's own path is
# the same for every family): their layout and in-memory cases run in make test-slow.
# family -> that sibling (test_transformers_integration runs the built-in four).
SAME_PATH_AS = {
    "olmoe": "qwen3_moe",  # softmax, norm_topk_prob, mlp.gate, per-expert gate/up/down
    "flex_olmo": "qwen3_moe",
    "mellum": "qwen3_moe",  # its dense first layer is transformers' (layer 0 is never an MoEBlock)
    "minimax": "mixtral",  # Mixtral's descriptor under another model_type
    "qwen3_next": "qwen2_moe",  # Qwen2-MoE's descriptor, gated shared expert
    "qwen3_5_moe_text": "qwen2_moe",
    "qwen4_exp_text": "qwen2_moe",  # norm_topk_prob false: qwen2_moe's own default
    "granitemoeshared": "granitemoe",  # the shared MLP beside the block is transformers'
    "granitemoehybrid": "granitemoe",
    "granitemoe_swa": "granitemoe",  # Granite's block, stored under the model's own names
    "lara_mini": "hunyuan_v1_moe",  # softmax of fp32 logits, renormalized, an ungated shared MLP
    # Routing given by transformers' router, cut under SP, to experts with no router of their own
    # (longcat_flash, whose zero-computation term is added after the layer, stays in make test).
    "zaya": "gemma4_text",
    "inkling_text": "gemma4_text",
}


def _config(model_type: str):
    """transformers' config of the tiny model, or None where the installed transformers lacks the
    class, or has one of another shape that refuses these arguments (transformers 5.17's
    qwen4_exp_text has no indexed attention)."""
    try:
        small = {k: v for k, v in SMALL.items() if k not in OWN_NAMES.get(model_type, ())}
        return tf.AutoConfig.for_model(model_type, **{**small, **CONFIGS[model_type]})
    except StrictDataclassError:
        return None
    except ValueError as exc:
        if str(exc).startswith("Unrecognized model identifier"):
            return None
        raise


def _random_selection_bias(model) -> None:
    """ERNIE 4.5: a selection bias of the size of the probabilities' spread (init gives zeros)."""
    g = torch.Generator().manual_seed(7)
    for name, bias in model.named_parameters():
        if name.endswith("moe_statics.e_score_correction_bias"):
            with torch.no_grad():
                bias.copy_(torch.rand(bias.shape, generator=g) / 4)


def _close_router_rows(model) -> None:
    """Phi-3.5-MoE: router rows = one shared row + small noise, so logits lie close together."""
    g = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        w = layer.mlp.router.weight
        with torch.no_grad():
            w.copy_(torch.randn(1, w.shape[1], generator=g) + 0.01 * torch.randn(w.shape, generator=g))


def _random_output_bias(model) -> None:
    """JetMoE: an output bias of the size of the block's output (init gives zeros)."""
    g = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        with torch.no_grad():
            layer.mlp.bias.copy_(torch.randn(layer.mlp.bias.shape, generator=g) / 2)


def _random_router_scales(model) -> None:
    """Gemma 4: the router's input scale and per-expert weight scale away from their init (ones)."""
    g = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        with torch.no_grad():
            layer.router.scale.copy_(1 + torch.randn(layer.router.scale.shape, generator=g) / 3)
            layer.router.per_expert_scale.copy_(0.5 + torch.rand(layer.router.per_expert_scale.shape, generator=g))


def _skipping_router(model) -> None:
    """ZAYA: the router's output projection at std 10 / sqrt(fan-in), so that its probabilities vary
    by token (init leaves them about uniform), the experts' balancing biases in [-1.01, -0.99),
    as the skip class's fixed -1 (init gives zeros, so that no token would skip), and the router
    state's scale away from ones."""
    g = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        gate = layer.mlp.gate
        out = gate.router_mlp.out_proj.weight
        with torch.no_grad():
            out.copy_(torch.randn(out.shape, generator=g) * 10 / out.shape[1] ** 0.5)
            experts = gate.balancing_biases.shape[0] - 1
            gate.balancing_biases[:experts] = torch.rand(experts, generator=g) * 0.02 - 1.01
            if hasattr(gate, "router_states_scale"):
                gate.router_states_scale.copy_(0.5 + torch.rand(gate.router_states_scale.shape, generator=g))


PREPARE = {"ernie4_5_moe": _random_selection_bias, "phimoe": _close_router_rows, "jetmoe": _random_output_bias,
           "gemma4_text": _random_router_scales, "zaya": _skipping_router}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str | None]:
    """model_type -> directory of its tiny random model (None: not in this transformers)."""
    root = tmp_path_factory.mktemp("softmax-families")
    out: dict[str, str | None] = {}
    # Each model is seeded by its family's place in CONFIGS: a new family goes at the end, so that
    # the others keep their random models (some bf16 cases sit near ties).
    for seed, name in enumerate(FAMILIES):
        cfg = _config(name)
        if cfg is None:
            out[name] = None
            continue
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(cfg).eval()
        if name in PREPARE:
            PREPARE[name](model)
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def _dir(models, family: str) -> str:
    if models[family] is None:
        pytest.skip(f"transformers {tf.__version__} has no config class for model_type {family!r} "
                    f"that takes the tiny model's arguments")
    return models[family]


def _plan(model_dir: str, layout: ParallelConfig | None = None, dtype: str | None = None):
    return plan_generate(GenerateSpec(model_dir, PROMPTS, NEW_TOKENS, layout or ParallelConfig(), compare=True,
                                      dtype=dtype))


def _check_bf16_ids(plan, results, reference) -> None:
    """bf16: the same greedy ids as transformers' bf16 generate (the logits differ by rounding)."""
    for r in results:
        assert not isinstance(r, dict), f"rank raised: {r}"
    c = compare_generations(plan, results, reference(plan))
    assert all(c.same_ids), f"bf16 {plan.parallel.name} {plan.model_type}: ids differ at steps {c.first_difference}"


@pytest.fixture(scope="module")
def reference():
    """transformers alone for a plan's batches, computed once per (model, batches)."""
    cache: dict[tuple, list] = {}

    def get(plan):
        key = (plan.spec.model_dir, plan.dtype, plan.dp_prompts)
        if key not in cache:
            cache[key] = reference_generate(plan)
        return cache[key]

    return get


# -- one rank: logits -------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_logits_equal_transformers(models, reference, family):
    plan = _plan(_dir(models, family))
    assert plan.model_type == family
    result = generate_rank(plan, None)
    c = compare_generations(plan, [result], reference(plan))
    assert all(c.same_ids), f"{family}: ids differ at steps {c.first_difference}"
    assert max(c.step_max_abs) <= FP32_ATOL, f"{family}: logits off by {c.step_max_abs}"


@pytest.mark.parametrize("family", [pytest.param(f, marks=[pytest.mark.slow] if f in SAME_PATH_AS else [])
                                    for f in FAMILIES])
def test_in_memory_model_equals_transformers(models, family):
    """shard_moe_blocks on the model transformers loaded (the model's own names, not the
    checkpoint's): the forward's logits equal the plain model's, and every MoE layer is an MoEBlock."""
    from moeshard.integrations.given_routing import MoEExperts
    from moeshard.integrations.transformers import MoEBlock, find_moe_blocks, moe_model_info, shard_moe_blocks

    model_dir = _dir(models, family)
    ids = torch.tensor([list(PROMPTS[0]), [1, 2, 3, 4, 5]])
    want = tf.AutoModelForCausalLM.from_pretrained(model_dir).eval()(ids).logits
    model = shard_moe_blocks(tf.AutoModelForCausalLM.from_pretrained(model_dir).eval())
    with torch.no_grad():
        got = model(ids).logits
    assert torch.allclose(got, want, atol=FP32_ATOL, rtol=0), (got - want).abs().max()
    info = moe_model_info(model)
    moe = [i for i in range(info.num_layers) if i not in info.dense_layers]
    assert moe and sorted(m.layer_index for m in model.modules() if isinstance(m, (MoEBlock, MoEExperts))) == moe
    with pytest.raises(ValueError, match="already a moeshard MoE(Block|Experts)"):
        find_moe_blocks(model)


def test_aria_experts_held_under_the_checkpoints_names_load_in_memory(models):
    """transformers before 5.24 holds Aria's experts as the checkpoint stores them
    (``experts.fc1.weight`` [E, H, 2I], ``experts.fc2.weight`` [E, I, H]): shard_moe_blocks reads
    them under those names (``ModelFamily.stored_names``), with the same logits."""
    from torch import nn

    from moeshard.integrations.transformers import shard_moe_blocks

    model_dir = _dir(models, "aria_text")
    ids = torch.tensor([list(PROMPTS[0]), [1, 2, 3, 4, 5]])
    want = tf.AutoModelForCausalLM.from_pretrained(model_dir).eval()(ids).logits
    older = tf.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for layer in older.model.layers:
        experts, held = layer.mlp.experts, nn.Module()
        if not hasattr(experts, "gate_up_proj"):  # this transformers holds them so already
            assert isinstance(experts.get_parameter("fc1.weight"), torch.Tensor)
            continue
        for name, tensor in (("fc1", experts.gate_up_proj), ("fc2", experts.down_proj)):
            part = nn.Module()
            part.weight = nn.Parameter(tensor.detach().clone())
            held.add_module(name, part)
        layer.mlp.experts = held  # the names 5.17 gives them; its forward is moeshard's after the swap
    with torch.no_grad():
        got = shard_moe_blocks(older)(ids).logits
    assert torch.allclose(got, want, atol=FP32_ATOL, rtol=0), (got - want).abs().max()


def test_the_nudges_reach_the_routing(models):
    """The ERNIE selection bias changes which experts are picked, and Phi-3.5-MoE's sparsemixer
    gives weights below 1 (its window holds more than the pick) for some tokens: the parity
    above covers those parts of the routing, not only their degenerate cases."""
    from moeshard.integrations.transformers import load_sharded_model
    from moeshard.router import route, router_logits

    x = torch.randn(64, SMALL["hidden_size"], generator=torch.Generator().manual_seed(3))
    checked = 0
    for family in ("ernie4_5_moe", "phimoe"):
        if models[family] is None:
            continue
        block = load_sharded_model(models[family]).model.layers[1].mlp
        r = block.route(x)
        if family == "ernie4_5_moe":
            unbiased = route(router_logits(x, block.gate.weight, block.cfg.router_dtype), block.cfg,
                             torch.zeros(block.cfg.num_experts)).topk_ids
            assert (r.topk_ids != unbiased).any()
        else:
            assert (r.topk_weights < 0.99).any() and (r.topk_weights > 0.99).any()
        checked += 1
    if not checked:
        pytest.skip(f"transformers {tf.__version__} has neither ernie4_5_moe nor phimoe")


@pytest.mark.parametrize("family", [f for f in FAMILIES if not DESCRIPTORS[f].experts_only])
def test_bf16_router_is_transformers_router(models, family):
    """bf16, on transformers' own router inputs: moeshard's logits are its router's bit for bit
    and its experts the same (ties aside, ``router_parity``); for a family whose router computes
    in the model dtype, fp32 logits would differ, so the test sees the precision. (Gemma 4's
    decoder layer routes with transformers' own router: ``test_given_routing_reaches_the_experts``.)"""
    parity = bf16_router_parity(tf, _dir(models, family))
    assert parity.logits_differ == parity.ids_differ == parity.biases_differ == 0, parity
    assert (parity.fp32_logits_differ > 0) == (DESCRIPTORS[family].router_dtype == "model"), parity


# family -> (the module that holds the router and the experts, relative to the decoder layer; the
# router's attribute there; its class): the families whose transformers router routes (``experts_only``).
GIVEN_ROUTING = {"gemma4_text": ("", "router", "Gemma4TextRouter"), "zaya": ("mlp", "gate", "ZayaRouter"),
                 "longcat_flash": ("mlp", "router", "LongcatFlashTopkRouter"),
                 "inkling_text": ("mlp", "gate", "InklingTopkRouter"),
                 "nemotron_h": ("mixer", "gate", "NemotronHTopkRouter")}


@pytest.mark.parametrize("family", GIVEN_ROUTING)
def test_given_routing_reaches_the_experts(models, family):
    """In bfloat16 the decoder layers (Gemma 4) or blocks (ZAYA) keep transformers' router, and
    moeshard's experts get exactly the ids and weights it returned, for every row, in every MoE
    layer; the layer's output is the weighted sum of those experts (transformers' own experts on
    the same routing, within bf16's tolerance of one rounding). ZAYA's MLP router has no [E, H]
    weight, so the layer holds no router of its own; some of its rows pick the skip class, which
    reaches the experts as expert 0 with weight 0. LongCat-Flash's router picks some rows'
    zero-computation experts (ids E and up), whose term the experts add. Both kinds of pick go
    through the layer as empty picks: the experts' kernel is handed the routed picks only, the
    others as padding rows (id -1)."""
    from moeshard.integrations.given_routing import MoEExperts
    from moeshard.integrations.transformers import load_sharded_model

    holder, router_name, router_class = GIVEN_ROUTING[family]
    model = load_sharded_model(_dir(models, family), dtype="bfloat16")
    plain = tf.AutoModelForCausalLM.from_pretrained(_dir(models, family), dtype=torch.bfloat16).eval()

    def parts(layer):
        block = layer.get_submodule(holder)
        return getattr(block, router_name), block.experts

    moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.get_submodule(holder), "experts")]
    routed, handed, theirs, kernel_ids = {}, {}, {}, {}
    hooks = []
    for index in moe:
        router, experts = parts(model.model.layers[index])
        assert isinstance(experts, MoEExperts) and type(router).__name__ == router_class
        assert not hasattr(experts, "gate")  # the router is transformers'; the layer holds none
        hooks.append(router.register_forward_hook(lambda _m, _a, out, i=index: routed.__setitem__(i, out)))
        hooks.append(experts.register_forward_hook(lambda _m, args, out, i=index: handed.__setitem__(i, (args, out))))
        experts.kernel = _recording(experts.kernel, kernel_ids.setdefault(index, []))
    for index in moe:
        hooks.append(parts(plain.model.layers[index])[1].register_forward_hook(
            lambda m, args, out, i=index: theirs.__setitem__(i, (m, out))))
    ids = torch.tensor([list(PROMPTS[0]), [1, 2, 3, 4, 5]])
    with torch.no_grad():
        model(ids)
        plain(ids)
    for hook in hooks:
        hook.remove()
    assert moe and sorted(handed) == sorted(routed) == moe, (sorted(handed), sorted(routed), moe)
    for index, ((rows, top_ids, weights), out) in handed.items():
        # The router's ids and weights, wherever its output tuple keeps them (LongCat-Flash's router
        # returns (weights, ids) under transformers 5.17, (logits, weights, ids) under 5.24).
        ids_out = next(t for t in routed[index] if not t.is_floating_point())
        weights_out = next(t for t in routed[index] if t.is_floating_point() and t.shape == ids_out.shape)
        assert torch.equal(top_ids, ids_out) and torch.equal(weights, weights_out)
        experts = theirs[index][0]
        with torch.no_grad():  # transformers' experts on moeshard's inputs: the same sum, rounded per expert
            want = experts(rows, top_ids, weights)
        assert torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2), (out - want).abs().max()
        # A pick of weight 0 (a skip, a zero-computation expert) counts in no expert's load.
        layer_experts = parts(model.model.layers[index])[1]
        real = (weights != 0) & (top_ids < layer_experts.cfg.num_experts)
        assert int(layer_experts.expert_loads().sum()) == int(real.sum()), (index, layer_experts.expert_loads())
        if family in ("zaya", "longcat_flash"):  # the others' picks all reach an expert
            (seen,) = kernel_ids[index]
            assert torch.equal(seen, torch.where(real, top_ids, -1).reshape(-1)), index
    picks = sum(i.numel() for (_rows, i, _w), _out in handed.values())
    if family == "zaya":
        skipped = sum(int(((w == 0) & (i == 0)).sum()) for (_rows, i, w), _out in handed.values())
        assert 0 < skipped < picks, skipped
    if family == "longcat_flash":  # ids past the routed experts pick a zero-computation one
        identity = sum(int((i >= model.config.n_routed_experts).sum()) for (_rows, i, _w), _out in handed.values())
        assert 0 < identity < picks, identity


def _recording(kernel, seen: list):
    """``kernel`` (the layer's experts) keeping each call's expert ids [M] in ``seen``."""

    def run(inp, weights):
        seen.append(inp.expert_ids.clone())
        return kernel(inp, weights)

    return run


def test_run_refuses_a_family_that_routes_in_its_decoder_layer(models, capsys):
    """``moeshard run`` routes one block alone: Gemma 4's router input is not the experts', so it
    refuses, exit 2, naming the model type, before any rank starts."""
    from moeshard.cli import main

    assert main(["run", "--model", _dir(models, "gemma4_text"), "--layer", "0", "--tokens", "4"]) == 2
    assert "model_type 'gemma4_text' routes with transformers' router" in capsys.readouterr().err


@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_bf16_one_rank_generates_what_transformers_generates(models, reference, family):
    plan = _plan(_dir(models, family), dtype="bfloat16")
    _check_bf16_ids(plan, [generate_rank(plan, None)], reference)


# -- several ranks: one spawn per world size --------------------------------------------------
LAYOUTS = {2: (ParallelConfig(2, 1, True), ParallelConfig(1, 2, True), ParallelConfig(1, 2, False)),
           4: (ParallelConfig(2, 2, True),)}


@pytest.fixture(scope="module")
def world(models):
    """(world size, slow) -> {(layout name, dtype, family): (plan, per-rank results)} for the
    families present whose layout cases are (slow) or are not (fast) in ``SAME_PATH_AS``, in
    float32; the fast 2-rank world also runs ``BF16_FAMILIES`` under EP2 in bfloat16."""

    def cases(key: tuple[int, bool]):
        ws, slow = key
        cases = [(layout, "float32", f) for layout in LAYOUTS[ws] for f in FAMILIES
                 if models[f] is not None and (f in SAME_PATH_AS) == slow]
        if ws == BF16_EP2.world_size and not slow:
            cases += [(BF16_EP2, "bfloat16", f) for f in BF16_FAMILIES if models[f] is not None]
        return ([(layout.name, dtype, f) for layout, dtype, f in cases],
                [_plan(models[f], layout, dtype) for layout, dtype, f in cases])

    worlds = GenerateWorlds(cases, SPAWN_TIMEOUT_S)
    return lambda ws, slow: worlds((ws, slow))


def _layout_params():
    # dp2-tp2-ep (4 ranks) runs in make test-slow: make test proves that layout for the built-in
    # families (tests/test_transformers_integration.py), and each family's own routing under EP
    # and TP in the 2-rank spawn.
    return [pytest.param(ws, layout.name, f, id=f"{layout.name}-{f}",
                         marks=[pytest.mark.slow] if f in SAME_PATH_AS or ws == 4 else [])
            for ws, layouts in LAYOUTS.items() for layout in layouts for f in FAMILIES]


@pytest.mark.parametrize("ws, layout, family", _layout_params())
def test_layout_generates_what_transformers_generates(models, world, reference, ws, layout, family):
    _dir(models, family)
    plan, results = world(ws, family in SAME_PATH_AS)[(layout, "float32", family)]
    for r in results:
        assert not isinstance(r, dict), f"rank raised: {r}"
        assert r.tp_disagreements == 0
    c = compare_generations(plan, results, reference(plan))
    assert all(c.same_ids), f"{layout} {family}: ids differ at steps {c.first_difference}"
    assert c.within_tolerance, f"{layout} {family}: logits off by {c.step_max_abs}"
    p = plan.parallel
    if p.enable_ep:  # each rank holds only its experts
        per = plan.cfg.num_experts // p.world_size
        assert [r.experts for r in results] == [(r * per, (r + 1) * per) for r in range(ws)]
    else:  # each TP rank its slice of I
        width = plan.cfg.intermediate_size // p.tp
        assert [r.intermediate for r in results] == [(t * width, (t + 1) * width) for t in range(p.tp)] * p.dp


@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_bf16_ep2_generates_what_transformers_generates(models, world, reference, family):
    _dir(models, family)
    plan, results = world(BF16_EP2.world_size, False)[(BF16_EP2.name, "bfloat16", family)]
    _check_bf16_ids(plan, results, reference)


# -- what config.json readers refuse ---------------------------------------------------------
def _raw(models, family: str, **changes) -> dict:
    """The family's saved config.json with ``changes``."""
    return {**json.loads((Path(_dir(models, family)) / "config.json").read_text()), **changes}


@pytest.mark.parametrize("family, changes, message", [
    ("ernie4_5_moe", {"use_bias": True}, "use_bias=true gives the shared experts' projections biases"),
    ("ernie4_5_moe", {"moe_norm_min": 1e-6}, "moe_norm_min=1e-06; routing kind 'softmax_bias' renormalizes with "
                                             "the floor 1e-12"),
    ("phimoe", {"num_experts_per_tok": 3}, "num_experts_per_tok=3; phimoe's sparsemixer routes every token to "
                                           "exactly 2 experts"),
    ("phimoe", {"router_jitter_noise": 0.05}, "router_jitter_noise=0.05; routing kind 'sparsemixer' masks with 0.01"),
    ("hunyuan_v1_moe", {"num_experts": [4, 8]}, "num_experts=[4, 8] differs between layers"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'; deepseek_v2 blocks route with one of"),
    ("granitemoehybrid", {"num_local_experts": 0}, "num_local_experts=0: the model has no MoE block"),
    ("mellum", {"mlp_layer_types": ["sparse"]}, "mlp_layer_types must list ['sparse', 'dense'] once per layer"),
    ("aria_text", {"hidden_act": "gelu"}, "hidden_act='gelu'; Aria runs its routed experts with SiLU and its shared "
                                          "experts with hidden_act"),
    ("aria_text", {"mlp_bias": True}, "mlp_bias=true puts biases on Aria's shared experts"),
])
def test_config_refusals_name_the_field(models, family, changes, message):
    with pytest.raises(ValueError, match="config.json: .*") as info:
        parse_hf_config(_raw(models, family, **changes), "config.json")
    assert message in str(info.value)


def _refusals():
    from moeshard.checkpoint.models.refusals import REFUSALS

    return sorted(REFUSALS.items())


@pytest.mark.parametrize("model_type, part", [*[(t, r[:48]) for t, r in _refusals()],
                                              ("doge", "rows of two embedding tables")])
def test_inexpressible_families_are_refused_naming_the_part(model_type, part):
    with pytest.raises(ValueError, match=f"config.json: model_type '{model_type}' is not supported: .*{re.escape(part)}"):
        parse_hf_config({"model_type": model_type}, "config.json")


def test_longcat_flash_counts_decoder_layers_and_zero_computation_experts():
    """LongCat-Flash's ``num_layers`` counts its decoder layers; transformers 5.17 also writes
    ``num_hidden_layers``, twice that (two attention sublayers a layer), which is not read;
    ``zero_expert_num`` is the Z its router picks beside the E routed experts (0: none)."""
    raw = dict(model_type="longcat_flash", hidden_size=32, num_layers=3, num_hidden_layers=6, n_routed_experts=4,
               zero_expert_num=2, moe_topk=2, expert_ffn_hidden_size=16)
    info = parse_hf_config(raw, "config.json")
    assert (info.num_layers, info.identity_experts, info.moe.num_experts, info.moe.top_k) == (3, 2, 4, 2)
    assert parse_hf_config({**raw, "zero_expert_num": None}, "config.json").identity_experts == 0
    with pytest.raises(ValueError, match=r"config.json: zero_expert_num must be an integer >= 0, got -1"):
        parse_hf_config({**raw, "zero_expert_num": -1}, "config.json")


def test_nemotron_h_reads_its_layer_types_latent_width_and_ungated_experts(models):
    """Nemotron-H: the layers' types from ``layers_block_type`` (transformers' saves), or the hub's
    ``hybrid_override_pattern``, one character a layer, which counts them too; the experts' width
    the latent size where the block projects into one, else the hidden size; relu2, ungated; a
    malformed type list or pattern refused naming the field."""
    raw = _raw(models, "nemotron_h")
    info = parse_hf_config(raw, "config.json")
    assert (info.num_layers, list(info.dense_layers)) == (4, [0, 2])
    assert (info.moe.hidden_size, info.moe.intermediate_size, info.moe.activation) == (16, 16, "relu2")
    assert info.moe.gate_up_size == 16 and info.moe.routed_scaling_factor == 2.0
    hub = {k: v for k, v in raw.items() if k != "layers_block_type"}
    hub.update(hybrid_override_pattern="M*EME-E", moe_latent_size=None, num_hidden_layers=7)
    info = parse_hf_config(hub, "config.json")
    assert (info.num_layers, list(info.dense_layers)) == (7, [0, 1, 3, 5])
    assert info.moe.hidden_size == raw["hidden_size"]
    assert "layer type is 'attention'" in info.dense_layers[1]
    with pytest.raises(ValueError, match=r"layers_block_type must be a non-empty list of \['mamba'.*got \['moe', 'conv'\]"):
        parse_hf_config({**raw, "layers_block_type": ["moe", "conv"]}, "config.json")
    with pytest.raises(ValueError, match=r"expected layers_block_type .* or hybrid_override_pattern .*'MEX'"):
        parse_hf_config({**hub, "hybrid_override_pattern": "MEX"}, "config.json")
    with pytest.raises(ValueError, match=r"mlp_hidden_act='silu' is not supported; expected one of \['relu2'\]"):
        parse_hf_config({**raw, "mlp_hidden_act": "silu"}, "config.json")


def test_config_readers(models):
    """What each reader makes of its config: routing kinds, shared experts, dense layers."""
    want = {  # model_type -> (scoring, renormalize, shared width, gated, dense layers, E, n_group)
        "olmoe": ("softmax", True, 0, False, [], 4, 1),
        "flex_olmo": ("softmax", False, 0, False, [], 4, 1),
        "mellum": ("softmax", True, 0, False, [0], 4, 1),
        "minimax": ("softmax", True, 0, False, [], 4, 1),
        "jamba": ("softmax", False, 0, False, [0], 4, 1),
        "qwen3_next": ("softmax", True, 24, True, [], 4, 1),
        "qwen3_5_moe_text": ("softmax", True, 24, True, [], 4, 1),
        "qwen4_exp_text": ("softmax", False, 24, True, [], 4, 1),
        "deepseek_v2": ("group_limited_greedy", False, 16, False, [0], 8, 4),
        "hunyuan_v1_moe": ("softmax", True, 16, False, [], 4, 1),
        "ernie4_5_moe": ("softmax_bias", True, 16, False, [0], 4, 1),
        "granitemoe": ("topk_softmax", False, 0, False, [], 4, 1),
        "granitemoeshared": ("topk_softmax", False, 0, False, [], 4, 1),
        "granitemoehybrid": ("topk_softmax", False, 0, False, [], 4, 1),
        "granitemoe_swa": ("topk_softmax", False, 0, False, [], 4, 1),
        "phimoe": ("sparsemixer", False, 0, False, [], 4, 1),
        "jetmoe": ("topk_softmax", False, 0, False, [], 4, 1),
        "gemma4_text": ("softmax", True, 0, False, [], 4, 1),
        "dbrx": ("softmax_model", True, 0, False, [], 4, 1),
        "lara_mini": ("softmax", True, 24, False, [], 4, 1),
        "aria_text": ("topk_softmax", False, 16, False, [], 4, 1),
        "zaya": ("softmax", False, 0, False, [], 4, 1),
        "longcat_flash": ("softmax", False, 0, False, [], 4, 1),
        "inkling_text": ("sigmoid", True, 0, False, [0], 4, 1),
        "nemotron_h": ("sigmoid", True, 0, False, [0, 2], 4, 1),
    }
    assert set(want) == set(FAMILIES)
    for family, (scoring, renorm, shared, gated, dense, experts, groups) in want.items():
        if models[family] is None:
            continue
        info = parse_hf_config(_raw(models, family), family)
        m = info.moe
        assert (m.scoring, m.renormalize, m.shared_width, m.shared_expert_gate, list(info.dense_layers),
                m.num_experts, m.n_group) == (scoring, renorm, shared, gated, dense, experts, groups), family
    greedy = parse_hf_config(_raw(models, "deepseek_v2", topk_method="greedy"), "deepseek_v2").moe
    assert (greedy.scoring, greedy.n_group, greedy.routed_scaling_factor) == ("softmax", 1, 2.0)


def test_dbrx_reads_its_nested_ffn_config(models):
    """DBRX keeps its expert settings in ``ffn_config``: read with their own messages, a norm other
    than the 1-norm refused, no normalization (null) honoured."""
    raw = _raw(models, "dbrx")
    ffn = raw["ffn_config"]

    def parse(**changes):
        return parse_hf_config({**raw, "ffn_config": {**ffn, **changes}}, "config.json").moe

    moe = parse()
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size, moe.renormalize, moe.activation,
            moe.router_dtype) == (4, 2, 32, 16, True, "silu", "model")
    assert parse(moe_normalize_expert_weights=None).renormalize is False
    assert parse(ffn_act_fn={"name": "gelu"}).activation == "gelu"
    with pytest.raises(ValueError, match=r"config.json: ffn_config: moe_normalize_expert_weights=2; DBRX would divide "
                                         r"the weights by their 2-norm"):
        parse(moe_normalize_expert_weights=2.0)
    with pytest.raises(ValueError, match=r"config.json: ffn_config: missing field 'moe_top_k'"):
        parse_hf_config({**raw, "ffn_config": {k: v for k, v in ffn.items() if k != "moe_top_k"}}, "config.json")
    with pytest.raises(ValueError, match=r"config.json: ffn_config must be an object holding DBRX's expert settings, "
                                         r"got \[1, 2\]"):
        parse_hf_config({**raw, "ffn_config": [1, 2]}, "config.json")
    assert parse_hf_config(raw, "config.json").num_layers == 2  # n_layers


def test_dbrx_without_normalization_equals_transformers(models):
    """``moe_normalize_expert_weights`` null, in memory at one rank: the softmax probabilities
    of the top k are the weights as they are."""
    from moeshard.integrations.transformers import MoEBlock

    model = tf.AutoModelForCausalLM.from_pretrained(_dir(models, "dbrx")).eval()
    model.config.ffn_config.moe_normalize_expert_weights = None
    for layer in model.transformer.blocks:
        layer.ffn.moe_normalize_expert_weights = None
    want, got = swapped_logits(model, torch.tensor([list(PROMPTS[0]), [1, 2, 3, 4, 5]]))
    block = model.transformer.blocks[0].ffn
    assert isinstance(block, MoEBlock) and block.cfg.renormalize is False
    assert torch.allclose(got, want, atol=FP32_ATOL, rtol=0), (got - want).abs().max()
