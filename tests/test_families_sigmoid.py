"""Sigmoid-scored and logit-then-score families, whole models against transformers.

Tiny random models of GLM-4-MoE (grouped top-k), GLM-4-MoE-Lite, dots1 (grouped, no
renormalization), EXAONE-MoE (two shared experts, the bias under the block in the checkpoint),
DeepSeek-V3.2 (DeepSeek-V3's block beside its indexer attention),
MiniMax-M2 (the bias on the block, every layer MoE), A.X-K1 (DeepSeek-V3's block ending in a norm of
its output), MiniMax-M3's text model (the clamped SwiGLU
in its experts and its shared expert, whose gate and up are one tensor), AFMoE (the bias on the block, a router
wrapping a linear, route_scale), Cohere2-MoE (top-k of the logits, then sigmoid or softmax
over the selected; shared experts averaged with the routed ones) and Kolibri-1 (top-k of the
logits plus a selection bias the checkpoint keeps outside the block) and HY-V4 (routed experts
that clamp their SwiGLU beside a shared MLP that does not) are built from transformers' own
config classes and saved with ``save_pretrained``. Their router weights and selection biases are
drawn at random (transformers initialises the biases, and AFMoE's router, to zero, where every
expert ties), and the one-rank test checks that the bias changes some token's experts, so a
block that ignored the bias, or took the weights from the biased scores, would fail.

At one rank the logits (and the router logits transformers records) equal transformers' within
fp32 1e-5, loaded from the checkpoint and sharded in memory. Greedy ids equal transformers'
``generate`` under EP2 (dp2-tp1-ep), SP (dp1-tp2-ep), TP2 (dp1-tp2-noep) and dp2-tp2-ep: one
spawn per world size runs every family's cases. In bfloat16 every block routes transformers'
own router inputs to its experts from logits equal to its router's bit for bit (each family's
``router_dtype``: fp32 for the DeepSeek-V3-style routers, the model dtype for MiniMax-M2, AFMoE,
Cohere2-MoE), and the greedy ids of ``BF16_FAMILIES`` equal transformers' at (1,1) and under
EP2 (in the 2-rank spawn; with fp32 logits MiniMax-M2's did not). A family whose config class
this transformers lacks is skipped with that reason.
"""

from __future__ import annotations

import pytest
import torch
from generate_worlds import GenerateWorlds
from router_parity import bf16_router_parity, swapped_logits

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
NEW_TOKENS = 4
PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11,))
SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
MLA = dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=8)

# model_type -> the config class's arguments beyond SMALL.
CONFIGS: dict[str, dict] = {
    "glm4_moe": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=2, topk_group=1, routed_scaling_factor=1.5),
    "glm4_moe_lite": dict(MLA, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
                          num_experts_per_tok=2),
    "dots1": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1),
    "exaone_moe": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       num_shared_experts=2),
    # DeepSeek-V3.2: DeepSeek-V3's block (grouped top-k, a dense first layer) beside the indexer's attention.
    "deepseek_v32": dict(MLA, q_lora_rank=16, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                         n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                         first_k_dense_replace=1, index_topk=4, index_head_dim=8, index_n_heads=2),
    "minimax_m2": dict(intermediate_size=16, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
    "afmoe": dict(intermediate_size=48, moe_intermediate_size=16, head_dim=8, num_experts=4, num_experts_per_tok=2,
                  num_shared_experts=1, route_scale=2.0),
    # The config class's default combination, "average"; its "softmax" selection runs at one rank below.
    "cohere2_moe": dict(intermediate_size=16, head_dim=8, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                        expert_selection_fn="sigmoid", first_k_dense_replace=1, prefix_dense_intermediate_size=48),
    # A Kimi delta attention layer with a dense MLP, then an MLA layer with the MoE block; the
    # checkpoint stores the delta attention's forget gate and convolutions as the hub does.
    "kimi_linear": dict(MLA, intermediate_size=48, moe_intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                        n_group=2, topk_group=1, n_shared_experts=1, linear_head_dim=8, linear_num_heads=4,
                        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"]),
    # A short-convolution layer, then an attention layer whose feed-forward is the MoE block.
    "lfm2_moe": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                     num_dense_layers=1, routed_scaling_factor=1.5, layer_types=["conv", "full_attention"]),
    "solar_open": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                       n_shared_experts=1, head_dim=8),
    # GLM-5: DeepSeek-V3.2's block (a dense first layer) beside its indexed attention.
    "glm_moe_dsa": dict(MLA, q_lora_rank=16, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, index_topk=4,
                        index_head_dim=16, index_n_heads=2),
    # Hunyuan 3: the bias on the block, the router stored as router.gate, the shared MLP as shared_mlp.
    "hy_v3": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8),
    # No shared experts; the attention's sinks stored as attention_sink_bias.
    "mimo_v2_flash": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                          head_dim=8, v_head_dim=8, sliding_window=8),
    # Sigmoid scores without a bias, an ungated shared expert, Qwen's dense-layer rule.
    "flint": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                  shared_expert_intermediate_size=24, mlp_only_layers=[0], sliding_window=8, head_dim=8),
    # DeepSeek-V3's router, no shared experts, the scale on the experts' sum.
    "beam": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, n_group=2,
                 topk_group=1, mlp_layer_types=["dense", "sparse"], sliding_window=8, head_dim=8),
    # Model-dtype logits, the bias stored under the experts, a scale on the experts' sum.
    "laguna": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                   shared_expert_intermediate_size=16, moe_routed_scaling_factor=1.5, head_dim=8),
    # A.X-K2: DeepSeek-V3's block; gated norms whose low-rank MLP and a fused query gate the
    # checkpoint stores under other names.
    "axk2": dict(MLA, kv_lora_rank=8, q_lora_rank=16, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                 n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, index_topk=4, index_head_dim=16,
                 index_n_heads=2, gated_norm_rank=4),
    # Sarvam-MoE: GLM-4-MoE under its original names (saved so by transformers), the query, key and
    # value rows and their biases fused in one tensor.
    "sarvam_moe": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                       n_shared_experts=1, first_k_dense_replace=1, head_dim=8, attention_bias=True),
    # Ling's hybrid: a Kimi delta attention layer with a dense MLP, then an MLA layer with the MoE
    # block, the config and the checkpoint under Ling's own names.
    "bailing_hybrid": dict(MLA, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                           num_experts_per_token=2, num_shared_experts=1, num_expert_group=2, topk_group=1,
                           layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                           linear_head_dim=8, linear_num_heads=4, num_nextn_predict_layers=0),
    # Sarvam-MLA: DeepSeek-V3 (transformers builds it so) with one group and a dense first layer.
    "sarvam_mla": dict(MLA, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                       n_shared_experts=1),
    # dots.note 3's text model: DeepSeek-V3's block with shared experts of their own width, beside
    # indexed attention; a dense first layer.
    "dots3_note_text": dict(MLA, q_lora_rank=16, head_dim=16, intermediate_size=48, moe_intermediate_size=16,
                            shared_experts_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                            n_shared_experts=1, index_topk=4, index_head_dim=16, index_n_heads=2,
                            mlp_layer_types=["dense", "sparse"], sliding_window=8),
    # MiniMax-M3's text model: the clamped SwiGLU in the experts and in a shared expert whose gate
    # and up are one tensor, a scale on the experts' sum, a dense first layer; the MoE layer's
    # attention is block-sparse (its indexer keeps 2 of every query's 2-token blocks).
    "minimax_m3_vl_text": dict(intermediate_size=16, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                               shared_intermediate_size=24, dense_intermediate_size=48, routed_scaling_factor=1.5,
                               rotary_dim=4, mlp_layer_types=["dense", "sparse"],
                               layer_types=["full_attention", "minimax_m3_sparse"], index_n_heads=2,
                               index_head_dim=8, index_block_size=2, index_topk_blocks=2),
    # Kolibri-1: top-k of the logits plus a selection bias, weighed by the sigmoid of the unbiased
    # logits; the bias stored outside the block (moe.router.expert_bias), two norms renamed.
    "kolibri1": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                     shared_expert_intermediate_size=24, head_dim=8, sliding_window=8),
    # HY-V4: DeepSeek-V3's routing, routed experts clamping their SwiGLU at swiglu_limit while the
    # shared MLP does not (its gate_up scaled below so that the clamps bite), hyper-connections and
    # indexed attention under the hub's names.
    "hy_v4": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                  n_shared_experts=1, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=8, head_dim=16, index_topk=4, index_head_dim=16, index_n_heads=2,
                  mlp_layer_types=["dense", "sparse"], num_key_value_heads=4),
    # A.X-K1: DeepSeek-V3's block ending in an RMS norm of its output (post_mlp_layernorm, drawn at
    # random below: transformers starts it at ones), stored under the decoder layer.
    "axk1": dict(MLA, q_lora_rank=16, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                 mlp_layer_types=["dense", "sparse"]),
}
# A norm the block applies to its output, drawn in [0.5, 1.5) (transformers starts it at ones).
OUTPUT_NORMS = {"axk1": "post_mlp_layernorm.weight"}
# The routed experts' gate_up and the shared MLP's gate and up scaled up, so that a clamping
# activation's limit is reached by a good share of the products (HY-V4 clamps its routed experts'
# at 10: at this scale about a third of them pass it), and a block that clamped the shared MLP's
# too would be seen.
GATE_UP_SCALE = {"hy_v4": 20.0}
# Families whose block takes the path of another family here (the same reader or descriptor
# fields: routing kind, names, shared experts): their layout cases run in make test-slow.
SAME_PATH_AS = {"solar_open": "glm4_moe", "glm_moe_dsa": "deepseek_v32", "beam": "glm4_moe", "mimo_v2_flash": "glm4_moe",
                "laguna": "minimax_m2",  # laguna: sigmoid of model-dtype logits with a bias, as minimax_m2
                "axk2": "deepseek_v32",  # axk2: its renames are outside the block, read at (1,1) in make test
                "sarvam_moe": "glm4_moe",  # and so are sarvam_moe's
                "bailing_hybrid": "kimi_linear",  # kimi_linear's reader and block, Ling's names outside the block
                "sarvam_mla": "glm4_moe", "dots3_note_text": "glm4_moe",
                # axk1: DeepSeek-V3's block; its norm on whole rows after the gather is the path of
                # jetmoe's output bias (test_families_softmax), its step under SP and TP2 in
                # test_train_families
                "axk1": "deepseek_v32"}
