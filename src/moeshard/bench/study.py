"""The study scripts' shared parts (``scripts/*_study.py``): their options, their JSON, and the
loop over models, token counts and schemes that runs their cases.

A study times variants of one stage side by side on the bench's workloads
(``moeshard.bench.workload``) and records each case as a dict; ``run_study`` runs the cases
model by model (each model made once) and writes the records after every case, so a run cut
short by the device's time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeshard.finite import json_text, with_nulls
from moeshard.outputs import atomic_write_text


def study_parser(doc: str, models: tuple[str, ...], tokens: tuple[int, ...], schemes: tuple[str, ...],
                 reps: int) -> argparse.ArgumentParser:
    """The options every study script takes: comma-separated ``--models``, ``--tokens`` and
    ``--schemes`` (defaults given), ``--rounds`` of alternating variants, ``--reps`` per timing
    and ``--json`` (``write_study``). The first line of ``doc`` describes the command."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--models", default=",".join(models))
    ap.add_argument("--tokens", default=",".join(map(str, tokens)))
    ap.add_argument("--schemes", default=",".join(schemes))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--json", default=None)
    return ap


def write_study(path: str | Path, script: str, args: argparse.Namespace, records: list) -> None:
    """Writes a study script's records as JSON with the command that reproduces them (``script``
    with every option of ``args`` but ``--json``), the device and torch's version. A NaN / Inf in
    a record (a variant's output gone wrong is a finding) is written as null and listed under
    ``"nonfinite"`` (``finite.with_nulls``), so the study goes on and keeps its records."""
    import torch

    options = " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in vars(args).items()
                       if v not in (None, False) and k != "json")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    out = {"command": f"python3 {script} {options}", "device": device,
           "torch": torch.__version__, "records": records}
    atomic_write_text(Path(path), json_text(with_nulls(out), indent=1))


def run_study(args: argparse.Namespace, script: str, make: Callable[[str], Any],
              study: Callable[[str, Any, int, str], dict], line: Callable[[dict], str]) -> list[dict]:
    """Runs a study's cases: for each model of ``args.models`` (``make(name)``, made once and
    dropped after its cases), token count of ``args.tokens`` and scheme of ``args.schemes``
    (``study_parser``'s options), ``study(name, model, tokens, scheme)`` gives a record, printed
    as ``line(record)``. With ``args.json`` every record so far is written after each case
    (``write_study``, naming ``script``). Cached CUDA memory is released after every case, so a
    case's peak does not carry into the next. Returns the records."""
    import torch

    from moeshard.bench.timing import release_memory

    records: list[dict] = []
    for name in args.models.split(","):
        model = make(name)
        for tokens in map(int, args.tokens.split(",")):
            for scheme in args.schemes.split(","):
                records.append(study(name, model, tokens, scheme))
                print(line(records[-1]), flush=True)
                if args.json:
                    write_study(args.json, script, args, records)
                if torch.cuda.is_available():
                    release_memory()
        del model
        if torch.cuda.is_available():
            release_memory()
    return records


def run_on_gpu(args: argparse.Namespace, script: str, study: Callable[..., dict],
               line: Callable[[dict], str]) -> list[dict]:
    """``run_study`` on the current CUDA device with the bench's full-size models
    (``moeshard.bench.workload.make_model``): ``study(name, model, tokens, scheme, flush, args)``
    gives a case's record; ``flush`` (``L2Flush``) is for the study's timings to call before
    each repetition, ``args`` the parsed options (``--rounds``, ``--reps`` and the script's own)."""
    import torch

    from moeshard.bench.timing import L2Flush
    from moeshard.bench.workload import make_model

    device = torch.device("cuda")
    flush = L2Flush(device)
    return run_study(args, script, lambda name: make_model(name, device),
                     lambda name, model, tokens, scheme: study(name, model, tokens, scheme, flush, args), line)


