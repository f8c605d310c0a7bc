"""gpt-oss and Llama-4 (text) run by moeshard, proved against transformers.

Tiny random models are built from transformers' own config classes (``AutoConfig.for_model``)
and saved with ``save_pretrained``:

* gpt_oss: a router with a bias, softmax over the top-k logits, experts with biases (random,
  since transformers initialises them to zero), the clamped SwiGLU, gate/up interleaved in a
  transposed ``gate_up_proj``; an MXFP4 copy of it (experts as ``*_blocks`` / ``*_scales``);
* llama4_text: sigmoid scores on the expert's input, top-1, a shared expert, MoE on every second
  layer (layer 0 keeps transformers' dense MLP), transposed experts.

At (1,1) the logits equal transformers' (fp32, 1e-5), through ``load_sharded_model`` and
``shard_moe_blocks``; under EP2, SP, TP2 and (2,2,ep) on CPU ranks the greedy ids equal
transformers' ``generate``: one spawn per world size runs every case of both families.
"""

from __future__ import annotations

import pytest
import torch

from moeshard.jobs.generate import (
    GenerateSpec,
    by_prompt,
    compare_generations,
    generate_plans,
    generate_rank,
    plan_generate,
    reference_generate,
)
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.spawn import RankFailure, spawn

tf = pytest.importorskip("transformers")

SPAWN_TIMEOUT_S = 240.0
NEW_TOKENS = 6
PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11,))
SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, initializer_range=0.1)
FAMILIES = ("gpt_oss", "llama4_text")


def _config(family: str):
    try:
        if family == "gpt_oss":
            return tf.AutoConfig.for_model("gpt_oss", **SMALL, intermediate_size=16, num_local_experts=4,
                                           num_experts_per_tok=2, max_position_embeddings=128)
        return tf.AutoConfig.for_model("llama4_text", **SMALL, intermediate_size=16, intermediate_size_mlp=24,
                                       num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2)
    except ValueError as exc:  # an older transformers without the model type
        pytest.skip(f"transformers {tf.__version__} has no {family} config class: {exc}")


def _tiny_model(family: str, seed: int):
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(_config(family)).eval()
    with torch.no_grad():
        # transformers initialises the expert biases to zero: random ones, so that a dropped or
        # misplaced bias (a TP rank adding it twice, an EP slot holding another expert's) shows.
        for name, p in model.named_parameters():
            if name.endswith(("gate_up_proj_bias", "down_proj_bias")):
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """family -> directory of a tiny random model saved by transformers."""
    root = tmp_path_factory.mktemp("tiny-families")
    out = {}
    for seed, family in enumerate(FAMILIES):
        _tiny_model(family, seed).save_pretrained(root / family)
        out[family] = str(root / family)
    return out


def _plan(models, family: str, layout: ParallelConfig | None = None, **kw):
    return plan_generate(GenerateSpec(models[family], PROMPTS, NEW_TOKENS, layout or ParallelConfig(), compare=True,
                                      **kw))


@pytest.fixture(scope="module")
def reference(models):
    """transformers alone for a plan's batches, computed once per (model, dtype, batches)."""
    cache = {}

    def get(plan):
        key = (plan.spec.model_dir, plan.dtype, plan.dp_prompts)
        if key not in cache:
            cache[key] = reference_generate(plan)
        return cache[key]

    return get


def _check_parity(plan, results, reference):
    for r in results:
        assert not isinstance(r, dict), f"rank raised: {r}"
        assert r.tp_disagreements == 0
    c = compare_generations(plan, results, reference(plan))
    assert c.within_tolerance, f"{plan.parallel.name} {plan.model_type}: logits off by {c.step_max_abs}"
    assert all(c.same_ids), f"{plan.parallel.name} {plan.model_type}: ids differ at steps {c.first_difference}"
    assert len(by_prompt(plan, results)) == len(PROMPTS)
    return c


# -- one rank ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_logits_equal_transformers(models, family):
    """fp32 logits within 1e-5 of transformers', from the checkpoint and from a model in memory;
    the block returns what transformers' block returns (a tuple)."""
    from moeshard.integrations.transformers import MoEBlock, load_sharded_model, shard_moe_blocks

    ids = torch.tensor([list(PROMPTS[0]), [1, 2, 3, 4, 5]])
    plain = tf.AutoModelForCausalLM.from_pretrained(models[family]).eval()
    want = plain(ids).logits
    for model in (load_sharded_model(models[family]),
                  shard_moe_blocks(tf.AutoModelForCausalLM.from_pretrained(models[family]).eval())):
        blocks = [getattr(layer, "mlp", None) or layer.feed_forward for layer in model.model.layers]
        assert [isinstance(b, MoEBlock) for b in blocks] == ([True, True] if family == "gpt_oss" else [False, True])
        got = model(ids).logits
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_generates_what_transformers_generates(models, reference, family):
    plan = _plan(models, family)
    _check_parity(plan, [generate_rank(plan, None)], reference)


# -- several ranks: one spawn per world size --------------------------------------------------
WORLD_CASES = {
    2: [ParallelConfig(2, 1, True), ParallelConfig(1, 2, True), ParallelConfig(1, 2, False)],
    4: [ParallelConfig(2, 2, True)],
}


@pytest.fixture(scope="module")
def world(models):
    """world size -> {(layout name, family): (plan, per-rank results)}, every case of that size
    in one spawn."""
    cache: dict[int, object] = {}

    def get(ws: int):
        if ws not in cache:
            keys = [(layout.name, family) for layout in WORLD_CASES[ws] for family in FAMILIES]
            plans = [_plan(models, family, ParallelConfig.parse(layout)) for layout, family in keys]
            try:
                per_rank = spawn(generate_plans, ws, args=(plans,), timeout_s=SPAWN_TIMEOUT_S)
            except RankFailure as failure:
                cache[ws] = failure
            else:
                cache[ws] = {key: (plan, [per_rank[r][i] for r in range(ws)])
                             for i, (key, plan) in enumerate(zip(keys, plans, strict=True))}
        if isinstance(cache[ws], RankFailure):
            pytest.fail(f"the {ws}-rank run failed:\n{cache[ws]}")
        return cache[ws]

    return get


def _world_params():
    return [pytest.param(ws, layout.name, family, id=f"{layout.name}-{family}")
            for ws, layouts in WORLD_CASES.items() for layout in layouts for family in FAMILIES]


@pytest.mark.parametrize("ws, layout, family", _world_params())
def test_layout_generates_what_transformers_generates(world, reference, ws, layout, family):
    plan, results = world(ws)[(layout, family)]
    _check_parity(plan, results, reference)
    p = plan.parallel
    if p.enable_ep:  # whole experts, 1/(dp*tp) of them per rank
        per = plan.cfg.num_experts // ws
        assert [r.experts for r in results] == [(r * per, (r + 1) * per) for r in range(ws)]