# Where each family's router weight and selection bias live in a block.
ROUTER_PARAMS = {"afmoe": ("router.gate.weight", "expert_bias"),
                 "minimax_m2": ("gate.weight", "e_score_correction_bias"),
                 "hy_v3": ("gate.weight", "e_score_correction_bias"),
                 "lfm2_moe": ("gate.weight", "expert_bias")}
# Selection biases drawn in [0, 0.3), or wider where that range moved no token's experts in the
# tiny model (the one-rank test checks that the bias decides some token's experts).
BIAS_RANGE = {"laguna": 1.0, "kolibri1": 2.0, "axk1": 1.0}  # kolibri1: added to logits, not to scores in (0, 1)
FAMILIES = tuple(CONFIGS)
# Families whose bf16 greedy ids are compared with transformers' at (1,1) and under EP2: routers
# in the model dtype. (glm4_moe_lite routes in fp32 in both; its bf16 ids differ where transformers'
# two best next-token logits are one bf16 step apart: docs/transformers.md, known differences.)
BF16_FAMILIES = ("minimax_m2", "afmoe", "lfm2_moe")
BF16_EP2 = ParallelConfig(2, 1, True)


def _config(model_type: str):
    """transformers' config of the tiny model, or None where this transformers lacks the type, or
    has a config class of another shape that refuses these arguments."""
    try:
        return tf.AutoConfig.for_model(model_type, **{**SMALL, **CONFIGS[model_type]})
    except (KeyError, ValueError, StrictDataclassError):
        return None


def _block(layer):
    """A decoder layer's feed-forward: ``mlp``, or LFM2-MoE's ``feed_forward``."""
    return getattr(layer, "mlp", None) or layer.feed_forward


def _randomize_routers(model, model_type: str, generator: torch.Generator) -> None:
    """Router weights at std 2/sqrt(H) and selection biases in [0, 0.3) (``BIAS_RANGE``): scores
    spread out, no ties."""
    weight_name, bias_name = ROUTER_PARAMS.get(model_type, ("gate.weight", "gate.e_score_correction_bias"))
    with torch.no_grad():
        for layer in model.model.layers:
            block = _block(layer)
            if not hasattr(block, "experts"):
                continue
            weight = block.get_parameter(weight_name)
            weight.copy_(torch.randn(weight.shape, generator=generator) * 2 / weight.shape[1] ** 0.5)
            owner, _, leaf = bias_name.rpartition(".")
            bias = getattr(block.get_submodule(owner) if owner else block, leaf, None)
            if bias is not None:
                bias.copy_(torch.rand(bias.shape, generator=generator) * BIAS_RANGE.get(model_type, 0.3))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """model_type -> directory of its tiny random model (families this transformers has)."""
    root = tmp_path_factory.mktemp("tiny-sigmoid")
    out = {}
    # Each model is seeded by its family's place in CONFIGS: a new family goes at the end, so that
    # the others keep their random models (some bf16 cases sit near ties).
    for seed, model_type in enumerate(FAMILIES):
        cfg = _config(model_type)
        if cfg is None:
            continue
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(cfg).eval()
        _randomize_routers(model, model_type, torch.Generator().manual_seed(100 + seed))
        if model_type in OUTPUT_NORMS:
            with torch.no_grad():
                for layer in model.model.layers:
                    block = _block(layer)
                    if hasattr(block, "experts"):
                        norm = block.get_parameter(OUTPUT_NORMS[model_type])
                        norm.copy_(torch.rand(norm.shape, generator=torch.Generator().manual_seed(seed)) + 0.5)
        if model_type in GATE_UP_SCALE:
            with torch.no_grad():
                for layer in model.model.layers:
                    block = _block(layer)
                    if hasattr(block, "experts"):
                        for name in ("experts.gate_up_proj", "shared_experts.gate_proj.weight",
                                     "shared_experts.up_proj.weight"):
                            block.get_parameter(name).mul_(GATE_UP_SCALE[model_type])
        model.save_pretrained(root / model_type)
        out[model_type] = str(root / model_type)
    return out