def time_variants(rec: dict, calls: dict[str, Callable[[], object]], flush, args: argparse.Namespace) -> dict:
    """Times each variant's call (``calls``: variant -> call) in ``args.rounds`` alternating rounds
    of ``args.reps`` repetitions (``timing.alternating_medians``), and stores the times in ``rec``:
    rec["rounds"][variant + "_ms"] each round's ms, rec["median_ms"][variant + "_ms"] their
    median. Returns rec."""
    from moeshard.bench.timing import alternating_medians

    rec["rounds"], rec["median_ms"] = alternating_medians({f"{k}_ms": fn for k, fn in calls.items()},
                                                          rounds=args.rounds, reps=args.reps, flush=flush)
    return rec


def case_line(rec: dict) -> str:
    """The start of a case's printed line: model, tokens, scheme (when the record has one) and
    each variant's median ms (``time_variants``)."""
    scheme = f"{rec['scheme']:10s} " if "scheme" in rec else ""
    return (f"{rec['model']:14s} T={rec['tokens']:<6d} {scheme}"
            + " ".join(f"{k[:-3]} {v:.3f}" for k, v in rec["median_ms"].items()))


def bits_line(rec: dict) -> str:
    """``case_line`` and whether each variant gave the reference's bits (rec["same_bits"])."""
    bits = " ".join(f"{k}:{'same' if v else 'DIFFERENT'}" for k, v in rec["same_bits"].items())
    return f"{case_line(rec)} | bits {bits}"


def plan_made_ahead(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` (one that runs ``TritonExperts``) with the tile plan the experts make handed in
    instead: made at the first call (eager, before any graph capture) and kept, so a graph
    captured later holds no plan kernel; the buffers the plan kernel zeroes (the per-expert amax,
    the row maxima) are zeroed by memsets. What the plan costs a call is its time against
    ``call``'s. The calls must route the same ids every time."""
    from unittest import mock

    from moeshard.kernels.align import align_rows

    plans: dict[int, Any] = {}

    def made_ahead(ids, E, block_m, amax=None, pdl_launch=False, row_amax=None):
        if block_m not in plans:
            plans[block_m] = align_rows(ids, E, block_m)
        for t in (amax, row_amax):
            if t is not None:
                t.zero_()
        return plans[block_m]

    def run():
        with mock.patch("moeshard.kernels.experts.align_rows", made_ahead):
            return call()

    return run


def experts_variants(case: RoutedCase, configs: dict, calls: dict[str, Callable[[], object]], rec: dict) -> None:
    """Adds a ``TritonExperts`` call on ``case`` for each config (variant -> ``ExpertsConfig``) to
    ``calls`` (for ``time_variants``), and records in rec["same_bits"]["experts"] whether all their
    outputs are the first one's bits."""
    import torch

    from moeshard.kernels.experts import TritonExperts

    def call(kernel: TritonExperts) -> Callable[[], torch.Tensor]:
        return lambda: kernel(case.inp, case.experts)

    outs = []
    for key, config in configs.items():
        calls[key] = run = call(TritonExperts(case.cfg.activation, case.cfg.dtype, config))
        outs.append(run())
    rec.setdefault("same_bits", {})["experts"] = all(torch.equal(outs[0], out) for out in outs[1:])


@dataclass(frozen=True)
class RoutedCase:
    """A study case's routed experts on the bench workload (``routed_case``): the model's config
    and device, the scheme's descriptor, the experts quantized for it, the hidden states x
    [T, H], the experts' input (``ExpertInput``: M routed rows) and the sizes M, E, H, I."""

    cfg: Any
    device: Any
    spec: Any
    experts: Any
    x: Any
    inp: Any
    M: int
    E: int
    H: int
    I: int  # noqa: E741 (the intermediate size, as everywhere in the kernels)


def routed_case(model, tokens: int, scheme: str) -> RoutedCase:
    """``tokens`` tokens of the bench's hidden states (``workload.hidden_states``) routed by the
    model's router (``workload.routed_input``) to its experts quantized with ``scheme``."""
    from moeshard.bench.workload import experts_for, hidden_states, routed_input
    from moeshard.config import QuantConfig
    from moeshard.quant import get_scheme

    cfg = model.cfg
    x = hidden_states(model, tokens, tokens)
    inp, _ = routed_input(model, x, QuantConfig(scheme))
    return RoutedCase(cfg, model.gate_up.device, get_scheme(scheme), experts_for(model, scheme), x, inp,
                      inp.num_rows, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size)
