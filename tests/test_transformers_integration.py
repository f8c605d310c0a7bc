"""Whole transformers models with their MoE blocks run by moeshard.

Tiny random Mixtral, Qwen2-MoE, Qwen3-MoE (tied embeddings) and DeepSeek-V3 (a dense first
layer, grouped routing, shared experts) models are saved with ``save_pretrained``; every rank
loads its share with ``load_sharded_model`` (or shards a model in memory with
``shard_moe_blocks``) and generates greedily. The expected values are transformers' own: the
same prompts, as the same batches, through ``from_pretrained`` and ``generate`` with no moeshard.

One spawn per world size runs every case of that size: world 2 (EP2, DP, TP, and the in-memory
API under EP2), world 4 (SP: dp2-tp2-ep, and dp2-tp2-noep).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from router_parity import bf16_router_parity

from moeshard.config import QuantConfig
from moeshard.jobs.generate import (
    GenerateSpec,
    by_prompt,
    compare_generations,
    generate_plans,
    generate_rank,
    greedy,
    plan_generate,
    reference_generate,
)
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.spawn import RankFailure, spawn
from moeshard.tolerances import LOGITS

tf = pytest.importorskip("transformers")

SPAWN_TIMEOUT_S = 240.0
NEW_TOKENS = 8
# Different lengths (left padding inside a batch); with dp=2, DP rank 0 runs prompts 0-1, rank 1 runs 2-3.
PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11,))
SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.1)


def _configs():
    return {
        "mixtral": tf.MixtralConfig(**SMALL, intermediate_size=48, num_key_value_heads=2, num_local_experts=4,
                                    num_experts_per_tok=2),
        "qwen2_moe": tf.Qwen2MoeConfig(**SMALL, intermediate_size=48, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=24, num_key_value_heads=2, num_experts=4,
                                       num_experts_per_tok=2),
        "qwen3_moe": tf.Qwen3MoeConfig(**SMALL, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=2,
                                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                       tie_word_embeddings=True),
        "deepseek_v3": tf.DeepseekV3Config(**SMALL, intermediate_size=48, moe_intermediate_size=16,
                                           first_k_dense_replace=1, num_key_value_heads=4, n_routed_experts=8,
                                           num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                           q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                           v_head_dim=8),
    }


FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """family -> directory of a tiny random model saved by transformers."""
    root = tmp_path_factory.mktemp("tiny-moe")
    out = {}
    for seed, (name, cfg) in enumerate(_configs().items()):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(cfg).eval()
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def _plan(models, family: str, layout: ParallelConfig | None = None, **kw):
    layout = layout or ParallelConfig()
    return plan_generate(GenerateSpec(models[family], PROMPTS, NEW_TOKENS, layout, compare=True, **kw))


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


def _check_parity(plan, results, reference, same_ids=True):
    for r in results:
        assert not isinstance(r, dict), f"rank raised: {r}"
        assert r.tp_disagreements == 0
    c = compare_generations(plan, results, reference(plan))
    assert c.within_tolerance, f"{plan.parallel.name} {plan.model_type}: logits off by {c.step_max_abs}"
    if same_ids:
        assert all(c.same_ids), f"{plan.parallel.name} {plan.model_type}: ids differ at steps {c.first_difference}"
    assert len(by_prompt(plan, results)) == len(PROMPTS)
    return c


def _full_expert_bytes(plan) -> int:
    cfg = plan.cfg
    moe_layers = plan.model_type != "deepseek_v3" and 2 or 1
    return moe_layers * cfg.num_experts * 3 * cfg.intermediate_size * cfg.hidden_size * cfg.dtype.itemsize


# -- one rank ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_generates_what_transformers_generates(models, reference, family):
    plan = _plan(models, family)
    result = generate_rank(plan, None)
    _check_parity(plan, [result], reference)
    assert result.expert_bytes == _full_expert_bytes(plan)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("threads", [1, 2])
def test_router_logits_and_loss_kept(models, family, threads):
    """The model's forward with labels and output_router_logits: same loss, same aux loss, and the
    recorded router logits are transformers' router module's own output (the block keeps it).

    Bit-equal where transformers' router sees the same rows: the first MoE layer's logits equal
    the plain model's, and every layer's recorded logits equal transformers' router applied to the
    rows that reached that block. A later layer's rows come from an earlier MoE block, whose sum
    moeshard computes in another GEMM order than transformers' experts; with more than one CPU
    thread the blocking differs and the rows differ by float rounding (~1e-7), so across models the
    later layers' logits are compared at 1e-5. Run at 1 and 2 threads: the suite's thread count
    depends on which tests ran before in the same process, and both must pass."""
    from moeshard.integrations.transformers import MoEBlock, find_moe_blocks, load_sharded_model, shard_moe_blocks

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ids = torch.tensor([list(PROMPTS[0]), [1, 2, 3, 4, 5]])
        plain = tf.AutoModelForCausalLM.from_pretrained(models[family]).eval()
        want = plain(ids, labels=ids, output_router_logits=True)
        for model in (load_sharded_model(models[family]),
                      shard_moe_blocks(tf.AutoModelForCausalLM.from_pretrained(models[family]).eval())):
            blocks = [layer.mlp for layer in model.model.layers]
            assert [isinstance(b, MoEBlock) for b in blocks] == [family != "deepseek_v3", True]
            seen: list[torch.Tensor] = []
            def record(_module, args, seen=seen):
                seen.append(args[0].detach().clone())
            hooks = [b.register_forward_pre_hook(record) for b in blocks if isinstance(b, MoEBlock)]
            try:
                got = model(ids, labels=ids, output_router_logits=True)
            finally:
                for h in hooks:
                    h.remove()
            assert torch.allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)
            assert torch.allclose(got.loss, want.loss, atol=1e-6)
            if getattr(want, "aux_loss", None) is not None:
                assert torch.allclose(got.aux_loss, want.aux_loss, atol=1e-6)
            with pytest.raises(ValueError, match="already a moeshard MoEBlock"):
                find_moe_blocks(model)
            if getattr(want, "router_logits", None) is None:
                # transformers before 5.24 records no router logits for DeepSeek-V3: neither may we.
                assert getattr(got, "router_logits", None) is None
                continue
            assert len(got.router_logits) == len(want.router_logits) == len(seen) > 0
            moe_blocks = [b for b in blocks if isinstance(b, MoEBlock)]
            for i, (a, b, rows, block) in enumerate(zip(got.router_logits, want.router_logits, seen, moe_blocks,
                                                        strict=True)):
                assert torch.equal(a, torch.nn.functional.linear(rows.reshape(-1, rows.shape[-1]), block.gate.weight))
                if i == 0:
                    assert torch.equal(a, b)
                else:
                    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_bf16_logits_within_tolerance(models, reference, family):
    """bf16: moeshard's block sums in fp32 and rounds once, transformers' rounds each expert's
    share, so logits differ by about a bf16 ulp; they stay within the bf16 tolerance at every
    step that has the same context (up to and including the first differing id, if any)."""
    plan = _plan(models, family, dtype="bfloat16")
    result = generate_rank(plan, None)
    c = _check_parity(plan, [result], reference, same_ids=False)
    assert c.atol == LOGITS["bfloat16"][0] and c.max_abs > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_router_is_transformers_router(models, family):
    """bf16, on transformers' own router inputs: moeshard's logits are its router's bit for bit
    and its experts the same (``router_parity``): Mixtral's and Qwen's routers compute in bf16
    (fp32 logits would differ), DeepSeek-V3's in fp32."""
    parity = bf16_router_parity(tf, models[family])
    assert parity.logits_differ == parity.ids_differ == parity.biases_differ == 0, parity
    assert (parity.fp32_logits_differ > 0) == (family != "deepseek_v3"), parity


