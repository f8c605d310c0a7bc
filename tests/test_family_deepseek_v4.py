"""DeepSeek-V4, a whole tiny random transformers model against transformers itself.

Its blocks route themselves: the first layer by token id (``gate.tid2eid``), the others on
sqrt(softplus) scores plus a selection bias. moeshard runs the routed experts (``MoEExperts``) on
the ids and weights transformers' routers hand them; the routers and the shared MLP stay
transformers'. The tiny model has one layer of each attention kind (compressed sparse with its
indexer, heavily compressed, sliding), random router weights, a random token table (distinct
experts per token) and selection bias (transformers initialises them to zeros, where every
expert ties), and its experts' gate_up scaled so that the clamped SwiGLU's limit is reached.

At one rank the logits and loss equal transformers' within fp32 1e-5, loaded from the checkpoint
(which transformers writes under the hub's names; the release's flat names read to the same
model) and sharded in memory; the hash layer's experts
receive exactly ``tid2eid[input_ids]``. Greedy ids and logits equal transformers' under SP
(dp1-tp2-ep), and in make test-slow under EP2 (dp2-tp1-ep), TP2 (dp1-tp2-noep) and dp2-tp2-ep. The
routing kind that describes the learned layers, ``sqrtsoftplus_bias_model``, picks the experts of
transformers' router with its weights bit for bit in bfloat16 and float32. Skipped where the
installed transformers has no DeepSeek-V4.
"""

from __future__ import annotations

import pytest
import torch
from generate_worlds import GenerateWorlds

from moeshard.jobs.generate import (
    GenerateSpec,
    compare_generations,
    plan_generate,
    reference_generate,
)
from moeshard.parallel.config import ParallelConfig

tf = pytest.importorskip("transformers")

SPAWN_TIMEOUT_S = 300.0
NEW_TOKENS = 4
VOCAB, E, K = 64, 4, 2
PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11,))
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
              head_dim=16, q_lora_rank=16, qk_rope_head_dim=8, moe_intermediate_size=16, n_routed_experts=E,
              num_experts_per_tok=K, mlp_layer_types=["hash_moe", "moe", "moe"], o_groups=2, o_lora_rank=8,
              index_n_heads=2, index_head_dim=8, index_topk=4, sliding_window=8, hc_mult=2,
              max_position_embeddings=256,
              layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"])
GATE_UP_SCALE = 20.0  # about a third of the gate and up products pass the limit of 10


def _config():
    try:
        return tf.AutoConfig.for_model("deepseek_v4", **CONFIG)
    except (KeyError, ValueError):
        pytest.skip(f"transformers {tf.__version__} has no DeepSeek-V4 config class taking the tiny model's arguments")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    cfg = _config()
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            block = layer.mlp
            block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=gen) * 2 / cfg.hidden_size ** 0.5)
            if hasattr(block.gate, "tid2eid"):
                block.gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(VOCAB)]))
            else:
                block.gate.e_score_correction_bias.copy_(torch.rand(E, generator=gen) * 0.3)
            block.experts.gate_up_proj.mul_(GATE_UP_SCALE)
    out = tmp_path_factory.mktemp("tiny-deepseek-v4") / "m"
    model.save_pretrained(out)
    return str(out)


def _plan(model_dir: str, layout: ParallelConfig | None = None, dtype: str | None = None):
    return plan_generate(GenerateSpec(model_dir, PROMPTS, NEW_TOKENS, layout or ParallelConfig(), compare=True,
                                      dtype=dtype))


def test_one_rank_logits_equal_transformers_and_the_routers_stay_its_own(model_dir):
    """(1,1), fp32: loaded from the checkpoint and sharded in memory, every layer's experts are
    moeshard's and its router and shared MLP transformers'; logits and loss within 1e-5."""
    from moeshard.integrations.given_routing import MoEExperts
    from moeshard.integrations.transformers import load_sharded_model, shard_moe_blocks

    ids = torch.tensor([list(PROMPTS[0]), [1, 2, 3, 4, 5]])
    plain = tf.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        want = plain(ids, labels=ids)
    for model in (load_sharded_model(model_dir), shard_moe_blocks(tf.AutoModelForCausalLM.from_pretrained(model_dir).eval())):
        blocks = [layer.mlp for layer in model.model.layers]
        assert all(isinstance(b.experts, MoEExperts) for b in blocks)
        assert [type(b.gate).__name__ for b in blocks] == ["DeepseekV4HashRouter", "DeepseekV4TopKRouter",
                                                           "DeepseekV4TopKRouter"]
        assert torch.equal(blocks[0].gate.tid2eid, plain.model.layers[0].mlp.gate.tid2eid)
        assert torch.equal(blocks[1].gate.e_score_correction_bias, plain.model.layers[1].mlp.gate.e_score_correction_bias)
        with torch.no_grad():
            got = model(ids, labels=ids)
        assert torch.allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5), (got.logits - want.logits).abs().max()
        assert torch.allclose(got.loss, want.loss, atol=1e-6)


