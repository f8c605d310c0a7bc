"""The study scripts' driver (``moeshard.bench.study.run_study``): every case in order, each model
made once, a line per case, and the records written after every case, so that a study cut short
(the device's time limit, a kernel that fails) keeps what it measured."""

from __future__ import annotations

import json

import pytest

from moeshard.bench.study import case_line, run_study, study_parser


def _args(tmp_path, *extra):
    return study_parser("a study\n", ("m1", "m2"), (1, 16), ("none", "fp8_tensor"), reps=3).parse_args(
        ["--json", str(tmp_path / "study.json"), *extra])


def test_every_case_runs_in_order_each_model_made_once(tmp_path, capsys):
    made = []

    def make(name):
        made.append(name)
        return {"model": name}

    def study(name, model, tokens, scheme):
        assert model == {"model": name}
        return {"model": name, "tokens": tokens, "scheme": scheme}

    records = run_study(_args(tmp_path), "scripts/x_study.py", make, study,
                        lambda r: f"{r['model']} {r['tokens']} {r['scheme']}")
    cases = [(m, t, s) for m in ("m1", "m2") for t in (1, 16) for s in ("none", "fp8_tensor")]
    assert made == ["m1", "m2"]
    assert [(r["model"], r["tokens"], r["scheme"]) for r in records] == cases
    assert capsys.readouterr().out.splitlines() == [f"{m} {t} {s}" for m, t, s in cases]
    written = json.loads((tmp_path / "study.json").read_text())
    assert written["records"] == records
    assert written["command"] == "python3 scripts/x_study.py --models m1,m2 --tokens 1,16 --schemes none,fp8_tensor " \
                                 "--rounds 3 --reps 3"


def test_a_study_cut_short_keeps_the_cases_it_measured(tmp_path):
    def study(name, model, tokens, scheme):
        if (name, tokens) == ("m1", 16):
            raise RuntimeError("the third case fails")
        return {"model": name, "tokens": tokens, "scheme": scheme}

    with pytest.raises(RuntimeError, match="the third case fails"):
        run_study(_args(tmp_path, "--models", "m1"), "scripts/x_study.py", lambda name: None, study, str)
    written = json.loads((tmp_path / "study.json").read_text())
    assert [(r["tokens"], r["scheme"]) for r in written["records"]] == [(1, "none"), (1, "fp8_tensor")]


def test_a_case_line_names_the_case_and_its_medians():
    rec = {"model": "qwen3-30b-a3b", "tokens": 4096, "scheme": "fp8_tensor",
           "median_ms": {"selected_ms": 0.4771, "both_ws_ms": 0.41}}
    assert case_line(rec) == "qwen3-30b-a3b  T=4096   fp8_tensor selected 0.477 both_ws 0.410"
    del rec["scheme"]
    assert case_line(rec) == "qwen3-30b-a3b  T=4096   selected 0.477 both_ws 0.410"


def test_a_nonfinite_figure_is_written_as_null_and_the_study_goes_on(tmp_path):
    """A variant whose output went wrong gives a NaN / Inf difference: a finding to record, not a
    reason to stop the study and lose its records."""
    def study(name, model, tokens, scheme):
        return {"model": name, "tokens": tokens, "scheme": scheme,
                "max_rel_diff": {"variant": float("nan") if tokens == 1 else float("inf")}}

    records = run_study(_args(tmp_path, "--models", "m1"), "scripts/x_study.py", lambda name: None, study, str)
    assert len(records) == 4
    written = json.loads((tmp_path / "study.json").read_text())
    assert [r["max_rel_diff"]["variant"] for r in written["records"]] == [None] * 4
    assert [(f["field"], f["value"]) for f in written["nonfinite"]] == [
        ("records[0].max_rel_diff.variant", "NaN"), ("records[1].max_rel_diff.variant", "NaN"),
        ("records[2].max_rel_diff.variant", "Infinity"), ("records[3].max_rel_diff.variant", "Infinity")]
