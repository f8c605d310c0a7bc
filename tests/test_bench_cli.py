"""``moeshard bench`` without a GPU, and its report machinery on the committed H200 run.

The benchmark itself needs CUDA (tests/gpu and the H200 run in docs/performance.md); here: the
refusal on CPU machines, option parsing, and that the committed ``results/h200/h200.json`` is what this
code derives from its raw timings (ratios and targets), rendered as a table and a plot.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from moeshard import cli
from moeshard.bench import report, runner, targets, workload
from moeshard.commands.args import ints
from moeshard.kernel_choice import select_kernel
from moeshard.layer import MoELayer

RUN = Path(__file__).resolve().parents[1] / "results" / "h200" / "h200.json"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA; the refusal is for machines without")
def test_bench_refuses_without_cuda(capsys):
    assert cli.main(["bench", "--models", "mixtral-8x7b"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "torch.cuda.is_available() is False" in err


def test_options_are_validated():
    assert ints("1,16, 64", "--decode-tokens") == (1, 16, 64)
    with pytest.raises(ValueError, match="--decode-tokens"):
        ints("1,x", "--decode-tokens")
    with pytest.raises(ValueError, match="model 'gpt'"):
        runner.BenchOptions(models=("gpt",)).validate()
    with pytest.raises(ValueError, match="quant 'int4'"):
        runner.BenchOptions(quants=("int4",)).validate()
    with pytest.raises(ValueError, match="positive"):
        runner.BenchOptions(decode_tokens=(0,)).validate()


@pytest.fixture(scope="module")
def committed():
    return json.loads(RUN.read_text())


def test_committed_ratios_follow_from_its_timings(committed):
    rederived = copy.deepcopy(committed["records"])
    for r in rederived:
        r.pop("ratios", None)
    runner.derive(rederived, committed["ceilings"])
    for new, old in zip(rederived, committed["records"], strict=True):
        assert new["ratios"].keys() == old["ratios"].keys()
        for key in old["ratios"]:
            assert new["ratios"][key] == pytest.approx(old["ratios"][key], rel=1e-12), (old["model"], old["tokens"], key)
    # targets added after that run come last; the ones it evaluated are unchanged
    assert targets.evaluate(committed["records"], committed["device"]["name"])[:len(committed["targets"])] == committed["targets"]


def test_the_layer_over_all_its_experts_counts_the_shared_experts_timed_alone():
    """Hand-computed: DeepSeek-V3 with 12 ms of routed experts, 2 ms of shared experts and a
    15 ms layer is 80% by the routed experts alone and 93.3% by all its experts; a model without
    shared experts gives the same ratio both ways; a record from before the bench timed the
    shared experts, or whose shared timing failed, gives none."""
    def rec(model, **extra):
        return {"model": model, "regime": "prefill", "tokens": 4096, "quant": "fp8_tensor", "experts_ms": 12.0,
                "layer_ms": 15.0, "expert_flops": 10**12, "layer_flops": 10**12, "weight_bytes": 10**9, **extra}
    records = [rec("deepseek-v3", shared_experts=True, shared_ms=2.0), rec("mixtral-8x7b", shared_experts=False),
               rec("deepseek-v3"), rec("deepseek-v3", shared_experts=True, shared_error="RuntimeError: x")]
    runner.derive(records, {"matmul": {"tflops": 989.0}, "copy": {"gbps": 4000.0}})
    assert records[0]["ratios"]["layer_over_experts"] == pytest.approx(0.8)
    assert records[0]["ratios"]["layer_over_all_experts"] == pytest.approx(14 / 15)
    assert records[1]["ratios"]["layer_over_all_experts"] == pytest.approx(0.8)
    assert "layer_over_all_experts" not in records[2]["ratios"] and "layer_over_all_experts" not in records[3]["ratios"]
    by_name = {t["name"]: t for t in targets.evaluate(records, "NVIDIA H200")}
    assert [c["met"] for c in by_name["fp8_layer_vs_experts"]["cases"]] == [False, False, False, False]
    assert [(c["case"], c["met"]) for c in by_name["fp8_layer_vs_all_experts"]["cases"]] == [
        ("deepseek-v3 T=4096 fp8_tensor", True), ("mixtral-8x7b T=4096 fp8_tensor", False)]


@pytest.mark.parametrize("model, shared", [("deepseek-v3", True), ("mixtral-8x7b", False)])
def test_a_case_times_the_layers_shared_experts_alone_where_it_has_them(monkeypatch, model, shared):
    """The bench's case on CPU with each timing replaced by one call: the shared experts are
    called on the case's hidden states and recorded where the model has them."""
    called = []

    def once(rec, key, fn, reps, flush, graph=True):
        out = fn()
        called.append((key, tuple(out.shape) if isinstance(out, torch.Tensor) else None))
        rec[key + "_ms"] = 1.0

    monkeypatch.setattr(runner, "_timed", once)
    cpu = torch.device("cpu")
    m = workload.make_model(model, cpu, size="small")
    opts = runner.BenchOptions(models=(model,), quants=("none",), baselines=False)
    experts = workload.experts_for(m, "none")
    layer = MoELayer(m.cfg, opts.quant("none", m.cfg), weights=m.shell, local_experts=experts, device=cpu)
    kernel = select_kernel(m.cfg.activation, m.cfg.dtype, cpu, "none")
    rec = runner._case(m, "none", experts, kernel, layer, "prefill", 6, opts, None)
    assert rec["shared_experts"] is shared and ("shared_ms" in rec) is shared
    assert [key for key, _ in called] == ["experts", "layer", *(["shared"] if shared else [])]
    if shared:
        assert called[-1][1] == (6, m.cfg.hidden_size)