def test_fp8_block_reports_its_quantization_error(models, reference):
    """A quantized run is compared with the unquantized model: the difference is its quantization
    error, reported (not judged by the tolerance table, which bounds parallel error)."""
    plan = _plan(models, "qwen3_moe", quant="fp8_block")
    result = generate_rank(plan, None)
    c = compare_generations(plan, [result], reference(plan))
    assert c.within_tolerance is None and c.quant == "fp8_block"
    assert 1e-4 < c.max_abs < 0.25, c.step_max_abs
    assert result.expert_bytes < _full_expert_bytes(plan) / 3  # fp8 bytes + scales, from fp32


def test_float32_beyond_the_table_is_judged_against_float32_rounding(models, reference):
    """Why: a whole model's float32 logits move with the order of rounding alone (on one H200,
    tiny gpt-oss: transformers' own float32 logits 1.3e-4 from its float64 ones, moeshard's 1.7e-5
    from transformers', beyond the 1e-5 table). A run beyond the table is judged against twice
    transformers' own float32 distance from float64 (the largest over the steps); farther is still a
    failure.
    The real float64 reference runs, then planted offsets on transformers' logits test the rule."""
    plan = _plan(models, "qwen3_moe")
    result = generate_rank(plan, None)
    ref = reference(plan)
    exact = reference_generate(plan, dtype=torch.float64)
    c = compare_generations(plan, [result], ref, exact)
    assert c.within_tolerance and c.noise_dtype == "float64" and c.within_noise
    assert all(n is not None and 0 < n < 1e-4 for n in c.dtype_noise), c.dtype_noise
    # Plant an offset of 1e-3 on one logit of transformers' float32 run at step 2 (beyond the table).
    planted = [(ids, logits.clone()) for ids, logits in ref]
    planted[0][1][2, 0, 5] += 1e-3
    c = compare_generations(plan, [result], planted)
    assert c.within_tolerance is False and c.within_noise is None
    # transformers' float32 rounding taken as 6e-4 (the "float64" run 6e-4 away at step 2): within.
    noisy = [(ids, logits.clone()) for ids, logits in planted]
    noisy[0][1][2] += 6e-4
    c = compare_generations(plan, [result], planted, noisy)
    assert c.within_tolerance is False and c.within_noise, (c.step_max_abs, c.dtype_noise)
    # ... as 4e-4: the 1e-3 difference is more than twice that, a failure.
    quiet = [(ids, logits.clone()) for ids, logits in planted]
    quiet[0][1][2] += 4e-4
    c = compare_generations(plan, [result], planted, quiet)
    assert c.within_tolerance is False and c.within_noise is False