def _model(models, model_type: str) -> str:
    if model_type not in models:
        pytest.skip(f"transformers {tf.__version__} has no config class for model_type {model_type!r} "
                    f"that takes the tiny model's arguments")
    return models[model_type]


def _plan(model_dir: str, layout: ParallelConfig | None = None, dtype: str | None = None):
    return plan_generate(GenerateSpec(model_dir, PROMPTS, NEW_TOKENS, layout or ParallelConfig(), compare=True,
                                      dtype=dtype))


@pytest.fixture(scope="module")
def reference():
    """transformers alone for a plan's batches, computed once per (model, batches)."""
    cache = {}

    def get(plan):
        key = (plan.spec.model_dir, plan.dtype, plan.dp_prompts)
        if key not in cache:
            cache[key] = reference_generate(plan)
        return cache[key]

    return get


def _check_parity(plan, results, reference) -> None:
    for r in results:
        assert not isinstance(r, dict), f"rank raised: {r}"
        assert r.tp_disagreements == 0
    c = compare_generations(plan, results, reference(plan))
    assert c.atol == 1e-5 and c.within_tolerance, f"{plan.parallel.name} {plan.model_type}: logits off by {c.step_max_abs}"
    assert all(c.same_ids), f"{plan.parallel.name} {plan.model_type}: ids differ at steps {c.first_difference}"


def _check_bf16_ids(plan, results, reference) -> None:
    """bf16: the same greedy ids as transformers' bf16 generate (the logits differ by rounding;
    docs/transformers.md)."""
    for r in results:
        assert not isinstance(r, dict), f"rank raised: {r}"
    c = compare_generations(plan, results, reference(plan))
    assert all(c.same_ids), f"bf16 {plan.parallel.name} {plan.model_type}: ids differ at steps {c.first_difference}"


# -- one rank ---------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", FAMILIES)
def test_one_rank_logits_and_router_logits_equal_transformers(models, model_type):
    """(1,1), fp32: the model's logits, loss and every recorded router logit match transformers'
    within 1e-5, loaded from the checkpoint and sharded in memory (transformers' router keeps
    running inside the block, so its recorder still sees every MoE layer)."""
    from moeshard.integrations.transformers import MoEBlock, load_sharded_model, shard_moe_blocks
    from moeshard.router import route, router_logits

    model_dir = _model(models, model_type)
    ids = torch.tensor([list(PROMPTS[0]), [1, 2, 3, 4, 5]])
    plain = tf.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    want = plain(ids, labels=ids, output_router_logits=True)
    moe_layers = [i for i, layer in enumerate(plain.model.layers) if hasattr(_block(layer), "experts")]
    assert moe_layers
    for model in (load_sharded_model(model_dir),
                  shard_moe_blocks(tf.AutoModelForCausalLM.from_pretrained(model_dir).eval())):
        assert [i for i, layer in enumerate(model.model.layers) if isinstance(_block(layer), MoEBlock)] == moe_layers
        block = _block(model.model.layers[moe_layers[0]])
        rows: list[torch.Tensor] = []
        hook = block.register_forward_pre_hook(
            lambda _m, args, rows=rows: rows.append(args[0].reshape(-1, args[0].shape[-1])))
        with torch.no_grad():
            got = model(ids, labels=ids, output_router_logits=True)
        hook.remove()
        if block.cfg.use_correction_bias:  # the bias decides some token's experts
            weight = block.hf_router.get_parameter(block.router_weight)
            unbiased = route(router_logits(rows[0], weight, block.cfg.router_dtype), block.cfg,
                             torch.zeros(block.cfg.num_experts))
            assert not torch.equal(block.route(rows[0]).topk_ids, unbiased.topk_ids)
        assert torch.allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5), (got.logits - want.logits).abs().max()
        assert torch.allclose(got.loss, want.loss, atol=1e-6)
        if getattr(want, "aux_loss", None) is not None:
            assert torch.allclose(got.aux_loss, want.aux_loss, atol=1e-6)
        if getattr(want, "router_logits", None) is not None:
            assert len(got.router_logits) == len(want.router_logits) == len(moe_layers)
            assert torch.equal(got.router_logits[0], want.router_logits[0])  # the same rows reach the first block
            for a, b in zip(got.router_logits, want.router_logits, strict=True):
                assert torch.allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_bf16_router_is_transformers_router(models, model_type):
    """bf16, on transformers' own router inputs: moeshard's logits are its router's bit for bit
    and its experts the same (ties aside, ``router_parity``); for a family whose router computes
    in the model dtype, fp32 logits would differ, so the test sees the precision."""
    from moeshard.checkpoint.families import FAMILIES as DESCRIPTORS

    parity = bf16_router_parity(tf, _model(models, model_type))
    assert parity.logits_differ == parity.ids_differ == parity.biases_differ == 0, parity
    assert (parity.fp32_logits_differ > 0) == (DESCRIPTORS[model_type].router_dtype == "model"), parity


@pytest.mark.parametrize("model_type", BF16_FAMILIES)
def test_bf16_one_rank_generates_what_transformers_generates(models, reference, model_type):
    plan = _plan(_model(models, model_type), dtype="bfloat16")
    _check_bf16_ids(plan, [generate_rank(plan, None)], reference)


# -- several ranks: one spawn per world size --------------------------------------------------
WORLD_LAYOUTS = {2: (ParallelConfig(2, 1, True), ParallelConfig(1, 2, True), ParallelConfig(1, 2, False)),
                 4: (ParallelConfig(2, 2, True),)}