def test_report_renders(committed, tmp_path):
    console = Console(record=True, width=200)
    report.print_tables(committed, console)
    text = console.export_text()
    assert "NVIDIA H200" in text and "fp8_block_vs_bf16" in text
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib" in report.plot(committed, tmp_path / "r.png")
    else:
        assert report.plot(committed, tmp_path / "r.png") is None
        assert (tmp_path / "r.png").stat().st_size > 10_000


def test_distributed_bench_plan_runs_on_cpu_ranks(tmp_path, capsys):
    """``--world-size`` on gloo ranks: the plan, the per-rank timing, the merge across ranks, the
    ratios and the report run end to end (the figures themselves mean nothing on CPUs)."""
    out = tmp_path / "dist.json"
    code = cli.main(["bench", "--world-size", "2", "--device", "cpu", "--size", "small", "--models", "deepseek-v3",
                     "--quants", "fp8_block", "--decode-tokens", "1", "--prefill-tokens", "5", "--reps", "1",
                     "--runs", "DP,EP2 low_latency,SP2 all2all", "--json", str(out), "--quiet"])
    assert code == 0
    doc = json.loads(out.read_text())
    runs = {(r["run"], r["tokens"]) for r in doc["records"]}
    assert runs == {(run, t) for run in ("1 GPU", "DP", "EP2 low_latency", "SP2 all2all") for t in (1, 5)}
    for r in doc["records"]:
        assert r["layer_ms"] > 0 and set(r["per_rank_ms"]) == {"0", "1"}, r
        if r["run"] != "DP":
            assert r["ratios"]["vs_dp"] > 0
        if r["run"].startswith(("EP2", "SP2")):
            assert r["dispatch_ms"] > 0 and r["combine_ms"] > 0 and r["raw_dispatch_ms"] > 0
            rows = r["tokens"] if r["run"].startswith("EP2") else -(-r["tokens"] // 2)
            assert r["dispatch_bytes"] == rows * 4 * (128 + 4)  # top-4 of 16; fp8 H=128 + one fp32 scale per 128
            assert r["combine_bytes"] == rows * 4 * 128 * 2
    printed = capsys.readouterr().out
    assert "layer per rank" in printed and "EP2 low_latency" in printed and "raw a2a" in printed


def test_backward_bench_plan_runs_on_cpu(tmp_path, capsys):
    """``bench --backward`` on the host: every figure of every case is there, the two
    implementations computed the same weight gradients, and the targets are evaluated."""
    out = tmp_path / "bwd.json"
    assert cli.main(["bench", "--backward", "--device", "cpu", "--size", "small", "--models", "deepseek-v3",
                 "--prefill-tokens", "16", "--reps", "1", "--quiet", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["model"], r["tokens"]) for r in result["records"]] == [("deepseek-v3", 16)]  # shared experts too
    for r in result["records"]:
        for prefix in ("experts", "grouped_mm", "layer"):
            assert r[f"{prefix}_fwd_ms"] > 0 and r[f"{prefix}_bwd_ms"] > 0, r
        assert r["weight_grad_rel_diff"] < 2e-2, r  # bf16 rounding, nothing more
    assert {t["name"] for t in result["targets"]} == {"experts_bwd_vs_grouped_mm", "layer_bwd_over_fwd",
                                                      "experts_bwd_over_fwd"}
    assert "target layer_bwd_over_fwd <= 2.2" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--backward", "--quants", "fp8_tensor"],
     "--backward does not read --quants; --quants is for the one-GPU bench or --world-size (or torchrun)"),
    (["--backward", "--decode-tokens", "1", "--shared-quant", "fp8_token", "--plot", "x.png"],
     "--backward does not read --decode-tokens, --shared-quant, --plot"),
    (["--world-size", "2", "--device", "cpu", "--no-layer"],
     "--world-size (or torchrun) does not read --no-layer; --no-layer is for the one-GPU bench or --backward"),
    (["--world-size", "2", "--device", "cpu", "--tune"], "--world-size (or torchrun) does not read --tune"),
    (["--size", "small"], "the one-GPU bench does not read --size; --size is for --world-size (or torchrun) or --backward"),
    (["--runs", "DP", "--no-graphs"], "the one-GPU bench does not read --runs, --no-graphs"),
    (["--backward", "--device", "cpu", "--timeout", "0.001"],
     "--backward does not read --timeout; --timeout is for --world-size (or torchrun)"),
    (["--device", "cpu", "--models", "mixtral-8x7b"],
     "the one-GPU bench does not read --device; --device is for --world-size (or torchrun) or --backward"),
])
def test_a_flag_the_mode_would_ignore_is_refused(argv, message, capsys):
    """Each of the bench's modes (one GPU, across ranks, backward) refuses, before it measures
    anything, a flag it does not read: ``--backward --quants fp8_tensor`` would otherwise time the
    bf16 backward under an fp8 command line."""
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_backward_bench_refuses_world_size(capsys):
    assert cli.main(["bench", "--backward", "--world-size", "2", "--device", "cpu"]) == 2
    assert "--backward times one device" in capsys.readouterr().err