def test_the_hash_layer_hands_the_token_table_to_the_experts(model_dir):
    """The first layer's experts receive, for every token, exactly ``tid2eid[token id]``, with the
    weights transformers' hash router gave; the learned layers' selection bias decides some
    token's experts (without it the router would pick others), so neither is ignored."""
    from moeshard.integrations.transformers import load_sharded_model

    model = load_sharded_model(model_dir)
    handed, routed = {}, {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        hooks.append(layer.mlp.experts.register_forward_hook(
            lambda _m, args, _out, i=index: handed.__setitem__(i, args)))
        hooks.append(layer.mlp.gate.register_forward_hook(lambda _m, _a, out, i=index: routed.__setitem__(i, out)))
    ids = torch.tensor([list(PROMPTS[0]), [1, 2, 3, 4, 5]])
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    table = model.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(handed[0][1], table[ids.reshape(-1)])
    for index in range(3):
        assert torch.equal(handed[index][1], routed[index][2]) and torch.equal(handed[index][2], routed[index][1])
    gate = model.model.layers[1].mlp.gate
    rows = handed[1][0]
    unbiased = torch.nn.functional.softplus(torch.nn.functional.linear(rows, gate.weight)).sqrt().topk(K).indices
    assert not torch.equal(unbiased.sort().values, handed[1][1].sort().values)


def test_the_releases_flat_names_read_to_the_same_model(model_dir, tmp_path):
    """DeepSeek-V4's release keeps its tensors in a flat namespace (``layers.{L}.``, ``embed.weight``,
    ``norm.weight``, ``head.weight``, ``hc_head_fn``), which transformers reads as it reads its own
    saves: the same tensors so named give moeshard's model the same logits, bit for bit."""
    import shutil

    from safetensors.torch import load_file, save_file

    from moeshard.integrations.transformers import load_sharded_model

    saved = load_file(f"{model_dir}/model.safetensors")
    renames = (("model.layers.", "layers."), ("model.embed_tokens.", "embed."), ("model.norm.", "norm."),
               ("model.hc_head.hc_", "hc_head_"))
    released = {next((new + n[len(old):] for old, new in renames if n.startswith(old)), n): t for n, t in saved.items()}
    assert sorted(n for n in released if not n.startswith("layers.")) == [
        "embed.weight", "hc_head_base", "hc_head_fn", "hc_head_scale", "head.weight", "norm.weight"]
    flat = tmp_path / "flat"
    shutil.copytree(model_dir, flat)
    save_file(released, str(flat / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.tensor([list(PROMPTS[0])])
    with torch.no_grad():
        assert torch.equal(load_sharded_model(str(flat))(ids).logits, load_sharded_model(model_dir)(ids).logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_routing_kind_is_transformers_learned_router(dtype):
    """``sqrtsoftplus_bias_model`` on transformers' own router module: the same experts, and the
    same weights bit for bit (each id's weight, whatever the order top-k returns them in), over
    rows whose scores in bfloat16 often sit a rounding apart."""
    from moeshard.config import MoEConfig
    from moeshard.router import route_tokens

    cfg = _config()
    router = type(tf.AutoModelForCausalLM.from_config(cfg).model.layers[1].mlp.gate)(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        # The weight in the model dtype, the selection bias in fp32, as from_pretrained holds them.
        router.weight.data = (torch.randn(router.weight.shape, generator=gen) * 2 / cfg.hidden_size ** 0.5).to(dtype)
        router.e_score_correction_bias.copy_(torch.rand(E, generator=gen) * 0.3)
    x = torch.randn(257, cfg.hidden_size, generator=gen).to(dtype)
    with torch.no_grad():
        _, want_weights, want_ids = router(x)
    moe = MoEConfig(num_experts=E, top_k=K, hidden_size=cfg.hidden_size, intermediate_size=16,
                    scoring="sqrtsoftplus_bias_model", routed_scaling_factor=cfg.routed_scaling_factor,
                    use_correction_bias=True, router_dtype="model", dtype=dtype)
    got = route_tokens(x, router.weight, moe, router.e_score_correction_bias)
    order_got, order_want = got.topk_ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(got.topk_ids.gather(1, order_got), want_ids.gather(1, order_want))
    assert torch.equal(got.topk_weights.gather(1, order_got), want_weights.float().gather(1, order_want))


@pytest.mark.parametrize("fields, message", [
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ({"swiglu_limit": 7.0}, "swiglu_limit=7.0"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_layer_types": ["dense", "moe"]}, "mlp_layer_types=['dense', 'moe']"),
])
def test_config_fields_moeshard_cannot_describe_are_refused(fields, message):
    from moeshard.checkpoint.hf_config import parse_hf_config

    base = {"model_type": "deepseek_v4", "num_hidden_layers": 2, "hidden_size": 32, "moe_intermediate_size": 16,
            "num_experts_per_tok": 2, "n_routed_experts": 4}
    info = parse_hf_config(base, "deepseek_v4/config.json")
    assert info.moe.scoring == "sqrtsoftplus_bias_model" and info.moe.activation == "silu_clamped"
    assert list(info.dense_layers) == []
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_hf_config({**base, **fields}, "deepseek_v4/config.json")


def test_training_with_transformers_load_balancing_loss_is_refused(tmp_path, capsys):
    """moeshard train adds the load-balancing loss over the global batch from moeshard's own
    routers; DeepSeek-V4's are transformers', so a config that turns the loss on is refused
    before any rank starts, naming the field (without it the model trains: test_train_families)."""
    import sys
    from pathlib import Path

    from moeshard.cli import main

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import make_tiny_moe

    _config()  # skipped where transformers has no DeepSeek-V4
    make_tiny_moe.make(str(tmp_path / "m"), "deepseek_v4", hidden=64, moe_intermediate=32, experts=4, vocab=64,
                       router_aux_loss_coef=0.01)
    assert main(["train", "--model", str(tmp_path / "m"), "--input-ids", "3,17,42;5,6,7", "--steps", "1"]) == 2
    assert "output_router_logits true" in capsys.readouterr().err


def test_run_refuses_it(model_dir, capsys):
    """``moeshard run`` routes one block alone, without token ids: refused, exit 2."""
    from moeshard.cli import main

    assert main(["run", "--model", model_dir, "--layer", "0", "--tokens", "4"]) == 2
    assert "model_type 'deepseek_v4' routes with transformers' router" in capsys.readouterr().err


def test_a_transformers_whose_norm_returns_float32_is_refused_below_float32(model_dir, monkeypatch, capsys):
    """transformers 5.17 keeps DeepSeek-V4's norms in float32 and returns their float32 output into
    the attention's bfloat16 projections, so neither it nor moeshard's model runs in bfloat16 there
    (the GPU machine's transformers). That norm planted here: the model is refused in bfloat16
    before any rank starts, naming the dtype and transformers, and still built in float32."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as theirs

    from moeshard.checkpoint.hf_config import read_hf_config
    from moeshard.cli import main

    info = read_hf_config(model_dir)
    if theirs.DeepseekV4RMSNorm(2)(torch.ones(1, 2, dtype=torch.bfloat16)).dtype == torch.bfloat16:
        assert info.moe_config(torch.bfloat16).dtype == torch.bfloat16  # the installed transformers runs it
    else:  # transformers 5.17 (make test-compat)
        with pytest.raises(ValueError, match="cannot run DeepSeek-V4"):
            info.moe_config(torch.bfloat16)
    monkeypatch.setattr(theirs.DeepseekV4RMSNorm, "forward", lambda self, x: self.weight * x.float())
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16: transformers \S+ cannot run DeepSeek-V4"):
        info.moe_config(torch.bfloat16)
    assert info.moe_config(torch.float32).dtype == torch.float32
    assert main(["generate", "--model", model_dir, "--input-ids", "3,17,42", "--dtype", "bfloat16",
                 "--max-new-tokens", "1"]) == 2
    assert "returns torch.float32 rows to the attention's torch.bfloat16 projections" in capsys.readouterr().err


# -- several ranks ----------------------------------------------------------------------------
# One spawn per group. make test runs SP (its given routing cut into each TP rank's chunk, the
# path Gemma 4's decoder layer takes too); EP2, TP2 and dp2-tp2-ep run in make test-slow.
GROUPS = {"sp": (ParallelConfig(1, 2, True),), "two": (ParallelConfig(2, 1, True), ParallelConfig(1, 2, False)),
          "four": (ParallelConfig(2, 2, True),)}


@pytest.fixture(scope="module")
def world(model_dir):
    def cases(group: str):
        return [layout.name for layout in GROUPS[group]], [_plan(model_dir, layout) for layout in GROUPS[group]]

    return GenerateWorlds(cases, SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("group, layout", [
    pytest.param(group, layout.name, id=layout.name, marks=[] if group == "sp" else [pytest.mark.slow])
    for group, layouts in GROUPS.items() for layout in layouts])
def test_layout_generates_what_transformers_generates(model_dir, world, group, layout):
    plan, results = world(group)[layout]
    ws = plan.parallel.world_size
    for r in results:
        assert not isinstance(r, dict), f"rank raised: {r}"
    c = compare_generations(plan, results, reference_generate(plan))
    assert c.atol == 1e-5 and c.within_tolerance, f"{layout}: logits off by {c.step_max_abs}"
    assert all(c.same_ids), f"{layout}: ids differ at steps {c.first_difference}"
    p = plan.parallel
    if p.enable_ep:  # each rank holds only its own experts
        per = E // ws
        assert [r.experts for r in results] == [(r * per, (r + 1) * per) for r in range(ws)]
    else:
        width = plan.cfg.intermediate_size // p.tp
        assert [r.intermediate for r in results] == [(t * width, (t + 1) * width) for t in range(p.tp)]