@pytest.fixture(scope="module")
def world(models):
    """world size -> {(layout name, dtype, model_type): (plan, per-rank results)}: every family
    this transformers has, under every layout of that world size, in float32 (and in the 2-rank
    world ``BF16_FAMILIES`` under EP2 in bfloat16), in one spawn."""

    def cases(key: tuple[int, bool]):
        ws, slow = key
        keys = [(layout, "float32", model_type) for layout in WORLD_LAYOUTS[ws] for model_type in FAMILIES
                if model_type in models and (model_type in SAME_PATH_AS) == slow]
        if ws == BF16_EP2.world_size and not slow:
            keys += [(BF16_EP2, "bfloat16", model_type) for model_type in BF16_FAMILIES if model_type in models]
        return ([(layout.name, dtype, model_type) for layout, dtype, model_type in keys],
                [_plan(models[model_type], layout, dtype) for layout, dtype, model_type in keys])

    worlds = GenerateWorlds(cases, SPAWN_TIMEOUT_S)
    return lambda ws, slow=False: worlds((ws, slow))


def _layout_params():
    # The 4-rank world costs about a minute on 2 cores (four processes importing transformers):
    # `make test-slow`. Its layout's code path runs in `make test` for deepseek_v3's sigmoid
    # routing (test_transformers_integration), and these families' own code (names, bias,
    # routing) runs here under EP, SP and TP in the 2-rank world.
    # A family in SAME_PATH_AS runs its layouts in make test-slow.
    return [pytest.param(ws, layout.name, model_type, id=f"{layout.name}-{model_type}",
                         marks=[pytest.mark.slow] if ws == 4 or model_type in SAME_PATH_AS else [])
            for ws, layouts in WORLD_LAYOUTS.items() for layout in layouts for model_type in FAMILIES]


@pytest.mark.parametrize("ws, layout, model_type", _layout_params())
def test_layout_generates_what_transformers_generates(models, world, reference, ws, layout, model_type):
    _model(models, model_type)
    plan, results = world(ws, model_type in SAME_PATH_AS)[(layout, "float32", model_type)]
    _check_parity(plan, results, reference)
    p = plan.parallel
    if p.enable_ep:  # each rank holds only its own experts
        per = plan.cfg.num_experts // ws
        assert [r.experts for r in results] == [(r * per, (r + 1) * per) for r in range(ws)]
    else:
        width = plan.cfg.intermediate_size // p.tp
        assert [r.intermediate for r in results] == [(t * width, (t + 1) * width) for t in range(p.tp)]


@pytest.mark.parametrize("model_type", BF16_FAMILIES)
def test_bf16_ep2_generates_what_transformers_generates(models, world, reference, model_type):
    _model(models, model_type)
    plan, results = world(BF16_EP2.world_size)[(BF16_EP2.name, "bfloat16", model_type)]
    _check_bf16_ids(plan, results, reference)


def _variant(model_type: str, **settings):
    """The family's tiny random model with other ``settings`` of its config, its routers drawn
    at random; skipped where this transformers lacks the type."""
    cfg = _config(model_type)
    if cfg is None:
        pytest.skip(f"transformers {tf.__version__} has no config class for model_type {model_type!r} "
                    f"that takes the tiny model's arguments")
    for name, value in settings.items():
        setattr(cfg, name, value)
    torch.manual_seed(7)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    _randomize_routers(model, model_type, torch.Generator().manual_seed(8))
    return model


def test_lfm2_moe_without_its_expert_bias_and_renormalization():
    """LFM2-MoE's other settings, in memory at one rank: no expert bias (transformers' router then
    gets None from the block, and so does moeshard's) and no renormalization."""
    from moeshard.integrations.transformers import MoEBlock

    model = _variant("lfm2_moe", use_expert_bias=False, norm_topk_prob=False)
    want, got = swapped_logits(model, torch.tensor([list(PROMPTS[0]), [1, 2, 3, 4, 5]]))
    block = model.model.layers[1].feed_forward
    assert isinstance(block, MoEBlock)
    assert (block.cfg.use_correction_bias, block.cfg.renormalize, block.cfg.routed_scaling_factor) == (False, False, 1.5)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_cohere2_softmax_selection_and_summed_shared_expert():
    """Cohere2-MoE's other settings, in memory at one rank: softmax over the selected logits
    (``topk_softmax``, norm_topk_prob unread) and shared experts summed, not averaged."""
    from moeshard.integrations.transformers import MoEBlock

    model = _variant("cohere2_moe", expert_selection_fn="softmax", shared_expert_combination_strategy="sum",
                     norm_topk_prob=False)
    want, got = swapped_logits(model, torch.tensor([list(PROMPTS[0]), [1, 2, 3, 4, 5]]))
    block = model.model.layers[1].mlp
    assert isinstance(block, MoEBlock)
    assert (block.cfg.scoring, block.cfg.renormalize, block.cfg.routed_scaling_factor, block.cfg.shared_scale) == \
        ("topk_softmax", False, 1.0, 1.0)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


# -- the routing kind topk_sigmoid and shared_scale -------------------------------------------
def _cfg(**kw):
    from moeshard.config import MoEConfig

    return MoEConfig(**{"num_experts": 4, "top_k": 2, "hidden_size": 8, "intermediate_size": 8, **kw})


def test_topk_sigmoid_scores_the_selected_logits_with_a_sigmoid():
    import math

    from moeshard.router import route

    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0], [1.0, 3.0, 2.0, 3.0]])
    s = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    plain = route(logits, _cfg(scoring="topk_sigmoid", renormalize=False))
    # row 0: logits 2 (expert 1), 1 (expert 3); row 1: experts 1 and 3 tie at 3 (lower index first)
    assert plain.topk_ids.tolist() == [[1, 3], [1, 3]]
    assert plain.topk_weights.tolist()[0] == pytest.approx([s(2), s(1)], rel=1e-6)
    assert plain.topk_weights.tolist()[1] == pytest.approx([s(3), s(3)], rel=1e-6)
    normed = route(logits, _cfg(scoring="topk_sigmoid", renormalize=True, routed_scaling_factor=0.5))
    assert normed.topk_ids.tolist() == plain.topk_ids.tolist()
    assert normed.topk_weights.tolist()[0] == pytest.approx([0.5 * s(2) / (s(2) + s(1)), 0.5 * s(1) / (s(2) + s(1))])
    assert normed.topk_weights.tolist()[1] == [0.25, 0.25]
    with pytest.raises(ValueError, match=r"n_group: scoring='topk_sigmoid' has no group top-k, got n_group=2"):
        _cfg(scoring="topk_sigmoid", n_group=2)
    with pytest.raises(ValueError, match=r"use_correction_bias: only defined for scoring='sigmoid'"):
        _cfg(scoring="topk_sigmoid", use_correction_bias=True)


def test_shared_scale_refusals():
    with pytest.raises(ValueError, match=r"MoEConfig.shared_scale: 0.5 needs num_shared_experts > 0"):
        _cfg(shared_scale=0.5)
    with pytest.raises(ValueError, match=r"MoEConfig.shared_scale: must be a finite number in \(0, 1000\], got 0"):
        _cfg(num_shared_experts=1, shared_intermediate_size=8, shared_scale=0)
    assert type(_cfg(num_shared_experts=1, shared_intermediate_size=8, shared_scale=1).shared_scale) is float


