"""``moeshard bench`` without a GPU, and its report machinery on the committed H200 run.

The benchmark itself needs CUDA (tests/gpu and the H200 run in docs/performance.md); here: the
refusal on CPU machines, option parsing, and that the committed ``scripts/h200.json`` is what this
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
from moeshard.bench import report, runner, targets
from moeshard.commands.args import ints

RUN = Path(__file__).resolve().parents[1] / "scripts" / "h200.json"


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
    for new, old in zip(rederived, committed["records"]):
        assert new["ratios"].keys() == old["ratios"].keys()
        for key in old["ratios"]:
            assert new["ratios"][key] == pytest.approx(old["ratios"][key], rel=1e-12), (old["model"], old["tokens"], key)
    assert targets.evaluate(committed["records"]) == committed["targets"]


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