def test_eos_does_not_stop_generation(models):
    """Every prompt gets exactly max_new_tokens (under EP every rank must run as many forward
    passes as the others), even when the model's EOS comes up; the model's own generation config
    is left as it was."""
    model = tf.AutoModelForCausalLM.from_pretrained(models["qwen2_moe"]).eval()
    ids, _ = greedy(model, [PROMPTS[0]], NEW_TOKENS, 0, False)
    model.generation_config.eos_token_id = ids[0][1]
    again, _ = greedy(model, [PROMPTS[0]], NEW_TOKENS, 0, False)
    assert again == ids and len(ids[0]) == NEW_TOKENS
    assert model.generation_config.eos_token_id == ids[0][1]


def _fp8_block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale_inv [ceil(N/128), ceil(K/128)]), w ~= q * scale_inv per
    128 x 128 tile: DeepSeek-V3's convention, written out here independently of moeshard.quant."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-N // 128), -(-K // 128))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s[i, j] = tile.abs().max() / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (tile / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def _write_fp8_deepseek(path: Path, moe_intermediate: int = 128) -> tuple[dict, dict]:
    """A tiny DeepSeek-V3 FP8 block checkpoint in ``path`` (one dense layer, one MoE layer, every
    projection stored as fp8 + weight_scale_inv); returns (the stored tensors, each fp8 weight
    dequantized in fp32 by the DeepSeek formula)."""
    from safetensors.torch import load_file, save_file

    cfg = tf.DeepseekV3Config(vocab_size=64, hidden_size=128, intermediate_size=128,
                              moe_intermediate_size=moe_intermediate,
                              num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2,
                              num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                              n_shared_experts=1, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
                              qk_nope_head_dim=16, v_head_dim=16, initializer_range=0.1)
    torch.manual_seed(5)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    stored, dequantized = {}, {}
    for name, w in load_file(path / "model.safetensors").items():
        if w.dim() == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight")):
            q, s = _fp8_block_quantize(w)
            stored[name], stored[name.replace(".weight", ".weight_scale_inv")] = q, s
            full = s.repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(128, 1)[:, :q.shape[1]]
            dequantized[name] = q.float() * full
        else:
            stored[name] = w
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    return stored, dequantized