def test_topk_sigmoid_and_shared_scale_through_layer_and_reference():
    """The layer and the reference agree on the preset's routing and averaged shared expert, and
    the shared expert's share is exactly half of what it is with shared_scale=1."""
    from dataclasses import replace

    from moeshard.layer import MoELayer
    from moeshard.presets import PRESETS
    from moeshard.reference import reference_forward
    from moeshard.tolerances import compare
    from moeshard.weights import MoEWeights

    c = PRESETS["cohere2-moe"].config("small")
    assert (c.scoring, c.shared_scale, c.routed_scaling_factor) == ("topk_sigmoid", 0.5, 0.5)
    w = MoEWeights.random(c, torch.Generator().manual_seed(3))
    x = torch.randn(12, c.hidden_size, generator=torch.Generator().manual_seed(4))
    layer = MoELayer(c, weights=w)
    with torch.no_grad():
        y = layer(x)
        summed = MoELayer(replace(c, shared_scale=1.0), weights=w)(x)
    ref = reference_forward(x, w, c)
    assert compare(y, ref, c.dtype, "none")[3]
    shared = reference_forward(x, w, replace(c, shared_scale=1.0)).out - ref.out
    assert torch.allclose((summed - y).double(), shared, atol=1e-5)
    assert shared.abs().max() > 0.01


# -- config.json and checkpoint names ---------------------------------------------------------
def _parse(model_type: str, **fields):
    from moeshard.checkpoint.hf_config import parse_hf_config

    base = {"model_type": model_type, "num_hidden_layers": 4, "hidden_size": 32, "moe_intermediate_size": 16,
            "intermediate_size": 16, "num_experts_per_tok": 2, "n_routed_experts": 4, "num_experts": 4,
            "num_local_experts": 4, "n_shared_experts": 1, "shared_expert_intermediate_size": 16}
    return parse_hf_config({**base, **fields}, f"{model_type}/config.json")


def test_dense_layers_follow_the_config_class():
    assert list(_parse("glm4_moe").dense_layers) == [0]  # first_k_dense_replace defaults to 1
    assert list(_parse("dots1").dense_layers) == []  # ... to 0
    assert list(_parse("glm4_moe_lite", first_k_dense_replace=3).dense_layers) == [0]  # transformers ignores it
    assert list(_parse("glm4_moe_lite", mlp_layer_types=["sparse", "dense", "sparse", "dense"]).dense_layers) == [1, 3]
    assert list(_parse("exaone_moe", first_k_dense_replace=2).dense_layers) == [0, 1]
    assert list(_parse("exaone_moe", first_k_dense_replace=2, mlp_layer_types=["sparse"] * 3 + ["dense"])
                .dense_layers) == [3]  # the list wins, as in transformers
    assert list(_parse("afmoe", num_dense_layers=3).dense_layers) == [0, 1, 2]
    assert list(_parse("minimax_m2").dense_layers) == []
    assert list(_parse("deepseek_v32", n_routed_experts=16).dense_layers) == [0, 1, 2]  # first_k_dense_replace: 3
    v32 = _parse("deepseek_v32", n_routed_experts=16).moe  # 8 groups by default
    assert (v32.n_group, v32.topk_group, v32.routed_scaling_factor, v32.renormalize) == (8, 4, 2.5, True)
    info = _parse("exaone_moe")
    with pytest.raises(ValueError, match=r"layer 0 of this exaone_moe model has no MoE block: it is a dense layer "
                                         r"\(layer < first_k_dense_replace=1 \(no mlp_layer_types\)\)"):
        info.check_layer(0)
    with pytest.raises(ValueError, match=r"mlp_layer_types must be a list of \['dense', 'sparse'\], got \['moe'"):
        _parse("glm4_moe_lite", mlp_layer_types=["moe"] * 4)
    with pytest.raises(ValueError, match="mlp_layer_types has 2 entries, but num_hidden_layers=4"):
        _parse("exaone_moe", mlp_layer_types=["dense", "sparse"])


def test_routing_fields_follow_the_config_class():
    glm = _parse("glm4_moe").moe
    assert (glm.scoring, glm.renormalize, glm.routed_scaling_factor, glm.n_group, glm.use_correction_bias,
            glm.shared_width) == ("sigmoid", True, 1.0, 1, True, 16)
    assert _parse("glm4_moe_lite").moe.routed_scaling_factor == 1.8
    dots = _parse("dots1", n_group=2, topk_group=1).moe
    assert (dots.renormalize, dots.n_group, dots.topk_group) == (False, 2, 1)
    exaone = _parse("exaone_moe").moe
    assert (exaone.routed_scaling_factor, exaone.num_shared_experts) == (2.5, 1)
    m2 = _parse("minimax_m2").moe
    assert (m2.intermediate_size, m2.renormalize, m2.has_shared_experts) == (16, True, False)
    af = _parse("afmoe", route_scale=2.5).moe
    assert (af.routed_scaling_factor, af.renormalize, af.num_shared_experts) == (2.5, True, 2)
    lfm2 = _parse("lfm2_moe", routed_scaling_factor=1.5).moe
    assert (lfm2.scoring, lfm2.renormalize, lfm2.routed_scaling_factor, lfm2.use_correction_bias,
            lfm2.intermediate_size) == ("sigmoid_bias_model", True, 1.5, True, 16)
    plain = _parse("lfm2_moe", use_expert_bias=False, norm_topk_prob=False).moe
    assert (plain.use_correction_bias, plain.renormalize) == (False, False)
    assert list(_parse("lfm2_moe").dense_layers) == [0, 1]  # num_dense_layers: 2
    assert list(_parse("lfm2_moe", num_dense_layers=1).dense_layers) == [0]
    hy = _parse("hy_v4", n_shared_experts=2, hidden_act="gelu").moe
    assert (hy.scoring, hy.activation, hy.shared_act, hy.routed_scaling_factor, hy.renormalize, hy.shared_width,
            hy.use_correction_bias) == ("sigmoid", "silu_clamped", "gelu", 2.827, True, 32, True)
    assert list(_parse("hy_v4").dense_layers) == [0]
    with pytest.raises(ValueError, match=r"swiglu_limit=7.0; moeshard's 'silu_clamped' activation computes limit=10.0 "
                                         r"\(transformers' HYV4Config default\)"):
        _parse("hy_v4", swiglu_limit=7.0)
    kolibri = _parse("kolibri1").moe
    assert (kolibri.scoring, kolibri.renormalize, kolibri.use_correction_bias, kolibri.shared_width) == \
        ("topk_sigmoid_biased", False, True, 16)
    # config.json's own (the hub's) spellings of the routing fields
    kimi = _parse("kimi_linear", num_local_experts=None, num_experts_per_tok=None, n_shared_experts=None, num_experts=8,
                  num_experts_per_token=2, moe_renormalize=False, num_expert_group=2, num_shared_experts=2).moe
    assert (kimi.num_experts, kimi.top_k, kimi.renormalize, kimi.n_group, kimi.shared_width,
            kimi.routed_scaling_factor) == (8, 2, False, 2, 32, 2.446)
    assert list(_parse("kimi_linear").dense_layers) == [0]  # first_k_dense_replace: 1
    # the router's precision comes from the family, as its transformers router computes
    assert [_parse(t, n_routed_experts=16, num_experts=16, num_local_experts=16).moe.router_dtype for t in FAMILIES] == \
        ["fp32"] * 5 + ["model"] * 3 + ["fp32"] + ["model"] + ["fp32"] * 6 + ["model"] + ["fp32"] * 5 + ["model"] + \
        ["fp32"] * 3
    with pytest.raises(ValueError, match=r"dots1/config.json: missing field 'n_shared_experts'"):
        _parse("dots1", n_shared_experts=None)
    with pytest.raises(ValueError, match=r"route_scale must be a finite number in \(0, 1000\], got 0"):
        _parse("afmoe", route_scale=0)


