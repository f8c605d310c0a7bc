"""``scripts/fp8_targets.py``: the targets over several bench runs. The counts and the misses'
spread on hand-made records whose ratios are known, the text of a real stored run, the run mode's
failures on a machine without a GPU (the forward bench refuses there), and its refusals."""

from __future__ import annotations

import json
import re
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import fp8_targets  # noqa: E402


def record(model, regime, tokens, quant, experts_ms, **ratios):
    return {"model": model, "regime": regime, "tokens": tokens, "quant": quant, "experts_ms": experts_ms,
            "ratios": ratios}


def runs_with(decode_ratio: float, layer_ratio: float, gpu: str = "NVIDIA H200") -> dict:
    # Mixtral fp8_tensor at 16 tokens: the fused-MoE kernel takes 0.364 ms, so these experts_ms
    # give fused / ours = decode_ratio. DeepSeek-V3 fp8_block at 4096 tokens: 6.43 ms / 1.3.
    return {"device": {"name": gpu}, "records": [
        record("mixtral-8x7b", "decode", 16, "fp8_tensor", 0.364 / decode_ratio, vs_copy=0.9),
        record("deepseek-v3", "prefill", 4096, "fp8_block", 6.43 / 1.3, layer_over_experts=layer_ratio),
    ]}


def test_counts_per_run_and_each_miss_with_its_spread_and_how_often_it_missed():
    text, summary = fp8_targets.report(["a-1", "a-2"], [runs_with(0.90, 0.80), runs_with(0.96, 0.84)], ["# h"])
    rows = {row["name"]: row for row in summary["targets"]}
    assert rows["fp8_vs_fused_moe"]["counts"] == [(1, 2), (2, 2)]
    [miss] = rows["fp8_vs_fused_moe"]["misses"]
    assert miss["case"] == "mixtral-8x7b T=16 fp8_tensor" and miss["missed_in"] == 1
    assert miss["values"] == pytest.approx([0.90, 0.96])
    assert rows["fp8_prefill_vs_fused"]["counts"] == [(1, 1), (1, 1)] and rows["fp8_prefill_vs_fused"]["misses"] == []
    assert rows["fp8_layer_vs_experts"]["misses"][0]["missed_in"] == 2
    assert "bf16_vs_peak" not in rows  # no run covers it: no row
    assert "| `fp8_vs_fused_moe` (>= 0.95) | 1 / 2 of 2 | mixtral-8x7b T=16 fp8_tensor 0.900-0.960 (1 of 2) |" in text
    assert "| `fp8_layer_vs_experts` (>= 0.85) | 0 / 0 of 1 | deepseek-v3 T=4096 fp8_block 0.800-0.840 (2 of 2) |" in text
    assert "== a-1\n  fp8_vs_fused_moe: 1/2; misses: mixtral-8x7b T=16 fp8_tensor 0.900\n" in text


def test_a_run_on_another_gpu_than_the_fused_moe_figures_has_no_fused_moe_case_and_says_so():
    """The fused-MoE figures are an H200's: an H100 run (or one whose GPU is unknown) is not
    compared with them, while its ratios within the run are still evaluated."""
    text, summary = fp8_targets.report(["a-1", "a-2"], [runs_with(0.90, 0.80), runs_with(0.90, 0.80, "NVIDIA H100 80GB HBM3")],
                                       ["# h"])
    rows = {row["name"]: row for row in summary["targets"]}
    assert rows["fp8_vs_fused_moe"]["counts"] == [(1, 2), None]
    assert rows["fp8_layer_vs_experts"]["counts"] == [(0, 1), (0, 1)]
    assert "# fused-MoE targets: not evaluated on NVIDIA H100 80GB HBM3; their figures are an H200's" in text
    assert "not evaluated" not in fp8_targets.report(["a-1"], [runs_with(0.9, 0.8)], ["# h"])[0]
    unknown = {"records": runs_with(0.9, 0.8)["records"]}
    [fused] = [t for t in fp8_targets.report(["x"], [unknown], ["# h"])[1]["per_run"]["x"] if t["name"] == "fp8_vs_fused_moe"]
    assert fused["met"] is None and fused["cases"] == []


