"""``scripts/bench_ab.py``: two codes' benches, alternating. A real CPU run of the bench's
backward mode (the one mode that runs without a GPU) through the script, its refusals, and the
summary's arithmetic on hand-made records."""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_ab  # noqa: E402

BENCH = ["--backward", "--device", "cpu", "--size", "small", "--models", "qwen3-30b-a3b",
         "--prefill-tokens", "16", "--reps", "1"]


# Four CPU benches (about 14 s on two cores) of a study tool: make test-slow.
@pytest.mark.slow
def test_two_rounds_alternate_and_the_summary_holds_every_round(tmp_path, capsys):
    base = tmp_path / "base" / "src"
    shutil.copytree(ROOT / "src" / "moeshard", base / "moeshard", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "ab"
    assert bench_ab.main(["--base-src", str(base), "--rounds", "2", "--out", str(out), "--", *BENCH]) == 0
    printed = capsys.readouterr().out
    order = [line.split(", ")[1].split(" ")[0] for line in printed.splitlines() if line.startswith("bench_ab: round")]
    assert order == ["base", "new", "new", "base"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == [] and summary["bench_args"] == BENCH
    assert summary["src"]["base"] == str(base.resolve())
    [case] = summary["cases"]
    assert case["case"] == {"model": "qwen3-30b-a3b", "tokens": 16}
    for name in ("experts_fwd_ms", "experts_fwdbwd_ms", "layer_fwdbwd_ms"):
        t = case["times"][name]
        assert [len(t["rounds"][c]) for c in ("base", "new")] == [2, 2]
        assert t["new_over_base"] == pytest.approx(t["median"]["new"] / t["median"]["base"])
    runs = {f"{c}-{r}.json": json.loads((out / f"{c}-{r}.json").read_text()) for c in ("base", "new") for r in (1, 2)}
    assert all("--quiet" in run["command"] for run in runs.values())
    assert runs["new-2.json"]["records"][0]["experts_fwd_ms"] in case["times"]["experts_fwd_ms"]["rounds"]["new"]
    with tarfile.open(f"{out}.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"ab/summary.txt", "ab/summary.json", "ab/base-1.json", "ab/new-2.txt"} <= names


def test_a_failed_run_is_named_and_the_exit_code_says_so(tmp_path):
    out = tmp_path / "ab"
    code = bench_ab.main(["--base-src", str(ROOT / "src"), "--rounds", "1", "--out", str(out), "--",
                          "--backward", "--device", "cpu", "--size", "small", "--models", "nosuch-moe"])
    assert code == 1
    text = (out / "summary.txt").read_text()
    assert "FAILED base-1: rc=2" in text and "FAILED new-1: rc=2" in text
    assert "nosuch-moe" in (out / "base-1.txt").read_text()


@pytest.mark.parametrize("argv,message", [
    (["--base-src", "SRC", "--", "--json", "x.json"], "bench argument --json: bench_ab sets it itself"),
    (["--base-src", "SRC", "--rounds", "0"], "--rounds: must be at least 1, got 0"),
    (["--base-src", "/nonexistent/src"], "--base-src: /nonexistent/src has no moeshard package"),
    (["--base-src", "SRC", "--timeout-s", "nan"], "--timeout-s: must be a finite number of seconds above 0, got nan"),
    (["--base-src", "SRC", "--timeout-s", "-5"], "--timeout-s: must be a finite number of seconds above 0, got -5.0"),
    (["--base-src", "SRC", "--out", "FILE"], "cannot make the folder: File exists"),
    (["--base-src", "SRC", "--out", "/proc/ab"], "--out /proc/ab: cannot make the folder"),
])
def test_refusals_name_the_argument(argv, message, capsys, tmp_path):
    (tmp_path / "afile").write_text("")
    argv = [{"SRC": str(ROOT / "src"), "FILE": str(tmp_path / "afile")}.get(a, a) for a in argv]
    with pytest.raises(SystemExit) as info:
        bench_ab.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_summary_medians_ratios_and_a_case_one_code_lacks():
    def run(*records):
        return {"records": list(records)}

    def rec(tokens, experts, layer=None):
        r = {"model": "m", "regime": "prefill", "tokens": tokens, "quant": "fp8_tensor", "rows": 2 * tokens,
             "experts_ms": experts, "ratios": {"vs_copy": 0.5}}
        return r if layer is None else {**r, "layer_ms": layer}

    rows = bench_ab.summarize({"base": [run(rec(4, 2.0, 3.0)), run(rec(4, 4.0, 5.0)), run(rec(4, 3.0, 4.0))],
                               "new": [run(rec(4, 1.0, 2.0), rec(8, 9.0)), run(rec(4, 2.0, 2.5)),
                                       run(rec(4, 6.0, 2.0))]})
    by_tokens = {row["case"]["tokens"]: row for row in rows}
    assert by_tokens[4]["case"] == {"model": "m", "regime": "prefill", "tokens": 4, "quant": "fp8_tensor"}
    experts, layer = by_tokens[4]["times"]["experts_ms"], by_tokens[4]["times"]["layer_ms"]
    assert experts["median"] == {"base": 3.0, "new": 2.0} and experts["new_over_base"] == pytest.approx(2 / 3)
    assert layer["median"] == {"base": 4.0, "new": 2.0} and layer["new_over_base"] == pytest.approx(0.5)
    lone = by_tokens[8]["times"]["experts_ms"]
    assert lone["rounds"] == {"base": [], "new": [9.0]} and lone["new_over_base"] is None
    text = bench_ab.render(rows, ["header"])
    assert "model=m quant=fp8_tensor regime=prefill tokens=4 experts_ms: 2.0000/4.0000/3.0000 -> " \
           "1.0000/2.0000/6.0000 (0.667, within spread)" in text
    assert "tokens=4 layer_ms: 3.0000/5.0000/4.0000 -> 2.0000/2.5000/2.0000 (0.500, faster)" in text
    assert "regime=prefill tokens=8 experts_ms: - -> 9.0000 (-, -)" in text
    assert bench_ab.verdict({"base": [1.0, 1.1], "new": [1.2, 1.3]}) == "slower"