def test_newer_readers_follow_their_config_classes():
    """The routing fields and dense layers of the families read on DeepSeek-V3's and Qwen's
    descriptors, at the defaults of their transformers config classes."""
    solar = _parse("solar_open").moe
    assert (solar.routed_scaling_factor, solar.renormalize, solar.n_group, solar.shared_width) == (1.0, True, 1, 16)
    assert list(_parse("solar_open", first_k_dense_replace=2).dense_layers) == []  # its config class has none
    dsa = _parse("glm_moe_dsa").moe
    assert (dsa.routed_scaling_factor, dsa.n_group, dsa.topk_group) == (2.5, 1, 1)
    assert list(_parse("glm_moe_dsa").dense_layers) == [0, 1, 2]
    hy = _parse("hy_v3").moe
    assert (hy.routed_scaling_factor, hy.renormalize, hy.use_correction_bias, hy.shared_width) == (2.826, True, True, 16)
    assert list(_parse("hy_v3").dense_layers) == [0]
    mimo = _parse("mimo_v2_flash", routed_scaling_factor=None).moe  # null on the hub
    assert (mimo.routed_scaling_factor, mimo.has_shared_experts, mimo.use_correction_bias) == (1.0, False, True)
    flint = _parse("flint", shared_expert_intermediate_size=24).moe
    assert (flint.use_correction_bias, flint.renormalize, flint.shared_width, flint.shared_expert_gate) == \
        (False, True, 24, False)
    assert list(_parse("flint").dense_layers) == [0, 1]  # mlp_only_layers: [0, 1]
    beam = _parse("beam", num_experts=16).moe
    assert (beam.n_group, beam.topk_group, beam.routed_scaling_factor, beam.has_shared_experts) == (8, 4, 2.5, False)
    assert list(_parse("beam", num_experts=16).dense_layers) == [0, 1, 2]
    laguna = _parse("laguna", moe_routed_scaling_factor=2.0).moe
    assert (laguna.routed_scaling_factor, laguna.renormalize, laguna.shared_width) == (2.0, True, 16)
    with pytest.raises(ValueError, match=r"moe_router_logit_softcapping=30.0; moeshard routes laguna blocks without"):
        _parse("laguna", moe_router_logit_softcapping=30.0)
    with pytest.raises(ValueError, match=r"moe_apply_router_weight_on_input=true"):
        _parse("laguna", moe_apply_router_weight_on_input=True)
    sarvam = _parse("sarvam_moe").moe
    assert (sarvam.routed_scaling_factor, sarvam.renormalize, sarvam.use_correction_bias, sarvam.shared_width) == \
        (2.5, True, True, 16)
    assert list(_parse("sarvam_moe").dense_layers) == [0]
    # the original config.json's spellings of the expert counts (SarvamMoEConfig.attribute_map)
    hub = _parse("sarvam_moe", n_routed_experts=None, num_local_experts=None, n_shared_experts=None, num_experts=8,
                 num_shared_experts=2).moe
    assert (hub.num_experts, hub.num_shared_experts, hub.shared_width) == (8, 2, 32)
    ling = _parse("bailing_hybrid", n_routed_experts=None, num_local_experts=None, n_shared_experts=None,
                  num_experts=16, num_shared_experts=1, num_experts_per_tok=None, num_experts_per_token=4).moe
    assert (ling.num_experts, ling.top_k, ling.n_group, ling.topk_group, ling.routed_scaling_factor, ling.renormalize,
            ling.shared_width) == (16, 4, 8, 4, 2.5, True, 16)
    mla = _parse("sarvam_mla").moe
    assert (mla.routed_scaling_factor, mla.n_group, mla.renormalize, mla.use_correction_bias, mla.shared_width) == \
        (2.5, 1, True, True, 16)
    assert list(_parse("sarvam_mla").dense_layers) == [0]
    dots3 = _parse("dots3_note_text", shared_experts_intermediate_size=24).moe
    assert (dots3.shared_width, dots3.routed_scaling_factor, dots3.renormalize) == (24, 1.0, True)
    old = _parse("dots3_note_text", moe_shared_expert_intermediate_size=40, n_shared_experts=2)  # older spellings
    assert old.moe.shared_width == 80 and list(old.dense_layers) == [0]
    assert list(_parse("dots3_note_text", first_k_dense_replace=0, moe_layer_freq=[1, 0, 1, 0]).dense_layers) == [1, 3]
    assert list(_parse("dots3_note_text", mlp_layer_types=["sparse", "dense", "dense", "sparse"]).dense_layers) == [1, 2]
    with pytest.raises(ValueError, match=r"mlp_bias=true puts biases on the shared experts"):
        _parse("dots3_note_text", mlp_bias=True)
    for bad in ([1, 1], [1, 0, 2, 1], [True, False, True, True]):
        with pytest.raises(ValueError, match=r"moe_layer_freq must be a list of num_hidden_layers=4 entries, each 0 "
                                             r"\(dense\) or 1 \(MoE\), got "):
            _parse("dots3_note_text", moe_layer_freq=bad)
    m3 = _parse("minimax_m3_vl_text", shared_intermediate_size=24).moe
    assert (m3.scoring, m3.renormalize, m3.use_correction_bias, m3.routed_scaling_factor, m3.shared_width,
            m3.activation, m3.shared_expert_gate) == ("sigmoid", True, True, 2.0, 24, "swiglu_clamped", False)
    assert list(_parse("minimax_m3_vl_text").dense_layers) == []  # every layer sparse by default
    assert list(_parse("minimax_m3_vl_text", mlp_layer_types=["dense", "sparse", "dense", "sparse"])
                .dense_layers) == [0, 2]
    assert list(_parse("minimax_m3_vl_text", moe_layer_freq=[0, 1, 1, 0]).dense_layers) == [0, 3]  # the hub's list
    with pytest.raises(ValueError, match=r"moe_layer_freq must be a list of num_hidden_layers=4 entries, each 0 "
                                         r"\(dense\) or 1 \(MoE\), got \[1, 1\]"):
        _parse("minimax_m3_vl_text", moe_layer_freq=[1, 1])
    with pytest.raises(ValueError, match=r"swiglu_limit=10.0; moeshard's 'swiglu_clamped' activation computes "
                                         r"limit=7.0 \(the value of every published MiniMax-M3\)"):
        _parse("minimax_m3_vl_text", swiglu_limit=10.0)
    sixteen = dict(num_local_experts=16, num_experts=16)  # its default 8 groups need 8 experts at least
    assert list(_parse("bailing_hybrid", **sixteen).dense_layers) == [0, 1]  # first_k_dense_replace: 2
    assert list(_parse("bailing_hybrid", **sixteen,
                       mlp_layer_types=["dense", "sparse", "sparse", "dense"]).dense_layers) == [0, 3]