def test_a_miss_that_rounds_to_the_threshold_prints_a_fourth_decimal():
    assert fp8_targets.fmt(1.49963, 1.5) == "1.4996"
    assert fp8_targets.fmt(1.50004, 1.5) == "1.500"  # met: three decimals
    assert fp8_targets.fmt(0.8471, 0.85) == "0.847"


def test_the_stored_runs_give_the_stored_evaluation(capsys):
    stored = ROOT / "results" / "h200"
    files = [stored / f"bench-2026-12-05-e3d932c-{n}.json" for n in ("1", "b-1", "2", "b-2")]
    assert fp8_targets.main(["--report", *map(str, files)]) == 0
    printed = capsys.readouterr().out
    blocks = printed[printed.index("== "):]
    old = (stored / "bench-2026-12-05-e3d932c.txt").read_text()
    old_blocks = old[old.index("== "):]
    # The same lines under each run; the runs are named after their files now. Lines differ only
    # where a miss rounds to its threshold, which the stored text printed with three decimals
    # (DeepSeek-V3's fp8_block_vs_bf16 at 1.4996 read 1.500 there).
    new = [line for line in blocks.splitlines() if not line.startswith("== ")]
    stored_lines = [line for line in old_blocks.splitlines() if not line.startswith("== ")]
    differ = [(a, b) for a, b in zip(new, stored_lines, strict=True) if a != b]
    assert any("deepseek-v3 T=16384 1.4996" in a for a, _ in differ)
    assert all(re.sub(r"\d\.\d{4}", lambda m: f"{float(m.group()):.3f}", a) == b for a, b in differ)
    assert "| `fp8_vs_fused_moe` (>= 0.95) | 29 / 29 / 29 / 29 of 30 |" in printed


def test_failed_runs_are_named_the_exit_code_says_so_and_the_folder_is_packed(tmp_path):
    out = tmp_path / "t"
    assert fp8_targets.main(["--rounds", "1", "--out", str(out), "--timeout-s", "120"]) == 1
    text = (out / "targets.txt").read_text()
    assert "# FAILED a-1: rc=2" in text and "# FAILED b-1: rc=2" in text
    assert "bench needs a CUDA GPU" in (out / "a-1.txt").read_text()
    summary = json.loads((out / "targets.json").read_text())
    assert summary["runs"] == ["a-1", "b-1"] and len(summary["failed"]) == 2
    assert summary["bench_args"]["b"][:2] == ["--quants", "none,fp8_tensor,fp8_token,fp8_block"]
    with tarfile.open(f"{out}.tar.gz") as tar:
        assert {"t/targets.txt", "t/targets.json", "t/a-1.txt", "t/b-1.txt"} <= set(tar.getnames())


@pytest.mark.parametrize("argv,message", [
    (["--", "--quants", "none"], "bench argument --quants: fp8_targets sets it itself"),
    (["--", "--json", "x.json"], "bench argument --json: fp8_targets sets it itself"),
    (["--rounds", "0"], "--rounds: must be at least 1, got 0"),
    (["--timeout-s", "nan"], "--timeout-s: must be a finite number of seconds above 0, got nan"),
    (["--report", "x.json", "--", "--models", "deepseek-v3"], "bench arguments --models deepseek-v3 have no use"),
    (["--report", "NOSUCH.json"], "--report NOSUCH.json: not a readable bench JSON"),
])
def test_refusals_name_the_argument_before_any_run(argv, message, capsys, tmp_path):
    argv = [a.replace("NOSUCH", str(tmp_path / "nosuch")) for a in argv]
    message = message.replace("NOSUCH", str(tmp_path / "nosuch"))
    with pytest.raises(SystemExit) as exc:
        fp8_targets.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_json_that_is_not_a_bench_result_is_refused(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"cases": []}))
    with pytest.raises(SystemExit):
        fp8_targets.main(["--report", str(path)])
    assert "no 'records' list" in capsys.readouterr().err