def test_study_rounds_alternate_between_the_timed_callables(monkeypatch):
    """The study scripts' ``alternating_medians``: every round times each callable once, in
    order (so drift spreads over all of them), and each key's median is over its rounds."""
    from moeshard.bench import timing

    order: list[str] = []
    times = iter([5.0, 1.0, 3.0, 2.0, 4.0, 9.0])

    def fake(fn, *, reps, flush):
        order.append(fn())
        return next(times)

    monkeypatch.setattr(timing, "graph_median_ms", fake)
    rounds, medians = timing.alternating_medians({"a": lambda: "a", "b": lambda: "b"}, rounds=3, reps=1, flush=None)
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert rounds == {"a": [5.0, 3.0, 4.0], "b": [1.0, 2.0, 9.0]}
    assert medians == {"a": 4.0, "b": 2.0}


@pytest.mark.parametrize("preset", ["gpt-oss-120b", "qwen3-30b-a3b"])
def test_bench_models_carry_every_weight_the_layer_needs(preset):
    """The bench's model (router, its bias, the experts' biases where the preset has them) gives
    the layer built from its shell and local experts the output of the layer built from the same
    weights whole: nothing the family computes is left out of what the bench times."""
    import dataclasses

    import torch

    from moeshard.bench.workload import experts_for, hidden_states, make_model
    from moeshard.config import QuantConfig
    from moeshard.layer import MoELayer

    m = make_model(preset, torch.device("cpu"), size="small")
    assert (m.shell.gate_bias is not None) == m.cfg.routing_kind.router_bias
    assert (m.gate_up_bias is not None) == (m.down_bias is not None) == m.cfg.expert_bias
    whole = dataclasses.replace(m.shell, gate_up=m.gate_up, down=m.down, gate_up_bias=m.gate_up_bias,
                                down_bias=m.down_bias)
    x = hidden_states(m, 9, seed=2)
    for scheme in ("none", "fp8_token"):
        split = MoELayer(m.cfg, QuantConfig(scheme), weights=m.shell, local_experts=experts_for(m, scheme))
        assert torch.equal(split(x), MoELayer(m.cfg, QuantConfig(scheme), weights=whole)(x)), scheme


def test_fused_moe_targets_on_another_gpu_say_why_they_have_no_case():
    """The fused-MoE figures are an H200's: a run on an H100 gets no fused-MoE case, the entry
    says why, and the report's row says "not on this GPU" instead of "not run"; on an H200 the
    same record is compared."""
    rec = {"model": "mixtral-8x7b", "regime": "prefill", "tokens": 4096, "quant": "fp8_tensor", "experts_ms": 2.0,
           "ratios": {}}
    on_h100 = {t["name"]: t for t in targets.evaluate([rec], "NVIDIA H100 80GB HBM3")}
    fused = on_h100["fp8_prefill_vs_fused"]
    assert fused["met"] is None and fused["cases"] == []
    assert fused["not_evaluated"] == "the fused-MoE figures are an H200's; this run is on NVIDIA H100 80GB HBM3"
    assert "not_evaluated" not in on_h100["fp8_layer_vs_experts"]
    on_h200 = {t["name"]: t for t in targets.evaluate([rec], "NVIDIA H200")}
    assert on_h200["fp8_prefill_vs_fused"]["cases"][0]["value"] == pytest.approx(2.61 / 2.0)
    assert "not_evaluated" not in on_h200["fp8_prefill_vs_fused"]
    console = Console(width=200, record=True)
    console.print(report.targets_table(list(on_h100.values())))
    rows = {line.split("│")[1].strip(): line for line in console.export_text().splitlines() if line.count("│") > 2}
    assert "not on this GPU" in rows["fp8_prefill_vs_fused"] and "not run" in rows["bf16_vs_peak"]
