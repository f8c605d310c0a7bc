"""``moeshard run`` end to end: the command's parser and ``func``, its output file, its errors.

The parser is built from ``moeshard.commands.run.add_parser`` alone and errors are handled as
``moeshard.cli.main`` does (ValueError -> message on stderr, exit code 2), so these tests depend
on no other subcommand.
"""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moeshard.commands import run as run_command
from moeshard.config import QuantConfig
from moeshard.jobs.run import random_weights
from moeshard.kernel_choice import select_kernel
from moeshard.presets import get_preset
from moeshard.reference import Reference, reference_forward
from moeshard.tolerances import compare


def moeshard_run(argv: list[str]) -> int:
    """``moeshard run ARGV`` with the CLI's error handling."""
    parser = argparse.ArgumentParser(prog="moeshard")
    sub = parser.add_subparsers(dest="command", required=True)
    run_command.add_parser(sub)
    args = parser.parse_args(["run", *argv])
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"moeshard run: error: {exc}", file=sys.stderr)
        return 2


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A tiny Qwen3-MoE saved with save_pretrained, its input file, and the transformers block output."""
    import transformers as tf

    root = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(7)
    cfg = tf.Qwen3MoeConfig(vocab_size=32, hidden_size=32, intermediate_size=48, moe_intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, initializer_range=0.2,
                            experts_implementation="eager", attn_implementation="eager")
    model = tf.Qwen3MoeForCausalLM(cfg).eval()
    model.save_pretrained(str(root / "model"))
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(3))
    save_file({"hidden_states": x}, str(root / "in.safetensors"))
    with torch.no_grad():
        expected = model.model.layers[0].mlp(x[None])[0].double()
    return root, expected


def test_run_checkpoint_one_rank_matches_transformers(tiny_qwen3, capsys):
    root, expected = tiny_qwen3
    out = root / "out.safetensors"
    code = moeshard_run(["--model", str(root / "model"), "--layer", "0", "--input", str(root / "in.safetensors"),
                         "--output", str(out)])
    assert code == 0
    got = load_file(str(out))
    assert list(got) == ["hidden_states"]
    _, atol, rtol, ok = compare(got["hidden_states"], expected, torch.float32, "none")
    assert ok
    with safe_open(str(out), "pt") as f:
        meta = json.loads(f.metadata()["moeshard_run"])
    assert meta["layout"] == "dp1-tp1-noep" and meta["backend"] == "local" and meta["quant"] == "none"
    printed = capsys.readouterr().out
    for fragment in ("qwen3_moe", "layer 0", "dp1-tp1-noep", "backend local", "quant none", "tokens 9", str(out), "wall time"):
        assert fragment in printed, fragment


def test_run_random_preset_two_ranks_matches_reference(tmp_path, capsys):
    """--random: weights and tokens from the seed, EP over 2 spawned ranks, uneven token split."""
    out = tmp_path / "out.safetensors"
    code = moeshard_run(["--random", "qwen2-57b-a14b", "--seed", "5", "--tokens", "11", "--tokens-per-rank", "3,8",
                         "--dp", "2", "--ep", "--backend", "allgather_reducescatter", "--quant", "fp8_token",
                         "--output", str(out)])
    assert code == 0
    got = load_file(str(out))
    cfg = get_preset("qwen2-57b-a14b").config("small")
    x = got["input_hidden_states"]
    assert x.shape == (11, cfg.hidden_size)
    ref = reference_forward(x, random_weights(cfg, 5), cfg, QuantConfig("fp8_token"))
    err, atol, rtol, ok = compare(got["hidden_states"], ref, torch.float32, "fp8_token")
    assert ok, f"max error {err} > {atol} + {rtol} |ref|"
    printed = capsys.readouterr().out
    assert "dp2-tp1-ep" in printed and "allgather_reducescatter" in printed and "[3,8]" in printed


@pytest.mark.parametrize("argv, message", [
    (["--random", "mixtral-8x7b", "--tokens", "5", "--dp", "2", "--tokens-per-rank", "2,2"],
     "--tokens-per-rank: [2, 2] sums to 4, but --tokens asks for T=5 tokens"),
    (["--random", "mixtral-8x7b", "--model", "somewhere"], "give either --model or --random, not both"),
    (["--model", "somewhere"], "--model needs --layer"),
    (["--tokens", "4"], "give exactly one of a model directory (--model) and a preset (--random)"),
    (["--random", "mixtral-8x7b", "--output", "/nonexistent-dir/out.safetensors"], "does not exist"),
    (["--random", "mixtral-8x7b", "--dp", "3", "--ep"], "num_experts=8 is not divisible by the EP size 3"),
    (["--random", "mixtral-8x7b", "--backend", "all2all"], "all2all needs expert parallelism"),
    (["--model", "/nonexistent-model", "--layer", "0"], "--model '/nonexistent-model' does not exist"),
])
def test_run_refusals_exit_2_before_spawning(argv, message, capsys):
    assert moeshard_run(argv) == 2
    assert message in capsys.readouterr().err


def test_run_refuses_bad_input_file(tiny_qwen3, tmp_path, capsys):
    root, _ = tiny_qwen3
    bad = tmp_path / "in.safetensors"
    save_file({"tokens": torch.zeros(3, 32)}, str(bad))
    assert moeshard_run(["--model", str(root / "model"), "--layer", "0", "--input", str(bad)]) == 2
    assert "has no tensor 'hidden_states'" in capsys.readouterr().err


def test_run_rank_that_cannot_load_stops_every_rank(tiny_qwen3, tmp_path, capsys):
    """A NaN in an expert only rank 1 owns: rank 1 refuses, rank 0 is told, nobody hangs, exit 2."""
    root, _ = tiny_qwen3
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((root / "model" / "config.json").read_text())
    with safe_open(str(root / "model" / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.0.mlp.experts.6.up_proj.weight"][0, 0] = float("inf")
    save_file(tensors, str(broken / "model.safetensors"))
    code = moeshard_run(["--model", str(broken), "--layer", "0", "--input", str(root / "in.safetensors"),
                         "--dp", "2", "--ep"])
    assert code == 2
    err = capsys.readouterr().err
    assert "rank 1: tensor 'model.layers.0.mlp.experts.6.up_proj.weight'" in err and "NaN/Inf" in err


# ----------------------------------------------------------------------------- CUDA (skipped without 2 GPUs)

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@needs_two_gpus
@pytest.mark.parametrize("layout, quant, dtype", [
    (["--dp", "2", "--ep"], "none", "float32"),
    (["--tp", "2"], "none", "bfloat16"),
    (["--tp", "2", "--ep"], "fp8_block", "bfloat16"),
    (["--dp", "2", "--ep", "--backend", "allgather_reducescatter"], "nvfp4", "bfloat16"),
    (["--tp", "2"], "fp8_tensor", "float32"),
    (["--dp", "2", "--ep", "--defer-input-quant"], "fp8_token", "bfloat16"),
])
def test_run_random_on_two_gpus_matches_reference(tmp_path, layout, quant, dtype):
    """NCCL ranks, one GPU each: the output of every token against the single-device reference."""
    out = tmp_path / "out.safetensors"
    argv = ["--random", "deepseek-v3", "--device", "cuda", "--tokens", "37", "--seed", "2", "--quant", quant,
            "--dtype", dtype, "--output", str(out), *layout]
    assert moeshard_run(argv) == 0
    got = load_file(str(out))
    with safe_open(str(out), "pt") as f:
        meta = json.loads(f.metadata()["moeshard_run"])
    cfg = get_preset("deepseek-v3").config("small", getattr(torch, dtype))
    weights, x = random_weights(cfg, 2), got["input_hidden_states"]
    ep, tp = "--ep" in layout, 2 if "--tp" in layout else 1
    q = QuantConfig(quant, defer_input_quant="--defer-input-quant" in layout) if quant != "none" else QuantConfig()
    # The accumulation error of the kernel the ranks ran (fp8 GEMMs on the fp8 tensor cores).
    acc = select_kernel(cfg.activation, cfg.dtype, torch.device("cuda"), quant).accumulation(quant)
    if ep:
        ref = reference_forward(x, weights, cfg, q, accumulation=acc)
    else:  # per-tensor activation scales are per DP rank without EP
        sizes = [int(n) for n in meta["tokens_per_dp_rank"].split(",")]
        ref = Reference.cat([reference_forward(part, weights, cfg, q, intermediate_shards=tp, accumulation=acc)
                             for part in torch.split(x, sizes)])
    err, atol, rtol, ok = compare(got["hidden_states"], ref, getattr(torch, dtype), quant)
    assert ok, f"{meta}: max error {err} > {atol} + {rtol} |ref|"


@needs_two_gpus
def test_run_checkpoint_on_two_gpus_matches_transformers(tiny_qwen3):
    root, expected = tiny_qwen3
    out = root / "out_cuda.safetensors"
    assert moeshard_run(["--model", str(root / "model"), "--layer", "0", "--input", str(root / "in.safetensors"),
                         "--output", str(out), "--tp", "2", "--device", "cuda"]) == 0
    assert compare(load_file(str(out))["hidden_states"], expected, torch.float32, "none")[3]


def test_a_run_whose_ranks_part_says_where_from_the_collective_trace(monkeypatch):
    """The trace is on by default in ``moeshard run``: a rank that raises while its peer waits
    in a collective is reported with where the two sequences part."""
    import faults

    from moeshard.errors import RankFailed
    from moeshard.jobs.run import RunSpec, plan_run
    from moeshard.parallel.config import ParallelConfig

    plan = plan_run(RunSpec(parallel=ParallelConfig(2, 1, True), preset="mixtral-8x7b", num_tokens=6,
                            backend="all2all", dtype="float32"))
    monkeypatch.setattr(run_command, "run_plans", faults.run_plans_raising_in_combine_on_rank1)
    with pytest.raises(RankFailed) as failed:
        run_command._execute_local(plan, timeout_s=12.0)
    message = str(failed.value)
    assert message.startswith("rank 0 raised") or message.startswith("rank 1 raised RuntimeError"), message
    assert "collectives: ranks part at collective #" in message, message
    assert "rank 0 failed in all_to_allv (ep)" in message and "< combine" in message, message
    assert "rank 1 never entered it (it raised RuntimeError (planted: combine refuses on rank 1))" in message, message