def test_exaone_bias_read_under_either_name(models, tmp_path):
    """transformers saves EXAONE-MoE's bias on the block (``mlp.e_score_correction_bias``, as the
    hub has it); a checkpoint written from the module's state dict has it on the router. Both load."""
    import shutil

    from safetensors.torch import load_file, save_file

    from moeshard.checkpoint import load_moe_block

    source = _model(models, "exaone_moe")
    saved = load_moe_block(source, 1)
    assert saved.names.correction_bias == "model.layers.1.mlp.e_score_correction_bias"
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.gate.e_score_correction_bias"] = tensors.pop("model.layers.1.mlp.e_score_correction_bias")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    moved = load_moe_block(tmp_path, 1)
    assert moved.names.correction_bias == "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(moved.weights.correction_bias, saved.weights.correction_bias)
    assert saved.weights.correction_bias.abs().sum() > 0


def test_family_descriptor_refuses_bad_router_names():
    from dataclasses import replace

    from moeshard.checkpoint.families import FAMILIES

    base = FAMILIES["afmoe"]
    assert (base.bias_module, base.bias_names) == ("expert_bias", ("expert_bias",))
    assert FAMILIES["exaone_moe"].bias_names == ("gate.e_score_correction_bias", "e_score_correction_bias")
    with pytest.raises(ValueError, match=r"ModelFamily\('afmoe'\).block_bias: expected None or a parameter name "
                                         r"of the block, got 'router.bias'"):
        replace(base, block_bias="router.bias")
    with pytest.raises(ValueError, match=r"router_weight: expected a dotted parameter name, got ''"):
        replace(base, router_weight="")
    with pytest.raises(ValueError, match=r"bias_aliases: expected tensor names after the block prefix, got \['x.'\]"):
        replace(base, bias_aliases=("x.",))
    with pytest.raises(ValueError, match=r"ModelFamily\('afmoe'\).router_dtype: 'bfloat16' is not one of "
                                         r"\['fp32', 'model'\]"):
        replace(base, router_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"ModelFamily\('axk1'\).output_norm: expected None or a module name of the "
                                         r"block, got 'norm.weight'"):
        replace(FAMILIES["axk1"], output_norm="norm.weight")
    with pytest.raises(ValueError, match=r"output_norm needs moeshard's block in place of transformers'"):
        replace(FAMILIES["deepseek_v4"], output_norm="post_mlp_layernorm")
    with pytest.raises(ValueError, match=r"experts_only needs an experts module name"):
        replace(FAMILIES["deepseek_v4"], experts="")
    with pytest.raises(ValueError, match=r"ModelFamily\('afmoe'\): linear_router=False needs experts_only=True"):
        replace(base, linear_router=False)
    with pytest.raises(ValueError, match=r"ModelFamily\('gemma4_text'\).identity_experts: 'zero_expert_num' needs a "
                                         r"config field name, experts_only=True and linear_router=False"):
        replace(FAMILIES["gemma4_text"], identity_experts="zero_expert_num")


def test_block_refuses_an_output_part_without_its_module_or_under_a_taken_name():
    """``MoEBlock``'s output bias and output norm: a name without its value (or the reverse) and a
    name the layer already uses are refused, naming the part and the layer."""
    from torch import nn

    from moeshard.config import MoEConfig
    from moeshard.integrations.transformers import MoEBlock

    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=4)
    router = nn.Linear(8, 4, bias=False)
    with pytest.raises(ValueError, match=r"MoEBlock \(layer 3\): output_norm_name='post_mlp_layernorm' and "
                                         r"output_norm \(None\) go together"):
        MoEBlock(router, cfg, layer=3, output_norm_name="post_mlp_layernorm")
    with pytest.raises(ValueError, match=r"output_norm_name='experts' is taken by the layer's own attribute"):
        MoEBlock(router, cfg, layer=3, output_norm_name="experts", output_norm=nn.LayerNorm(8))
    with pytest.raises(ValueError, match=r"output_bias_name=None and output_bias \(given\) go together"):
        MoEBlock(router, cfg, layer=3, output_bias=torch.zeros(8))
    block = MoEBlock(router, cfg, layer=3, output_norm_name="post_mlp_layernorm", output_norm=nn.LayerNorm(8))
    assert block.gradient_roles()["post_mlp_layernorm.weight"].kind == "replicated"


