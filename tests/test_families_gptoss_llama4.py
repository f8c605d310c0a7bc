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
transformers' ``generate``: one spawn per world size runs every case of both families (the
MXFP4 model under TP2, where a rank reads half of each 32-column block of down; its EP2 slices
are read and compared without ranks). In bfloat16 both route transformers' own router inputs
from logits equal to its router's bit for bit (their routers compute in the model dtype, gpt-oss
with the bias inside the product) to the same experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from generate_worlds import GenerateWorlds
from router_parity import bf16_router_parity

from moeshard.jobs.generate import (
    GenerateSpec,
    by_prompt,
    compare_generations,
    generate_rank,
    plan_generate,
    reference_generate,
)
from moeshard.parallel.config import ParallelConfig

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


# -- MXFP4, written here independently of moeshard: e2m1 codes, two a byte (low nibble first),
# one e8m0 exponent per 32 values along the reduction axis, as gpt-oss checkpoints ship them.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]): each block's
    scale the power of two that brings its amax to at most 6, each value the nearest code."""
    *lead, K = w.shape
    groups = w.float().reshape(*lead, K // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(2.0**-100) / 6.0))
    codes = (groups / torch.exp2(exponent).unsqueeze(-1)).unsqueeze(-1).sub(E2M1).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def save_mxfp4_gpt_oss(directory: Path, seed: int) -> None:
    """A tiny gpt_oss saved by transformers, its experts rewritten as MXFP4 blocks and scales in
    the shipped layout (gate_up [E, 2I, H/32, 16] rows interleaved, down [E, H, I/32, 16])."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    cfg = _config("gpt_oss")
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 64, 32, 16  # blocks of 32 along H and I
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate_up_proj_bias", "down_proj_bias")):
                p.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    stored = {}
    for name, t in load_file(directory / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # the model's [E, H, 2I] / [E, I, H] transposed to the stored [E, 2I, H] / [E, H, I]
            stored[name + "_blocks"], stored[name + "_scales"] = mxfp4_quantize(t.transpose(1, 2))
        else:
            stored[name] = t
    save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    # dequantize: transformers' own loading (the reference) dequantizes on a CPU without kernels.
    config["quantization_config"] = {"quant_method": "mxfp4", "dequantize": True,
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """family -> directory of a tiny random model saved by transformers ("gpt_oss_mxfp4": its
    experts in MXFP4)."""
    root = tmp_path_factory.mktemp("tiny-families")
    out = {}
    for seed, family in enumerate(FAMILIES):
        _tiny_model(family, seed).save_pretrained(root / family)
        out[family] = str(root / family)
    save_mxfp4_gpt_oss(root / "gpt_oss_mxfp4", 7)
    out["gpt_oss_mxfp4"] = str(root / "gpt_oss_mxfp4")
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
def test_bf16_router_is_transformers_router(models, family):
    """bf16, on transformers' own router inputs: moeshard's logits are its router's bit for bit
    (fp32 logits would not be) and its experts the same (``router_parity``)."""
    parity = bf16_router_parity(tf, models[family])
    assert parity.logits_differ == parity.ids_differ == parity.biases_differ == 0 and parity.fp32_logits_differ > 0, parity


@pytest.mark.parametrize("family", FAMILIES + ("gpt_oss_mxfp4",))
def test_one_rank_generates_what_transformers_generates(models, reference, family):
    plan = _plan(models, family)
    _check_parity(plan, [generate_rank(plan, None)], reference)


# -- MXFP4 ----------------------------------------------------------------------------------
def test_mxfp4_dequantization_is_transformers_own():
    """Every code and a range of exponents: moeshard's dequantization of the stored bytes equals
    transformers' (``integrations.mxfp4.convert_moe_packed_tensors``, which also transposes to
    the model's [E, K, N]) bit for bit."""
    from moeshard.checkpoint.mxfp4 import dequantize_mxfp4
    mx = pytest.importorskip("transformers.integrations.mxfp4")

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 8, 4), generator=g, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        want = mx.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 128, 8]
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2), want)
    assert set(dequantize_mxfp4(blocks[:1, :1, :1], torch.full((1, 1, 1), 127, dtype=torch.uint8),
                                torch.float32).abs().flatten().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_transformers_reference_holds_mxfp4_experts_in_the_asked_dtype(models, dtype):
    """transformers 5.17 (the GPU machine's) dequantizes MXFP4 experts to bf16 whatever dtype is
    asked, so its fp32 reference ran gpt-oss's experts in bf16 (logits 1e-2 off the 1e-5 parity);
    5.24 loads them in the asked dtype. The reference's loader gives the asked dtype under either,
    with the checkpoint's exact values; and a model holding its experts in bf16, as 5.17 loads
    them, is brought to the same bits."""
    from safetensors.torch import load_file

    from moeshard.checkpoint.hf_model import _mxfp4_experts_in, load_transformers_model
    from moeshard.checkpoint.mxfp4 import dequantize_mxfp4

    stored = load_file(Path(models["gpt_oss_mxfp4"]) / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    want = dequantize_mxfp4(stored[name + "_blocks"], stored[name + "_scales"], dtype).transpose(1, 2)
    model = load_transformers_model(models["gpt_oss_mxfp4"], dtype)
    params = dict(model.named_parameters())
    assert params[name].dtype == dtype and torch.equal(params[name], want)
    for p in params.values():
        if p.dtype == dtype:
            p.data = p.data.to(torch.bfloat16)  # what transformers 5.17 loads for an fp32 model's experts
    _mxfp4_experts_in(model, dtype)
    assert params[name].dtype == dtype and torch.equal(params[name], want)
    assert params["model.layers.1.mlp.experts.down_proj_bias"].dtype == torch.bfloat16  # only the MXFP4 weights


@pytest.mark.parametrize("layout", [ParallelConfig(1, 2, False), ParallelConfig(2, 1, True)],
                         ids=lambda p: p.name)
def test_mxfp4_rank_reads_its_slice_as_transformers_dequantizes(models, layout):
    """Each rank's experts (a TP half of I, whose down columns sit inside one 32-column block,
    or EP whole experts) and biases, read from the MXFP4 checkpoint, equal the same slice of
    transformers' dequantized model; the down bias only on TP rank 0."""
    from moeshard.checkpoint import load_moe_block
    from moeshard.checkpoint.hf_model import load_transformers_model

    ref = load_transformers_model(models["gpt_oss_mxfp4"], torch.float32).eval()
    experts = ref.model.layers[1].mlp.experts  # transformers' dequantized [E, H, 2I] interleaved, [E, I, H]
    gate_up = experts.gate_up_proj.transpose(1, 2)
    gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)  # gate rows, then up rows
    down, I = experts.down_proj.transpose(1, 2), experts.intermediate_size
    bias = torch.cat([experts.gate_up_proj_bias[:, 0::2], experts.gate_up_proj_bias[:, 1::2]], dim=1)
    for rank in range(layout.world_size):
        block = load_moe_block(models["gpt_oss_mxfp4"], 1, parallel=layout, rank=rank)
        assert block.model.checkpoint_format == "mxfp4" and block.quant.scheme == "none"
        got, s = block.local_experts, block.spec
        e = slice(s.expert_start, s.expert_stop)
        w = I // s.tp_size
        lo, hi = s.tp_rank * w, (s.tp_rank + 1) * w
        assert torch.equal(got.gate_up, torch.cat([gate_up[e, lo:hi], gate_up[e, I + lo:I + hi]], dim=1))
        assert torch.equal(got.down, down[e, :, lo:hi])
        assert torch.equal(got.gate_up_bias, torch.cat([bias[e, lo:hi], bias[e, I + lo:I + hi]], dim=1))
        if s.tp_rank == 0:
            assert torch.equal(got.down_bias, experts.down_proj_bias[e])
        else:
            assert got.down_bias is None


def test_mxfp4_refused_where_it_cannot_be_read(models, tmp_path):
    from moeshard.checkpoint.hf_config import parse_hf_config

    config = json.loads((Path(models["gpt_oss_mxfp4"]) / "config.json").read_text())
    mixtral = {"model_type": "mixtral", "num_hidden_layers": 1, "num_local_experts": 4, "num_experts_per_tok": 2,
               "hidden_size": 64, "intermediate_size": 32, "quantization_config": config["quantization_config"]}
    with pytest.raises(ValueError, match="quant_method='mxfp4' is not supported for model_type 'mixtral'"):
        parse_hf_config(mixtral)
    assert parse_hf_config(config).checkpoint_format == "mxfp4"
    with pytest.raises(ValueError, match=r"swiglu_limit=8.0; moeshard's 'swiglu_clamped' activation computes "
                                         r"limit=7.0"):
        parse_hf_config({**config, "swiglu_limit": 8.0})


# -- several ranks: one spawn per world size --------------------------------------------------
WORLD_CASES = {
    2: [(ParallelConfig(2, 1, True), FAMILIES), (ParallelConfig(1, 2, True), FAMILIES),
        (ParallelConfig(1, 2, False), FAMILIES + ("gpt_oss_mxfp4",))],
    4: [(ParallelConfig(2, 2, True), FAMILIES)],
}


@pytest.fixture(scope="module")
def world(models):
    """world size -> {(layout name, family): (plan, per-rank results)}, every case of that size
    in one spawn."""

    def cases(ws: int):
        keys = [(layout.name, family) for layout, families in WORLD_CASES[ws] for family in families]
        return keys, [_plan(models, family, ParallelConfig.parse(layout)) for layout, family in keys]

    return GenerateWorlds(cases, SPAWN_TIMEOUT_S)


def _world_params():
    # The 4-rank spawn (dp2-tp2-ep) runs in make test-slow: make test proves that layout for the
    # built-in families (tests/test_transformers_integration.py), and these families' own parts
    # (router bias, expert biases, input weights) under EP and TP in the 2-rank spawn.
    return [pytest.param(ws, layout.name, family, id=f"{layout.name}-{family}",
                         marks=[pytest.mark.slow] if ws == 4 else [])
            for ws, cases in WORLD_CASES.items() for layout, families in cases for family in families]


@pytest.mark.parametrize("ws, layout, family", _world_params())
def test_layout_generates_what_transformers_generates(world, reference, ws, layout, family):
    plan, results = world(ws)[(layout, family)]
    _check_parity(plan, results, reference)
    p = plan.parallel
    if p.enable_ep:  # whole experts, 1/(dp*tp) of them per rank
        per = plan.cfg.num_experts // ws
        assert [r.experts for r in results] == [(r * per, (r + 1) * per) for r in range(ws)]