def test_fp8_block_checkpoint_whole_model(tmp_path):
    """A DeepSeek-V3-style FP8 checkpoint: every projection stored as fp8 + weight_scale_inv. The
    experts load as fp8_block as stored; the other fp8 weights (attention, dense MLP, shared
    experts) are dequantized into the model dtype; generation runs."""
    from moeshard.integrations.transformers import MoEBlock, load_sharded_model

    stored, dequantized = _write_fp8_deepseek(tmp_path)
    model = load_sharded_model(tmp_path)
    layers = model.model.layers
    assert isinstance(layers[1].mlp, MoEBlock) and layers[1].mlp.quant.scheme == "fp8_block"
    assert layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert torch.equal(model.get_parameter(name), dequantized[name])
    assert torch.equal(layers[1].mlp.shared_experts.up_proj.weight,
                       dequantized["model.layers.1.mlp.shared_experts.up_proj.weight"])
    ids, logits = greedy(model, [PROMPTS[0]], NEW_TOKENS, 0, True)
    assert len(ids[0]) == NEW_TOKENS and torch.isfinite(logits).all()

    # With the shared experts quantized too, they keep the checkpoint's own codes and scales.
    model = load_sharded_model(tmp_path, quant=QuantConfig("fp8_block", shared="fp8_block"))
    shared = model.model.layers[1].mlp.shared_experts
    assert shared.quantized is not None and shared.quantized.stored is not None
    prefix = "model.layers.1.mlp.shared_experts."
    want = torch.cat([stored[prefix + "gate_proj.weight_scale_inv"], stored[prefix + "up_proj.weight_scale_inv"]])
    assert torch.equal(shared.quantized.stored.gate_up.scale[0], want)
    ids, logits = greedy(model, [PROMPTS[0]], NEW_TOKENS, 0, True)
    assert len(ids[0]) == NEW_TOKENS and torch.isfinite(logits).all()
    used = shared.quantized.weights(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    assert torch.equal(used.gate_up.scale[0], want)


def test_fp8_block_checkpoint_loads_dequantized_with_quant_none(tmp_path):
    """quant none from an FP8 block checkpoint (what training needs: no backward through fp8
    experts): the routed experts are dequantized as they are read, each element the DeepSeek
    formula's q * scale, whole and as a TP rank's slice of I (64 of 128 rows: a slice inside a
    128-row tile, dequantized whole then cut); another scheme is still refused."""
    from moeshard.checkpoint import load_moe_block
    from moeshard.integrations.transformers import load_sharded_model

    _, dequantized = _write_fp8_deepseek(tmp_path)
    prefix = "model.layers.1.mlp.experts."
    want_gu = torch.stack([torch.cat([dequantized[f"{prefix}{e}.gate_proj.weight"],
                                      dequantized[f"{prefix}{e}.up_proj.weight"]]) for e in range(4)])
    want_dn = torch.stack([dequantized[f"{prefix}{e}.down_proj.weight"] for e in range(4)])
    model = load_sharded_model(tmp_path, quant="none")
    block = model.model.layers[1].mlp
    assert block.quant.scheme == "none" and block.experts.gate_up_proj.dtype == torch.float32
    assert torch.equal(block.experts.gate_up_proj, want_gu) and torch.equal(block.experts.down_proj, want_dn)
    half = load_moe_block(tmp_path, 1, parallel=ParallelConfig(1, 2, False), rank=1, quant="none")
    assert torch.equal(half.local_experts.gate_up, torch.cat([want_gu[:, 64:128], want_gu[:, 192:256]], dim=1))
    assert torch.equal(half.local_experts.down, want_dn[..., 64:128])
    with pytest.raises(ValueError, match=r"loads only as quant 'fp8_block' \(as stored\) or 'none' \(dequantized\)"):
        load_sharded_model(tmp_path, quant="fp8_token")


@pytest.mark.parametrize("tp, rank, tiles", [(2, 1, (128, 256)), (4, 1, (0, 128)), (4, 2, (128, 256))])
def test_a_tp_rank_reads_only_the_fp8_tiles_that_cover_its_slice(tmp_path, monkeypatch, tp, rank, tiles):
    """I = 256 (two 128-row tiles): a TP rank dequantizes the tiles its slice of I lies in, not
    the whole expert, and its slice is the DeepSeek formula's values."""
    from moeshard.checkpoint import load_moe_block
    from moeshard.checkpoint.experts import ExpertReader

    _, dequantized = _write_fp8_deepseek(tmp_path, moe_intermediate=256)
    read = set()
    into = ExpertReader._into

    def recording(self, e, lo, hi, *args, **kwargs):
        read.add((lo, hi))
        return into(self, e, lo, hi, *args, **kwargs)

    monkeypatch.setattr(ExpertReader, "_into", recording)
    block = load_moe_block(tmp_path, 1, parallel=ParallelConfig(1, tp, False), rank=rank, quant="none")
    assert read == {tiles}
    lo, hi = rank * 256 // tp, (rank + 1) * 256 // tp
    prefix = "model.layers.1.mlp.experts."
    for e in range(4):
        want = torch.cat([dequantized[f"{prefix}{e}.gate_proj.weight"][lo:hi],
                          dequantized[f"{prefix}{e}.up_proj.weight"][lo:hi]])
        assert torch.equal(block.local_experts.gate_up[e], want), e
        assert torch.equal(block.local_experts.down[e], dequantized[f"{prefix}{e}.down_proj.weight"][:, lo:hi]), e


def test_fp8_block_checkpoint_trains_with_quant_none(tmp_path, capsys):
    """moeshard train from an FP8 block checkpoint: refused as stored (no backward through fp8
    experts), trained with --quant none under EP2; --compare and --save need transformers to load
    the checkpoint, which takes the accelerate package: without it both are refused before any
    rank starts, naming why."""
    import importlib.util

    from moeshard.cli import main

    _write_fp8_deepseek(tmp_path / "fp8")
    argv = ["train", "--model", str(tmp_path / "fp8"), "--input-ids", "3,17,42;5,6,7", "--steps", "2", "--lr", "0.05",
            "--optimizer", "sgd"]
    assert main(argv) == 2
    assert "quant 'fp8_block' has no backward" in capsys.readouterr().err
    assert main([*argv, "--quant", "none", "--dp", "2", "--ep"]) == 0
    losses = capsys.readouterr().out.split("loss before each step: [")[1].split("]")[0].split(", ")
    assert float(losses[1]) < float(losses[0])
    if importlib.util.find_spec("accelerate") is not None:
        pytest.skip("accelerate is installed: transformers loads the checkpoint, nothing to refuse")
    for extra, flag in ((["--compare"], "--compare"), (["--save", str(tmp_path / "saved")], "--save")):
        assert main([*argv, "--quant", "none", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"moeshard train: error: {flag}: transformers loads an FP8 block checkpoint only with the "
                       f"accelerate package, which this environment lacks (pip install accelerate); run without "
                       f"{flag}"), err
    assert main(["generate", "--model", str(tmp_path / "fp8"), "--input-ids", "3,17", "--max-new-tokens", "1",
                 "--compare"]) == 2
    assert "--compare: transformers loads an FP8 block checkpoint only with the accelerate package" in \
        capsys.readouterr().err
    assert not (tmp_path / "saved").exists()


# -- several ranks: one spawn per world size --------------------------------------------------
def _in_memory_rank(model_dir: str, layout: ParallelConfig, prompts) -> tuple:
    """A rank of the in-memory API: from_pretrained (every expert), then shard_moe_blocks."""
    import transformers

    from moeshard.integrations.transformers import expert_bytes, shard_moe_blocks

    groups = ParallelGroups.build(layout)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    shard_moe_blocks(model, groups)
    ids, logits = greedy(model, list(prompts), NEW_TOKENS, 0, True)
    return ids, logits, expert_bytes(model)


def _world_rank(plans, in_memory):
    out = generate_plans(plans)
    extra = [_in_memory_rank(*args) for args in in_memory]
    return out, extra


# Every family runs under EP or SP at least once (Mixtral under EP2 through the in-memory API).
WORLD_CASES = {
    2: [(ParallelConfig(2, 1, True), ("qwen3_moe", "deepseek_v3")), (ParallelConfig(2, 1, False), ("qwen2_moe",)),
        (ParallelConfig(1, 2, False), ("mixtral",))],
    4: [(ParallelConfig(2, 2, True), ("mixtral", "qwen2_moe", "deepseek_v3")),
        (ParallelConfig(2, 2, False), ("qwen3_moe",))],
}


@pytest.fixture(scope="module")
def world(models):
    """world size -> ({(layout name, family): per-rank results}, in-memory per-rank results)."""
    cache = {}

    def get(ws: int):
        if ws not in cache:
            cases = [(layout, family) for layout, families in WORLD_CASES[ws] for family in families]
            keys = [(layout.name, family) for layout, family in cases]
            plans = [_plan(models, family, layout) for layout, family in cases]
            if ws == 2:  # the fixed-capacity backend, sized from the plan (a CLI user cannot size it)
                keys.append(("dp2-tp1-ep low_latency", "mixtral"))
                plans.append(_plan(models, "mixtral", ParallelConfig(2, 1, True), backend="low_latency"))
            in_memory = [(models["mixtral"], ParallelConfig(2, 1, True), PROMPTS[:2])] if ws == 2 else []
            try:
                per_rank = spawn(_world_rank, ws, args=(plans, in_memory), timeout_s=SPAWN_TIMEOUT_S,
                                 preload=("moeshard.jobs.generate",))
            except RankFailure as failure:
                cache[ws] = failure
            else:
                cache[ws] = ({key: (plan, [per_rank[r][0][i] for r in range(ws)])
                              for i, (key, plan) in enumerate(zip(keys, plans, strict=True))},
                             [per_rank[r][1] for r in range(ws)])
        if isinstance(cache[ws], RankFailure):
            pytest.fail(f"the {ws}-rank run failed:\n{cache[ws]}")
        return cache[ws]

    return get


def _world_params():
    # The 4-rank world (16 s on 2 cores) runs in `make test-slow`: generate under TP runs at 2 ranks
    # (dp1-tp2) here, and the 4-rank dp2-tp2-ep model against transformers in test_train.py.
    return [pytest.param(ws, layout.name, family, id=f"{layout.name}-{family}",
                         marks=(pytest.mark.slow,) if ws == 4 else ())
            for ws, cases in WORLD_CASES.items() for layout, families in cases for family in families]


@pytest.mark.parametrize("ws, layout, family", _world_params())
def test_layout_generates_what_transformers_generates(world, reference, ws, layout, family):
    plan, results = world(ws)[0][(layout, family)]
    _check_parity(plan, results, reference)
    p = plan.parallel
    assert [r.rank for r in results] == list(range(ws))
    # Each rank holds only its share of the experts: 1/(dp*tp) with EP, 1/tp of I under TP.
    share = p.world_size if p.enable_ep else p.tp
    assert [r.expert_bytes for r in results] == [_full_expert_bytes(plan) // share] * ws
    if p.enable_ep:
        per = plan.cfg.num_experts // ws
        assert [r.experts for r in results] == [(r * per, (r + 1) * per) for r in range(ws)]
    # The TP ranks of a DP rank ran the same prompts and produced the same ids.
    for r in results:
        assert r.prompts == plan.dp_prompts[r.dp_rank]
        assert r.generated == results[r.dp_rank * p.tp].generated


def test_low_latency_runs_sized_by_the_plan(world, reference):
    """low_latency needs max_tokens_per_rank; generate derives it from the prompts and new tokens."""
    plan, results = world(2)[0][("dp2-tp1-ep low_latency", "mixtral")]
    assert plan.backend == "low_latency" and plan.max_tokens_per_rank >= max(len(p) for p in PROMPTS) + NEW_TOKENS
    _check_parity(plan, results, reference)


def test_in_memory_model_under_ep(world, models, reference):
    """shard_moe_blocks on a model transformers loaded whole: EP2, each DP rank its own prompts."""
    per_rank = world(2)[1]
    plan = _plan(models, "mixtral", ParallelConfig(2, 1, True))
    plan = replace(plan, spec=replace(plan.spec, prompts=PROMPTS[:2]), dp_prompts=((0, 1),))
    want_ids, want_logits = reference(plan)[0]
    for rank, ((ids, logits, held),) in enumerate(per_rank):
        assert ids == want_ids, f"rank {rank}"
        assert torch.allclose(logits, want_logits, atol=1e-5, rtol=1e-5)
        assert held == _full_expert_bytes(plan) // 2


# -- the command ------------------------------------------------------------------------------
def moeshard_generate(argv: list[str]) -> int:
    """``moeshard generate ARGV`` with the CLI's error handling (ValueError -> stderr, exit 2)."""
    from moeshard.commands import generate as generate_command

    parser = argparse.ArgumentParser(prog="moeshard")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_command.add_parser(sub)
    args = parser.parse_args(["generate", *argv])
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"moeshard generate: error: {exc}", file=sys.stderr)
        return 2


def test_command_generates_compares_and_writes_json(models, tmp_path, capsys):
    out = tmp_path / "gen.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("3, 17, 42\n\n5 6\n")
    code = moeshard_generate(["--model", models["deepseek_v3"], "--input-file", str(prompts), "--max-new-tokens", "8",
                              "--compare", "--output", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    data = json.loads(out.read_text())
    assert [p["input_ids"] for p in data["prompts"]] == [[3, 17, 42], [5, 6]]
    assert all(len(p["generated_ids"]) == 8 for p in data["prompts"])
    assert data["comparison"]["same_ids"] == [True, True] and data["comparison"]["within_tolerance"] is True
    assert data["run"]["layout"] == "dp1-tp1-noep"
    assert "same ids for 2 of 2 prompt(s)" in printed and "within" in printed
    assert f"-> {data['prompts'][0]['generated_ids']}" in printed
    assert not list(tmp_path.glob(".gen.json.*"))  # written atomically, nothing left behind


def test_command_under_torchrun_in_this_process(models, tmp_path, monkeypatch):
    """A torchrun world of one rank (this process, env://): init from the environment, the gather
    of the ranks' results on rank 0 (``jobs.world.execute_torchrun``), the comparison, and the
    process group torn down after; the ids are the one-process run's."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--model", models["deepseek_v3"], "--input-ids", "3,17,42;5,6", "--max-new-tokens", "4", "--compare"]
    alone = tmp_path / "alone.json"
    assert moeshard_generate([*argv, "--output", str(alone)]) == 0
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    out = tmp_path / "torchrun.json"
    assert moeshard_generate([*argv, "--output", str(out)]) == 0
    data, want = json.loads(out.read_text()), json.loads(alone.read_text())
    assert [p["generated_ids"] for p in data["prompts"]] == [p["generated_ids"] for p in want["prompts"]]
    assert data["comparison"]["same_ids"] == [True, True] and [r["rank"] for r in data["ranks"]] == [0]
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("argv, message", [
    (["--dp", "2", "--ep", "--input-ids", "3,4"], "--dp 2: every DP rank runs its own prompts, but only 1"),
    (["--input-ids", "3,64"], "token ids [64] outside the vocabulary [0, 64)"),
    (["--input-ids", "3;4;5", "--dp", "3", "--ep"], "not divisible by the EP size 3"),
    (["--input-ids", "3,x"], "--input-ids: '3,x' is not a comma-separated list of integers"),
    (["--input-ids", "3", "--max-new-tokens", "0"], "--max-new-tokens: must be an integer >= 1"),
    (["--input-ids", "3,4", "--max-new-tokens", "1000000"], "--max-new-tokens 1000000: the longest prompt has 2 tokens"),
    (["--input-ids", "3", "--timeout", "nan"], "--timeout: must be a finite number"),
    (["--input-ids", "3", "--dp", "2", "--timeout", "-1"], "--timeout: must be a finite number"),
    ([], "give exactly one of --input-ids and --input-file"),
    (["--input-ids", "3", "--tp", "2", "--quant", "fp8_block"], "aligned to 128, but intermediate_size=16 / tp=2 = 8"),
])
def test_command_refuses_before_any_rank_starts(models, capsys, argv, message):
    code = moeshard_generate(["--model", models["qwen3_moe"], *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_command_refuses_to_overwrite_what_it_reads(models, tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text("[[3, 4], [5]]")
    code = moeshard_generate(["--model", models["mixtral"], "--input-file", str(prompts), "--output", str(prompts)])
    assert code == 2 and "a file this run reads" in capsys.readouterr().err
    code = moeshard_generate(["--model", models["mixtral"], "--input-ids", "3", "--output",
                              str(Path(models["mixtral"]) / "model.safetensors")])
    assert code == 2 and "a file this run reads" in capsys.readouterr().err
    prompts.write_text('{"ids": [3]}')
    code = moeshard_generate(["--model", models["mixtral"], "--input-file", str(prompts)])
    assert code == 2 and "must be a list of token ids" in capsys.readouterr().err


def _planted_lm_head(models, directory: Path, value) -> str:
    """A copy of the tiny Mixtral whose lm_head weight is ``value(weight)``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(models["mixtral"], directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = value(tensors["lm_head.weight"]).contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return str(directory)


def test_nonfinite_logits_are_exit_7_and_nothing_is_written(models, tmp_path, capsys):
    """A NaN weight is refused when read (exit 2); finite weights can still make NaN logits (an
    lm_head of +-3e38 overflows to +Inf and -Inf, which sum to NaN), from which greedy's ids mean
    nothing: exit 7, nothing written, unless --allow-nonfinite, whose JSON lists the steps (a NaN
    figure in it is null: test_cli_errors.py::test_nonfinite_figures_are_exit_7_or_null_with_their_reason)."""
    from moeshard.cli import main

    nan = _planted_lm_head(models, tmp_path / "nan", lambda w: w.index_put((torch.tensor([0]), torch.tensor([1])),
                                                                            torch.tensor(float("nan"))))
    assert main(["generate", "--model", nan, "--input-ids", "3,4;5"]) == 2
    assert "'lm_head.weight'" in capsys.readouterr().err
    huge = _planted_lm_head(models, tmp_path / "huge",
                            lambda w: torch.where(torch.arange(w.shape[1]) % 2 == 0, 3e38, -3e38).to(w.dtype).expand_as(w))
    out = tmp_path / "gen.json"
    argv = ["generate", "--model", huge, "--input-ids", "3,4;5", "--max-new-tokens", "2", "--output", str(out)]
    assert main(argv) == 7
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("moeshard generate: error: the logits hold NaN/Inf at 4 (prompt, step) "
                                               "pair(s), the first prompt 0 at step 0"), err
    assert not out.exists()
    assert main([*argv, "--allow-nonfinite"]) == 0
    assert "the ids chosen from them mean nothing" in capsys.readouterr().out
    data = json.loads(out.read_text(), parse_constant=lambda token: pytest.fail(f"{token} in the JSON"))
    assert data["nonfinite_logits"] == [{"prompt": p, "step": s} for p in (0, 1) for s in (0, 1)]


def test_unsupported_model_type_refused(tmp_path):
    from moeshard.integrations.transformers import shard_moe_blocks

    llama = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        shard_moe_blocks(llama)