def test_minimax_m2_fp8_block_checkpoint(tmp_path):
    """MiniMax-M2 ships FP8 block checkpoints (w1/w3/w2 per expert, weight_scale_inv per 128 x 128
    tile, router and bias unquantized): the experts load as fp8_block as stored, the bias from the
    block, and generation runs."""
    import json

    from safetensors.torch import load_file, save_file

    from moeshard.integrations.transformers import MoEBlock, load_sharded_model
    from moeshard.jobs.generate import greedy

    cfg = tf.AutoConfig.for_model("minimax_m2", **{**SMALL, "hidden_size": 128, "intermediate_size": 128, "head_dim": 32,
                                                   "num_local_experts": 4, "num_experts_per_tok": 2})
    torch.manual_seed(11)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    _randomize_routers(model, "minimax_m2", torch.Generator().manual_seed(12))
    model.save_pretrained(tmp_path)
    stored = _fp8_block_tensors(load_file(tmp_path / "model.safetensors"),
                                lambda name: name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")))
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_sharded_model(tmp_path)
    block = loaded.model.layers[1].mlp
    assert isinstance(block, MoEBlock) and block.quant.scheme == "fp8_block"
    assert block.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert torch.equal(block.e_score_correction_bias, stored["model.layers.1.block_sparse_moe.e_score_correction_bias"])
    ids, logits = greedy(loaded, [PROMPTS[0]], NEW_TOKENS, 0, True)
    assert len(ids[0]) == NEW_TOKENS and torch.isfinite(logits).all()


def _fp8_block_tensors(tensors: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """``tensors`` with each weight ``names`` accepts (2-D, or fused experts [E, R, C]) stored as
    fp8 e4m3 codes and a scale per 128 x 128 tile (the last tile padded), under the FP8 block
    checkpoint's scale names (``weight_scale_inv``, ``<fused>_scale_inv``)."""
    from moeshard.checkpoint.names import scale_name

    stored = {}
    for name, w in tensors.items():
        if w.dim() not in (2, 3) or not names(name):
            stored[name] = w
            continue
        *lead, r, c = w.shape
        n, k = -(-r // 128) * 128, -(-c // 128) * 128
        padded = torch.zeros(*lead, n, k)
        padded[..., :r, :c] = w.abs()
        scale = padded.reshape(*lead, n // 128, 128, k // 128, 128).amax(dim=(-3, -1)).clamp_min(1e-12) / 448.0
        full = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :r, :c]
        stored[name], stored[scale_name(name)] = (w / full).to(torch.float8_e4m3fn), scale
    return stored


def test_minimax_m3_hub_names_and_moe_layer_freq(models, tmp_path):
    """The checkpoint MiniMax publishes names the block as Mixtral does (``block_sparse_moe.``,
    ``experts.{e}.w1/w3/w2``), keeps the shared MLP's gate and up apart and the selection bias on
    the block, and lists its MoE layers as ``moe_layer_freq``; transformers' save fuses the
    shared gate_up and moves the bias to the router. Both read to the same block, and the hub
    one's logits equal transformers' within fp32 1e-5 (the dense parts stay transformers')."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from moeshard.checkpoint import load_moe_block
    from moeshard.integrations.transformers import load_sharded_model

    source = _model(models, "minimax_m3_vl_text")
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    moe, hub = "model.layers.1.mlp.", "model.layers.1.block_sparse_moe."
    gate_up, down = tensors.pop(moe + "experts.gate_up_proj"), tensors.pop(moe + "experts.down_proj")
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        tensors[f"{hub}experts.{e}.w1.weight"] = gate_up[e, :inter].clone()
        tensors[f"{hub}experts.{e}.w3.weight"] = gate_up[e, inter:].clone()
        tensors[f"{hub}experts.{e}.w2.weight"] = down[e].clone()
    shared_gate, shared_up = tensors.pop(moe + "shared_experts.gate_up_proj.weight").chunk(2)
    tensors[hub + "shared_experts.gate_proj.weight"] = shared_gate.clone()
    tensors[hub + "shared_experts.up_proj.weight"] = shared_up.clone()
    tensors[hub + "shared_experts.down_proj.weight"] = tensors.pop(moe + "shared_experts.down_proj.weight")
    tensors[hub + "gate.weight"] = tensors.pop(moe + "gate.weight")
    tensors[hub + "e_score_correction_bias"] = tensors.pop(moe + "gate.e_score_correction_bias")
    assert not [k for k in tensors if k.startswith(moe)]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.pop("mlp_layer_types") == ["dense", "sparse"]
    config["moe_layer_freq"] = [0, 1]
    (tmp_path / "config.json").write_text(json.dumps(config))

    saved, published = load_moe_block(source, 1), load_moe_block(tmp_path, 1)
    assert (saved.names.shared_fused, published.names.shared_fused) == (True, False)
    assert published.names.correction_bias == hub + "e_score_correction_bias"
    for field in ("gate", "correction_bias", "shared_gate", "shared_up", "shared_down"):
        assert torch.equal(getattr(saved.weights, field), getattr(published.weights, field)), field
    for a, b in ((saved.local_experts.gate_up, published.local_experts.gate_up),
                 (saved.local_experts.down, published.local_experts.down)):
        assert torch.equal(a, b)
    ids = torch.tensor([list(PROMPTS[0])])
    want = tf.AutoModelForCausalLM.from_pretrained(source).eval()(ids).logits
    with torch.no_grad():
        got = load_sharded_model(tmp_path)(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_minimax_m3_fused_shared_gate_up_fp8_block_checkpoint(tmp_path):
    """An FP8 block checkpoint of the transformers names: the shared MLP's fused gate_up [2S, H]
    is stored as one fp8 tensor with its tile scales. With S a multiple of 128 it is kept as
    stored for ``quant.shared = fp8_block`` (gate's tiles then up's, the layout the layer takes),
    and in the model dtype it is dequantized whole and split into gate and up; generation runs."""
    import json

    from safetensors.torch import load_file, save_file

    from moeshard.checkpoint import load_moe_block
    from moeshard.checkpoint.dense import in_dtype
    from moeshard.config import QuantConfig
    from moeshard.integrations.transformers import MoEBlock, load_sharded_model
    from moeshard.jobs.generate import greedy

    cfg = tf.AutoConfig.for_model("minimax_m3_vl_text", **{
        **SMALL, **CONFIGS["minimax_m3_vl_text"], "hidden_size": 128, "intermediate_size": 128,
        "shared_intermediate_size": 128, "dense_intermediate_size": 128, "head_dim": 32, "rotary_dim": 16,
        "index_head_dim": 32})
    torch.manual_seed(13)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    _randomize_routers(model, "minimax_m3_vl_text", torch.Generator().manual_seed(14))
    model.save_pretrained(tmp_path)
    moe = "model.layers.1.mlp."
    stored = _fp8_block_tensors(load_file(tmp_path / "model.safetensors"),
                                lambda name: name.startswith((moe + "shared_experts.", moe + "experts.")))
    assert stored[moe + "shared_experts.gate_up_proj.weight"].dtype == torch.float8_e4m3fn
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    block = load_moe_block(tmp_path, 1, quant=QuantConfig("fp8_block", shared="fp8_block"))
    kept = block.shared_stored.gate_up
    assert torch.equal(kept.data[0].view(torch.uint8),
                       stored[moe + "shared_experts.gate_up_proj.weight"].view(torch.uint8))
    assert torch.equal(kept.scale[0], stored[moe + "shared_experts.gate_up_proj.weight_scale_inv"])
    whole = in_dtype(stored[moe + "shared_experts.gate_up_proj.weight"],
                     stored[moe + "shared_experts.gate_up_proj.weight_scale_inv"], block.weights.shared_gate.dtype,
                     "block")
    assert torch.equal(block.weights.shared_gate, whole[:128]) and torch.equal(block.weights.shared_up, whole[128:])
    loaded = load_sharded_model(tmp_path)
    assert isinstance(loaded.model.layers[1].mlp, MoEBlock)
    ids, logits = greedy(loaded, [PROMPTS[0]], NEW_TOKENS, 0, True)
    assert len(ids[0]) == NEW_TOKENS and torch.isfinite(logits).all()
