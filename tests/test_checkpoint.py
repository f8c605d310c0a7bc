"""Real checkpoints against transformers itself, under every layout; per-rank reading; errors.

Tiny random models of each supported type are built with transformers (from a config, after
``torch.manual_seed``), saved to a temporary directory, loaded by moeshard and compared with the
transformers block's own output (``model.model.layers[L].mlp``, fp32, eager experts):

* hub naming (what ``save_pretrained`` writes: per-expert tensors, Mixtral ``block_sparse_moe.w1/w3/w2``),
  fused transformers-5 naming (the model's ``state_dict()`` written as is), and a sharded
  checkpoint with ``model.safetensors.index.json``;
* an FP8 block checkpoint written here (fp8 ``weight`` + ``weight_scale_inv``), loaded as fp8_block
  and compared with ``reference_forward`` on the dequantized weights.

All multi-rank cases of one world size run in one ``spawn`` (module-scoped fixture), each case a
``RunPlan`` executed by ``moeshard.jobs.run.run_plans`` -- the code path of
``moeshard run``. Every output row of every token is compared; DP ranks get different (and
uneven, sometimes empty) token counts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeshard.checkpoint import load_moe_block, read_hf_config
from moeshard.config import QuantConfig
from moeshard.jobs.run import RunPlan, RunSpec, plan_run, run_plans, run_rank, split_tokens
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.spawn import RankFailure, spawn
from moeshard.quant import QuantizedWeight
from moeshard.reference import Reference, reference_forward
from moeshard.sharding import shard_experts
from moeshard.tolerances import compare
from moeshard.weights import MoEWeights

T = 13  # global tokens per case
H = 32
SPAWN_TIMEOUT_S = 240.0

# (dp, tp, ep) per world size, as the brief lists them.
LAYOUTS = {
    1: [(1, 1, False)],
    2: [(1, 2, False), (2, 1, True), (1, 2, True), (2, 1, False)],
    4: [(2, 2, True), (2, 2, False), (1, 4, True)],
}
EP_BACKENDS = ("allgather_reducescatter", "all2all")
# Token splits over DP ranks (by dp), cycled through the cases: an empty rank, one token, uneven.
SPLITS = {1: [(T,)], 2: [(0, T), (6, 7), (12, 1)]}

HF_CHECKPOINTS = ("mixtral_hub", "mixtral_fused", "qwen2_moe_sharded", "qwen3_moe_norm_hub", "qwen3_moe_nonorm_fused",
                  "deepseek_v3_hub", "deepseek_v3_fused")
CHECKPOINTS = HF_CHECKPOINTS + ("deepseek_v3_fp8",)


# ----------------------------------------------------------------------------- building checkpoints

@dataclass(frozen=True)
class Ckpt:
    """A checkpoint on disk with its input and the expected output of its MoE block.

    expect(x, tp, ep) -> fp64 [T, H]: the expected block output for input rows x (the same for
    every layout for transformers models; the fp8 reference depends on the TP slicing)."""

    name: str
    path: Path
    layer: int
    input_path: Path
    x: torch.Tensor
    hf_out: torch.Tensor | None
    ref_weights: MoEWeights | None
    quant: str


def _hf_common():
    return dict(vocab_size=32, hidden_size=H, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                initializer_range=0.2, experts_implementation="eager", attn_implementation="eager")


def _hf_model(kind: str):
    """(model, MoE layer index) of a tiny random model; ``torch.manual_seed`` makes it reproducible."""
    import transformers as tf

    common = _hf_common()
    torch.manual_seed({"mixtral": 1, "qwen2_moe": 2, "qwen3_norm": 3, "qwen3_nonorm": 4, "deepseek_v3": 5}[kind])
    if kind == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, **common)
        return tf.MixtralForCausalLM(cfg).eval(), 1
    if kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=32, shared_expert_intermediate_size=24,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0], **common)
        return tf.Qwen2MoeForCausalLM(cfg).eval(), 1
    if kind in ("qwen3_norm", "qwen3_nonorm"):
        cfg = tf.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                                norm_topk_prob=kind == "qwen3_norm", **common)
        return tf.Qwen3MoeForCausalLM(cfg).eval(), 0
    cfg = tf.DeepseekV3Config(intermediate_size=48, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                              n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
                              n_shared_experts=2, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8, **{**common, "num_key_value_heads": 2})
    model = tf.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        # Non-zero, per-expert different: the bias must change which experts are chosen.
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.rand(8) * 0.4 + 0.05)
    return model, 1


def _write_fused(model, path: Path) -> None:
    """transformers-5 names as the model holds them (experts.gate_up_proj [E, 2I, H], ...)."""
    path.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    model.config.to_json_file(str(path / "config.json"))


def _write_input(path: Path, seed: int, hidden: int) -> torch.Tensor:
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(seed))
    save_file({"hidden_states": x}, str(path))
    return x


def _fp8_block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] fp32 -> (fp8 [N, K], scale_inv fp32 [ceil(N/128), ceil(K/128)]), w ~= q * scale_inv
    per 128 x 128 tile, the DeepSeek-V3 convention (written out here, independent of moeshard.quant)."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(N / 128), math.ceil(K / 128))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s[i, j] = tile.abs().max() / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (tile / s[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def _dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    full = s.repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(128, 1)[:, :q.shape[1]]
    return q.float() * full


FP8 = dict(E=8, H=64, I=256, K=2, S=256)


def _write_fp8_checkpoint(path: Path, seed: int = 11) -> MoEWeights:
    """A DeepSeek-V3-style FP8 block checkpoint (layer 1 MoE, layer 0 dense, not stored) with
    per-expert fp8 weights + weight_scale_inv, fp8 shared experts, fp32 router and bias.
    Returns the dequantized weights (what the checkpoint means) for the reference."""
    E, Hd, I, S = FP8["E"], FP8["H"], FP8["I"], FP8["S"]
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])  # noqa: E731
    p = "model.layers.1.mlp."
    tensors = {p + "gate.weight": rnd(E, Hd) * 2, p + "gate.e_score_correction_bias": torch.rand(E, generator=gen) * 0.1}
    deq: dict[str, torch.Tensor] = {}
    weights = {f"experts.{e}.{proj}": rnd(*shape) for e in range(E)
               for proj, shape in (("gate_proj", (I, Hd)), ("up_proj", (I, Hd)), ("down_proj", (Hd, I)))}
    weights.update({f"shared_experts.{proj}": rnd(*shape)
                    for proj, shape in (("gate_proj", (S, Hd)), ("up_proj", (S, Hd)), ("down_proj", (Hd, S)))})
    for name, w in weights.items():
        q, s = _fp8_block_quantize(w)
        tensors[f"{p}{name}.weight"], tensors[f"{p}{name}.weight_scale_inv"] = q, s
        deq[name] = _dequant(q, s)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": Hd, "intermediate_size": 128,
              "moe_intermediate_size": I, "n_routed_experts": E, "num_experts_per_tok": FP8["K"], "n_group": 4,
              "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_shared_experts": 1,
              "first_k_dense_replace": 1, "hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc",
              "dtype": "float32", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                          "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    (path / "config.json").write_text(json.dumps(config))
    return MoEWeights(
        gate=tensors[p + "gate.weight"],
        gate_up=torch.stack([torch.cat([deq[f"experts.{e}.gate_proj"], deq[f"experts.{e}.up_proj"]]) for e in range(E)]),
        down=torch.stack([deq[f"experts.{e}.down_proj"] for e in range(E)]),
        correction_bias=tensors[p + "gate.e_score_correction_bias"],
        shared_gate=deq["shared_experts.gate_proj"], shared_up=deq["shared_experts.up_proj"],
        shared_down=deq["shared_experts.down_proj"])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Ckpt]:
    root = tmp_path_factory.mktemp("ckpts")
    out: dict[str, Ckpt] = {}
    built = {}
    for kind in ("mixtral", "qwen2_moe", "qwen3_norm", "qwen3_nonorm", "deepseek_v3"):
        built[kind] = _hf_model(kind)
    layouts = {"mixtral_hub": ("mixtral", "hub"), "mixtral_fused": ("mixtral", "fused"),
               "qwen2_moe_sharded": ("qwen2_moe", "sharded"), "qwen3_moe_norm_hub": ("qwen3_norm", "hub"),
               "qwen3_moe_nonorm_fused": ("qwen3_nonorm", "fused"), "deepseek_v3_hub": ("deepseek_v3", "hub"),
               "deepseek_v3_fused": ("deepseek_v3", "fused")}
    for i, (name, (kind, naming)) in enumerate(layouts.items()):
        model, layer = built[kind]
        path = root / name
        if naming == "fused":
            _write_fused(model, path)
        else:
            # Small shards force model.safetensors.index.json for the "sharded" checkpoint.
            model.save_pretrained(str(path), max_shard_size="20KB" if naming == "sharded" else "10GB")
        x = _write_input(root / f"{name}.input.safetensors", 100 + i, H)
        with torch.no_grad():
            hf_out = model.model.layers[layer].mlp(x[None])[0].double()
        block_state = model.model.layers[layer].mlp.state_dict()
        out[name] = Ckpt(name, path, layer, root / f"{name}.input.safetensors", x, hf_out,
                         MoEWeights.from_state_dict(block_state, read_hf_config(path).moe_config()), "none")
    fp8_weights = _write_fp8_checkpoint(root / "deepseek_v3_fp8")
    x = _write_input(root / "fp8.input.safetensors", 200, FP8["H"])
    out["deepseek_v3_fp8"] = Ckpt("deepseek_v3_fp8", root / "deepseek_v3_fp8", 1, root / "fp8.input.safetensors", x,
                                  None, fp8_weights, "fp8_block")
    return out


def test_checkpoint_namings_are_what_we_think(ckpts):
    """save_pretrained (transformers 5) writes hub per-expert names; the fused copies hold the
    model's own names; the sharded one has an index over several files."""
    def names(c: Ckpt) -> set[str]:
        keys = set()
        for f in c.path.glob("*.safetensors"):
            with safe_open(str(f), "pt") as h:
                keys |= set(h.keys())
        return keys

    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in names(ckpts["mixtral_hub"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in names(ckpts["mixtral_fused"])
    assert "model.layers.0.mlp.experts.15.down_proj.weight" in names(ckpts["qwen3_moe_norm_hub"])
    assert "model.layers.1.mlp.experts.down_proj" in names(ckpts["deepseek_v3_fused"])
    sharded = ckpts["qwen2_moe_sharded"].path
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    assert "model.layers.1.mlp.shared_expert_gate.weight" in names(ckpts["qwen2_moe_sharded"])


# ----------------------------------------------------------------------------- the layout matrix

@dataclass(frozen=True)
class Case:
    id: str
    ckpt: str
    layout: tuple[int, int, bool]
    backend: str | None
    tokens: tuple[int, ...]
    quant: str | None = None
    defer: bool = False


def cases(ws: int) -> list[Case]:
    out, i = [], 0
    for ckpt in CHECKPOINTS:
        for dp, tp, ep in LAYOUTS[ws]:
            for backend in (EP_BACKENDS if ep else (None,)):
                tokens = SPLITS[dp][i % len(SPLITS[dp])]
                i += 1
                cid = f"{ckpt}-dp{dp}-tp{tp}{'-ep' if ep else ''}-{backend or 'local'}-{'_'.join(map(str, tokens))}"
                out.append(Case(cid, ckpt, (dp, tp, ep), backend, tokens))
    if ws > 1:
        # Schemes whose scales span a whole expert: read whole rows, quantize, slice (TP, EP off).
        dp, tp = (1, 2) if ws == 2 else (2, 2)
        tokens = (T,) if dp == 1 else (5, 8)
        for quant in ("fp8_tensor", "fp8_token", "nvfp4"):
            out.append(Case(f"mixtral_fused-dp{dp}-tp{tp}-local-{quant}", "mixtral_fused", (dp, tp, False), None, tokens,
                            quant))
        out.append(Case(f"deepseek_v3_fp8-dp{dp}-tp{tp}-local-deferred", "deepseek_v3_fp8", (dp, tp, False), None,
                        tokens, defer=True))
        ep_layout = (2, 1, True) if ws == 2 else (2, 2, True)
        out.append(Case("qwen2_moe_sharded-ep-all2all-fp8_token", "qwen2_moe_sharded", ep_layout, "all2all", (4, 9),
                        "fp8_token"))
    return out


def _plan(case: Case, ckpts: dict[str, Ckpt]) -> RunPlan:
    c = ckpts[case.ckpt]
    spec = RunSpec(parallel=ParallelConfig(*case.layout), model_dir=str(c.path), layer=c.layer,
                   input_path=str(c.input_path), tokens_per_rank=case.tokens, quant=case.quant,
                   defer_input_quant=case.defer, backend=case.backend)
    return plan_run(spec)


def _expected(case: Case, c: Ckpt) -> tuple[torch.Tensor | Reference, str]:
    """(fp64 [T, H] expected output (transformers') or the reference, quant scheme for the tolerance)."""
    dp, tp, ep = case.layout
    scheme = case.quant or c.quant
    if scheme == "none":
        return c.hf_out, "none"
    cfg = read_hf_config(c.path).moe_config(torch.float32)
    quant = QuantConfig(scheme)
    shards = 1 if ep else tp
    # Per-tensor activation scales are taken over the layer's quantization domain: the EP group
    # (all tokens) with EP on, this DP rank's tokens without; fp8_block/fp8_token are per row.
    if ep:
        return reference_forward(c.x, c.ref_weights, cfg, quant, intermediate_shards=shards), scheme
    parts, start = [], 0
    for n in case.tokens:
        parts.append(reference_forward(c.x[start:start + n], c.ref_weights, cfg, quant, intermediate_shards=shards))
        start += n
    return Reference.cat(parts), scheme


@pytest.fixture(scope="module")
def matrix(ckpts):
    """world size -> {case id: per-rank results}, from one spawn per world size (1: in process)."""
    cache: dict[int, object] = {}

    def get(ws: int) -> dict[str, list]:
        if ws not in cache:
            todo = cases(ws)
            plans = [_plan(case, ckpts) for case in todo]
            if ws == 1:
                per_rank = [[run_rank(plan, None) for plan in plans]]
            else:
                try:
                    per_rank = spawn(run_plans, ws, args=(plans,), timeout_s=SPAWN_TIMEOUT_S,
                                     preload=("moeshard.jobs.generate",))
                except RankFailure as failure:
                    per_rank = failure
            if isinstance(per_rank, RankFailure):
                cache[ws] = per_rank
            else:
                cache[ws] = {case.id: [per_rank[r][i] for r in range(ws)] for i, case in enumerate(todo)}
        if isinstance(cache[ws], RankFailure):
            pytest.fail(f"the {ws}-rank run failed:\n{cache[ws]}")
        return cache[ws]

    return get


def _case_params():
    # World size 4 in make test-slow: the two-rank world reads every checkpoint through the same
    # readers, and test_transformers_integration loads a checkpoint under dp2-tp2-ep in make test.
    return [pytest.param(ws, case.id, id=f"ws{ws}-{case.id}", marks=(pytest.mark.slow,) if ws == 4 else ())
            for ws in (1, 2, 4) for case in cases(ws)]


@pytest.mark.parametrize("ws, case_id", _case_params())
def test_block_matches_transformers_under_layout(matrix, ckpts, ws, case_id):
    case = {c.id: c for c in cases(ws)}[case_id]
    results = matrix(ws)[case_id]
    for rank, r in enumerate(results):
        assert not isinstance(r, dict), f"rank {rank} raised {r}"
        assert r.rank == rank
    out = results[0].output
    expected, scheme = _expected(case, ckpts[case.ckpt])
    plain = expected.out if isinstance(expected, Reference) else expected
    assert out.shape == (T, plain.shape[1]) and out.dtype == torch.float32
    err, atol, rtol, ok = compare(out, expected, torch.float32, scheme)
    worst = int((out.double() - plain).abs().amax(dim=1).argmax())
    assert ok, f"{case_id}: max |out - expected| = {err:.3g} > {atol} + {rtol}*|expected| (worst row {worst})"
    dp, tp, ep = case.layout
    E = ckpts[case.ckpt].ref_weights.gate.shape[0]
    for r in results:
        if ep:
            per = E // (dp * tp)
            assert r.experts == (r.rank * per, (r.rank + 1) * per)
        else:
            assert r.experts == (0, E)
        assert r.tokens == case.tokens[r.dp_rank]


# ----------------------------------------------------------------------------- per-rank reading

def _write_random_fused(path: Path, E: int, Hd: int, I: int, dtype=torch.float32, seed: int = 0,
                        chunk_experts: int = 1) -> int:
    """A qwen3_moe checkpoint whose layer 0 holds random fused experts; returns the file size."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    p = "model.layers.0.mlp."
    tensors = {p + "gate.weight": torch.randn(E, Hd, generator=gen).to(dtype),
               p + "experts.gate_up_proj": (torch.randn(E, 2 * I, Hd, generator=gen) / Hd**0.5).to(dtype),
               p + "experts.down_proj": (torch.randn(E, Hd, I, generator=gen) / I**0.5).to(dtype)}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_hidden_layers": 1, "hidden_size": Hd, "moe_intermediate_size": I,
        "num_experts": E, "num_experts_per_tok": 2, "norm_topk_prob": True, "dtype": str(dtype).removeprefix("torch.")}))
    return (path / "model.safetensors").stat().st_size


@pytest.mark.parametrize("quant", ["none", "fp8_block", "fp8_tensor", "fp8_token", "nvfp4"])
@pytest.mark.parametrize("layout", [(1, 2, False), (2, 2, False), (4, 1, True)])
def test_slices_read_equal_shards_of_full_weights(tmp_path, quant, layout):
    """Every rank's experts read from the file equal ``shard_experts`` of the full weights, bit for
    bit, for every scheme (slices read directly, or whole experts quantized then sliced)."""
    path = tmp_path / "ckpt"
    _write_random_fused(path, E=4, Hd=32, I=512, dtype=torch.bfloat16)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        full_gu = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj")
        full_dn = f.get_tensor("model.layers.0.mlp.experts.down_proj")
    parallel = ParallelConfig(*layout)
    for rank in range(parallel.world_size):
        block = load_moe_block(path, 0, parallel=parallel, rank=rank, quant=quant, dtype="float32")
        want = shard_experts(full_gu, full_dn, block.cfg, QuantConfig(quant), block.spec)
        for got, exp in ((block.local_experts.gate_up, want.gate_up), (block.local_experts.down, want.down)):
            if isinstance(exp, QuantizedWeight):
                assert isinstance(got, QuantizedWeight) and got.shape == exp.shape
                for field in ("data", "scale", "global_scale"):
                    a, b = getattr(got, field), getattr(exp, field)
                    assert (a is None) == (b is None)
                    if a is not None:
                        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                           b.view(torch.uint8) if b.element_size() == 1 else b), (rank, field)
            else:
                assert torch.equal(got, exp), rank


def test_fp8_checkpoint_is_read_as_stored(ckpts):
    """fp8_block from an FP8 checkpoint: the fp8 bytes and scales of the kept slice, untouched."""
    c = ckpts["deepseek_v3_fp8"]
    block = load_moe_block(c.path, 1, parallel=ParallelConfig(tp=2), rank=1)
    assert block.quant.scheme == "fp8_block"
    gu, dn = block.local_experts.gate_up, block.local_experts.down
    assert isinstance(gu, QuantizedWeight) and gu.shape == (8, 256, 64) and dn.shape == (8, 64, 128)
    with safe_open(str(c.path / "model.safetensors"), "pt") as f:
        get = lambda n: f.get_tensor(f"model.layers.1.mlp.experts.5.{n}")  # noqa: E731
        gate, up, down = get("gate_proj.weight"), get("up_proj.weight"), get("down_proj.weight")
        want_data = torch.cat([gate[128:], up[128:]]).view(torch.uint8)
        want_scale = torch.cat([get("gate_proj.weight_scale_inv")[1:], get("up_proj.weight_scale_inv")[1:]])
        assert torch.equal(gu.data[5].view(torch.uint8), want_data)
        assert torch.equal(gu.scale[5], want_scale)
        assert torch.equal(dn.data[5].view(torch.uint8), down[:, 128:].view(torch.uint8))
        assert torch.equal(dn.scale[5], get("down_proj.weight_scale_inv")[:, 1:])


def test_fp8_shared_experts_run_as_stored(ckpts):
    """``--shared-quant fp8_block`` on an FP8 checkpoint: the shared MLP runs the file's codes and
    scales. In a bf16 model the dequantized weights are the stored values rounded to bf16, and
    quantizing those again gives other scales (checked here, so the test can tell the two apart);
    the layer must use the stored ones until its shared weights change, then quantize the new
    ones."""
    from moeshard.checkpoint.loader import build_layer
    from moeshard.experts.shared import shared_gate_up
    from moeshard.quant import quantize_weight

    c = ckpts["deepseek_v3_fp8"]
    block = load_moe_block(c.path, 1, quant=QuantConfig("fp8_block", shared="fp8_block"), dtype="bfloat16")
    stored = block.shared_stored
    assert stored is not None and isinstance(stored.gate_up, QuantizedWeight) and isinstance(stored.down, QuantizedWeight)
    with safe_open(str(c.path / "model.safetensors"), "pt") as f:
        get = lambda n: f.get_tensor(f"model.layers.1.mlp.shared_experts.{n}")  # noqa: E731
        codes = torch.cat([get("gate_proj.weight"), get("up_proj.weight")]).view(torch.uint8)
        assert torch.equal(stored.gate_up.data[0].view(torch.uint8), codes)
        assert torch.equal(stored.gate_up.scale[0],
                           torch.cat([get("gate_proj.weight_scale_inv"), get("up_proj.weight_scale_inv")]))
        assert torch.equal(stored.down.data[0].view(torch.uint8), get("down_proj.weight").view(torch.uint8))
        assert torch.equal(stored.down.scale[0], get("down_proj.weight_scale_inv"))
    w = block.weights
    again = quantize_weight(shared_gate_up(w.shared_gate, w.shared_up), "fp8_block")
    assert not torch.equal(again.scale, stored.gate_up.scale)  # requantizing bf16 values moves the scales

    layer = build_layer(block)
    shared = layer.shared_experts
    assert shared is not None and shared.quantized is not None
    layer(c.x[:5].to(torch.bfloat16))
    used = shared.quantized.weights(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    assert isinstance(used.gate_up, QuantizedWeight) and isinstance(used.down, QuantizedWeight)
    assert torch.equal(used.gate_up.scale, stored.gate_up.scale) and torch.equal(used.down.scale, stored.down.scale)
    assert torch.equal(used.gate_up.data.view(torch.uint8), stored.gate_up.data.view(torch.uint8))

    with torch.no_grad():
        shared.down_proj.weight.mul_(0.5)  # new weights: not the stored codes' values any more
    used = shared.quantized.weights(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    assert isinstance(used.down, QuantizedWeight)
    assert torch.equal(used.down.scale, quantize_weight(shared.down_proj.weight.unsqueeze(0), "fp8_block").scale)
    assert not torch.equal(used.down.scale, stored.down.scale)

    plain = load_moe_block(c.path, 1, quant=QuantConfig("fp8_block"), dtype="bfloat16")
    assert plain.shared_stored is None  # shared experts in the model dtype: nothing to keep
    with pytest.raises(ValueError, match="shared_stored \\(fp8_block\\) given, but quant.shared is 'none'"):
        build_layer(dataclasses.replace(plain, shared_stored=stored))


def test_run_takes_the_fp8_shared_experts_as_stored(ckpts):
    """``moeshard run --shared-quant fp8_block`` on an FP8 checkpoint gives the bits of a layer
    built from the loaded block (stored shared codes), and not those of the same layer with its
    shared MLP quantized again from the bf16 weights (which differ here)."""
    from moeshard.checkpoint.loader import build_layer

    c = ckpts["deepseek_v3_fp8"]
    spec = RunSpec(model_dir=str(c.path), layer=c.layer, input_path=str(c.input_path), quant="fp8_block",
                   shared_quant="fp8_block", dtype="bfloat16")
    got = run_rank(plan_run(spec), None).output
    block = load_moe_block(c.path, 1, quant=QuantConfig("fp8_block", shared="fp8_block"), dtype="bfloat16")
    x = c.x.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(got, build_layer(block)(x))
        requantized = build_layer(dataclasses.replace(block, shared_stored=None))(x)
    assert not torch.equal(got, requantized)


def test_fp8_fused_checkpoint_reads_like_per_expert(ckpts, tmp_path):
    """The same FP8 weights stored fused (``experts.gate_up_proj`` fp8 [E, 2I, H] with
    ``experts.gate_up_proj_scale_inv`` [E, 2I/128, ceil(H/128)], transformers-5 style) load to the
    same bytes and scales as the per-expert checkpoint, for a TP slice and for EP."""
    src = ckpts["deepseek_v3_fp8"].path
    p = "model.layers.1.mlp."
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if ".experts." not in k}
        per = lambda e, n: f.get_tensor(f"{p}experts.{e}.{n}")  # noqa: E731
        E = FP8["E"]
        tensors[p + "experts.gate_up_proj"] = torch.stack(
            [torch.cat([per(e, "gate_proj.weight"), per(e, "up_proj.weight")]).view(torch.uint8) for e in range(E)]
        ).view(torch.float8_e4m3fn)
        tensors[p + "experts.gate_up_proj_scale_inv"] = torch.stack(
            [torch.cat([per(e, "gate_proj.weight_scale_inv"), per(e, "up_proj.weight_scale_inv")]) for e in range(E)])
        tensors[p + "experts.down_proj"] = torch.stack(
            [per(e, "down_proj.weight").view(torch.uint8) for e in range(E)]).view(torch.float8_e4m3fn)
        tensors[p + "experts.down_proj_scale_inv"] = torch.stack([per(e, "down_proj.weight_scale_inv") for e in range(E)])
    dst = tmp_path / "fused_fp8"
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    for parallel, rank in ((ParallelConfig(tp=2), 1), (ParallelConfig(dp=4, enable_ep=True), 2)):
        a = load_moe_block(src, 1, parallel=parallel, rank=rank).local_experts
        b = load_moe_block(dst, 1, parallel=parallel, rank=rank).local_experts
        for wa, wb in ((a.gate_up, b.gate_up), (a.down, b.down)):
            assert wa.shape == wb.shape
            assert torch.equal(wa.data.view(torch.uint8), wb.data.view(torch.uint8))
            assert torch.equal(wa.scale, wb.scale)


MEMORY_PROBE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from moeshard.checkpoint import load_moe_block
    from moeshard.parallel.config import ParallelConfig

    def status_kib(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))

    # Peak = VmHWM, this process's own high-water mark. ru_maxrss is not usable here: Linux
    # carries it across fork+exec, so it starts at the (pytest) parent's resident size.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS, dropping the import-time peak
    except OSError:
        pass
    path, ep = sys.argv[1], int(sys.argv[2])
    before = status_kib("VmRSS")
    block = load_moe_block(path, 0, parallel=ParallelConfig(dp=ep, enable_ep=True), rank=0)
    peak = status_kib("VmHWM")
    held = block.local_experts.gate_up.nbytes + block.local_experts.down.nbytes
    print(json.dumps({"growth_bytes": (peak - before) * 1024, "held_bytes": held,
                      "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_rank_reads_only_its_share_peak_memory(tmp_path):
    """Rank 0 of ep=4 loading a ~200 MB checkpoint in a fresh process: peak RSS grows by its
    quarter plus about one expert (the slice being copied) and a fixed overhead, far below the
    file size: the whole file is never read, nor kept mapped."""
    E = 16
    size = _write_random_fused(tmp_path / "big", E=E, Hd=1024, I=1024)
    probe = tmp_path / "probe.py"
    probe.write_text(MEMORY_PROBE)
    src = str(Path(__file__).resolve().parents[1] / "src")
    done = subprocess.run([sys.executable, str(probe), str(tmp_path / "big"), "4"], capture_output=True, text=True,
                          env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr
    numbers = json.loads(done.stdout.strip().splitlines()[-1])
    growth, held = numbers["growth_bytes"], numbers["held_bytes"]
    expert = size / E
    assert abs(held - size / 4) < 0.01 * size  # the rank keeps its quarter of the experts
    assert growth < held + 2 * expert + 32 * 2**20 and growth < 0.5 * size, \
        f"peak RSS grew by {growth / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file ({numbers})"


# ----------------------------------------------------------------------------- errors

def _expect_error(match: str, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_error_missing_directory_and_config(tmp_path):
    _expect_error(r"model directory '.*nowhere' does not exist", load_moe_block, tmp_path / "nowhere", 0)
    (tmp_path / "empty").mkdir()
    _expect_error(r"has no config.json", load_moe_block, tmp_path / "empty", 0)


def test_error_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    msg = _expect_error(r"model_type 'llama' is not supported", load_moe_block, tmp_path, 0)
    for supported in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
        assert supported in msg


def test_error_missing_config_field(tmp_path):
    raw = {"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 8, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    _expect_error(r"config.json: missing field 'num_local_experts' \(or 'num_experts'\) \(model_type 'mixtral'\)",
                  load_moe_block, tmp_path, 0)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_experts": 4}))  # the older spelling is accepted
    _expect_error(r"missing field 'intermediate_size' \(model_type 'mixtral'\)", load_moe_block, tmp_path, 0)


def test_error_dense_layers_and_range(ckpts):
    _expect_error(r"layer 0 of this deepseek_v3 model has no MoE block: it is a dense layer \(layer < "
                  r"first_k_dense_replace=1\)", load_moe_block, ckpts["deepseek_v3_hub"].path, 0)
    _expect_error(r"layer 0 of this qwen2_moe model has no MoE block: it is a dense layer \(listed in "
                  r"mlp_only_layers=\[0\]\)", load_moe_block, ckpts["qwen2_moe_sharded"].path, 0)
    _expect_error(r"layer 2 is out of range: .* num_hidden_layers=2", load_moe_block, ckpts["mixtral_hub"].path, 2)
    _expect_error(r"layer -1 is out of range", load_moe_block, ckpts["mixtral_hub"].path, -1)


def test_decoder_sparse_step_makes_dense_layers(tmp_path):
    raw = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 8, "moe_intermediate_size": 8,
           "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = read_hf_config(tmp_path)
    assert sorted(model.dense_layers) == [0, 2]
    _expect_error(r"layer 2 .* dense layer \(\(layer \+ 1\) % decoder_sparse_step=2 != 0\); MoE layers: \[1, 3\]",
                  model.check_layer, 2)


def test_a_new_model_family_is_one_registry_entry(tmp_path, monkeypatch):
    """A family the code has never heard of loads once FAMILIES has its entry: here qwen3_moe's
    mapping under another model_type, with its block under ``moe.`` and w1/w3/w2 experts."""
    from dataclasses import replace

    from moeshard.checkpoint import families

    entry = replace(families.FAMILIES["qwen3_moe"], model_type="toy_moe", block_prefixes=("moe.",),
                    expert_spellings=(families.W1_W3_W2,))
    monkeypatch.setitem(families.FAMILIES, "toy_moe", entry)
    path = tmp_path / "toy"
    _write_random_fused(path, E=4, Hd=16, I=32)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        fused = {k: f.get_tensor(k) for k in f.keys()}
    p, q = "model.layers.0.mlp.", "model.layers.0.moe."
    tensors = {q + "gate.weight": fused[p + "gate.weight"]}
    for e in range(4):
        gate, up = fused[p + "experts.gate_up_proj"][e].chunk(2)
        tensors.update({f"{q}experts.{e}.w1.weight": gate, f"{q}experts.{e}.w3.weight": up,
                        f"{q}experts.{e}.w2.weight": fused[p + "experts.down_proj"][e]})
    save_file(tensors, str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "model_type": "toy_moe"}))
    block = load_moe_block(path, 0)
    assert block.model.model_type == "toy_moe" and block.names.prefix == q and block.names.spelling == ("w1", "w3", "w2")
    assert torch.equal(block.local_experts.gate_up, fused[p + "experts.gate_up_proj"])
    assert torch.equal(block.local_experts.down, fused[p + "experts.down_proj"])
    monkeypatch.delitem(families.FAMILIES, "toy_moe")
    _expect_error(r"model_type 'toy_moe' is not supported", load_moe_block, path, 0)


def _fused_copy(tmp_path: Path, edit) -> Path:
    """A small fused checkpoint with ``edit(tensors)`` applied before writing."""
    path = tmp_path / "edited"
    _write_random_fused(path, E=4, Hd=16, I=32)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_error_missing_tensor_names_it_and_the_file(tmp_path):
    path = _fused_copy(tmp_path, lambda t: t.pop("model.layers.0.mlp.experts.down_proj"))
    _expect_error(r"experts.down_proj is missing; looked in \['model.safetensors'\]", load_moe_block, path, 0)


def test_error_missing_router_names_candidates(tmp_path):
    path = _fused_copy(tmp_path, lambda t: t.pop("model.layers.0.mlp.gate.weight"))
    _expect_error(r"router tensor 'model.layers.0.mlp.gate.weight' is missing; looked in \['model.safetensors'\]",
                  load_moe_block, path, 0)


def test_error_missing_per_expert_tensor(ckpts, tmp_path):
    src = ckpts["mixtral_hub"].path
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.block_sparse_moe.experts.5.w2.weight"}
    (tmp_path / "m").mkdir()
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    (tmp_path / "m" / "config.json").write_text((src / "config.json").read_text())
    _expect_error(r"tensor 'model.layers.1.block_sparse_moe.experts.5.w2.weight' is missing; looked in "
                  r"\['model.safetensors'\]", load_moe_block, tmp_path / "m", 1)


def test_error_wrong_shape_names_tensor_expected_actual(tmp_path):
    def edit(t):
        t["model.layers.0.mlp.experts.down_proj"] = torch.zeros(4, 16, 48)
    path = _fused_copy(tmp_path, edit)
    _expect_error(r"tensor 'model.layers.0.mlp.experts.down_proj' in '.*model.safetensors' has shape \[4, 16, 48\], "
                  r"expected \[4, 16, 32\]", load_moe_block, path, 0)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"])
def test_error_nan_in_loaded_tensor(tmp_path, name):
    def edit(t):
        t[name][1, 2, ...] = float("nan")
    path = _fused_copy(tmp_path, edit)
    _expect_error(rf"tensor '{name}' in '.*model.safetensors' holds 1\d* NaN/Inf", load_moe_block, path, 0)


def test_error_missing_shard_of_index(ckpts, tmp_path):
    src = ckpts["qwen2_moe_sharded"].path
    dst = tmp_path / "sharded"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    victim = index["weight_map"]["model.layers.1.mlp.gate.weight"]
    (dst / victim).unlink()
    _expect_error(rf"safetensors file '.*{victim}' does not exist", load_moe_block, dst, 1)


def test_error_only_pickle_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_hidden_layers": 1, "hidden_size": 8,
                                                      "intermediate_size": 8, "num_local_experts": 4,
                                                      "num_experts_per_tok": 2}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    _expect_error(r"only pickle-based files \['pytorch_model.bin'\]; moeshard never unpickles", load_moe_block,
                  tmp_path, 0)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_error_malformed_safetensors_names_file(tmp_path, damage):
    path = tmp_path / "bad"
    _write_random_fused(path, E=4, Hd=16, I=32)
    f = path / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:-100] if damage == "truncated" else b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    _expect_error(r"safetensors file '.*model.safetensors' is malformed or truncated", load_moe_block, path, 0)


def test_error_fp8_checkpoint_with_other_quant(ckpts):
    _expect_error(r"quant 'nvfp4' was asked for, but .*config.json describes an FP8 block checkpoint .* loads only as "
                  r"quant 'fp8_block'", load_moe_block, ckpts["deepseek_v3_fp8"].path, 1, quant="nvfp4")


def test_error_tokens_per_rank_and_input_shape(ckpts, tmp_path):
    assert split_tokens(7, 3) == (3, 2, 2)
    assert split_tokens(1, 4) == (1, 0, 0, 0)
    _expect_error(r"\[3, 4\] sums to 7, but the input has T=13 tokens", split_tokens, 13, 2, (3, 4))
    _expect_error(r"expected 2 integers >= 0 \(one per DP rank\), got \[13\]", split_tokens, 13, 2, (13,))
    c = ckpts["mixtral_hub"]
    bad = tmp_path / "bad_input.safetensors"
    save_file({"hidden_states": torch.zeros(3, H + 1)}, str(bad))
    _expect_error(r"hidden_states must be \[T, hidden_size=32\], got \[3, 33\]", plan_run,
                  RunSpec(model_dir=str(c.path), layer=c.layer, input_path=str(bad)))
    _expect_error(r"input file '.*nope.safetensors' does not exist", plan_run,
                  RunSpec(model_dir=str(c.path), layer=c.layer, input_path=str(tmp_path / "nope.safetensors")))


def test_error_layout_refused_before_spawn(ckpts):
    c = ckpts["deepseek_v3_fp8"]  # I = 256: tp=4 slices of 64 are not 128-aligned for fp8_block
    _expect_error(r"fp8_block.*aligned to 128.*= 64", plan_run,
                  RunSpec(parallel=ParallelConfig(tp=4), model_dir=str(c.path), layer=1))
    _expect_error(r"num_experts=8 is not divisible by the EP size 3", plan_run,
                  RunSpec(parallel=ParallelConfig(dp=3, enable_ep=True), model_dir=str(c.path), layer=1))


def test_files_beside_the_model_are_ignored_as_transformers_ignores_them(tmp_path, caplog):
    """model.safetensors is the model; an input and an expected output kept beside it (both with
    a ``hidden_states`` tensor, even one with a router tensor's name) are not read, and said so."""
    path = tmp_path / "m"
    _write_random_fused(path, E=4, Hd=16, I=32)
    alone = load_moe_block(path, 0)
    for name in ("input.safetensors", "expected.safetensors"):
        save_file({"hidden_states": torch.ones(3, 16)}, str(path / name))
    save_file({"model.layers.0.mlp.gate.weight": torch.zeros(4, 16)}, str(path / "zz-stray.safetensors"))
    with caplog.at_level("INFO", logger="moeshard.checkpoint"):
        beside = load_moe_block(path, 0)
    assert "expected.safetensors, input.safetensors, zz-stray.safetensors" in caplog.text
    assert torch.equal(alone.weights.gate, beside.weights.gate)
    assert torch.equal(alone.local_experts.gate_up, beside.local_experts.gate_up)


def test_shards_without_an_index_are_read_by_their_pattern(tmp_path):
    """model-0000i-of-0000N.safetensors without an index: every shard is read, other files not;
    a tensor stored in two shards is refused naming both, a missing shard naming its number."""
    path = tmp_path / "m"
    _write_random_fused(path, E=4, Hd=16, I=32)
    whole = load_moe_block(path, 0)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[::2]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[1::2]}, str(path / "model-00002-of-00002.safetensors"))
    save_file({"hidden_states": torch.ones(2, 16)}, str(path / "input.safetensors"))
    got = load_moe_block(path, 0)
    assert torch.equal(got.local_experts.gate_up, whole.local_experts.gate_up)
    assert torch.equal(got.local_experts.down, whole.local_experts.down)
    save_file({names[0]: tensors[names[0]]}, str(path / "model-00002-of-00002.safetensors"))
    _expect_error(rf"tensor '{names[0]}' is stored twice, in 'model-00001-of-00002.safetensors' and "
                  r"'model-00002-of-00002.safetensors' .* no model.safetensors.index.json", load_moe_block, path, 0)
    (path / "model-00002-of-00002.safetensors").unlink()
    _expect_error(r"shard set of 2 files is incomplete or misnumbered: missing shard numbers \[2\]", load_moe_block, path, 0)
    (path / "model-00001-of-00002.safetensors").unlink()
    _expect_error(r"no model.safetensors, no model.safetensors.index.json and no model-00001-of-0000N.safetensors "
                  r"shards; its other \*.safetensors files \['input.safetensors'\]", load_moe_block, path, 0)


@pytest.mark.parametrize("fused", [True, False])
def test_error_huge_expert_count_is_refused_from_the_headers(tmp_path, fused):
    """A config claiming 10^9 experts is refused at once by the router's header shape (and a
    per-expert naming by the number of tensors the files hold), before any loop over experts."""
    import time

    path = tmp_path / "huge"
    _write_random_fused(path, E=4, Hd=16, I=32)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_experts": 10**9, "num_experts_per_tok": 2}))
    if not fused:  # per-expert names, router removed so only the tensor count can bound the loop
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        p = "model.layers.0.mlp."
        per_expert = {f"{p}experts.{e}.{proj}_proj.weight": w for e in range(4)
                      for proj, w in zip(("gate", "up"), t[p + "experts.gate_up_proj"][e].chunk(2), strict=True)}
        per_expert.update({f"{p}experts.{e}.down_proj.weight": t[p + "experts.down_proj"][e] for e in range(4)})
        save_file(per_expert | {p + "gate.weight": t[p + "gate.weight"]}, str(path / "model.safetensors"))
        from moeshard.checkpoint.experts import ExpertReader
        from moeshard.checkpoint.names import resolve_block_names
        from moeshard.checkpoint.reader import SafetensorsCheckpoint
        model = read_hf_config(path)
        ckpt = SafetensorsCheckpoint(path)
        start = time.monotonic()
        _expect_error(r"num_experts=1000000000 needs 3000000000 per-expert tensors .* holds 13 tensors in all",
                      ExpertReader, ckpt, resolve_block_names(ckpt, model, 0), model.moe_config(), model.format)
        assert time.monotonic() - start < 5
    start = time.monotonic()
    _expect_error(r"tensor 'model.layers.0.mlp.gate.weight' .* has shape \[4, 16\], expected \[1000000000, 16\]",
                  load_moe_block, path, 0)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("change, message", [
    ({"weight_block_size": [1, 128]}, r"weight_block_size=\[1, 128\]; moeshard's fp8_block needs \[128, 128\]"),
    ({"activation_scheme": "static"}, r"activation_scheme='static'; only 'dynamic' is supported"),
    ({"expert_dtype": "fp4"}, r"expert_dtype='fp4'; this family reads FP8 block checkpoints whose experts are fp8 too, "
                              r"not .* \(the format 'fp8_block_mxfp4', DeepSeek-V4's\)"),
])
def test_fp8_block_configs_moeshard_does_not_read_are_refused_naming_the_field(change, message):
    """An FP8 block quantization_config moeshard cannot read is refused from config.json alone, the
    field and its value named: another block, static activation scales, or FP4 experts (the E8M0
    scales of DeepSeek-V4's style are read where the experts are fp8; its FP4 experts by DeepSeek-V4's
    family alone: tests/test_fp8_block_mxfp4_checkpoints.py)."""
    from moeshard.checkpoint.hf_config import parse_hf_config

    q = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    raw = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 64, "moe_intermediate_size": 32,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
           "intermediate_size": 128}
    assert parse_hf_config({**raw, "quantization_config": q}, "config.json").checkpoint_format == "fp8_block"
    with pytest.raises(ValueError, match=message):
        parse_hf_config({**raw, "quantization_config": {**q, **change}}, "config.json")
